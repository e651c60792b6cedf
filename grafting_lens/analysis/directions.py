"""What finetuning changed, direction by direction: read, dosed, attributed, kept.

Each direction ``i`` of a weight's change ``dW = sum_i s_i u_i v_i^T`` (its SVD, or a LoRA
donor's rank components; see :mod:`grafting_lens.models.directions`) writes ``u_i`` when its
input lies along ``v_i``. :func:`read_directions` reads both sides through the vocabulary;
:func:`dose_response` grafts cells at several strengths or ranks of the change;
:func:`attribute_directions` estimates each direction's effect from one backward pass and
grafts it alone; :func:`keep_directions` cuts a minimal graft's cells to their fewest
directions. See ``docs/concepts/directions.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from grafting_lens.analysis.attribution import AttributionPlan, BatchMetric, Cell, cell_label
from grafting_lens.analysis.metrics import bootstrap_ci, recovery_ci
from grafting_lens.core.arguments import as_texts, is_integer, shown
from grafting_lens.core.errors import (
    ArgumentTypeError,
    AttributionError,
    SelectionError,
    kind,
    refuse_first,
)
from grafting_lens.engine.relaxation import relaxing
from grafting_lens.models.directions import (
    DirectionsSource,
    check_matrix_components,
    check_rank,
    check_strength,
)
from grafting_lens.models.lora_source import LoraLinear
from grafting_lens.models.model_set import ModelSet, check_model_set
from grafting_lens.models.sources import shared_bridge

__all__ = ["attribute_directions", "dose_response", "keep_directions", "read_directions"]

_WRITES = {"o", "mlp_out", "embed", "pos_embed", "shared_expert"}
_READS = {"q", "k", "v", "mlp_in", "mlp_gate", "unembed", "attn_gate", "router"}


def read_directions(
    models: ModelSet,
    component: str,
    layer: int | None = None,
    *,
    donor: int | str = 1,
    k: int = 8,
    tokens: int = 10,
    answers: Sequence[str] | str | None = None,
) -> pd.DataFrame:
    """The top ``k`` directions of ``donor``'s change to one weight matrix, read as tokens.

    Args:
        models: The model set.
        component: A component holding one weight matrix (``"mlp_out"``, ``"o"``...).
        layer: Its layer (``None`` for ``embed``, ``unembed``).
        donor: The donor's index or name.
        k: How many directions, largest first (a LoRA donor: its first ``k`` components).
        tokens: How many tokens each side lists at each end.
        answers: Texts looked for among the listed tokens: an answer is found when its first
            token (its encoding without special tokens, as given: ``" Tom"`` with its leading
            space) is listed.

    Returns:
        One row per direction: ``component``, ``layer``, ``direction``, ``singular_value``,
        ``share`` (of ``||dW||_F^2``), the tokens ``output_top`` / ``_bottom`` and
        ``input_top`` / ``_bottom`` (empty where a side is not read; signed so that the
        strongest is on top), and with ``answers`` the ``answers_found``.

    Raises:
        SelectionError: A component with no single weight matrix at ``layer``, ``k`` < 1.
    """
    check_model_set(models)
    if not (is_integer(k) and k >= 1 and is_integer(tokens) and tokens >= 1):
        raise kind(k if not is_integer(k) else tokens, int, SelectionError)(
            f"k={shown(k)}, tokens={shown(tokens)}: give counts of 1 or more."
        )
    source = _changes(models, donor)
    if (component, layer) not in models.pairs:
        raise SelectionError(
            f"({component!r}, {layer}) is not a component of this model set: see models.pairs."
        )
    found = [f for f in map(source.factors, models.slots(component, layer)) if f is not None]
    if len(found) != 1:
        raise SelectionError(
            f"{component} at layer {layer} holds {len(found)} weight matrices with directions: "
            "read a component of one linear layer or embedding (o, mlp_out, q...)."
        )
    values, U, Vh, norm2 = found[0]
    count = min(int(k), len(values))
    original: Any = models.base.original_model
    unembedding = original.get_output_embeddings().weight.detach().float()  # [vocab, d_model]
    embedding = original.get_input_embeddings().weight.detach().float()
    vocab = int(embedding.shape[0])

    def reading(vector: torch.Tensor, through: torch.Tensor | None) -> torch.Tensor | None:
        if len(vector) == vocab and component in ("embed", "unembed"):
            return vector
        return None if through is None else through.to(vector.device) @ vector

    listed = []
    targets = as_texts(answers, "answers", "a text or texts") if answers is not None else []
    heads = {a: models.tokenizer.encode(a, add_special_tokens=False)[:1] for a in targets}
    decode = models.tokenizer.convert_ids_to_tokens
    for i in range(count):
        out = reading(U[:, i], unembedding if component in _WRITES else None)
        into = reading(Vh[i], embedding if component in _READS else None)
        first = out if out is not None else into
        sign = -1.0 if first is not None and first.max() < -first.min() else 1.0
        row: dict = {
            "component": component,
            "layer": layer,
            "direction": i,
            "singular_value": float(values[i]),
            "share": float(values[i] ** 2 / norm2) if norm2 else float("nan"),
        }
        ids: set[int] = set()
        for side, scores in (("output", out), ("input", into)):
            top = bottom = []
            if scores is not None:
                scores = sign * scores
                top = scores.topk(min(tokens, vocab)).indices.tolist()
                bottom = (-scores).topk(min(tokens, vocab)).indices.tolist()
                ids |= set(top) | set(bottom)
            row[f"{side}_top"], row[f"{side}_bottom"] = decode(top), decode(bottom)
        if answers is not None:
            row["answers_found"] = [a for a, head in heads.items() if set(head) & ids]
        listed.append(row)
    return pd.DataFrame(listed).astype({"layer": "Int64"})


def _changes(models: ModelSet, donor: int | str) -> DirectionsSource:
    """The donor's change as directions (``donor`` checked by :meth:`ModelSet.directions`)."""
    made = models.directions(donor).sources[-1]
    assert isinstance(made, DirectionsSource)
    return made


