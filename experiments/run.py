"""Run the paper's runs in this folder: each TOML file becomes one ``grafting-lens run`` call.

A file says which registered experiment runs, on which world, under which semantics, into
which directory, with which further options (``[options]``: any option of
``grafting-lens run <experiment>``, by its long name without the dashes); ``figure``,
``claim`` and ``result`` say what it reproduces and where its numbers are discussed. This
script only expands a file into the command and runs it: what the run computes is the
command's.

Run::

    python experiments/run.py experiments/figure2_position.toml   # one run
    python experiments/run.py experiments/*.toml --dry-run          # the commands, not run
    python experiments/run.py --all                                 # every run of the folder

Extra arguments after ``--`` go to every command (e.g. ``-- --quick --no-png``). Under
``torchrun`` or ``srun`` the ranks share each run (docs/how-to/many-gpus.md)::

    torchrun --standalone --nproc-per-node 2 experiments/run.py experiments/figure2_position.toml
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from grafting_lens.core.errors import ExperimentError, did_you_mean

FOLDER = Path(__file__).resolve().parent

KEYS = {"figure", "experiment", "world", "semantics", "out", "claim", "result", "options"}
"""What a run's file may hold; anything else is refused (a typo would otherwise be ignored)."""

REQUIRED = ("figure", "experiment", "out", "claim", "result")

TOP_OPTIONS = ("out", "world", "semantics")
"""Keys of a file's top level that are options of the command: not to be set again."""

USAGE = 2
"""The exit status for a run file or a command line that cannot be used."""


def runs() -> list[Path]:
    """Every run's file in this folder (``targets.toml`` holds the toy world's targets)."""
    return sorted(path for path in FOLDER.glob("*.toml") if path.name != "targets.toml")


def read(path: Path) -> dict[str, Any]:
    """The run a file describes, its keys and their kinds checked (not yet against the
    experiment).

    Raises:
        ExperimentError: The file is missing, a directory, unreadable, not UTF-8 or not
            TOML; a key is unknown, missing, of the wrong kind or set twice.
    """
    run = _load(path)
    unknown = sorted(set(run) - KEYS)
    missing = [key for key in REQUIRED if key not in run]
    if unknown or missing:
        raise ExperimentError(
            f"{path}: "
            + (f"unknown keys {unknown} (known: {sorted(KEYS)}); " if unknown else "")
            + (f"missing keys {missing}" if missing else "")
        )
    for key in sorted(KEYS - {"options"}):
        if key in run and not (isinstance(run[key], str) and run[key].strip()):
            raise ExperimentError(
                f"{path}: {key} is {_kind(run[key])}; it takes one string, e.g. "
                f'{key} = "{_EXAMPLES[key]}".'
            )
    options = run.get("options", {})
    if not isinstance(options, dict):
        raise ExperimentError(
            f"{path}: options is {_kind(options)}; it is a table, [options], of the command's "
            "options by their long names (batch_size = 4)."
        )
    names: dict[str, str] = {}
    for key, value in options.items():
        dest = key.replace("-", "_")
        if dest in TOP_OPTIONS and dest in run:
            raise ExperimentError(
                f"{path}: {dest} is set both at the top ({run[dest]!r}) and in [options] "
                f"({value!r}); the command would take the last. Keep the one at the top."
            )
        if dest in names:
            raise ExperimentError(
                f"{path}: [options] sets {names[dest]!r} and {key!r}, one option twice; the "
                "command would take the last. Keep one."
            )
        names[dest] = key
        scalars = (bool, int, float, str)
        if not isinstance(value, scalars) and not (
            isinstance(value, list) and all(isinstance(v, scalars[1:]) for v in value)
        ):
            raise ExperimentError(
                f"{path}: [options] {key} is {_kind(value)}; an option takes a string, a "
                "number, true or false, or a list of strings and numbers."
            )
    return run


_EXAMPLES = {
    "figure": "Figure 2",
    "experiment": "position",
    "world": "toy",
    "semantics": "reference",
    "out": "out/figure2_position",
    "claim": "what the paper claims",
    "result": "docs/results.md: Position grafting",
}


