"""The runner: every configuration on every example of every test set, for every model set.

:func:`run_experiment` runs a grid, model sets x test sets x configurations, into a tidy
DataFrame, one row per example and configuration: the configurations of the same examples
are stacked as blocks of rows of one forward pass (:mod:`grafting_lens.study.stacking`),
checked before the first, and cut into chunks that a run directory keeps
(:mod:`grafting_lens.study.run_directory`), so a killed run resumes. How a run grafts,
scores, batches and saves is one :class:`RunOptions`, the place for a new option.
:func:`run_position_grafting` is the short way to the paper's first experiment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from grafting_lens.analysis.batch import TokenizedExamples, as_batch
from grafting_lens.analysis.scoring import (
    SCORE_COLUMNS,
    TOP_K_COLUMNS,
    LastTokenScorer,
    Score,
    score_pass,
)
from grafting_lens.core import ranks
from grafting_lens.core.arguments import as_list, is_integer, shown
from grafting_lens.core.console import show_progress
from grafting_lens.core.errors import (
    ArgumentTypeError,
    ExperimentError,
    GraftingLensError,
    check_known,
    kind,
)
from grafting_lens.engine.positions import select_positions
from grafting_lens.models.model_set import ModelSet
from grafting_lens.study.configs import PAPER_POSITION_CONFIGS, GraftConfig, retarget
from grafting_lens.study.run_directory import Rows, RunDirectory, batch_digest, describe_run
from grafting_lens.study.semantics import (
    DEFAULT_SEMANTICS,
    Semantics,
    as_semantics,
    semantics_or_default,
)
from grafting_lens.study.specs import get_configs
from grafting_lens.study.stacking import (
    ResolvedGraft,
    check_conflicts,
    resolve_configs,
    stacked_mask,
)
from grafting_lens.study.testsets import TestSet

__all__ = [
    "POSITION_GRAFTING_COLUMNS",
    "ChunkInfo",
    "RunOptions",
    "run_experiment",
    "run_position_grafting",
]

IDENTITY_COLUMNS = (
    "models",
    "dataset",
    "prompt",
    "direction",
    "example",
    "relation_id",
    "text",
    "config",
    "layers",
    "semantics",
)
"""What a row is: model set, test set, example, configuration (``layers``: as
:func:`layers_label` writes them) and semantics (tags follow)."""

ANSWER_COLUMNS = ("target", "target_id")
"""The answer a row is scored against: its text and first token."""

POSITION_GRAFTING_COLUMNS = (
    "example",
    "relation_id",
    "prompt",
    "direction",
    "text",
    "config",
    "semantics",
    *ANSWER_COLUMNS,
    *SCORE_COLUMNS,
    *TOP_K_COLUMNS,
)
"""Columns of :func:`run_position_grafting`'s table, in order."""

_ORDER_COLUMNS = ("_m", "_t", "_c")

_KEY_COLUMNS = (*_ORDER_COLUMNS, "example")
"""What tells the rows of a run apart: model set, test set, configuration, example."""


