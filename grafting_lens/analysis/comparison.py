"""Grafting and activation patching, side by side, on the same configurations.

Two ways to ask "where does the finetuned model differ?"
--------------------------------------------------------
Both tools run one checkpoint (the *target*, usually the pretrained base) and
import something from another (the *source*, usually the finetuned donor) at
chosen token positions and layers, then score the answer. They import different
things:

* **Activation patching** (:mod:`grafting_lens.patching.patch`) imports a *vector*. It
  runs the donor, records an activation (a residual stream, an attention or MLP
  output) and writes it over the target's own at the chosen place. Whatever the
  target had computed there is deleted, and whatever the donor had computed
  upstream, at every position, comes along with the vector.
* **Grafting** (:mod:`grafting_lens.engine.graft`) imports a *function*. The chosen
  components compute with the donor's weights, from the target's own residual
  stream; their output replaces the target component's output and everything
  else the stream holds stays. At positions outside the graft, every weight is
  the target's, so the keys and values a grafted position attends to are the
  target's too.

The paper this package implements (Nief et al., ICLR 2026) starts from that
difference: patching says where the donor's stream *carries* the answer,
grafting says which weights *compute* it.

Which patch goes with which graft
---------------------------------
A comparison is a list of :class:`ComparisonPair`: graft these components at
layer ``l``, patch this site at layer ``l``, at the same positions. The default
pairs, and the opt-in cumulative one:

=============  ==================================  ================
pair           graft at layer ``l``                patch at ``l``
=============  ==================================  ================
``block``      every per-layer component           ``resid_post``
``attention``  ``ln1+q+k+v+o``                     ``attn_out``
``mlp``        ``ln2+ffn``                         ``mlp_out``
``stream``     the embeddings and layers ``0..l``  ``resid_post``
=============  ==================================  ================

No pair is an identity (the concept page "Grafting versus patching" says when the
two sides coincide, and why):

* **The residual stream is cumulative; a block is not.** Patching ``resid_post`` at
  the last token (LT) at layer ``l`` hands the target the donor's whole computation
  up to ``l``, including what the donor's attention read at other positions, so its
  curve over layers says *by when* the answer is present. Grafting layer ``l``'s
  block swaps that layer's weights alone, reading the target's keys and values: its
  curve peaks where the weights *compute* the answer from what the target has.
* **The cumulative graft** (:data:`STREAM_PAIR`) grafts the embeddings and layers
  ``0..l``: over all positions it equals the ``resid_post`` patch exactly; at LT the
  gap between the two is what flows into LT from the other positions.
* **Attention reads other positions; the MLP does not.** An ``attn_out`` patch at LT
  brings the donor's attention over the donor's keys and values; the graft, the
  donor's weights over the target's. An MLP graft and an ``mlp_out`` patch agree
  as long as everything upstream does. (The paper's ``attn`` group is Q, K and V;
  the norm and output projection are added because ``attn_out`` is measured after
  them.)
* **Both agree at the extremes**: every block at every position is the donor's stream
  read out by the target's final norm and unembedding; ``"all"`` is the donor.

Directions follow :mod:`grafting_lens.patching.patch`: ``"sufficiency"`` runs the
target and imports from the source (does the donor's weight or activation
*suffice* to make the target answer?); ``"necessity"`` runs the source and
imports the target's (does the donor *need* its own?). A graft in the necessity
direction runs the donor's weights everywhere, the final norm and unembedding
included, and the target's weights at the chosen components and positions.

How it runs
-----------
:func:`compare_graft_and_patch` takes the examples ``batch_size`` at a time and,
for each chunk, runs every graft configuration (positions x pair x layer) as a
block of rows of one batch, joined with :meth:`GraftMask.cat`, and every patch
configuration through :func:`~grafting_lens.patching.patch.resid_patch_sweep`, which
batches its (layer, positions) cells the same way; pairs that patch the same
site share one sweep. Both compute the unembedding at each row's last token only,
the one position scored. It returns one tidy row per example, configuration and
method. :func:`summarize_comparison` aggregates it with bootstrap intervals and
:func:`grafting_lens.analysis.plots.plot_comparison` draws the two methods next to each other, layer by layer.

Examples:
    >>> tokenized = data.tokenize_examples(data.make_examples(relations, prompt="qa"),
    ...                                    models.tokenizer)
    >>> results = compare_graft_and_patch(models, tokenized, positions=("LT", "FE"))
    >>> summary = summarize_comparison(results)
    >>> fig = plots.plot_comparison(summary, value="top5")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from tqdm.auto import tqdm

from grafting_lens.analysis import metrics
from grafting_lens.analysis.batch import TokenizedExamples, as_batch
from grafting_lens.analysis.scoring import SCORE_COLUMNS, TOP_TOKEN_COLUMNS, LastTokenScorer
from grafting_lens.core.arguments import is_integer
from grafting_lens.core.console import show_progress
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.engine.graft import graft_forward
from grafting_lens.engine.masks import GraftMask, Key
from grafting_lens.engine.positions import PositionSets, position_sets
from grafting_lens.models.components import GLOBAL_COMPONENTS, expand_components
from grafting_lens.models.layers import LayerSpec, resolve_layers
from grafting_lens.models.model_set import ModelSet
from grafting_lens.patching.patch import (
    LAYER_POSITION_SITES,
    check_direction,
    check_model_set,
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
        site: The activation to patch, one of
            :data:`~grafting_lens.patching.patch.LAYER_POSITION_SITES`.
        cumulative: Graft ``components`` at layers ``0..l`` and the input
            embeddings instead of at layer ``l`` alone: the graft that builds the
            stream a ``resid_post`` patch imports (see the module docstring).
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
"""Columns of :func:`compare_graft_and_patch`'s table, in order (the scores are
:mod:`grafting_lens.analysis.scoring`'s)."""

