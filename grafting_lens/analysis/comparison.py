"""Grafting and activation patching, side by side, on the same configurations.

Patching (:mod:`grafting_lens.patching.patch`) imports a *vector*: the donor's activation,
with everything the donor computed upstream. Grafting (:mod:`grafting_lens.engine.graft`)
imports a *function*: the donor's weights, computing from the target's own stream. Patching
says where the donor's stream *carries* the answer, grafting which weights *compute* it
(Nief et al., ICLR 2026). A :class:`ComparisonPair` names the graft and the patch compared
at each layer (``docs/concepts/grafting-vs-patching.md``: the pairs, and when they coincide).

:func:`compare_graft_and_patch` runs every (positions x pair x layer) configuration both
ways, grafts in blocks of rows and patches in one batched sweep per site, and returns one
tidy row per example, configuration and method; :func:`summarize_comparison` adds intervals.

Examples:
    >>> results = compare_graft_and_patch(models, tokenized, positions=("LT", "FE"))
    >>> fig = plots.plot_comparison(summarize_comparison(results), value="top5")
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool
from tqdm.auto import tqdm

from grafting_lens.analysis import metrics
from grafting_lens.analysis.batch import TokenizedExamples, as_batch
from grafting_lens.analysis.scoring import (
    SCORE_COLUMNS,
    TOP_TOKEN_COLUMNS,
    LastTokenScorer,
    Score,
    ScoredPass,
    score_pass,
)
from grafting_lens.core.arguments import is_integer, shown
from grafting_lens.core.console import show_progress
from grafting_lens.core.errors import (
    ArgumentTypeError,
    GraftingLensError,
    check_known,
    refuse_first,
)
from grafting_lens.engine.graft import graft_forward
from grafting_lens.engine.masks import GraftMask, Key
from grafting_lens.engine.positions import PositionSets, position_sets
from grafting_lens.models.components import GLOBAL_COMPONENTS, expand_components
from grafting_lens.models.layers import LayerSpec, resolve_layers
from grafting_lens.models.model_set import ModelSet, check_model_set
from grafting_lens.patching.patch import (
    LAYER_POSITION_SITES,
    LastTokenMetric,
    check_direction,
    check_site,
    resid_patch_sweep,
)

__all__ = [
    "DEFAULT_PAIRS",
    "METHODS",
    "RESULT_COLUMNS",
    "STREAM_PAIR",
    "ComparisonPair",
    "compare_graft_and_patch",
    "reference_scores",
    "summarize_comparison",
]


@dataclass(frozen=True)
class ComparisonPair:
    """A graft and the activation patch it is compared with, at the same layer.

    Attributes:
        name: Label in tables and figure panels.
        components: What to graft: names, groups or a ``+``-joined string (see
            :mod:`grafting_lens.models.components`). Global components in it (``embed``,
            ``ln_final``...) are grafted whatever the layer.
        site: The activation to patch (:data:`~grafting_lens.patching.patch.LAYER_POSITION_SITES`).
        cumulative: Graft ``components`` at layers ``0..l`` and the input embeddings,
            not at ``l`` alone: the stream a ``resid_post`` patch imports.
    """

    name: str
    components: str
    site: str
    cumulative: bool = False


DEFAULT_PAIRS: tuple[ComparisonPair, ...] = (
    ComparisonPair("block", "block", "resid_post"),
    ComparisonPair("attention", "ln1+attn+o", "attn_out"),
    ComparisonPair("mlp", "ln2+ffn", "mlp_out"),
)
"""One layer's block, attention and MLP, each against the activation it writes."""

STREAM_PAIR = ComparisonPair("stream", "block", "resid_post", cumulative=True)
"""The embeddings and layers ``0..l`` grafted, against ``resid_post`` patched at ``l``."""

METHODS: tuple[str, ...] = ("graft", "patch")
"""The two methods, as they appear in the ``method`` column."""

RESULT_COLUMNS: tuple[str, ...] = (
    "example",
    "relation_id",
    "prompt",
    "text",
    "target",
    "target_id",
    "method",
    "direction",
    "positions",
    "pair",
    "components",
    "site",
    "cumulative",
    "layer",
    *SCORE_COLUMNS,
    *TOP_TOKEN_COLUMNS,
)
"""Columns of :func:`compare_graft_and_patch`'s table, in order."""

PairSpec = Union[ComparisonPair, tuple[str, str], tuple[str, str, str]]
"""A :class:`ComparisonPair`, ``(components, site)`` or ``(name, components, site)``."""

