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

Extra arguments after ``--`` go to every command (e.g. ``-- --quick --no-png``).
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

FOLDER = Path(__file__).resolve().parent

KEYS = {"figure", "experiment", "world", "semantics", "out", "claim", "result", "options"}
"""What a run's file may hold; anything else is refused (a typo would otherwise be ignored)."""

REQUIRED = ("figure", "experiment", "out", "claim", "result")


def runs() -> list[Path]:
    """Every run's file in this folder (``targets.toml`` holds the toy world's targets)."""
    return sorted(path for path in FOLDER.glob("*.toml") if path.name != "targets.toml")


def read(path: Path) -> dict[str, Any]:
    """The run a file describes, its keys checked (not yet against the experiment)."""
    with path.open("rb") as file:
        run = tomllib.load(file)
    unknown = sorted(set(run) - KEYS)
    missing = [key for key in REQUIRED if key not in run]
    if unknown or missing:
        raise SystemExit(
            f"{path}: "
            + (f"unknown keys {unknown} (known: {sorted(KEYS)}); " if unknown else "")
            + (f"missing keys {missing}" if missing else "")
        )
    return run


def command(path: Path) -> list[str]:
    """The arguments of ``grafting-lens`` that run the file ``path``."""
    run = read(path)
    argv = ["run", run["experiment"], "--out", str(run["out"])]
    if "world" in run:
        argv += ["--world", run["world"]]
    if "semantics" in run:
        argv += ["--semantics", run["semantics"]]
    for name, value in run.get("options", {}).items():
        flag = f"--{name.replace('_', '-')}"
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not False:
            argv += [flag, str(value)]
    return argv


def main(argv: list[str] | None = None) -> int:
    """Expand each file into its command and run it (or print it, with ``--dry-run``)."""
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
    from grafting_lens.study import cli

    for path in files:
        arguments = [*command(path), *extra]
        print(f"# {path.name}: grafting-lens {shlex.join(arguments)}", flush=True)
        if not options.dry_run:
            status = cli.main(arguments)
            if status:
                return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
