"""``grafting-lens run <experiment>``: its options, their checks, the set-up, the run, the report.

Every experiment shares one declaration of its options (:func:`experiment_parser`) and runs
through :func:`run_experiment_command`: options checked before anything loads, the run
resumed from ``--out`` when it is the same run, the report written (under ranks, by rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grafting_lens.core import ranks
from grafting_lens.core.console import threads_beyond_cores
from grafting_lens.core.errors import GraftingLensError, refuse_first
from grafting_lens.core.files import DirectoryLock, check_writable

if TYPE_CHECKING:
    import pandas as pd

# torch, pandas and the models are imported where a run needs them, so that
# `grafting-lens run <experiment> --help` and a refused option answer at once.

WORLDS = ("toy", "smollm2", "gemma3")
"""What ``--world`` accepts: the toy world and :data:`grafting_lens.worlds.real_world.WORLDS`."""

DTYPES = ("float32", "bfloat16", "float16")
"""What ``--dtype`` accepts."""

DEFAULT_DATASET = "fake_movies_real_actors"
"""The dataset ``--model`` runs ask about unless ``--dataset`` says otherwise."""

_RELATION_OPTIONS = ("dataset", "n_relations", "seed", "relations")
"""Options that choose the relations of ``--model`` runs; the toy world has its own."""


def count(text: str) -> int:
    """An option's count (``--batch-size``...): a whole number >= 1, else a usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def experiment_parser(experiment: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The options of ``grafting-lens run <experiment>``: those every run shares, and its
    donor options and its own (from its spec).

    Args:
        experiment: A registered experiment.
        prog: How its usage names the command (default ``grafting-lens run <experiment>``;
            ``grafting-lens demo`` for the demo).

    Raises:
        ExperimentError: An unknown experiment.
    """
    from grafting_lens.study import get_experiment

    spec = get_experiment(experiment)
    parser = argparse.ArgumentParser(
        prog=prog or f"grafting-lens run {spec.name}", description=spec.title
    )
    add = parser.add_argument
    add("--out", required=True, help="Directory for tables, figures and the resumable runs.")
    add(
        "--model", help=f"A real checkpoint (hub id, directory or .gguf file) as {spec.roles[0]!r}."
    )
    add(
        "--world",
        choices=WORLDS,
        help="Without --model: the toy world (default), or a real model and its finetunes: "
        "smollm2 (SmolLM2-135M) or gemma3 (Gemma 3 270M), built first with grafting-lens "
        "world build <name>.",
    )
    add(
        "--sft-seed",
        type=int,
        metavar="SEED",
        help="With a real --world built with more sft seeds (smollm2: 1): the sft finetuned "
        "with this seed in the sft role (the checkpoint sft_seed<SEED>), for the spread "
        "across training seeds.",
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
    add("--n-examples", type=count, help="Ask about the first N relations only.")
    add(
        "--prompts",
        metavar="FILE",
        help="Your own prompts instead of the relations: a .json list of objects or a .csv "
        "with the columns prompt, target (' Sandra Bullock', one leading space), and "
        "optionally first_entity and name (see grafting_lens.study.read_prompts).",
    )
    add("--batch-size", type=count, default=8, help="Examples per forward pass (default 8).")
    add("--device", help="torch device the models run on, e.g. cuda or cuda:1 (default: the CPU).")
    add(
        "--dtype",
        choices=DTYPES,
        help="The models' precision (default: the semantics', float32 for reference, as the "
        "code loaded them; the checkpoint's for clean).",
    )
    add(
        "--lazy",
        action="store_true",
        help="Open the donors (checkpoint directories of safetensors) lazily: only the "
        "components a graft takes from them are read, memory-mapped, on first use "
        "(load_models(lazy=True)); the results are the same.",
    )
    add(
        "--threads",
        type=int,
        help="torch CPU threads, at most the cores this process may use (default: 1 for the toy "
        "world, torch's default for --model).",
    )
    add(
        "--dataset",
        help="With --model: the dataset the donors were finetuned on (one of "
        f"grafting_lens.worlds.data.DATASETS; default {DEFAULT_DATASET}).",
    )
    add(
        "--n-relations",
        type=count,
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
        "grafting_lens.study.Semantics).",
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
    add(
        "--score",
        choices=("first_token", "answer_logprob", "kl", "logit_diff"),
        help="What each row scores beyond the answer's first token (the paper's columns): the "
        "whole answer's log-probability, KL to the donor, or the answer's logit minus "
        "--counter's (functions: score= in Python).",
    )
    add("--counter", help="--score logit_diff's counter-answer, one for every prompt.")
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
        help="Show progress bars, or --no-progress to hide them, so that a log file gets no bars "
        "(default: only when standard error is a terminal).",
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
        2 for options that do not parse, 130 after Ctrl-C (one line: resume by running the
        same command again, or, where the run does not resume, start it again).
    """
    try:
        parser = experiment_parser(experiment, prog=command)
    except GraftingLensError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exit_:  # --help, or options argparse refused (it printed why)
        return int(exit_.code or 0)
    command = command or f"grafting-lens run {experiment}"
    try:
        return _run(experiment, args, f"{command} {shlex.join(argv)}".strip())
    except ValueError as error:  # GraftingLensError and every other input error raised on purpose
        print(f"Error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        from grafting_lens.study import get_experiment

        spec = get_experiment(experiment)
        finetunes = (
            spec.finetune_missing_donor
            and args.model is not None
            and not any(getattr(args, _dest(option)) for option, _ in spec.donors.values())
        )
        if (spec.run is None or spec.run_resumes) and not finetunes:
            return interrupted("run the same command to resume")
        return interrupted("run the same command to start again (this run does not resume)")


INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""


def interrupted(what_next: str) -> int:
    """Say in one line that the command was interrupted and what to do; return 130."""
    print(f"Interrupted; {what_next}.", file=sys.stderr)
    return INTERRUPTED


def _run(experiment: str, args: argparse.Namespace, command: str) -> int:
    # Under a launcher every rank shares the run; first they check they run one command.
    with ranks.shared_ranks():
        same = {f"--{name.replace('_', '-')}": value for name, value in vars(args).items()}
        ranks.same(command.split(" -")[0], same, fix="start every rank with the same command")
        lock, locked = ranks.agree(lambda: _checked(experiment, args))
        try:  # one process (or one job's ranks) writes into --out; another is refused
            ranks.agree(lock.acquire)
            return int(locked(command))
        finally:
            lock.release()


def _checked(experiment: str, args: argparse.Namespace) -> tuple[DirectoryLock, Callable]:
    """The command's options checked (before anything is written or loaded); its run."""
    from grafting_lens.models.loading import resolve_placement
    from grafting_lens.study import get_experiment

    spec = get_experiment(experiment)
    out = check_writable(args.out, "--out")  # not empty, not a file, writable
    checkpoints = _checkpoints(spec, args)
    _check_relation_options(args, toy=checkpoints is None)
    needs = args.score == "logit_diff"
    refuse_first(
        GraftingLensError,
        (
            (
                args.world is not None and checkpoints is not None,
                f"--world {args.world} and --model both name the models: pass one of them.",
            ),
            (
                args.world not in (None, "toy") and args.toy_config is not None,
                f"--toy-config configures the toy world: leave it out with --world {args.world}.",
            ),
            (
                args.score not in (None, "first_token") and spec.run is not None,
                f"--score scores configurations' rows; {spec.name} has its own.",
            ),
            (
                needs and not (args.counter or "").strip(),
                "--score logit_diff needs --counter TEXT, the answer it is compared with.",
            ),
            (
                not needs and args.counter is not None,
                "--counter is --score logit_diff's: drop it, or add --score logit_diff.",
            ),
        ),
    )
    if args.prompts is not None:
        from grafting_lens.study.named import check_prompts_apply

        check_prompts_apply(spec)  # before anything loads
    semantics = _semantics(spec, args)
    dtype = None if semantics.dtype == "checkpoint" else semantics.dtype
    resolve_placement(args.device, dtype)  # a typo fails now, not after minutes of loading
    toy_config = _toy_config(args.toy_config)
    _apply_thread_policy(args.threads, toy=checkpoints is None and args.world in (None, "toy"))
    run = functools.partial(_run_locked, spec, args, out, checkpoints, toy_config, semantics, dtype)
    return DirectoryLock(out, "The output directory (--out)", shared=True), run


def _run_locked(
    spec: Any,
    args: argparse.Namespace,
    out: Path,
    checkpoints: list[str] | None,
    toy_config: Any,
    semantics: Any,
    dtype: str | None,
    command: str,
) -> int:
    from grafting_lens.analysis.scoring import Score
    from grafting_lens.study.named import run_spec, setup_experiment
    from grafting_lens.study.report import prepare_report_directory, write_experiment_report
    from grafting_lens.study.run_directory import weights_digests
    from grafting_lens.study.runner import RunOptions
    from grafting_lens.study.testsets import check_answers, read_prompts

    prompts = None if args.prompts is None else read_prompts(args.prompts)  # before loading
    started = time.perf_counter()
    setup = ranks.agree(
        lambda: setup_experiment(
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
            on_status=lambda line: print(line, file=sys.stderr),
            world=args.world or "toy",
            lazy=args.lazy,
            sft_seed=args.sft_seed,
        )
    )
    # Answers the tokenizer cannot score are refused before the report directory is touched.
    answers = list if prompts is None else lambda: check_answers(prompts, setup.models, semantics)
    shared = ranks.agree(answers)
    # A grid of configurations saves chunks and reads them back; a runner of its own that
    # resumes (the graft attribution) keeps its progress in out/runs too.
    resumed = setup.resumable and spec.run is None
    keeps = resumed or spec.run_resumes
    description = _describe_command_run(spec, args, setup, weights_digests(setup.models))
    if prompts is not None:  # the file's content, not its name, makes the run
        content = Path(args.prompts).expanduser().read_bytes()
        description["prompts"] = hashlib.sha256(content).hexdigest()[:16]
    description["semantics"] = semantics.label
    fingerprint = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:20]
    # Under ranks (torchrun, srun), rank 0 prepares and writes the report; all compute.
    ranks.agree(
        lambda: (
            ranks.first()
            and prepare_report_directory(
                out,
                spec.name,
                fingerprint,
                description=description,
                command=command,
                overwrite=args.overwrite,
                runs=keeps,
            )
        )
    )
    computed: list[int] = []
    tables = run_spec(
        spec,
        setup,
        # A runner of its own keeps its progress on rank 0 only (the others compute in memory).
        out=out / "runs" if keeps and (resumed or ranks.first()) else None,
        quick=args.quick,
        n_examples=args.n_examples,
        options=RunOptions(
            batch_size=args.batch_size,
            progress=args.progress,
            semantics=semantics,
            score=Score.of(args.score or "first_token", counter=args.counter),
        ),
        extras={option.dest: getattr(args, option.dest) for option in spec.options},
        on_chunk=lambda chunk: computed.append(chunk.rows),
        prompts=prompts,
    )
    elapsed = time.perf_counter() - started
    results = tables["results"]
    rows_computed = sum(ranks.gather(sum(computed))) if resumed else len(results)
    if not ranks.first():
        return 0
    notes = [
        f"Models: {setup.label} ("
        + ", ".join(f"{role}={name}" for role, name in zip(spec.roles, setup.models.names))
        + (
            f"); {spec.direction} prompts about the {spec.relations!r} relations."
            if prompts is None
            else f"); the prompts of {args.prompts}."
        ),
        f"{rows_computed} of {len(results)} rows computed in {elapsed:.1f} s on "
        f"{_where(setup.models.device)}"
        + (f" (the others read back from {out / 'runs'})." if resumed else "."),
    ]
    notes += shared
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
        print(line)
    for problem in report.problems:
        print(problem)
    print(f"Wrote {out / 'results.csv'} ({len(results)} rows) and {len(report.files) - 1} more:")
    print("  " + ", ".join(path.name for path in report.files if path.name != "results.csv"))
    print(f"Done in {elapsed:.0f}s.")
    return 0