Scores = dict[tuple[str, str, int], list[dict[str, Any]]]
"""Per configuration (positions, pair, layer): one dict of scores per example."""

# An example's columns in the tables, and the attribute each is read from.
_ABOUT = {"relation_id": "relation_id", "prompt": "prompt_name", "text": "text", "target": "target"}


def compare_graft_and_patch(
    models: ModelSet,
    tokenized: Any,
    positions: PositionSets = ("LT", "FE"),
    layers: LayerSpec = "all",
    pairs: Sequence[PairSpec] = DEFAULT_PAIRS,
    *,
    direction: str = "sufficiency",
    methods: Sequence[str] = METHODS,
    source: int = 1,
    target: int = 0,
    batch_size: int = 8,
    rows_per_forward: int = 256,
    progress: bool | None = None,
    score: Any = "first_token",
    counter: Any = None,
) -> pd.DataFrame:
    """Graft and patch the same (positions x pair x layer) configurations; score each example.

    Args:
        models: The aligned checkpoints; ``target`` runs and ``source`` is imported.
        tokenized: A tokenized batch (what :func:`~grafting_lens.analysis.batch.as_batch` takes).
        positions: Span expressions (``"LT"``, ``"(FE+LT)^C"``...), or ``{label: span or
            [batch, pos] boolean tensor}``.
        layers: The layers ``l`` of the configurations (see :func:`~grafting_lens.resolve_layers`).
        pairs: What to compare at each layer (:class:`ComparisonPair`, :data:`STREAM_PAIR`...).
        direction: ``"sufficiency"`` (alias ``"denoising"``) or ``"necessity"`` (``"noising"``).
        methods: ``("graft", "patch")`` or one of them.
        source: Index of the donor in the model set.
        target: Index of the reference (the base).
        batch_size: Examples per chunk, each chunk cut to its own longest row.
        rows_per_forward: Rows of one forward pass (at least one configuration of a chunk).
        progress: Show a progress bar over chunks (default: where someone watches).
        score: What else each row scores, as in :func:`~grafting_lens.graft`: ``"kl"``
            compares with ``source`` and recovers from ``target``; under a teacher-forced
            score the answer's positions are grafted or patched with the prompt's last token.
        counter: ``score="logit_diff"``'s counter-answer, one or one per example.

    Returns:
        A tidy DataFrame with the columns of :data:`RESULT_COLUMNS` and the score's, one row
        per method, position set, pair, layer and example, in that nesting order.

    Raises:
        ArgumentTypeError: An argument of the wrong type (``methods=None``, ``source="1"``),
            naming it.
        GraftingLensError: (or a subclass, before any forward pass) an unknown position set,
            component, site, method or direction; a layer outside the model; a site the
            architecture lacks; a span the batch lacks; a bad source, target, size or batch.
    """
    plan = _ComparisonPlan(  # every argument checked before any pass
        models=models,
        tokenized=tokenized,
        positions=positions,
        layers=layers,
        pairs=pairs,
        direction=direction,
        methods=methods,
        source=source,
        target=target,
        batch_size=batch_size,
        rows_per_forward=rows_per_forward,
        progress=progress,
        score=score,
        counter=counter,
    )
    scores: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    starts = range(0, len(plan.batch), plan.batch_size)
    bar = tqdm(starts, desc="graft vs patch", disable=not plan.progress, unit="chunk")
    with torch.no_grad():
        for start in bar:
            chunk = plan.chunk(start, min(start + plan.batch_size, len(plan.batch)))
            for method, run in (("graft", _graft_chunk), ("patch", _patch_chunk)):
                if method in plan.methods:
                    for config, rows in run(plan, chunk).items():
                        scores.setdefault((method, *config), []).extend(rows)
    return plan.frame(scores)


@dataclass(frozen=True)
class _CheckedPair:
    """A validated pair: its components expanded for the model set."""

    spec: ComparisonPair
    layer_components: tuple[str, ...]
    global_components: tuple[str, ...]


@dataclass(frozen=True)
class _ComparisonConfig:
    """One graft or patch configuration: a position set, a pair and a layer."""

    positions: str
    pair: _CheckedPair
    layer: int