def _kind(value: Any) -> str:
    """A TOML value's kind, as a message names it."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    kinds |= {list: "an array", dict: "a table"}
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"{kinds.get(type(value), 'a ' + type(value).__name__)} ({shown})"


def _load(path: Path) -> dict[str, Any]:
    """The TOML of a run file, every way of not having one said in one line."""
    if path.is_dir():
        raise ExperimentError(
            f"{path} is a directory; name a run file (.toml) in it, or pass --all for every "
            f"run of {FOLDER.name}/."
        )
    if not path.is_file():
        names = [run.name for run in runs()]
        raise ExperimentError(
            f"No run file {path}.{did_you_mean(path.name, names)} The runs of "
            f"{FOLDER.name}/: {', '.join(names)}."
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ExperimentError(
            f"{path} is not UTF-8 (byte {error.object[error.start]:#04x} at offset "
            f"{error.start}); TOML files are UTF-8: save it as UTF-8."
        ) from None
    except OSError as error:
        raise ExperimentError(f"Cannot read {path}: {error.strerror or error}.") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ExperimentError(
            f"{path} is not valid TOML: {error}. Fix that line (a key set twice in one table "
            "is an error too)."
        ) from None


def command(path: Path) -> list[str]:
    """The arguments of ``grafting-lens`` that run the file ``path``.

    Raises:
        ExperimentError: What :func:`read` refuses; an unknown experiment; an option the
            experiment does not take, or a value it cannot take there.
    """
    from grafting_lens.study import get_experiment
    from grafting_lens.study.run_command import experiment_parser

    run = read(path)
    try:
        spec = get_experiment(run["experiment"])
    except ExperimentError as error:
        raise ExperimentError(f"{path}: {error}") from None
    actions = {
        action.dest: action
        for action in experiment_parser(spec.name)._actions
        if action.option_strings and action.dest != "help"
    }
    argv = ["run", spec.name, "--out", run["out"]]
    for key in ("world", "semantics"):
        if key in run:
            argv += _flag(path, key, run[key], actions)
    for name, value in run.get("options", {}).items():
        argv += _flag(path, name, value, actions)
    return argv


def _flag(path: Path, name: str, value: Any, actions: dict[str, Any]) -> list[str]:
    """The arguments that give the option ``name`` the value ``value``, checked against
    the experiment's own declaration of it."""
    dest = name.replace("-", "_")
    action = actions.get(dest)
    where = f"{path}: {name}"
    if action is None:
        known = sorted(actions)
        raise ExperimentError(
            f"{where} is not an option of this experiment.{did_you_mean(dest, known)} Its "
            f"options: {', '.join(known)}."
        )
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ExperimentError(f"{where} is {_kind(value)}; it takes true or false.")
        return [flag if value else f"--no-{flag[2:]}"]
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ExperimentError(
                f"{where} is {_kind(value)}; it is a switch: write {name} = true (or false)."
            )
        return [flag] if value else []
    if isinstance(value, bool):
        raise ExperimentError(
            f"{where} is {_kind(value)}; it takes a value ({flag} {action.metavar or 'VALUE'})."
        )
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and action.nargs is None:
        raise ExperimentError(
            f"{where} is {_kind(value)}; it takes one value: write {name} = {value[0]!r}."
            if value
            else f"{where} is an empty array; it takes one value."
        )
    for item in values:
        try:
            converted = action.type(str(item)) if action.type is not None else str(item)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
            raise ExperimentError(f"{where} = {item!r}: {error}.") from None
        if action.choices is not None and converted not in action.choices:
            raise ExperimentError(
                f"{where} = {item!r} is not one of {', '.join(map(str, action.choices))}."
            )
    return [flag, *map(str, values)]


def _check_extra(path: Path, extra: list[str]) -> None:
    """Refuse arguments after ``--`` that give a value to an option the file sets: the
    command would take the last of the two without a word."""
    run = read(path)
    given = {name.replace("-", "_") for name in run.get("options", {})}
    given |= {key for key in TOP_OPTIONS if key in run}
    for argument in extra:
        if not argument.startswith("--"):
            continue
        dest = argument[2:].split("=")[0].replace("-", "_")
        dest = dest.removeprefix("no_") if dest.startswith("no_progress") else dest
        if dest in given and dest not in _SWITCHES:
            raise ExperimentError(
                f"{argument.split('=')[0]} is given after -- and {path.name} sets {dest} too; "
                "the command would take the last. Drop one (or edit the file)."
            )


_SWITCHES = {"quick", "no_png", "overwrite", "lazy"}
"""Options that only switch something on: given twice, they say the same."""


def main(argv: list[str] | None = None) -> int:
    """Expand each file into its command and run it (or print it, with ``--dry-run``).

    Returns:
        0; 2 for a run file or command line that cannot be used (one line, ``error: ...``);
        a failed run's status; 130 after Ctrl-C.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args:
        args, extra = args[: args.index("--")], args[args.index("--") + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="Run files (TOML) of this folder.")
    parser.add_argument("--all", action="store_true", help="Every run file of this folder.")
    parser.add_argument("--dry-run", action="store_true", help="Print the commands only.")
    options = parser.parse_args(args)
    files = runs() if options.all else options.files
    if not files:
        parser.error("name run files, or pass --all")
    from grafting_lens.core import ranks
    from grafting_lens.study import cli
    from grafting_lens.study.run_command import interrupted

    try:
        # Every file is checked before the first run starts: a typo in the last file
        # fails now, not after hours.
        commands = []
        for path in files:
            _check_extra(path, extra)
            commands.append((path, [*command(path), *extra]))
    except ExperimentError as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE
    try:
        with ranks.shared_ranks():  # under torchrun, every run shared by the ranks
            for path, arguments in commands:
                if ranks.first():  # once, not once per rank
                    print(f"# {path.name}: grafting-lens {shlex.join(arguments)}", flush=True)
                if not options.dry_run:
                    status = cli.main(arguments)
                    if status:
                        return status
    except KeyboardInterrupt:
        return interrupted("run the same command to resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