@dataclass(frozen=True)
class RunOptions:
    """How a run grafts, scores, batches and saves (everything but what it asks of whom).

    Attributes:
        batch_size: Examples per forward pass (``batch_size * len(configs)`` rows). Free
            to change when resuming.
        chunk_size: Examples per chunk (the unit that is saved and resumed).
        semantics: What the configurations mean, how prompts are tokenized and answers
            ranked: a :class:`~grafting_lens.study.semantics.Semantics` or its label
            (``"reference+unembed=base"``). ``None``:
            :data:`~grafting_lens.study.semantics.DEFAULT_SEMANTICS`, or a named
            experiment's own (its :class:`~grafting_lens.study.specs.ExperimentSpec`'s).
        top_k: How many top tokens to list per row.
        seeds: Seeds to record with every row, as ``<name>_seed`` columns (e.g. the toy
            world's).
        progress: Show a progress bar (default: when someone watches). Free to change
            when resuming.
        logits: ``"scored"`` (default): the unembedding runs at the scored (last) token
            only (at every position where a configuration grafts it); ``"all"``: at every
            position (the same scores, for comparison). Free to change when resuming.
        score: What each row scores beyond the answer's first token
            (:class:`~grafting_lens.analysis.scoring.Score`: ``"first_token"``, the paper's
            columns alone; ``"answer_logprob"``, ``"logit_diff"``, ``"kl"`` or a function).

    Raises:
        ExperimentError: A size below 1, a seed name that is not a plain name, or a
            semantics label that does not read.
    """

    batch_size: int = 8
    chunk_size: int = 64
    semantics: Semantics | str | None = None
    top_k: int = 10
    seeds: Mapping[str, int] = field(default_factory=dict)
    progress: bool | None = None
    logits: str = "scored"
    score: Any = "first_token"

    def __post_init__(self) -> None:
        object.__setattr__(self, "score", Score.of(self.score))
        for name in ("batch_size", "chunk_size", "top_k"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise kind(value, (int, float), ExperimentError)(
                    f"{name} must be an integer >= 1, got {value!r}."
                )
            # Python's int, whichever way it came: the options are part of a run's JSON.
            object.__setattr__(self, name, int(value))
        if self.logits not in ("scored", "all"):
            raise ExperimentError(
                f"logits must be 'scored' (the scored token's) or 'all' (every position's), "
                f"got {self.logits!r}."
            )
        seeds = dict(self.seeds or {})
        for name in seeds:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*", str(name)):
                raise ExperimentError(f"Seed names become columns; {name!r} is not a plain name.")
        object.__setattr__(self, "seeds", seeds)
        semantics = None if self.semantics is None else as_semantics(self.semantics)
        object.__setattr__(self, "semantics", semantics)

    def with_semantics(self, default: Semantics) -> RunOptions:
        """These options with ``default`` as the semantics if none was given."""
        if self.semantics is not None:
            return self
        return dataclasses.replace(self, semantics=default)

    def fingerprint(self) -> dict[str, Any]:
        """The options that change a row, as a run directory records them."""
        semantics = semantics_or_default(self.semantics)
        return {
            "chunk_size": self.chunk_size,
            "top_k": self.top_k,
            "semantics": semantics.describe(),
            "seeds": dict(self.seeds),
            **({"score": self.score.describe()} if self.score.name != "first_token" else {}),
        }


RUN_OPTIONS = tuple(field.name for field in dataclasses.fields(RunOptions))
"""The options :func:`run_experiment` takes as keywords."""


@dataclass(frozen=True)
class ChunkInfo:
    """What :func:`run_experiment` passes to ``on_chunk`` after each chunk is written.

    Attributes:
        index: Position of the chunk in the run (0-based), of ``total``.
        total: Number of chunks in the run.
        chunk_id: Its name, ``m<model set>-t<test set>-c<chunk>``.
        rows: Rows it holds.
        path: The file it was written to (None without ``out``).
    """

    index: int
    total: int
    chunk_id: str
    rows: int
    path: Path | None


@dataclass
class _TestCell:
    """One (model set, test set) pair: its checked batch and every configuration's positions."""

    model_index: int
    test_index: int
    batch: TokenizedExamples
    # positions[config][graft] -> [n_examples, pos] bool
    positions: list[list[torch.Tensor]]
    counter_ids: torch.Tensor | None = None  # logit_diff's counter-answers' first tokens


@dataclass(frozen=True)
class _Grid:
    """A validated run: what every chunk needs to compute its rows."""

    model_sets: list[tuple[str, ModelSet]]
    test_sets: list[TestSet]
    configs: list[GraftConfig]
    resolved: list[list[list[ResolvedGraft]]]
    tag_columns: list[str]
    options: RunOptions
    semantics: Semantics


def run_experiment(
    models: ModelSet | Mapping[str, ModelSet],
    test_sets: TestSet | Sequence[TestSet],
    configs: str | GraftConfig | Sequence[str | GraftConfig],
    *,
    registry: str | Mapping[str, GraftConfig] = "position",
    out: str | os.PathLike | None = None,
    options: RunOptions | None = None,
    on_chunk: Callable[[ChunkInfo], None] | None = None,
    **settings: Any,
) -> pd.DataFrame:
    """Run every configuration on every example of every test set, for every model set.

    Work is cut into chunks of ``chunk_size`` examples of one (model set, test set); within
    a chunk, ``batch_size`` examples at a time, taken in order of length, go through one
    forward pass holding every configuration of them. The run's semantics (default
    :data:`~grafting_lens.study.semantics.DEFAULT_SEMANTICS`, the paper's released code)
    says what the configurations graft, how examples are tokenized and answers ranked.

    With ``out``, the run lives in that directory (:mod:`grafting_lens.study.run_directory`):
    calling again with the same arguments resumes, and a directory holding a different run
    is refused. ``batch_size`` and ``progress`` may change between calls.
    Inside :func:`~grafting_lens.core.ranks.shared_ranks` the chunks are shared by the ranks.

    Args:
        models: A model set, or ``{label: model set}`` to compare several (the ``models``
            column).
        test_sets: What to ask (see :func:`~grafting_lens.study.testsets.make_test_sets`).
        configs: Configuration names (looked up in ``registry``) or :class:`GraftConfig` s.
        registry: A registered experiment whose configurations names are looked up in
            (:func:`~grafting_lens.study.specs.get_configs`), or a mapping of them.
        out: Directory for resumable results (None: keep everything in memory).
        options: How to run (:class:`RunOptions`); ``settings`` override its fields.
        on_chunk: Called with a :class:`ChunkInfo` after each chunk is computed (and
            written); an exception raised there stops the run.
        **settings: Fields of :class:`RunOptions` by name (``batch_size``, ``semantics``...).

    Returns:
        One row per model set, test set, configuration and example, in that order: the
        columns of :data:`IDENTITY_COLUMNS` (``example``: the row of the test set; ``text``:
        the exact prompt), the configurations' tags, ``target``, ``target_id`` (the
        answer's first token), the scores of :mod:`grafting_lens.analysis.scoring`
        (``target_rank``, 0 = top-1, ``target_prob``, ``top1``, ``top5``, ``topk_*``),
        ``data_seed`` and a ``<name>_seed`` column per entry of ``seeds``.

    Raises:
        GraftingLensError: Before any forward pass: an unknown configuration, a layer, a
            component or a source a model set lacks, a span a test set lacks, grafts that
            disagree on a cell, bad sizes, test sets worded or models of a precision other
            than the semantics'.
        RunError: ``out`` holds a different run, or files that are not a run's.
    """
    share = ranks.current()  # first thing on every rank: joining a job is a collective step
    for name in settings:  # dataclasses.replace would raise a bare TypeError
        check_known(name, RUN_OPTIONS, "run_experiment option", ExperimentError)
    kinds: dict[str, tuple[Any, Any]] = {
        "options": (options, RunOptions),
        "registry": (registry, (Mapping, str)),
        "on_chunk": (on_chunk, Callable),
    }
    for name, (value, accepted) in kinds.items():
        if value is not None and not isinstance(value, accepted):
            raise ArgumentTypeError(f"{name}={shown(value)} is of another type.")
    options = dataclasses.replace(options or RunOptions(), **settings).with_semantics(
        DEFAULT_SEMANTICS
    )
    grid = _grid(models, test_sets, configs, registry, options)
    cells = _prepare_cells(grid)
    scorer = LastTokenScorer(top_k=options.top_k, **grid.semantics.scoring())
    seed_columns = [f"{name}_seed" for name in options.seeds]
    columns = [
        *_ORDER_COLUMNS,
        *IDENTITY_COLUMNS,
        *grid.tag_columns,
        *ANSWER_COLUMNS,
        *scorer.columns,
        *options.score.columns,
        "data_seed",
        *seed_columns,
    ]

    chunks = []
    for cell in cells:
        order = torch.argsort(cell.batch.attention_mask.sum(dim=1), stable=True)
        for number, start in enumerate(range(0, len(order), options.chunk_size)):
            chunk_id = f"m{cell.model_index}-t{cell.test_index}-c{number}"
            chunks.append((chunk_id, cell, order[start : start + options.chunk_size]))
    # Under ranks, chunk i is rank i % world's: no chunk claimed, computed twice or lost.
    mine = {chunk_id for chunk_id, _, _ in (chunks if share is None else share.share(chunks))}
    # What each chunk must hold: every configuration of its examples, once.
    expected = {
        chunk_id: [
            (cell.model_index, cell.test_index, config, example)
            for config in range(len(grid.configs))
            for example in index.tolist()
        ]
        for chunk_id, cell, index in chunks
    }
    spec = None
    if out is not None or share is not None:  # shared: every rank's call compared first
        spec = describe_run(
            model_sets=grid.model_sets,
            test_sets=grid.test_sets,
            examples=[len(cells[index].batch) for index in range(len(grid.test_sets))],
            test_digests={
                (cell.model_index, cell.test_index): batch_digest(cell.batch, cell.positions)
                for cell in cells
            },
            configs=grid.configs,
            options=options.fingerprint(),
            columns=[c for c in columns if c not in _ORDER_COLUMNS],
            chunk_ids=[c[0] for c in chunks],
        )
        ranks.same("run_experiment", {**spec, "out": out})
    run_dir = None if out is None else RunDirectory.open(out, spec or {})
    with run_dir if run_dir is not None else contextlib.nullcontext():
        done: dict[str, Rows] = {}
        if run_dir is not None:
            own = {chunk_id: expected[chunk_id] for chunk_id in mine}
            done = ranks.agree(lambda: run_dir.finished(own, columns, _KEY_COLUMNS))
        records = ranks.agree(
            lambda: _compute(grid, chunks, mine, done, run_dir, columns, on_chunk)
        )
        if share is not None and run_dir is not None:  # every rank's chunks, read back
            records = run_dir.finished(expected, columns, _KEY_COLUMNS)
        elif share is not None:  # or handed over
            records = {key: rows for part in ranks.gather(records) for key, rows in part.items()}

    table = pd.DataFrame(
        [row for chunk_id, _, _ in chunks for row in records[chunk_id]], columns=columns
    )
    table = table.sort_values([*_ORDER_COLUMNS, "example"], kind="stable")
    return table.drop(columns=list(_ORDER_COLUMNS)).reset_index(drop=True)


def _compute(
    grid: _Grid,
    chunks: Sequence[tuple[str, _TestCell, torch.Tensor]],
    mine: set[str],
    done: Mapping[str, Rows],
    run_dir: RunDirectory | None,
    columns: Sequence[str],
    on_chunk: Callable[[ChunkInfo], None] | None,
) -> dict[str, Rows]:
    """``done``, and every chunk of ``mine`` not in it, computed (and written to ``run_dir``)."""
    options = grid.options
    rows_of = {c: len(index) * len(grid.configs) for c, _, index in chunks if c in mine}
    bar = tqdm(
        total=sum(rows_of.values()),
        initial=sum(rows_of[chunk_id] for chunk_id in done),
        desc="grafting",
        unit="row",
        disable=not show_progress(options.progress),
    )
    records: dict[str, Rows] = dict(done)
    scorers: dict[int, LastTokenScorer] = {}
    with bar, torch.inference_mode():
        for position, (chunk_id, cell, index) in enumerate(chunks):
            if chunk_id in done or chunk_id not in mine:
                continue
            tokenizer = grid.model_sets[cell.model_index][1].tokenizer
            scorer = scorers.setdefault(
                id(tokenizer),
                LastTokenScorer(tokenizer, top_k=options.top_k, **grid.semantics.scoring()),
            )
            rows: Rows = []
            for start in range(0, len(index), options.batch_size):
                examples = index[start : start + options.batch_size]
                rows.extend(_run_examples(grid, cell, examples, scorer))
                bar.update(len(examples) * len(grid.configs))
            path = None
            if run_dir is not None:
                path = run_dir.write(chunk_id, columns, rows)
            records[chunk_id] = rows
            if on_chunk is not None:
                on_chunk(ChunkInfo(position, len(chunks), chunk_id, len(rows), path))
    return records


def run_position_grafting(
    models: ModelSet,
    tokenized: Any,
    configs: Sequence[str] = PAPER_POSITION_CONFIGS,
    batch_size: int = 8,
    *,
    components: str | Iterable[str] | None = None,
    semantics: Semantics | str | None = None,
    source: int = 1,
    top_k: int = 10,
    progress: bool | None = None,
    score: Any = "first_token",
    counter: Any = None,
) -> pd.DataFrame:
    """Run position-grafting configurations over a tokenized batch and score each prediction.

    The paper's first experiment (section 4.1): every weight of the finetune (SFT) grafted
    onto the pretrained model (PRE) at some positions only
    (:data:`~grafting_lens.study.configs.POSITION_CONFIGS`); :func:`run_experiment` for one
    model set and one batch, in memory. What "every weight" is, and how the batch must be
    tokenized, follow ``semantics`` (default the paper's released code).

    Args:
        models: Base (source 0, PRE) and donor (``source``, SFT).
        tokenized: A :class:`grafting_lens.analysis.batch.TokenizedExamples`: right-padded
            prompts ending right before the answer.
        configs: Names in :data:`~grafting_lens.study.configs.POSITION_CONFIGS`, in table order.
        batch_size: Examples per forward pass.
        components: What to graft instead of ``all``, read under ``semantics``.
        semantics: A :class:`~grafting_lens.study.semantics.Semantics` or its label.
        source: Index of the donor in the model set.
        top_k: How many top tokens to list per row.
        progress: Show a progress bar (default: when someone watches).
        score: What else each row scores, as in :func:`~grafting_lens.graft` (its columns
            follow); ``counter``: ``score="logit_diff"``'s counter-answers.

    Returns:
        A tidy DataFrame, one row per configuration and example (grouped by configuration,
        in ``configs`` order), with the columns of :data:`POSITION_GRAFTING_COLUMNS`
        (``example``: the row in ``tokenized``; as :func:`run_experiment`'s) and the score's.

    Raises:
        GraftingLensError: An unknown configuration, an empty or malformed batch, or a bad
            ``batch_size``.
    """
    chosen = retarget(
        get_configs(configs, "position", kind="position-grafting"), components, source
    )
    results = run_experiment(
        models,
        TestSet(tokenized),
        chosen,
        batch_size=batch_size,
        chunk_size=max(64, int(batch_size)) if is_integer(batch_size) else 64,
        semantics=semantics,
        top_k=top_k,
        progress=progress,
        score=(scored := Score.of(score, donor=source, counter=counter)),
    )
    return results.loc[:, [*POSITION_GRAFTING_COLUMNS, *scored.columns]]


# ------------------------------------------------------------------------ validation


def _grid(
    models: ModelSet | Mapping[str, ModelSet],
    test_sets: TestSet | Sequence[TestSet],
    configs: str | GraftConfig | Sequence[str | GraftConfig],
    registry: str | Mapping[str, GraftConfig],
    options: RunOptions,
) -> _Grid:
    model_sets = _model_sets(models)
    forms = "a TestSet or a list of them (make_test_sets)"
    test_list = (
        [test_sets]
        if isinstance(test_sets, TestSet)
        else as_list(test_sets, "test_sets", forms, ExperimentError)
    )
    semantics = semantics_or_default(options.semantics)
    seen: dict[tuple[Any, ...], int] = {}
    for index, test_set in enumerate(test_list):
        if not isinstance(test_set, TestSet):
            raise ExperimentError(
                "test_sets must hold TestSet objects (see make_test_sets), got "
                f"{type(test_set).__name__}."
            )
        # Rows say which test set they come from by these labels only.
        key = (test_set.dataset, test_set.prompt, test_set.seed, _directions(test_set))
        if key in seen:
            raise ExperimentError(
                f"Test sets {seen[key]} and {index} are both {test_set.label!r} (seed "
                f"{test_set.seed}, direction {'/'.join(map(str, key[3]))}): their rows could not "
                "be told apart, and a summary would count their examples together. Pass each "
                "prompt once, or give the test sets different dataset labels."
            )
        seen[key] = index
        if test_set.templates is not None and test_set.templates != semantics.prompts:
            raise ExperimentError(
                f"Test set {test_set.label!r} is worded as the {test_set.templates} words its "
                f"prompts, but the semantics {semantics.label!r} asks the {semantics.prompts}'s: "
                f"make it with make_test_sets(..., templates={semantics.prompts!r}), or run "
                f"dataclasses.replace(semantics, prompts={test_set.templates!r})."
            )
        _check_tokenization(test_set, semantics)
    _check_precision(model_sets, semantics)
    config_list = get_configs(configs, registry, semantics=semantics)
    resolved = [
        resolve_configs(config_list, label, model_set, semantics=semantics)
        for label, model_set in model_sets
    ]
    tag_columns = list(dict.fromkeys(key for config in config_list for key in config.tags))
    taken = {*IDENTITY_COLUMNS, *ANSWER_COLUMNS, *SCORE_COLUMNS, *TOP_K_COLUMNS, "data_seed"}
    reused = set(tag_columns) & taken
    if reused:
        raise ExperimentError(f"Configuration tags may not reuse result columns: {sorted(reused)}.")
    return _Grid(model_sets, test_list, config_list, resolved, tag_columns, options, semantics)


def _check_tokenization(test_set: TestSet, semantics: Semantics) -> None:
    """Refuse a batch tokenize_examples made under other rules than the semantics' (a batch
    built by hand records none and is taken as it is)."""
    rules = getattr(test_set.examples, "rules", None) if test_set.is_tokenized else None
    if not isinstance(rules, Mapping):
        return
    wanted = dict(semantics.tokenization())
    differ = {name: value for name, value in wanted.items() if rules.get(name) != value}
    if differ:
        made = ", ".join(f"{name}={rules.get(name)!r}" for name in differ)
        asked = ", ".join(f"{name}={value!r}" for name, value in differ.items())
        raise ExperimentError(
            f"Test set {test_set.label!r} was tokenized with {made}, but the semantics "
            f"{semantics.label!r} tokenizes with {asked}, and its rows would say so: tokenize "
            f"it with tokenize_examples(examples, tokenizer, **semantics.tokenization()), or "
            f"run dataclasses.replace(semantics, {made})."
        )


def _check_precision(model_sets: list[tuple[str, ModelSet]], semantics: Semantics) -> None:
    """Refuse models whose precision is not the one the semantics runs in."""
    if semantics.dtype == "checkpoint":
        return
    wanted = getattr(torch, semantics.dtype)
    for label, models in model_sets:
        # Asked of each source, not of its model: a lazily loaded donor is not read.
        dtypes = {dtype for source in models.sources for dtype in source.floating_dtypes()}
        if dtypes and dtypes != {wanted}:
            found = ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in dtypes))
            raise ExperimentError(
                f"The semantics {semantics.label!r} runs models in {semantics.dtype} (the paper's "
                f"code loaded float32), but model set {label!r} holds {found} weights: load it "
                f"with load_models(..., dtype=torch.{semantics.dtype}), or run "
                "dataclasses.replace(semantics, dtype='checkpoint') to keep its precision."
            )