_FREE_OPTIONS = frozenset(  # sft_seed: the checkpoint it names counts by its weights
    "out model batch_size device lazy threads cache_dir overwrite no_png progress sft_seed".split()
)
"""Options of ``grafting-lens run`` that change no result (checkpoints count by their weights)."""


def _where(device: Any) -> str:
    """Where a run computed, for its summary: the CPU's threads, or the accelerator."""
    torch, share = _torch(), ranks.current()
    each = "" if share is None else f"{share.world} ranks, each on "
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return f"{each}{threads} CPU thread{'s' if threads > 1 else ''}"
    if device.type != "cuda":
        return f"{each}{device.type if share else device}"
    name = torch.cuda.get_device_name(device)
    return f"{each}an {name}" if share else f"{device} ({name})"


def _describe_command_run(
    spec: Any, args: argparse.Namespace, setup: Any, digests: Sequence[str]
) -> dict[str, Any]:
    """What makes a command's run this run: the experiment, the weights, the relations asked
    and every option that changes a result. Its hash is the run's fingerprint in ``--out``."""
    free = set(_FREE_OPTIONS) | ({"score"} if args.score in (None, "first_token") else set())
    free |= {"counter"} if args.counter is None else set()
    free |= {_dest(option) for option, _ in spec.donors.values()}
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