class _ComparisonPlan:
    """Validated arguments of one comparison: every check happens here, before any forward."""

    def __init__(
        self,
        *,
        models: ModelSet,
        tokenized: Any,
        positions: PositionSets,
        layers: LayerSpec,
        pairs: Sequence[PairSpec],
        direction: str,
        methods: Sequence[str],
        source: int,
        target: int,
        batch_size: int,
        rows_per_forward: int,
        progress: bool | None,
        score: Any,
        counter: Any,
    ) -> None:
        check_model_set(models)
        self.models = models
        methods = _check_methods(methods)
        if not isinstance(direction, str):
            raise ArgumentTypeError(
                f"direction= must be 'sufficiency' or 'necessity', got {shown(direction)}."
            )
        self.direction = check_direction(direction)
        _check_options(len(models), source, target, batch_size, rows_per_forward)
        _check_shapes(positions, pairs)
        self.methods = tuple(method for method in METHODS if method in methods)
        self.source, self.target = source, target = int(source), int(target)
        # Which checkpoint runs, and which one the grafted weights come from.
        swapped = self.direction == "necessity"
        self.running, self.giving = (source, target) if swapped else (target, source)
        self.batch_size, self.rows_per_forward = int(batch_size), int(rows_per_forward)
        self.layers = resolve_layers(layers, models.n_layers)
        self.pairs = _check_pairs(pairs, models, "patch" in self.methods)
        self.batch = as_batch(tokenized, models)
        self.selections = position_sets(positions, self.batch.spans, self.batch.attention_mask)
        self.scorer = LastTokenScorer(models.tokenizer, top_token=True)
        # kl compares with the source, recovered from the target; the source may be 0 here,
        # which Score.of refuses as a donor (it is graft()'s base).
        self.scored = dataclasses.replace(Score.of(score, counter=counter), donor=source)
        self.counter_ids = (
            self.scored.counter_ids(self.batch.examples or [], self.batch, models.tokenizer)
            if self.scored.name == "logit_diff"
            else None
        )
        self.configs = [
            _ComparisonConfig(label, pair, layer)
            for label in self.selections
            for pair in self.pairs
            for layer in self.layers
        ]
        self.progress = show_progress(progress)  # a bad progress= is refused after the rest

    def chunk(self, start: int, stop: int) -> _ExampleChunk:
        rows = self.batch.rows(range(start, stop))
        length = rows.tokens.shape[1]
        selections = {label: s[start:stop, :length] for label, s in self.selections.items()}
        counters = None if self.counter_ids is None else self.counter_ids[start:stop]
        laid = self.scored.lay_out(rows, [[s] for s in selections.values()])
        grown = {label: laid.selections[i][0] for i, label in enumerate(selections)}
        return _ExampleChunk(list(range(start, stop)), rows, selections, laid, grown, counters)

    def rows(self, columns: dict[str, list[Any]], examples: Sequence[int]) -> list[dict[str, Any]]:
        """One dict per row: its example's index and its columns."""
        return [
            {"example": example, **dict(zip(columns, values))}
            for example, *values in zip(examples, *columns.values())
        ]

    def frame(self, scores: dict[tuple[str, str, str, int], list[dict[str, Any]]]) -> pd.DataFrame:
        """The table: one row per method, configuration and example, in that nesting order."""
        examples = self.batch.examples or [None] * len(self.batch)
        rows = []
        for method, config in itertools.product(self.methods, self.configs):
            pair, spec = config.pair, config.pair.spec
            setting = {
                "method": method,
                "direction": self.direction,
                "positions": config.positions,
                "pair": spec.name,
                "components": "+".join(pair.global_components + pair.layer_components),
                "site": spec.site,
                "cumulative": spec.cumulative,
                "layer": config.layer,
            }
            for score in scores[(method, config.positions, spec.name, config.layer)]:
                index = score["example"]
                about = {c: getattr(examples[index], a, None) for c, a in _ABOUT.items()}
                target_id = int(self.batch.target_ids[index])
                rows.append({**score, **about, "target_id": target_id, **setting})
        return pd.DataFrame(rows, columns=[*RESULT_COLUMNS, *self.scored.columns])


def _check_methods(methods: object) -> tuple[str, ...]:
    """``methods`` as distinct names of :data:`METHODS`: one, or a list of them."""
    if isinstance(methods, str):
        methods = (methods,)
    if isinstance(methods, (Mapping, bytes, torch.Tensor)) or not isinstance(methods, Iterable):
        raise ArgumentTypeError(
            f"methods= must be 'graft', 'patch' or both, e.g. {METHODS}; got {shown(methods)}."
        )
    given = tuple(methods)
    for method in given:
        check_known(method, METHODS, "method in methods")
    refuse_first(
        GraftingLensError,
        [
            (not given, f"methods= holds nothing; give 'graft', 'patch' or both, e.g. {METHODS}."),
            (len(set(given)) != len(given), f"methods= lists a method twice: {given}."),
        ],
    )
    return given