def _directions(test_set: TestSet) -> tuple[str, ...]:
    """The directions a test set's examples ask (a column of every row)."""
    examples = test_set.examples
    if test_set.is_tokenized:
        examples = getattr(examples, "examples", None) or ()
    return tuple(sorted({str(getattr(example, "direction", None)) for example in examples}))


def _model_sets(models: ModelSet | Mapping[str, ModelSet]) -> list[tuple[str, ModelSet]]:
    if isinstance(models, ModelSet):
        return [(",".join(models.names), models)]
    if isinstance(models, Mapping):
        if not models:
            raise ExperimentError("No model set given.")
        labels: dict[str, Any] = {}
        for label, model_set in models.items():
            if not isinstance(model_set, ModelSet):
                raise ExperimentError(
                    f"models[{label!r}] is a {type(model_set).__name__}; pass ModelSets from "
                    "load_models."
                )
            if str(label) in labels:
                raise ExperimentError(
                    f"The model sets {labels[str(label)]!r} and {label!r} would both be labelled "
                    f"{str(label)!r} in the models column; give them distinct names."
                )
            labels[str(label)] = label
        return [(str(label), model_set) for label, model_set in models.items()]
    raise ArgumentTypeError(
        f"models must be a ModelSet (grafting_lens.load_models) or a mapping of them, got "
        f"{type(models).__name__}."
    )