def _checkpoints(spec: Any, args: argparse.Namespace) -> list[str] | None:
    """The checkpoints the options name, base first; None for the toy world. Checks them."""
    given = [flag for flag in spec.inapplicable if getattr(args, _dest(flag))]
    threads = args.threads  # the counts of argparse's `count` type are >= 1 already
    too_many = None if threads is None else threads_beyond_cores(threads, "--threads")
    donors = {role: getattr(args, _dest(option)) for role, (option, _) in spec.donors.items()}
    flags = {role: option for role, (option, _) in spec.donors.items()}
    named = [flags[role] for role, value in donors.items() if value is not None]
    missing = [flags[role] for role, value in donors.items() if value is None]
    one = len(named) == 1
    refuse_first(
        GraftingLensError,
        (
            (
                given,
                f"{' and '.join(given)} do not apply here: the {spec.name} experiment "
                f"({spec.title}) does not use them.",
            ),
            (threads is not None and threads < 1, f"--threads must be >= 1, got {threads}."),
            (too_many, str(too_many)),
            (
                args.model is None and named,
                f"{' and '.join(named)} {'needs' if one else 'need'} --model (the base "
                f"{'it is' if one else 'they are'} grafted into).",
            ),
            (
                args.model is not None
                and missing
                and not (spec.finetune_missing_donor and len(missing) == len(donors)),
                f"With --model, the {spec.name} experiment also needs {', '.join(missing)} "
                f"(roles: {', '.join(spec.roles)}).",
            ),
        ),
    )
    if args.model is None:
        return None
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
    from grafting_lens.study.testsets import RepeatedKey, unique_keys
    from grafting_lens.worlds.toy import ToyWorldConfig

    try:
        return ToyWorldConfig(**json.loads(text, object_pairs_hook=unique_keys))
    except RepeatedKey as error:
        raise GraftingLensError(
            f"--toy-config sets {error.args[0]!r} twice (JSON would keep the last); keep one."
        ) from None
    except (json.JSONDecodeError, TypeError) as error:
        raise GraftingLensError(
            f"--toy-config is not a JSON object of ToyWorldConfig fields: {error}"
        ) from error