def _counts(models: ModelSet, donor: int, keys: Any) -> dict[tuple, int | None]:
    """Directions of each ``(component, layer)``'s change (None: no changed matrix)."""
    probe = _changes(models, donor)
    found = {key: [probe.factors(slot) for slot in models.slots(*key)] for key in keys}
    return {
        key: min((len(f[0]) for f in factors if f is not None and f[3]), default=None)
        for key, factors in found.items()
    }


class _Grafts:
    """A plan whose model set gains a source for each part of the donor's change asked for."""

    def __init__(self, plan: AttributionPlan) -> None:
        self.plan, self.made = copy.copy(plan), dict[str, int]()  # the copy's model set grows

    def source(self, rank: Any = None, strength: Any = 1.0) -> int:
        """The index of the donor cut to ``rank`` directions and times ``strength``."""
        if rank is None and not isinstance(strength, Mapping) and strength == 1:
            return self.plan.source
        key = f"rank={rank}, strength={strength}"
        if key not in self.made:
            models = self.plan.models
            self.made[key] = len(models)
            name = f"{models.names[self.plan.source]}[{key}]"
            self.plan.models = models.directions(
                self.plan.source, rank=rank, strength=strength, name=name
            )
        return self.made[key]


def dose_response(
    models: ModelSet,
    tokenized: Any,
    *,
    strengths: Sequence[Any] | None = None,
    ranks: Sequence[int | None] | None = None,
    components: str | Sequence[str] = "all",
    layers: Any = "all",
    positions: Any = "LT",
    cells: Any = None,
    donor: int | str = 1,
    metric: str | BatchMetric = "logprob",
    confidence: float = 0.95,
    n_resamples: int = 1000,
    batch_size: int = 16,
    rows_per_forward: int = 64,
) -> pd.DataFrame:
    """The metric of one graft at several strengths, or ranks, of the donor's change.

    The cells are ``components x layers x positions`` (as for ``attribute_grafts``), or
    ``cells=``: a ``MinimalGraft``, its ``cells`` or ``(component, layer, positions)`` triples.
    At strength ``s`` every cell computes with ``W_base + s * dW`` (a number, or
    ``{(component, layer): s}``); at rank ``k`` with its top ``k`` directions (at most all;
    ``None``: the whole cell, norms and biases included, which rank leaves the base's).

    Returns:
        One row per value: ``strength`` or ``rank``, ``n`` (prompts), ``metric`` (mean) with
        ``metric_low`` / ``metric_high``, and ``recovery`` (0 the base, 1 the whole graft of
        these cells, a ratio of means) with its paired bootstrap interval over prompts.

    Raises:
        SelectionError: Neither or both of ``strengths`` and ``ranks``, an empty list, a bad
            value; and what ``attribute_grafts`` refuses.
    """
    check_model_set(models)
    swept = [(name, v) for name, v in (("strength", strengths), ("rank", ranks)) if v is not None]
    values = list(swept[0][1]) if len(swept) == 1 and not isinstance(swept[0][1], str) else []
    if not values:
        raise SelectionError(
            "dose_response sweeps one setting: give strengths=[0, 0.5, 1] or ranks=[1, 4, "
            f"None], a non-empty list (got strengths={shown(strengths)}, ranks={shown(ranks)})."
        )
    axis = swept[0][0]
    if axis == "strength":  # refused before any pass; a mapping's cells when its source is made
        values = [v if isinstance(v, Mapping) else check_strength(v) for v in values]
    else:
        values = [check_rank(v) for v in values]
        if any(isinstance(v, tuple) for v in values):
            raise SelectionError(
                f"ranks={shown(ranks)}: a sweep takes counts (None: every direction); graft "
                "chosen directions with ModelSet.directions(rank=[...])."
            )
    bootstrap_ci([0.0], n_resamples, confidence)  # refuses them before any pass
    index = models.sources.index(_changes(models, donor).donor)
    chosen, grid = _cells(cells, components, layers, positions)
    if axis == "rank" and cells is None:  # given cells' norms stay the base's below None
        check_matrix_components(models, grid["components"])
    plan = AttributionPlan(
        models,
        tokenized,
        source=index,
        metric=metric,
        batch_size=batch_size,
        rows_per_forward=rows_per_forward,
        progress=False,
        **grid,
    )
    chosen = chosen or list(plan.cells)
    counts = _counts(models, index, {cell[:2] for cell in chosen}) if axis == "rank" else {}
    grafts = _Grafts(plan)

    def sources(value: Any) -> dict[Cell, int]:
        if axis == "strength":
            return dict.fromkeys(chosen, grafts.source(strength=value))
        return {  # a count past a matrix's directions: all of them
            cell: grafts.source(
                rank=value if value is None else min(value, counts[cell[:2]] or value)
            )
            for cell in chosen
        }

    measured = grafts.plan.exact([{}, dict.fromkeys(chosen, plan.source), *map(sources, values)])
    base, whole = measured[0].numpy(), measured[1].numpy()
    rows = []
    for value, scores in zip(values, measured[2:].numpy()):
        low, high = bootstrap_ci(scores, n_resamples, confidence)
        recovery = recovery_ci(scores, base, whole, n_resamples, confidence)
        rows.append(
            {
                axis: value,
                "n": len(scores),
                "metric": float(scores.mean()),
                "metric_low": low,
                "metric_high": high,
                **dict(zip(("recovery", "recovery_low", "recovery_high"), recovery)),
            }
        )
    frame = pd.DataFrame(rows)
    return frame.astype({"rank": "Int64"}) if axis == "rank" else frame  # <NA>: every one