def _prepare_cells(grid: _Grid) -> list[_TestCell]:
    """Tokenize each test set per model set and evaluate every configuration's positions."""
    tokenized: dict[tuple[int, int], TokenizedExamples] = {}
    cells = []
    for model_index, (label, models) in enumerate(grid.model_sets):
        vocab = int(models.base.cfg.d_vocab)
        if grid.options.top_k > vocab:
            raise ExperimentError(
                f"top_k={grid.options.top_k} exceeds the vocabulary of {label!r} ({vocab})."
            )
        for test_index, test_set in enumerate(grid.test_sets):
            key = (id(models.tokenizer), test_index)
            try:
                if key not in tokenized:
                    tokenized[key] = test_set.batch(models, grid.semantics)
                batch = as_batch(tokenized[key], models)
            except GraftingLensError as error:
                raise type(error)(
                    f"Test set {test_set.label!r} on model set {label!r}: {error}"
                ) from error
            positions = []
            for config, grafts in zip(grid.configs, grid.resolved[model_index]):
                try:
                    selected = [
                        select_positions(g.positions, batch.spans, batch.attention_mask)
                        for g in grafts
                    ]
                except GraftingLensError as error:
                    missing = "first_entity" not in batch.spans and "'first_entity'" in str(error)
                    if test_set.source is not None and missing:
                        # Not "tokenize with tokenize_examples": the span comes from the file.
                        error = type(error)(
                            f"{test_set.source} has no first_entity column, and configuration "
                            f"{config.name!r} grafts at the first entity: add the column (the "
                            "entity as each prompt writes it), or run configurations of the "
                            "last token only."
                        )
                    raise type(error)(
                        f"Configuration {config.name!r} on test set {test_set.label!r}: {error}"
                    ) from error
                check_conflicts(config, grafts, selected, f"test set {test_set.label!r}")
                positions.append(selected)
            score = grid.options.score
            score.check(len(models), [vocab])
            counters = None
            if score.name == "logit_diff":
                counters = score.counter_ids(test_set.examples, batch, models.tokenizer)
            cells.append(_TestCell(model_index, test_index, batch, positions, counters))
    return cells