def _apply_thread_policy(threads: int | None, *, toy: bool) -> None:
    """The command's one policy for CPU threads; under ranks, a rank's share of the cores."""
    share = ranks.current()
    if threads is not None:
        _torch().set_num_threads(threads)
    elif toy:
        _torch().set_num_threads(1)
    elif share is not None and share.device.type == "cpu":
        _torch().set_num_threads(share.threads)


def _semantics(spec: Any, args: argparse.Namespace) -> Any:
    """The run's semantics: ``--semantics`` (default: the experiment's), then the flags
    that change one field of it (``--unembed``, ``--lm-head``, ``--dtype``)."""
    from grafting_lens.study import as_semantics

    changes = {
        "unembed": args.unembed and args.unembed.replace("-", "_"),
        "lm_head": args.lm_head,
        "dtype": args.dtype,
    }
    semantics = as_semantics(args.semantics or spec.semantics)
    return dataclasses.replace(semantics, **{k: v for k, v in changes.items() if v})


def _semantics_note(semantics: Any) -> str:
    """One line for the report: which semantics ran, in words."""
    from grafting_lens.study import CLEAN, REFERENCE

    meaning = {
        REFERENCE: "as the paper's released code (tied unembedding follows a grafted embedding, "
        "no final norm or position embedding grafted, n // 4 quarters, the tokenizer's own BOS, "
        "SFT = the finetuned model, ranks by probability, the code's prompts)",
        CLEAN: "the library's (components as named, tied weights kept apart, the base's "
        "unembedding, a BOS before every prompt, ranks by logit)",
    }.get(semantics, "a preset with the changes named")
    return f"Semantics: {semantics.label}: {meaning}; see docs/concepts/paper-code-library.md."