def _check_options(
    n_models: int, source: object, target: object, batch_size: object, rows_per_forward: object
) -> None:
    """Refuse a source or target that is not a checkpoint of the ``n_models``, or a size < 1."""
    checkpoint = f"the index of a checkpoint, 0..{n_models - 1}"
    named = [
        ("source", source, checkpoint),
        ("target", target, checkpoint),
        ("batch_size", batch_size, "an integer >= 1"),
        ("rows_per_forward", rows_per_forward, "an integer >= 1"),
    ]
    for name, value, what in named:
        if not is_integer(value):
            raise ArgumentTypeError(f"{name}= must be {what}, got {shown(value)}.")
    index = {name: int(value) for name, value, _ in named}  # type: ignore[call-overload]
    for name in ("source", "target"):
        if not 0 <= index[name] < n_models:
            raise GraftingLensError(
                f"{name}={index[name]}, but the model set has {n_models} sources "
                f"(0..{n_models - 1})."
            )
    if index["source"] == index["target"]:
        raise GraftingLensError(
            f"source and target are both {index['source']}: importing a checkpoint into itself "
            "changes nothing."
        )
    for name in ("batch_size", "rows_per_forward"):
        if index[name] < 1:
            raise GraftingLensError(f"{name}= must be an integer >= 1, got {index[name]}.")


def _check_shapes(positions: object, pairs: object) -> None:
    """Refuse ``positions`` or ``pairs`` that are not lists (nor one given bare)."""
    for name, value, forms in (
        ("positions", positions, "span expressions such as ('LT', 'FE'), or {label: span}"),
        ("pairs", pairs, "ComparisonPairs or (name, components, site) tuples, e.g. DEFAULT_PAIRS"),
    ):
        # One position set, or one pair, may be given bare.
        bare = isinstance(value, ComparisonPair if name == "pairs" else str)
        if not bare and (
            isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable)
        ):
            raise ArgumentTypeError(f"{name}= must be {forms}; got {shown(value)}.")


@dataclass(frozen=True)
class _ExampleChunk:
    """Some consecutive examples, cut to their longest row."""

    examples: list[int]  # each row's index in the whole batch
    batch: TokenizedExamples
    selections: dict[str, Bool[torch.Tensor, "batch pos"]]
    laid: ScoredPass  # the pass the score needs: the prompts, or each followed by its answer
    grown: dict[str, Bool[torch.Tensor, "batch pos"]]  # the selections over the laid-out pass
    counter_ids: torch.Tensor | None