# ------------------------------------------------------------------------ computing


def _run_examples(
    grid: _Grid, cell: _TestCell, examples: torch.Tensor, scorer: LastTokenScorer
) -> Rows:
    """One forward pass: every configuration of ``examples`` (rows of the cell), scored."""
    label, models = grid.model_sets[cell.model_index]
    test_set = grid.test_sets[cell.test_index]
    batch = cell.batch.rows(examples)
    length = batch.tokens.shape[1]
    positions = [[p[examples, :length] for p in per_config] for per_config in cell.positions]
    scores = score_pass(
        models,
        grid.options.score,
        batch,
        positions,
        lambda selections, shape: stacked_mask(
            models, grid.resolved[cell.model_index], selections, shape
        ),
        scorer,
        counter_ids=None if cell.counter_ids is None else cell.counter_ids[examples],
        logits=grid.options.logits,
    )
    score_columns = [scores[column] for column in (*scorer.columns, *grid.options.score.columns)]
    seed_values = list(grid.options.seeds.values())
    layer_labels = [layers_label(grafts) for grafts in grid.resolved[cell.model_index]]
    rows = []
    example_list = examples.tolist()
    for config_index, config in enumerate(grid.configs):
        tags = [config.tags.get(column) for column in grid.tag_columns]
        for offset, example_index in enumerate(example_list):
            row = config_index * len(example_list) + offset
            example = batch.examples[offset] if batch.examples is not None else None
            rows.append(
                [
                    cell.model_index,
                    cell.test_index,
                    config_index,
                    label,
                    test_set.dataset,
                    test_set.prompt,
                    getattr(example, "direction", None),
                    example_index,
                    getattr(example, "relation_id", None),
                    getattr(example, "text", None),
                    config.name,
                    layer_labels[config_index],
                    grid.semantics.label,
                    *tags,
                    getattr(example, "target", None),
                    int(batch.target_ids[offset]),
                    *(column[row] for column in score_columns),
                    test_set.seed,
                    *seed_values,
                ]
            )
    return rows


def layers_label(grafts: Sequence[ResolvedGraft]) -> str:
    """The layers a configuration grafted, in numbers (a range's name means different layers
    under different arithmetics): ``"8-17"``, or per component where its grafts differ
    (``"attn 0-17; o+mlp_in+mlp_out 9-17"``); ``"-"`` where none grafts a layer."""

    def numbers(layers: Sequence[int]) -> str:
        runs: list[list[int]] = []
        for layer in sorted(set(layers)):
            if runs and layer == runs[-1][-1] + 1:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)

    layered = [graft for graft in grafts if graft.layers]
    spans = list(dict.fromkeys(numbers(graft.layers) for graft in layered))
    if not spans:
        return "-"
    if len(spans) == 1:
        return spans[0]
    return "; ".join(
        dict.fromkeys(f"{'+'.join(g.components)} {numbers(g.layers)}" for g in layered)
    )