def _cells(cells: Any, components: Any, layers: Any, positions: Any) -> tuple[list[Cell], dict]:
    """The cells asked for (none: the grid's) and the grid that holds them."""
    if cells is None:
        return [], dict(components=components, layers=layers, positions=positions)
    groups = getattr(cells, "groups", None)  # a MinimalGraft: its cells and position groups
    cells = getattr(cells, "cells", cells)
    rows = (
        cells[["component", "layer", "positions"]].itertuples(index=False)
        if isinstance(cells, pd.DataFrame)
        else cells
    )
    try:
        chosen = [(str(c), None if pd.isna(layer) else int(layer), str(p)) for c, layer, p in rows]
    except (TypeError, ValueError, KeyError):
        chosen = []
    if not chosen:
        raise kind(cells, (list, tuple, pd.DataFrame), SelectionError)(
            f"cells={shown(cells):.80}: give a MinimalGraft, its cells or (component, layer, "
            "positions) triples, e.g. [('mlp_out', 6, 'LT')]."
        )
    layers = sorted({layer for _, layer, _ in chosen if layer is not None})
    labels = tuple(dict.fromkeys(p for _, _, p in chosen))
    grid = dict(
        components=list(dict.fromkeys(c for c, _, _ in chosen)),
        layers=layers or "all",
        positions={p: groups[p] for p in labels} if isinstance(groups, Mapping) else labels,
    )
    return chosen, grid


class _WeightedLinear(LoraLinear):
    """``base(x) + B (w * A x) * scale``, each direction weighted per position (``w``)."""

    def update(self, x: torch.Tensor) -> torch.Tensor:
        along = F.linear(x.to(self.lora_A.dtype), self.lora_A)  # [batch, pos, k]
        weight = self.__dict__["weight_per_position"]
        if along.shape != weight.shape:
            raise AttributionError(
                f"A weight matrix's input of shape {list(x.shape)} is not laid out [batch, pos, "
                "d_in], so its directions cannot be weighted per position: leave it out."
            )
        return F.linear(along * weight.to(along), self.lora_B) * self.scale