def _graft_chunk(plan: _ComparisonPlan, chunk: _ExampleChunk) -> Scores:
    """Every graft configuration of one chunk, ``rows_per_forward // size`` of them a pass."""
    size = len(chunk.batch)
    per_pass = max(1, plan.rows_per_forward // size)
    results: Scores = {}
    for begin in range(0, len(plan.configs), per_pass):
        configs = plan.configs[begin : begin + per_pass]

        def masks(selections: Any, shape: tuple[int, int], configs=configs) -> GraftMask:
            return GraftMask.cat([_graft_mask(plan, chunk, c, shape) for c in configs])

        columns = score_pass(  # each row's scored tokens: the unembedding runs there alone
            plan.models,
            plan.scored,
            chunk.batch,
            [[chunk.selections[c.positions]] for c in configs],
            masks,
            plan.scorer,
            counter_ids=chunk.counter_ids,
            base=plan.target,
        )
        scored = plan.rows(columns, chunk.examples * len(configs))
        for block, config in enumerate(configs):
            key = (config.positions, config.pair.spec.name, config.layer)
            results[key] = scored[block * size : (block + 1) * size]
    return results


def _graft_mask(
    plan: _ComparisonPlan, chunk: _ExampleChunk, config: _ComparisonConfig, shape: tuple[int, int]
) -> GraftMask:
    """The running checkpoint everywhere, the giving one at the configuration's components."""
    models, real, pair = plan.models, chunk.laid.attention_mask, config.pair
    layers = range(config.layer + 1) if pair.spec.cumulative else (config.layer,)
    grafted: set[Key] = {(name, layer) for name in pair.layer_components for layer in layers}
    grafted |= {(name, None) for name in pair.global_components}
    if pair.spec.cumulative:
        grafted |= {(name, None) for name in ("embed", "pos_embed") if name in models.components}
    everywhere = real * plan.running
    here = torch.where(chunk.grown[config.positions], plan.giving, plan.running) * real
    entries = {key: here if key in grafted else everywhere for key in models.pairs}
    return GraftMask.from_dict(models, entries, shape)


def _patch_chunk(plan: _ComparisonPlan, chunk: _ExampleChunk) -> Scores:
    """Every patch configuration of one chunk: one batched sweep per distinct site."""
    results: Scores = {}
    labels = list(chunk.selections)
    recorded: list[list[dict[str, Any]]] = []
    laid, score = chunk.laid, plan.scored
    reads = laid.logits(1)
    reference = None
    if score.name == "kl":  # the target's and the source's own runs, at the scored tokens
        wholes = [
            GraftMask.build(plan.models, laid.tokens, source=i, attention_mask=laid.attention_mask)
            for i in (plan.target, plan.source)
        ]
        both = graft_forward(
            plan.models,
            laid.tokens.repeat(2, 1),
            GraftMask.cat(wholes),
            attention_mask=laid.attention_mask.repeat(2, 1),
            logits=laid.logits(2),
        )
        reference = (both[: len(laid.tokens)], both[len(laid.tokens) :])

    def record(logits: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(len(logits))
        scored = logits if isinstance(reads, str) else logits[rows[:, None], reads]
        columns = (
            plan.scorer(logits, chunk.batch.target_ids, laid.attention_mask)
            if reads == "all"
            else plan.scorer(scored[:, :1], chunk.batch.target_ids)
        )
        values = laid.values(scored, 1, chunk.batch.target_ids, chunk.counter_ids, reference)
        recorded.append(plan.rows({**columns, **values}, chunk.examples))
        # The sweep may run cells in any order but returns its values in cell order;
        # returning the call's number tells which scores are whose.
        return torch.full((logits.shape[0],), float(len(recorded) - 1))

    for site in dict.fromkeys(pair.spec.site for pair in plan.pairs):
        values, _ = resid_patch_sweep(
            plan.models,
            laid.tokens,
            # the last token alone where that is all a score reads: no probe (it counts calls)
            LastTokenMetric(record) if reads == "last" else record,
            site=site,
            layers=list(plan.layers),
            positions=dict(chunk.grown),
            source=plan.source,
            target=plan.target,
            direction=plan.direction,
            attention_mask=laid.attention_mask,
            reduce="none",
            chunk_size=plan.rows_per_forward,
            progress=False,
            logits="last" if reads == "last" else "all",
        )
        for pair in plan.pairs:
            if pair.spec.site == site:
                for layer_index, layer in enumerate(plan.layers):
                    for label_index, label in enumerate(labels):
                        call = int(values[layer_index, label_index, 0])
                        results[(label, pair.spec.name, layer)] = recorded[call]
    return results


def _check_pairs(
    pairs: Sequence[PairSpec], models: ModelSet, patched: bool
) -> tuple[_CheckedPair, ...]:
    """The pairs, each a :class:`ComparisonPair`, its components expanded (one may be bare)."""

    def texts(value: object) -> TypeGuard[tuple[str, ...]]:
        return isinstance(value, tuple) and all(isinstance(part, str) for part in value)

    if isinstance(pairs, ComparisonPair) or (texts(pairs) and pairs):
        pairs = [pairs]  # a single pair given bare
    checked = []
    for pair in pairs:
        if texts(pair) and len(pair) in (2, 3):
            pair = ComparisonPair(*(pair if len(pair) == 3 else ("/".join(pair), *pair)))
        if not isinstance(pair, ComparisonPair):
            raise ArgumentTypeError(
                f"A pair is a ComparisonPair, (components, site) or (name, components, site); "
                f"got {shown(pair)} in pairs=."
            )
        # A graft needs no site: its availability matters only where a patch runs.
        check_site(pair.site, models if patched else None, LAYER_POSITION_SITES)
        components = expand_components(pair.components, models.components, models.architecture)
        checked.append(
            _CheckedPair(
                pair,
                layer_components=tuple(c for c in components if c not in GLOBAL_COMPONENTS),
                global_components=tuple(c for c in components if c in GLOBAL_COMPONENTS),
            )
        )
    names = [pair.spec.name for pair in checked]
    if not names or len(set(names)) != len(names):
        raise GraftingLensError(
            f"Pairs need distinct names (they label the results), at least one: got {names}. "
            "Pass pairs=DEFAULT_PAIRS or (name, components, site) triples."
        )
    return tuple(checked)


def reference_scores(
    models: ModelSet, tokenized: Any, sources: Sequence[int] | None = None, batch_size: int = 32
) -> pd.DataFrame:
    """Each checkpoint's own scores, from its own forward: the floor and ceiling of a comparison.

    Args:
        models: The model set.
        tokenized: As for :func:`compare_graft_and_patch`.
        sources: Which checkpoints (default all of them), or one.
        batch_size: Examples per forward pass.

    Returns:
        One row per checkpoint and example: ``example``, ``relation_id``, ``prompt``,
        ``model`` (its name), ``source`` (its index), and the scores ``target_rank``,
        ``target_prob``, ``top1``, ``top5``.

    Raises:
        GraftingLensError: A malformed batch, bad or repeated sources, a bad ``batch_size``.
    """
    check_model_set(models)
    if is_integer(sources):
        sources = [sources]
    elif sources is None:
        sources = list(range(len(models)))
    elif isinstance(sources, (str, bytes, Mapping, torch.Tensor)) or not isinstance(
        sources, Iterable
    ):
        raise ArgumentTypeError(
            f"sources= must be checkpoint indices, e.g. [0, 1]; got {shown(sources)}."
        )
    sources = list(sources)
    if (
        not all(is_integer(index) and 0 <= index < len(models) for index in sources)
        # A source twice counts each example twice (int(): torch scalars hash by identity).
        or len({int(index) for index in sources}) != len(sources)
        or not is_integer(batch_size)
        or batch_size < 1
    ):
        raise GraftingLensError(
            f"reference_scores needs distinct sources of the model set's {len(models)} "
            f"(0..{len(models) - 1}) and a batch_size >= 1; got {sources} and {batch_size!r}."
        )
    batch = as_batch(tokenized, models)
    scorer = LastTokenScorer()
    rows = []
    with torch.no_grad():
        for index in sources:
            for start in range(0, len(batch), int(batch_size)):
                chunk = batch.rows(range(start, min(start + int(batch_size), len(batch))))
                mask = chunk.attention_mask.to(models.device)
                last = mask.sum(dim=1) - 1
                kept, column = torch.unique(last, return_inverse=True)
                logits = models[int(index)](
                    chunk.tokens.to(models.device),
                    attention_mask=mask,
                    return_type="logits",
                    logits_to_keep=kept,
                )
                final = logits[torch.arange(len(last)), column.to(logits.device)][:, None]
                scores = scorer(final, chunk.target_ids)
                for offset, example in enumerate(chunk.examples or [None] * len(chunk)):
                    about = {
                        c: getattr(example, _ABOUT[c], None) for c in ("relation_id", "prompt")
                    }
                    model = {"model": models.names[int(index)], "source": int(index)}
                    values = {column: scores[column][offset] for column in SCORE_COLUMNS}
                    rows.append({"example": start + offset, **about, **model, **values})
    return pd.DataFrame(rows)


def summarize_comparison(
    results: pd.DataFrame,
    by: Sequence[str] = ("positions", "pair", "method", "layer"),
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Top-1/top-5 accuracy, mean rank and mean target probability per group, with intervals
    (``n_resamples``, ``confidence`` and ``seed``: as for ``summarize``).

    Args:
        results: A table from :func:`compare_graft_and_patch` (or :func:`reference_scores`,
            with ``by=("prompt", "model")``).
        by: Columns that define a group; add ``"prompt"`` to keep prompts apart.

    Returns:
        :func:`~grafting_lens.analysis.metrics.summarize`'s columns plus ``target_prob``,
        ``target_prob_low`` and ``target_prob_high``.

    Raises:
        GraftingLensError: What :func:`~grafting_lens.analysis.metrics.summarize`
            refuses, or a table without ``target_prob``.
    """
    by = metrics.column_names(by, "by", "('positions', 'pair', 'method', 'layer')")
    summary = metrics.summarize(
        results, by=by, ks=(1, 5), n_resamples=n_resamples, confidence=confidence, seed=seed
    )
    if "target_prob" not in results.columns:
        raise GraftingLensError("summarize_comparison needs a target_prob column.")
    intervals = []
    for _, group in results.groupby(by, sort=False, observed=True, dropna=False):
        values = group["target_prob"].to_numpy(dtype=np.float64)
        low, high = metrics.bootstrap_ci(values, n_resamples, confidence, seed)
        intervals.append((float(values.mean()), low, high))
    summary["target_prob"], summary["target_prob_low"], summary["target_prob_high"] = (
        list(column) for column in zip(*intervals)
    )
    return summary
