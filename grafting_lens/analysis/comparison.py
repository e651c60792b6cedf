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

No pair is an identity; each bullet below says when the two sides coincide.

* **The residual stream is cumulative; a block is not.** ``resid_post`` at layer
  ``l`` is the embeddings plus the outputs of layers ``0..l``, all computed by the
  donor. Patching it at the last token (LT) hands the target the donor's whole
  computation up to ``l``, *including what the donor's attention read from other
  positions* (the first entity, FE, where the paper finds facts are "enriched").
  So once any layer ``<= l`` has moved the answer into LT's stream, patching
  ``resid_post`` at every later layer "restores" the answer: the curve over layers
  tends to rise and stay up, and says *by when* the answer is present, not
  *where* it was computed. Grafting layer ``l``'s block at LT swaps that one layer's weights:
  the donor's layer computes from the target's stream, and reads the target's
  keys and values at FE. Its curve over layers peaks at the layers whose weights
  compute the answer from what the target already has, and stays low where they
  need the donor's enriched FE or the donor's earlier layers.
* **The cumulative graft** (:data:`STREAM_PAIR`, ``cumulative=True``) grafts the
  embeddings and layers ``0..l`` at the chosen positions: at LT, the donor's
  weights compute LT's stream up to ``l``, but over the target's keys and values
  at every other position. Over *all* positions it equals the ``resid_post`` patch
  exactly. At LT the two differ in one thing only: the keys and values LT's
  attention reads at the other positions in layers ``0..l`` are the donor's in
  the patch and the target's in the graft, so the gap between the two curves is
  what flows into LT from the other positions (FE among them). At the last
  layer it is the paper's LT configuration but for the final norm.