class _Weighted(DirectionsSource):
    """Some directions of each matrix, weighted per position (``per_position`` by slot path)."""

    per_position: dict[str, torch.Tensor]

    def module(self, slot: Any) -> nn.Module:
        layer, weight = super().module(slot), self.per_position.get(slot.path)
        if weight is None or not isinstance(layer, LoraLinear):
            return layer
        weighted = _WeightedLinear(layer.base_layer, layer.lora_A, layer.lora_B, layer.scale)
        weighted.__dict__["weight_per_position"] = weight
        return weighted


def attribute_directions(
    models: ModelSet,
    tokenized: Any,
    *,
    components: str | Sequence[str] = "o+ffn",
    layers: Any = "all",
    positions: Any = "LT",
    k: int = 8,
    donor: int | str = 1,
    metric: str | BatchMetric = "logprob",
    verify: bool = True,
    batch_size: int = 16,
    rows_per_forward: int = 64,
) -> pd.DataFrame:
    """Estimate what each of the top ``k`` directions of a cell's change does to the metric.

    At each cell of a linear layer's matrix (as for ``attribute_grafts``; norms and
    embeddings left out) the graft is relaxed to ``W_base + sum_i c_i s_i u_i v_i^T``:
    direction ``i``'s estimate is ``d metric / d c_i`` at ``c = 0`` (from the base), one
    backward pass per position group. With ``verify`` each is also grafted alone.

    Returns:
        One row per cell and direction: ``cell``, ``component``, ``layer``, ``positions``,
        ``direction``, ``singular_value``, ``share`` (of ``||dW||_F^2``), ``estimate``,
        ``exact`` (NaN without ``verify``), each with its ``_se``, and ``n``; as
        ``attribution_agreement`` takes it.

    Raises:
        SelectionError: ``k`` < 1, no cell with a weight matrix; and what ``attribute_grafts``
            refuses.
    """
    check_model_set(models)
    refuse_first(
        ArgumentTypeError,
        [
            (not is_integer(k), f"k={shown(k)}: give a count of directions, e.g. 8."),
            (not isinstance(verify, bool), f"verify={shown(verify)}: True or False."),
        ],
    )
    refuse_first(SelectionError, [(not (is_integer(k) and k >= 1), f"k={k}: give 1 or more.")])
    index = models.sources.index(_changes(models, donor).donor)
    plan = AttributionPlan(
        models,
        tokenized,
        source=index,
        progress=False,
        metric=metric,
        components=components,
        layers=layers,
        positions=positions,
        batch_size=batch_size,
        rows_per_forward=rows_per_forward,
    )
    counts = _counts(models, index, plan.keys)
    linear = (nn.Linear, Conv1D)
    keys = [  # one linear matrix the donor changed
        key
        for key in plan.keys
        if counts[key]
        and len(models.slots(*key)) == 1
        and isinstance(models.slots(*key)[0].module(models.base), linear)
    ]
    if not keys:
        raise SelectionError(
            f"components={shown(components)} holds no linear weight matrix the donor changed "
            "at these layers: name o, mlp_out, q..."
        )
    ranks = {key: min(int(k), counts[key] or 0) for key in keys}
    made = _changes(models, index)
    bridge = partial(shared_bridge, models.base)
    weighted = _Weighted("weighted", made.base, made.donor, rank=ranks, make_bridge=bridge)
    weighted.per_position = {}  # set before each relaxed pass
    derived = ModelSet(
        [*models.sources, weighted],
        [*models.names, weighted.name],
        allow_uncovered=models.allow_uncovered,
        graftable=models.graftable,
    )
    cells = [cell for cell in plan.cells if cell[:2] in ranks]
    estimates = {cell: torch.zeros(ranks[cell[:2]], len(plan.batch)) for cell in cells}
    device = models.device
    for label in plan.groups:
        for rows_index, rows in plan.chunks():
            tokens, attention = rows.tokens.to(device), rows.attention_mask.to(device)
            selection = plan.selections[label][rows_index, : tokens.shape[1]].to(device)
            weights = {
                key: torch.zeros(*tokens.shape, r, device=device) for key, r in ranks.items()
            }
            weighted.per_position = {
                models.slots(*key)[0].path: w.requires_grad_() for key, w in weights.items()
            }
            with torch.enable_grad():
                mix = dict.fromkeys(keys, selection.float())
                with relaxing(derived, mix, source=len(models)) as model:
                    logits = model(tokens, attention_mask=attention, return_type="logits")
                if plan.last_only:
                    last = attention.sum(dim=1) - 1
                    logits = logits[torch.arange(len(last)), last][:, None]
                values = plan.metric(logits, rows)
                gradients = torch.autograd.grad(values.sum(), list(weights.values()))
            for key, gradient in zip(keys, gradients):
                estimates[key + (label,)][:, rows_index] = gradient.sum(dim=1).T.float().cpu()
    exact = {cell: torch.full_like(e, float("nan")) for cell, e in estimates.items()}
    if verify:
        grafts = _Grafts(plan)
        configs = [
            {cell: grafts.source(rank=[i])} for cell in cells for i in range(ranks[cell[:2]])
        ]
        measured = grafts.plan.exact([{}, *configs])
        effects = iter(measured[1:] - measured[0])
        exact = {
            cell: torch.stack([next(effects) for _ in range(ranks[cell[:2]])]) for cell in cells
        }
    return _direction_rows(made, models, cells, estimates, exact)