PairSpec = Union[ComparisonPair, tuple[str, str], tuple[str, str, str]]
"""A :class:`ComparisonPair`, ``(components, site)`` or ``(name, components, site)``."""

Scores = dict[tuple[str, str, int], list[dict[str, Any]]]
"""Per configuration (positions, pair, layer): one dict of scores per example."""


# --------------------------------------------------------------------------- run


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
) -> pd.DataFrame:
    """Graft and patch the same (positions x pair x layer) configurations; score each example.

    Every argument is checked before the first forward pass.

    Args:
        models: The aligned checkpoints; ``target`` runs, ``source`` is imported
            (swapped in the necessity direction).
        tokenized: A :class:`grafting_lens.analysis.batch.TokenizedExamples` (or what
            :func:`~grafting_lens.analysis.batch.as_batch` takes): right-padded prompts
            ending right before the answer.
        positions: Where to graft and patch: span expressions
            (:func:`grafting_lens.engine.positions.select_positions`: ``"LT"``, ``"FE"``,
            ``"(FE+LT)^C"``...), or a mapping from a label to such an expression or to
            a ``[batch, pos]`` boolean tensor over ``tokenized``'s rows.
        layers: The layers ``l`` of the configurations (see
            :func:`~grafting_lens.resolve_layers`).
        pairs: What to compare at each layer (see :class:`ComparisonPair`,
            :data:`DEFAULT_PAIRS`, :data:`STREAM_PAIR`).
        direction: ``"sufficiency"`` (run ``target``, import ``source``; alias
            ``"denoising"``) or ``"necessity"`` (run ``source``, import ``target``;
            alias ``"noising"``).
        methods: ``("graft", "patch")`` or one of them.
        source: Index of the donor in the model set.
        target: Index of the reference (the base) in the model set.
        batch_size: Examples per chunk; each chunk is cut to its own longest row.
        rows_per_forward: Rows of one forward pass (examples x configurations); a
            pass holds at least one configuration of a chunk.
        progress: Show a progress bar over chunks (default: where someone watches,
            see :func:`~grafting_lens.core.console.show_progress`).

    Returns:
        A tidy DataFrame with the columns of :data:`RESULT_COLUMNS`, one row per
        method, position set, pair, layer and example, in that nesting order, scored
        at the last token: ``target_rank`` (0 = top-1), ``target_prob``, ``top1``,
        ``top5``, ``top_token_id`` and ``top_token``.

    Raises:
        GraftingLensError: (or a subclass) an unknown position set, component, site,
            method or direction; a layer outside the model; a site the architecture
            lacks; a span the batch lacks; a bad source, target, ``batch_size`` or
            ``rows_per_forward``; a malformed batch.
    """
    plan = _ComparisonPlan(
        models, tokenized, positions, layers, pairs, direction, methods, source, target,
        batch_size, rows_per_forward,
    )  # fmt: skip
    scores: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    starts = range(0, len(plan.batch), plan.batch_size)
    bar = tqdm(starts, desc="graft vs patch", disable=not show_progress(progress), unit="chunk")
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
    ) -> None:
        check_model_set(models)
        self.models = models
        methods = (methods,) if isinstance(methods, str) else tuple(methods)
        for method in methods:
            metrics.check_choice("method", method, METHODS)
        self.direction = check_direction(direction)
        indices = (source, target, batch_size, rows_per_forward)
        if (
            not methods
            or len(set(methods)) != len(methods)
            or not all(map(is_integer, indices))
            or not (0 <= min(source, target) and max(source, target) < len(models))
            or source == target
            or min(batch_size, rows_per_forward) < 1
        ):
            raise GraftingLensError(
                f"compare_graft_and_patch needs distinct methods of {METHODS} (got {methods}), "
                f"a source and a target that are two checkpoints of the {len(models)} "
                f"(got {source!r}, {target!r}), and batch_size and rows_per_forward "
                f">= 1 (got {batch_size!r}, {rows_per_forward!r})."
            )
        self.methods = tuple(method for method in METHODS if method in methods)
        self.source, self.target = int(source), int(target)
        # Which checkpoint runs, and which one the grafted weights come from.
        self.running, self.giving = (
            (self.target, self.source)
            if self.direction == "sufficiency"
            else (self.source, self.target)
        )
        self.batch_size, self.rows_per_forward = int(batch_size), int(rows_per_forward)
        self.layers = resolve_layers(layers, models.n_layers)
        self.pairs = _check_pairs(pairs, models, "patch" in self.methods)
        self.batch = as_batch(tokenized, models)
        self.selections = position_sets(positions, self.batch.spans, self.batch.attention_mask)
        self.scorer = LastTokenScorer(models.tokenizer, top_token=True)
        self.configs = [
            _ComparisonConfig(label, pair, layer)
            for label in self.selections
            for pair in self.pairs
            for layer in self.layers
        ]

    def chunk(self, start: int, stop: int) -> _ExampleChunk:
        rows = self.batch.rows(range(start, stop))
        length = rows.tokens.shape[1]
        selections = {label: s[start:stop, :length] for label, s in self.selections.items()}
        return _ExampleChunk(start, rows, selections)

    def score(
        self,
        logits: Float[torch.Tensor, "rows 1 d_vocab"],
        target_ids: Int[torch.Tensor, " rows"],
        examples: Sequence[int],
    ) -> list[dict[str, Any]]:
        """One dict per row, from its last token's logits: its example's index and the scores."""
        scores = self.scorer(logits, target_ids)
        columns = self.scorer.columns
        return [
            {"example": example, **dict(zip(columns, values))}
            for example, *values in zip(examples, *(scores[c] for c in columns))
        ]

    def frame(self, scores: dict[tuple[str, str, str, int], list[dict[str, Any]]]) -> pd.DataFrame:
        examples = self.batch.examples
        rows = []
        for method in self.methods:
            for config in self.configs:
                spec = config.pair.spec
                components = "+".join(config.pair.global_components + config.pair.layer_components)
                for score in scores[(method, config.positions, spec.name, config.layer)]:
                    index = score["example"]
                    example = examples[index] if examples is not None else None
                    rows.append(
                        {
                            "example": index,
                            "relation_id": getattr(example, "relation_id", None),
                            "prompt": getattr(example, "prompt_name", None),
                            "text": getattr(example, "text", None),
                            "target": getattr(example, "target", None),
                            "target_id": int(self.batch.target_ids[index]),
                            "method": method,
                            "direction": self.direction,
                            "positions": config.positions,
                            "pair": spec.name,
                            "components": components,
                            "site": spec.site,
                            "cumulative": spec.cumulative,
                            "layer": config.layer,
                            **{column: score[column] for column in self.scorer.columns},
                        }
                    )
        return pd.DataFrame(rows, columns=list(RESULT_COLUMNS))