def _check_checkpoint(name: str, option: str) -> None:
    """Fail early on a checkpoint that cannot be found (a donor may be a LoRA adapter)."""
    path = Path(name).expanduser()
    if path.exists():
        from grafting_lens.models.adapters import is_adapter_directory

        if path.is_dir() and is_adapter_directory(path):
            if option == "--model":
                raise GraftingLensError(
                    f"--model {name!r} is a LoRA adapter, but --model is the base every graft "
                    "runs through: pass the model the adapter was trained on as --model, and "
                    "the adapter as a donor (--donor, or the experiment's donor options)."
                )
            return
        from grafting_lens.models.gguf_checkpoint import CHECKPOINT_FIX, checkpoint_problem

        problem = checkpoint_problem(path)  # a GGUF file passes: load_models converts it
        if problem is not None:
            extra = "" if option == "--model" else " A donor may also be a LoRA adapter directory."
            raise GraftingLensError(f"{option} {name!r} is {problem}. {CHECKPOINT_FIX}{extra}")
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        where = "on the Hugging Face hub"
        if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
            where = "in the local Hugging Face cache (HF_HUB_OFFLINE is set)"
        raise GraftingLensError(
            f"Unknown model {name!r} for {option}: it is not a local directory and was not found "
            f"{where}. Pass a hub id such as 'gpt2', a directory written by save_pretrained or a .gguf file. "
            f"({type(error).__name__}: {' '.join(str(error).split())[:200]})"
        ) from None


def _torch() -> Any:
    import torch

    return torch


def _dest(flag: str) -> str:
    """An option's attribute in the parsed arguments: ``--task-model`` -> ``task_model``."""
    return flag.lstrip("-").replace("-", "_")


# ------------------------------------------------------------------------------ output


def _print_summary(summary: pd.DataFrame, title: str) -> None:
    """The summary on standard output: the cells summary.md has, intervals beside each accuracy."""
    from grafting_lens.study.markdown import visible
    from grafting_lens.study.report import summary_table

    # A name's newline or terminal escape sequence is shown, not obeyed.
    shown = summary_table(summary).map(
        lambda cell: visible(cell) if isinstance(cell, str) else cell
    )
    print(visible(f"{title} (95% bootstrap CI; mean rank 0 = the top token)"))
    print(shown.to_string(index=False))