def _direction_rows(
    made: DirectionsSource, models: ModelSet, cells: list[Cell], estimates: dict, exact: dict
) -> pd.DataFrame:
    """One row per cell and direction, with standard errors over prompts."""
    from scipy import stats  # imported when needed: it takes a second to import

    rows = []
    for cell in cells:
        factors = made.factors(models.slots(*cell[:2])[0])
        assert factors is not None  # a cell of one changed matrix
        values, norm2 = factors[0], factors[3]
        for i, (estimate, effect) in enumerate(zip(estimates[cell], exact[cell])):
            rows.append(
                {
                    "cell": cell_label(*cell),
                    "component": cell[0],
                    "layer": cell[1],
                    "positions": cell[2],
                    "direction": i,
                    "singular_value": float(values[i]),
                    "share": float(values[i] ** 2 / norm2),
                    "estimate": float(estimate.mean()),
                    "estimate_se": float(stats.sem(estimate)),
                    "exact": float(effect.mean()),
                    "exact_se": float(stats.sem(effect)),
                    "n": len(estimate),
                }
            )
    return pd.DataFrame(rows).astype({"layer": "Int64"})


def keep_directions(
    plan: AttributionPlan, cells: Sequence[Cell], *, fraction: float, bottom: float, top: float
) -> pd.DataFrame:
    """Cut each of ``cells``, in order, to its fewest top directions (1, 2, 4... then
    bisection) whose exact graft, with the cells before it cut and those after it whole,
    still recovers ``fraction`` of ``bottom`` -> ``top``; a cell that needs all of them, or
    has no matrix, stays whole (``find_minimal_graft(..., directions=True)``).

    Returns:
        One row per cell: ``order``, ``cell``, ``component``, ``layer``, ``positions``,
        ``directions`` (kept; <NA>: whole), ``of`` (the matrix's), ``share`` (of
        ``||dW||_F^2`` kept) and ``recovery`` (exact, with the cells up to it cut).
    """
    grafts, counts = _Grafts(plan), _counts(plan.models, plan.source, {c[:2] for c in cells})
    probe = _changes(plan.models, plan.source)
    kept: dict[Cell, int | None] = dict.fromkeys(cells)
    memo: dict[tuple, float] = {}

    def recovery(trial: dict[Cell, int | None]) -> float:
        key = tuple(trial.values())
        if key not in memo:
            config = {cell: grafts.source(rank=r) for cell, r in trial.items()}
            memo[key] = (float(grafts.plan.exact([config]).mean()) - bottom) / (top - bottom)
        return memo[key]

    rows = []
    for order, cell in enumerate(cells, 1):
        count, low, high = counts[cell[:2]] or 0, 0, None  # `low` falls short, `high` reaches
        while high is None and max(1, 2 * low) < count:
            trial = max(1, 2 * low)
            if recovery({**kept, cell: trial}) >= fraction:
                high = trial
            else:
                low = trial
        while high is not None and high - low > 1:
            middle = (low + high) // 2
            low, high = (
                (low, middle) if recovery({**kept, cell: middle}) >= fraction else (middle, high)
            )
        kept[cell] = high
        factors = probe.factors(plan.models.slots(*cell[:2])[0]) if count else None
        share = float((factors[0][:high] ** 2).sum() / factors[3]) if factors and high else None
        rows.append(
            {
                "order": order,
                "cell": cell_label(*cell),
                "component": cell[0],
                "layer": cell[1],
                "positions": cell[2],
                "directions": high,
                "of": count or None,
                "share": share,
                "recovery": recovery(kept),
            }
        )
    return pd.DataFrame(rows).astype(dict.fromkeys(("layer", "directions", "of"), "Int64"))