@dataclass(frozen=True)
class _ExampleChunk:
    """Some consecutive examples, cut to their longest row."""

    start: int
    batch: TokenizedExamples
    selections: dict[str, Bool[torch.Tensor, "batch pos"]]

    @property
    def examples(self) -> list[int]:
        """Index of each row in the whole batch."""
        return list(range(self.start, self.start + len(self.batch)))


def _graft_chunk(plan: _ComparisonPlan, chunk: _ExampleChunk) -> Scores:
    """Every graft configuration of one chunk, ``rows_per_forward // size`` of them a pass."""
    size = len(chunk.batch)
    per_pass = max(1, plan.rows_per_forward // size)
    results: Scores = {}
    for begin in range(0, len(plan.configs), per_pass):
        configs = plan.configs[begin : begin + per_pass]
        mask = GraftMask.cat([_graft_mask(plan, chunk, config) for config in configs])
        repeats = len(configs)
        logits = graft_forward(  # logits="last" (engine)
            plan.models,
            chunk.batch.tokens.repeat(repeats, 1),
            mask,
            attention_mask=chunk.batch.attention_mask.repeat(repeats, 1),
            last_only=True,
        )
        scored = plan.score(
            logits, chunk.batch.target_ids.repeat(repeats), chunk.examples * repeats
        )
        for block, config in enumerate(configs):
            key = (config.positions, config.pair.spec.name, config.layer)
            results[key] = scored[block * size : (block + 1) * size]
    return results


def _graft_mask(
    plan: _ComparisonPlan, chunk: _ExampleChunk, config: _ComparisonConfig
) -> GraftMask:
    """The running checkpoint everywhere, the giving one at the configuration's components."""
    models = plan.models
    real = chunk.batch.attention_mask
    pair = config.pair
    layers = range(config.layer + 1) if pair.spec.cumulative else (config.layer,)
    grafted: set[Key] = {(name, layer) for name in pair.layer_components for layer in layers}
    grafted |= {(name, None) for name in pair.global_components}
    if pair.spec.cumulative:
        grafted |= {(name, None) for name in ("embed", "pos_embed") if name in models.components}
    everywhere = real * plan.running
    here = torch.where(chunk.selections[config.positions], plan.giving, plan.running) * real
    entries = {key: here if key in grafted else everywhere for key in models.pairs}
    batch, length = chunk.batch.tokens.shape
    return GraftMask.from_dict(models, entries, (int(batch), int(length)))


def _patch_chunk(plan: _ComparisonPlan, chunk: _ExampleChunk) -> Scores:
    """Every patch configuration of one chunk: one batched sweep per distinct site."""
    results: Scores = {}
    labels = list(chunk.selections)
    for site in dict.fromkeys(pair.spec.site for pair in plan.pairs):
        recorded: list[list[dict[str, Any]]] = []
        values, _ = resid_patch_sweep(  # logits="last" by default: the scored token only
            plan.models,
            chunk.batch.tokens,
            _recorder(plan, chunk, recorded),
            site=site,
            layers=list(plan.layers),
            positions=dict(chunk.selections),
            source=plan.source,
            target=plan.target,
            direction=plan.direction,
            attention_mask=chunk.batch.attention_mask,
            reduce="none",
            chunk_size=plan.rows_per_forward,
            progress=False,
        )
        for pair in plan.pairs:
            if pair.spec.site == site:
                for layer_index, layer in enumerate(plan.layers):
                    for label_index, label in enumerate(labels):
                        call = int(values[layer_index, label_index, 0])
                        results[(label, pair.spec.name, layer)] = recorded[call]
    return results


def _recorder(
    plan: _ComparisonPlan, chunk: _ExampleChunk, recorded: list[list[dict[str, Any]]]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A sweep metric that scores each cell's rows into ``recorded``."""

    def record(logits: Float[torch.Tensor, "batch 1 d_vocab"]) -> torch.Tensor:
        recorded.append(plan.score(logits, chunk.batch.target_ids, chunk.examples))
        # The sweep may run cells in any order but returns its values in cell
        # order; returning the call's number tells which scores are whose.
        return torch.full((logits.shape[0],), float(len(recorded) - 1))

    return record


def _check_pairs(
    pairs: Sequence[PairSpec], models: ModelSet, patched: bool
) -> tuple[_CheckedPair, ...]:
    if isinstance(pairs, ComparisonPair) or (
        isinstance(pairs, tuple) and pairs and all(isinstance(part, str) for part in pairs)
    ):
        pairs = [pairs]  # a single pair given bare
    checked = []
    for pair in pairs:
        if (
            isinstance(pair, tuple)
            and len(pair) in (2, 3)
            and all(isinstance(p, str) for p in pair)
        ):
            pair = (
                ComparisonPair(*pair) if len(pair) == 3 else ComparisonPair("/".join(pair), *pair)
            )
        if not isinstance(pair, ComparisonPair):
            raise GraftingLensError(
                f"A pair is a ComparisonPair, (components, site) or (name, components, site); "
                f"got {pair!r}."
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


# -------------------------------------------------------------------- references


def reference_scores(
    models: ModelSet,
    tokenized: Any,
    sources: Sequence[int] | None = None,
    batch_size: int = 32,
) -> pd.DataFrame:
    """Each checkpoint's own scores, unmodified: the floor and ceiling of a comparison.

    Each checkpoint runs its own forward, with the unembedding at each row's last
    token only.

    Args:
        models: The model set.
        tokenized: As for :func:`compare_graft_and_patch`.
        sources: Which checkpoints (default all of them).
        batch_size: Examples per forward pass.

    Returns:
        One row per checkpoint and example: ``example``, ``relation_id``,
        ``prompt``, ``model`` (its name in ``models.names``), ``source`` (its
        index), and the scores ``target_rank``, ``target_prob``, ``top1``, ``top5``.

    Raises:
        GraftingLensError: A malformed batch, sources out of range or listed twice,
            or a bad ``batch_size``.
    """
    check_model_set(models)
    sources = list(range(len(models))) if sources is None else list(sources)
    if (
        not all(is_integer(index) and 0 <= index < len(models) for index in sources)
        or len(set(sources)) != len(sources)  # each example would count twice in a summary
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
                for offset in range(len(chunk)):
                    example = chunk.examples[offset] if chunk.examples is not None else None
                    rows.append(
                        {
                            "example": start + offset,
                            "relation_id": getattr(example, "relation_id", None),
                            "prompt": getattr(example, "prompt_name", None),
                            "model": models.names[int(index)],
                            "source": int(index),
                            **{column: scores[column][offset] for column in SCORE_COLUMNS},
                        }
                    )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------- summaries


def summarize_comparison(
    results: pd.DataFrame,
    by: Sequence[str] = ("positions", "pair", "method", "layer"),
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Top-1/top-5 accuracy, mean rank and mean target probability per group, with intervals.

    Args:
        results: A table from :func:`compare_graft_and_patch` (or
            :func:`reference_scores`, with ``by=("prompt", "model")``).
        by: Columns that define a group; add ``"prompt"`` to keep prompts apart.
        n_resamples: Resamples of every bootstrap interval.
        confidence: The intervals' confidence level.
        seed: The bootstrap's seed.

    Returns:
        :func:`~grafting_lens.analysis.metrics.summarize`'s columns plus ``target_prob``,
        ``target_prob_low`` and ``target_prob_high``, one row per group in order of
        first appearance.

    Raises:
        GraftingLensError: What :func:`~grafting_lens.analysis.metrics.summarize`
            refuses, or a table without ``target_prob``.
    """
    by = [by] if isinstance(by, str) else list(by)
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