* **Away from LT, a graft acts from its own layer on; a patch only after it.**
  At FE, a graft of layer ``l`` changes the keys and values FE offers to LT *at
  layer l itself* (and FE's stream for the layers after). Patching ``resid_post``
  at FE at ``l`` reaches LT only through the layers after ``l``: at the last
  layer it cannot change the answer at all, while a graft of the last layer's
  attention can.
* **Attention reads other positions.** ``attn_out`` patched at LT is the donor's
  attention over the donor's keys and values at every position, fed by the
  donor's earlier layers. Grafting ``ln1+q+k+v+o`` at LT uses the donor's query,
  key, value and output weights *at LT*; the keys and values of earlier
  positions come from the target's weights and the target's stream. The two agree
  only when the upstream streams agree and the graft covers every position.
  (The paper's ``attn`` group is Q, K and V alone; the output projection and the
  norm are added here because ``attn_out`` is measured after them.)
* **The MLP is position-wise.** ``mlp_out`` patched at LT is the donor's MLP
  applied to the donor's stream at LT; grafting ``ln2+ffn`` at LT applies the same
  weights to the target's stream at LT. If the donor differs from the target only
  in that MLP the two are identical, and so is a ``resid_post`` patch of that
  layer; they part as soon as anything upstream differs.
* **Both agree at the extremes.** Grafting the embeddings and every block at every
  position is the donor's residual stream read out by the target's final norm
  and unembedding, which is what patching ``resid_post`` at the last layer at every
  position gives too; grafting ``"all"`` components (final norm and unembedding
  included) is exactly the donor.

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
site share one sweep. It returns one tidy row per example, configuration and
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
from grafting_lens.core.errors import GraftingLensError, did_you_mean
from grafting_lens.engine.graft import graft_forward
from grafting_lens.engine.masks import GraftMask, Key
from grafting_lens.engine.positions import PositionSets, position_sets
from grafting_lens.models.components import GLOBAL_COMPONENTS, expand_components
from grafting_lens.models.layers import LayerSpec, resolve_layers
from grafting_lens.models.model_set import ModelSet
from grafting_lens.patching.patch import DIRECTIONS, SITES, available_sites, resid_patch_sweep

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
        site: The activation to patch, one of :data:`grafting_lens.patching.patch.SITES`
            except the per-head ``z``.
        cumulative: Graft ``components`` at layers ``0..l`` and the input
            embeddings (``embed``, ``pos_embed``) instead of at layer ``l`` alone:
            the graft that builds the same residual stream a ``resid_post`` patch
            imports (see the module docstring).
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
        tokenized: A :class:`grafting_lens.analysis.batch.TokenizedExamples` (or anything with
            ``tokens``, ``attention_mask``, ``target_ids`` and ``spans``): right-padded
            prompts ending right before the answer.
        positions: Where to graft and patch: span expressions
            (:func:`grafting_lens.engine.positions.select_positions`: ``"LT"``, ``"FE"``,
            ``"FE+LT"``, ``"(FE+LT)^C"``...), or a mapping from a label to such an
            expression or to a ``[batch, pos]`` boolean tensor over ``tokenized``'s rows.
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
            pass holds at least one configuration of a chunk, whatever this says.
        progress: Show a progress bar over chunks (default: when standard error is a
            terminal or in a notebook, see :func:`~grafting_lens.core.console.show_progress`).

    Returns:
        A tidy DataFrame with the columns of :data:`RESULT_COLUMNS`, one row per
        method, position set, pair, layer and example, in that nesting order:
        ``method`` (``"graft"``/``"patch"``), ``direction``, ``positions`` (the
        label), ``pair``, ``components`` and ``site`` (what the pair grafts and
        patches, on every row), ``cumulative``, ``layer``, and the scores at the
        last token: ``target_rank`` (0 = top-1), ``target_prob``, ``top1``,
        ``top5``, ``top_token_id`` and ``top_token``.

    Raises:
        GraftingLensError: (or a subclass) an unknown position set, component,
            site or direction; a layer outside the model; a site the architecture
            lacks or the per-head ``z``; a span the position set needs but the batch
            lacks; a bad source, target, method, ``batch_size`` or
            ``rows_per_forward``; a malformed batch.
    """
    plan = _ComparisonPlan(
        models,
        tokenized,
        positions=positions,
        layers=layers,
        pairs=pairs,
        direction=direction,
        methods=methods,
        source=source,
        target=target,
        batch_size=batch_size,
        rows_per_forward=rows_per_forward,
    )
    scores: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    starts = range(0, len(plan.batch), batch_size)
    with torch.no_grad():
        for start in tqdm(
            starts, desc="graft vs patch", disable=not show_progress(progress), unit="chunk"
        ):
            chunk = plan.chunk(start, min(start + batch_size, len(plan.batch)))
            if "graft" in plan.methods:
                for config, rows in _graft_chunk(plan, chunk).items():
                    scores.setdefault(("graft", *config), []).extend(rows)
            if "patch" in plan.methods:
                for config, rows in _patch_chunk(plan, chunk).items():
                    scores.setdefault(("patch", *config), []).extend(rows)
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
        *,
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
        if not isinstance(models, ModelSet):
            raise GraftingLensError(
                f"Expected a ModelSet, got {type(models).__name__}. Load the checkpoints with "
                "grafting_lens.load_models(base, donor, ...)."
            )
        self.models = models
        self.methods = _check_methods(methods)
        if direction not in DIRECTIONS:
            raise GraftingLensError(
                f"Unknown direction {direction!r}.{did_you_mean(str(direction), DIRECTIONS)} "
                "Use 'sufficiency' (run the target, import the source) or 'necessity' (run the "
                "source, import the target)."
            )
        self.direction = DIRECTIONS[direction]
        for name, index in (("source", source), ("target", target)):
            if not is_integer(index) or not 0 <= index < len(models):
                raise GraftingLensError(
                    f"{name}={index!r}, but the model set has {len(models)} sources "
                    f"(0..{len(models) - 1})."
                )
        if source == target:
            raise GraftingLensError(
                f"source and target are both {source}: importing a checkpoint into itself "
                "changes nothing."
            )
        self.source, self.target = int(source), int(target)
        # Which checkpoint runs, and which one the grafted weights come from.
        self.running, self.giving = (
            (target, source) if self.direction == "sufficiency" else (source, target)
        )
        for name, value in (("batch_size", batch_size), ("rows_per_forward", rows_per_forward)):
            if not is_integer(value) or value < 1:
                raise GraftingLensError(f"{name} must be an integer >= 1, got {value!r}.")
        self.rows_per_forward = int(rows_per_forward)
        self.layers = resolve_layers(layers, models.n_layers)
        self.pairs = _check_pairs(pairs, models, self.methods)
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
        return _ExampleChunk(
            start=start,
            batch=rows,
            selections={
                label: selection[start:stop, :length]
                for label, selection in self.selections.items()
            },
        )

    def score(
        self,
        logits: Float[torch.Tensor, "rows pos d_vocab"],
        target_ids: Int[torch.Tensor, " rows"],
        attention_mask: Int[torch.Tensor, "rows pos"] | None,
        examples: Sequence[int],
    ) -> list[dict[str, Any]]:
        """One dict per row: its example's index and the scorer's columns."""
        scores = self.scorer(logits, target_ids, attention_mask)
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
                key = (method, config.positions, spec.name, config.layer)
                components = "+".join(config.pair.global_components + config.pair.layer_components)
                for score in scores[key]:
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
    def size(self) -> int:
        return len(self.batch)

    @property
    def examples(self) -> list[int]:
        """Index of each row in the whole batch."""
        return list(range(self.start, self.start + self.size))


def _graft_chunk(
    plan: _ComparisonPlan, chunk: _ExampleChunk
) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """Every graft configuration of one chunk, ``rows_per_forward // size`` of them a pass."""
    per_pass = max(1, plan.rows_per_forward // chunk.size)
    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for begin in range(0, len(plan.configs), per_pass):
        configs = plan.configs[begin : begin + per_pass]
        mask = GraftMask.cat([_graft_mask(plan, chunk, config) for config in configs])
        repeats = len(configs)
        attention_mask = chunk.batch.attention_mask.repeat(repeats, 1)
        tokens = chunk.batch.tokens.repeat(repeats, 1)
        # Each row's last real token alone: the unembedding runs there only.
        logits = graft_forward(plan.models, tokens, mask, attention_mask=attention_mask)
        scored = plan.score(
            logits,
            chunk.batch.target_ids.repeat(repeats),
            None,
            chunk.examples * repeats,
        )
        for block, config in enumerate(configs):
            key = (config.positions, config.pair.spec.name, config.layer)
            results[key] = scored[block * chunk.size : (block + 1) * chunk.size]
    return results


def _graft_mask(
    plan: _ComparisonPlan, chunk: _ExampleChunk, config: _ComparisonConfig
) -> GraftMask:
    """The running checkpoint everywhere, the giving one at the configuration's components."""
    models = plan.models
    selected = chunk.selections[config.positions]
    real = chunk.batch.attention_mask.bool()
    pair = config.pair
    layers = range(config.layer + 1) if pair.spec.cumulative else (config.layer,)
    grafted: set[Key] = {(name, layer) for name in pair.layer_components for layer in layers}
    grafted |= {(name, None) for name in pair.global_components}
    if pair.spec.cumulative:
        grafted |= {(name, None) for name in ("embed", "pos_embed") if name in models.components}
    everywhere = real.long() * plan.running
    here = torch.where(selected, plan.giving, plan.running) * real.long()
    entries = {key: here if key in grafted else everywhere for key in models.pairs}
    batch, length = chunk.batch.tokens.shape
    return GraftMask.from_dict(models, entries, (int(batch), int(length)))


def _patch_chunk(
    plan: _ComparisonPlan, chunk: _ExampleChunk
) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """Every patch configuration of one chunk: one batched sweep per distinct site."""
    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    sites = list(dict.fromkeys(pair.spec.site for pair in plan.pairs))
    for site in sites:
        recorded: list[list[dict[str, Any]]] = []
        values, _ = resid_patch_sweep(
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
        labels = list(chunk.selections)
        for pair in plan.pairs:
            if pair.spec.site != site:
                continue
            for layer_index, layer in enumerate(plan.layers):
                for label_index, label in enumerate(labels):
                    call = int(values[layer_index, label_index, 0])
                    results[(label, pair.spec.name, layer)] = recorded[call]
    return results


def _recorder(
    plan: _ComparisonPlan, chunk: _ExampleChunk, recorded: list[list[dict[str, Any]]]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A sweep metric that scores each cell's rows into ``recorded``."""

    def record(logits: Float[torch.Tensor, "batch pos d_vocab"]) -> torch.Tensor:
        recorded.append(
            plan.score(logits, chunk.batch.target_ids, chunk.batch.attention_mask, chunk.examples)
        )
        # The sweep may run cells in any order but returns its values in cell
        # order; returning the call's number tells which scores are whose.
        return torch.full((logits.shape[0],), float(len(recorded) - 1))

    return record


# -------------------------------------------------------------------- references


def reference_scores(
    models: ModelSet,
    tokenized: Any,
    sources: Sequence[int] | None = None,
    batch_size: int = 32,
) -> pd.DataFrame:
    """Each checkpoint's own scores, unmodified: the floor and ceiling of a comparison.

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
        GraftingLensError: A malformed batch, a source out of range or listed twice, or a
            bad ``batch_size``.
    """
    if not isinstance(models, ModelSet):
        raise GraftingLensError(f"Expected a ModelSet, got {type(models).__name__}.")
    sources = list(range(len(models))) if sources is None else list(sources)
    for index in sources:
        if not is_integer(index) or not 0 <= index < len(models):
            raise GraftingLensError(
                f"Source {index!r} is out of range: the model set has {len(models)} sources."
            )
    sources = [int(index) for index in sources]
    if len(set(sources)) != len(sources):
        # Each example would be scored twice, and a summary would count it twice.
        raise GraftingLensError(f"A source is listed twice: {sources}.")
    if not is_integer(batch_size) or batch_size < 1:
        raise GraftingLensError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    batch_size = int(batch_size)
    batch = as_batch(tokenized, models)
    scorer = LastTokenScorer()
    rows = []
    with torch.no_grad():
        for index in sources:
            model = models[index]
            for start in range(0, len(batch), batch_size):
                stop = min(start + batch_size, len(batch))
                chunk = batch.rows(range(start, stop))
                mask = chunk.attention_mask.to(models.device)
                logits = model(
                    chunk.tokens.to(models.device), attention_mask=mask, return_type="logits"
                )
                scores = scorer(logits, chunk.target_ids, mask)
                for offset, example_index in enumerate(range(start, stop)):
                    example = chunk.examples[offset] if chunk.examples is not None else None
                    rows.append(
                        {
                            "example": example_index,
                            "relation_id": getattr(example, "relation_id", None),
                            "prompt": getattr(example, "prompt_name", None),
                            "model": models.names[index],
                            "source": index,
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
        n_resamples: Resamples of every bootstrap interval (see
            :func:`~grafting_lens.analysis.metrics.bootstrap_ci`).
        confidence: The intervals' confidence level.
        seed: The bootstrap's seed.

    Returns:
        :func:`~grafting_lens.analysis.metrics.summarize`'s columns (``n``, ``top1``, ``top5``,
        ``mean_rank``, each with ``_low`` and ``_high``) plus ``target_prob``,
        ``target_prob_low`` and ``target_prob_high``, one row per group in order
        of first appearance.

    Raises:
        GraftingLensError: An empty table or missing columns.
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


# ------------------------------------------------------------------------ figure


def _check_methods(methods: Sequence[str] | str) -> tuple[str, ...]:
    methods = (methods,) if isinstance(methods, str) else tuple(methods)
    if not methods:
        raise GraftingLensError(f"No method given; choose from {METHODS}.")
    for method in methods:
        if method not in METHODS:
            raise GraftingLensError(
                f"Unknown method {method!r}.{did_you_mean(str(method), METHODS)} "
                f"Methods: {', '.join(METHODS)}."
            )
    if len(set(methods)) != len(methods):
        raise GraftingLensError(f"A method is listed twice: {methods}.")
    return tuple(method for method in METHODS if method in methods)


def _check_pairs(
    pairs: Sequence[PairSpec], models: ModelSet, methods: Sequence[str]
) -> tuple[_CheckedPair, ...]:
    if isinstance(pairs, ComparisonPair) or (
        isinstance(pairs, tuple) and pairs and all(isinstance(part, str) for part in pairs)
    ):
        pairs = [pairs]  # a single pair given bare
    checked: list[_CheckedPair] = []
    names: set[str] = set()
    for pair in pairs:
        spec = _as_pair(pair)
        if spec.site not in SITES or spec.site == "z":
            per_position = [site for site in SITES if site != "z"]
            hint = (
                " The per-head 'z' has no graft counterpart here; use head_patch_sweep."
                if spec.site == "z"
                else did_you_mean(str(spec.site), per_position)
            )
            raise GraftingLensError(
                f"Pair {spec.name!r}: unknown site {spec.site!r}.{hint} "
                f"Sites: {', '.join(per_position)}."
            )
        if "patch" in methods and spec.site not in available_sites(models):
            raise GraftingLensError(
                f"Pair {spec.name!r}: {models.architecture} has no {spec.site!r} site "
                f"(its sites: {', '.join(available_sites(models))})."
            )
        components = expand_components(spec.components, models.components, models.architecture)
        if spec.name in names:
            raise GraftingLensError(f"Two pairs are named {spec.name!r}; names label the results.")
        names.add(spec.name)
        checked.append(
            _CheckedPair(
                spec,
                layer_components=tuple(c for c in components if c not in GLOBAL_COMPONENTS),
                global_components=tuple(c for c in components if c in GLOBAL_COMPONENTS),
            )
        )
    if not checked:
        raise GraftingLensError(
            "No pair given: pass pairs=DEFAULT_PAIRS or (components, site) pairs."
        )
    return tuple(checked)


def _as_pair(pair: object) -> ComparisonPair:
    if isinstance(pair, ComparisonPair):
        return pair
    if isinstance(pair, tuple) and all(isinstance(part, str) for part in pair):
        if len(pair) == 2:
            return ComparisonPair(f"{pair[0]}/{pair[1]}", pair[0], pair[1])
        if len(pair) == 3:
            return ComparisonPair(*pair)
    raise GraftingLensError(
        f"A pair is a ComparisonPair, (components, site) or (name, components, site); got {pair!r}."
    )
