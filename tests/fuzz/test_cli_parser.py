"""The command line's parsers driven with generated argv lists.

Every argv either stops in argparse (exit status 2, its message naming an option or a
value given), or parses and then passes the command's checks at the door (everything
``grafting-lens run`` checks before it takes the output directory's lock and loads models)
or is refused there with a GraftingLensError naming an option or a value given.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

import grafting_lens as gl
from fuzz.strategies import budget, text, threads_kept
from grafting_lens.study import EXPERIMENTS, cli, run_command
from grafting_lens.study.run_command import experiment_parser

VALUES = st.one_of(
    st.sampled_from(["", " ", "0", "-1", "1", "8", "nan", "1e9", "toy", "gemma3", "mars", "clean"]),
    st.sampled_from(
        ["reference+unembed=base", "float16", "cpu", "cuda:9", "{}", '{"n_relations": 0}']
    ),
    st.sampled_from(["{bad json", "PRE", "all", "task", "out.csv", "🎬", "--", "-x"]),
    st.sampled_from(["kl", "logit_diff", "answer_logprob", "first_token", " Paris"]),
    text(8),
)


class _Door(Exception):
    """Raised where the run would take the output directory's lock: the checks passed."""


def _argv(data, options: list[str], scratch: Path) -> list[str]:
    paths = st.sampled_from(
        [str(scratch / "out"), str(scratch / "file"), str(scratch), "", str(scratch / "a" / "b")]
    )
    argv: list[str] = []
    for _ in range(data.draw(st.integers(0, 6), "options")):
        option = data.draw(
            st.one_of(
                st.sampled_from(options), st.sampled_from(["--bogus", "-", "--out=", "--batch"])
            ),
            "option",
        )
        argv.append(option)
        if data.draw(st.integers(0, 3), "how many values"):
            argv.append(
                data.draw(
                    paths if option in ("--out", "--prompts", "--cache-dir") else VALUES, "value"
                )
            )
    if data.draw(st.booleans(), "--out given"):
        argv += ["--out", data.draw(paths, "--out")]
    return argv


def _names_something(message: str, argv: list[str]) -> bool:
    quoted = any(repr(token) in message for token in argv)  # '' and ' ' named by their quotes
    return quoted or any(t.strip() and t.strip() in message for t in argv) or "--out" in message


def _parsed(parser, argv: list[str], also: str = "--out"):
    """The parsed ``argv``, or None when argparse refused it with a message naming it."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            return parser.parse_args(argv)
    except SystemExit as exit_:
        assert exit_.code == 2
        assert _names_something(said.getvalue(), argv) or also in said.getvalue(), said.getvalue()
        return None


@budget(80)
@given(data=st.data())
def test_run_parser_and_its_door(data):
    experiment = data.draw(st.sampled_from(sorted(EXPERIMENTS)), "experiment")
    parser = experiment_parser(experiment)
    options = [
        o for action in parser._actions for o in action.option_strings if o not in ("-h", "--help")
    ]
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        (Path(scratch) / "file").write_text("x")
        argv = _argv(data, options, Path(scratch))
        args = _parsed(parser, argv)
        if args is None:
            return
        try:
            with threads_kept(), mock.patch.object(run_command, "DirectoryLock", side_effect=_Door):
                run_command._run(experiment, args, "grafting-lens run")
        except _Door:
            pass
        except gl.GraftingLensError as error:
            assert _names_something(str(error), argv), f"{argv}: {error}"
        assert not any(Path(scratch).rglob(".lock")), "a refused run left its lock behind"


@budget(40)
@given(data=st.data())
def test_world_parser_and_its_door(data):
    # In a scratch working directory: "--cache-dir 0" is a directory named 0, made there.
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        empty = Path(scratch, "empty")
        empty.mkdir()
        fake = Path(scratch, "model.gguf")
        fake.write_bytes(b"GGUF not really")
        argv = ["build"] if data.draw(st.integers(0, 5), "build") else []
        name = data.draw(st.sampled_from([None, "mars", "", "TOY", "toy ", "-1", "🎬"]), "name")
        argv += [] if name is None else [name]
        for _ in range(data.draw(st.integers(0, 3), "options")):
            option = data.draw(
                st.sampled_from(["--base", "--find-links", "--threads", "--cache-dir", "--nope"]),
                "option",
            )
            value = data.draw(
                st.sampled_from(
                    [
                        str(empty),
                        str(fake),
                        str(Path(scratch, "missing")),
                        "",
                        "0",
                        "-1",
                        "10000000",
                    ]
                ),
                "value",
            )
            argv += [option, value]
        args = _parsed(cli.world_parser(), argv, also="build")
        if args is None:
            return
        if args.name is None and args.base is None:
            return  # the command itself says "name (or --base)" (tests/study/test_cli.py)
        try:
            with threads_kept():
                cli._world_build(args)
        except gl.GraftingLensError as error:
            assert _names_something(str(error), argv), f"{argv}: {error}"
        else:
            raise AssertionError(f"{argv} built a world from nothing")
