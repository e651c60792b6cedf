"""The smallest graft that recovers the donor: attribution proposes, exact grafts decide.

:func:`find_minimal_graft` looks for a small set ``S`` of cells (a component at a layer at a
group of positions) whose graft recovers at least ``fraction`` of the gap, averaged over
prompts, ``recovery(S) = (metric(base + S) - metric(base)) / (metric(donor) -
metric(base))``. Each step attributes every remaining cell from the current graft and
accepts, among the best ``proposals``, the one whose exact graft recovers most (a beam
with ``beam > 1``); once ``fraction`` is reached it drops the cells the set can do
without, so the result is 1-minimal. It is greedy: a pair of cells that helps only
together can be missed. Every reported recovery is an exact graft. The concept page "What
a graft attribution estimates" tells the story.

Examples:
    >>> found = find_minimal_graft(models, batch, fraction=0.8, held_out=other_batch)
    >>> found.cells, found.recovery, found.held_out_recovery
    >>> logits = gl.graft_forward(models, batch.tokens, found.mask(models, batch),
    ...                           attention_mask=batch.attention_mask, logits="all")
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from tqdm.auto import tqdm

from grafting_lens.analysis.attribution import (
    METHODS,
    AttributionPlan,
    BatchMetric,
    Cell,
    PositionGroups,
    _check_count,
    cell_label,
    resolve_groups,
)
from grafting_lens.analysis.batch import as_batch
from grafting_lens.analysis.metrics import check_choice
from grafting_lens.core.arguments import is_number
from grafting_lens.core.console import show_progress
from grafting_lens.core.errors import AttributionError
from grafting_lens.engine.graft import graft_forward
from grafting_lens.engine.masks import GraftMask
from grafting_lens.models.layers import LayerSpec
from grafting_lens.models.model_set import ModelSet

__all__ = ["REFERENCES", "MinimalGraft", "find_minimal_graft"]

REFERENCES: tuple[str, ...] = ("donor", "all_cells")
"""What a recovery of 1 means: the donor run whole, or the graft of every candidate cell."""

_REFERENCE_NAMES = {"donor": "donor", "all_cells": "graft of every candidate cell"}

CURVE_COLUMNS: tuple[str, ...] = ("prompts", "cells", "cell", "metric", "recovery")
"""Columns of the ``curve`` of a :class:`MinimalGraft`."""


@dataclass(frozen=True)
class MinimalGraft:
    """A small set of cells whose graft recovers a fraction of the donor's metric.

    Attributes:
        cells: In the order added: ``order`` (1, 2...), ``cell`` (its label),
            ``component``, ``layer`` (``<NA>`` for global components), ``positions``.
        curve: The exact recovery of the first ``k`` cells, ``k = 0..len(cells)``:
            ``prompts`` (``"search"`` or ``"held_out"``), ``cells`` (``k``), ``cell`` (the
            ``k``-th cell's label, empty for 0), ``metric`` (mean over prompts), ``recovery``.
        search: One row per candidate set tried: ``step``, ``cells`` (labels joined with
            " + "), the ``cell`` it added, its ``estimate``, the set's exact ``recovery``
            and whether it was ``kept`` in the beam.
        fraction: The recovery asked for.
        recovery: The recovery of all the cells on the search prompts.
        held_out_recovery: The same on the held-out prompts (``None`` without them).
        reached: Whether ``recovery >= fraction``.
        reference: What a recovery of 1 is (:data:`REFERENCES`).
        groups: Each position group's label and specification (to select in other prompts).
        source: The donor's index in the model set.
    """

    cells: pd.DataFrame
    curve: pd.DataFrame
    search: pd.DataFrame
    fraction: float
    recovery: float
    held_out_recovery: float | None
    reached: bool
    reference: str
    groups: Mapping[str, Any]
    source: int

    def mask(self, models: ModelSet, tokenized: Any) -> GraftMask:
        """The graft of these cells for a batch of prompts (the search's or others), on the
        model set the search ran on.

        Raises:
            AttributionError: A position group given as a tensor over the search's prompts.
        """
        batch = as_batch(tokenized, models)
        selections = resolve_groups(self.groups, batch)
        shape = tuple(batch.tokens.shape)
        entries: dict[Any, torch.Tensor] = {}
        for component, layer, label in self._cell_tuples():
            value = entries.setdefault((component, layer), torch.zeros(shape, dtype=torch.long))
            value[selections[label]] = self.source
        return GraftMask.from_dict(
            models, entries, (shape[0], shape[1]), attention_mask=batch.attention_mask
        )

    def _cell_tuples(self) -> list[Cell]:
        layers = [None if pd.isna(layer) else int(layer) for layer in self.cells["layer"]]
        return list(zip(self.cells["component"], layers, self.cells["positions"]))


def find_minimal_graft(
    models: ModelSet,
    tokenized: Any,
    *,
    fraction: float = 0.9,
    held_out: Any = None,
    metric: str | BatchMetric = "logprob",
    components: str | Sequence[str] = "all",
    layers: LayerSpec = "all",
    positions: PositionGroups = ("FE", "LT"),
    source: int = 1,
    reference: str = "donor",
    proposals: int = 8,
    beam: int = 1,
    method: str = "gradient",
    steps: int = 8,
    max_cells: int | None = None,
    prune: bool = True,
    batch_size: int = 16,
    rows_per_forward: int = 64,
    progress: bool | None = None,
    logits: str = "last",
) -> MinimalGraft:
    """The smallest set of cells found whose graft recovers ``fraction`` of the donor's metric.

    Arguments shared with :func:`~grafting_lens.analysis.attribution.attribute_grafts` mean
    what they mean there (``metric``: higher must be better).

    Args:
        models: The aligned checkpoints.
        tokenized: The search prompts (a tokenized batch).
        fraction: The recovery to reach, in (0, 1].
        held_out: Other prompts on which to report the recovery of the cells found (their
            position groups are selected afresh, so no tensors over the search's rows).
        reference: ``"donor"`` (recovery 1 is the donor whole) or ``"all_cells"`` (the graft
            of every candidate cell, which may fall short of the donor).
        proposals: Candidates per beam member and step, by attribution.
        beam: Sets kept per step (1: greedy).
        method: The attribution proposing candidates: ``"gradient"`` or ``"integrated"``.
        max_cells: Stop after this many cells (default: every candidate).
        prune: Drop cells the result can do without.
        progress: Show a progress bar over the search's steps.

    Returns:
        A :class:`MinimalGraft`.

    Raises:
        AttributionError: A fraction outside (0, 1], a reference that does not beat the
            base on the metric, or a bad option (and all ``attribute_grafts`` refuses).
    """
    if not is_number(fraction) or not 0 < fraction <= 1:
        raise AttributionError(
            f"fraction must be a number in (0, 1] (the share of the gap between the base and "
            f"the donor to recover), got {fraction!r}."
        )
    fraction = float(fraction)  # a numpy float too; kept in the result as Python's
    check_choice("reference", reference, REFERENCES, AttributionError)
    check_choice("method", method, METHODS, AttributionError)
    for name, value in (("proposals", proposals), ("beam", beam), ("steps", steps)):
        _check_count(name, value)
    if max_cells is not None:
        _check_count("max_cells", max_cells)
    settings: dict[str, Any] = dict(
        metric=metric,
        components=components,
        layers=layers,
        direction="sufficiency",
        source=source,
        start=None,
        batch_size=batch_size,
        rows_per_forward=rows_per_forward,
        progress=False,
        logits=logits,
    )
    plan = AttributionPlan(models, tokenized, positions=positions, **settings)
    held = None
    if held_out is not None:
        held_batch = as_batch(held_out, models)
        selections = resolve_groups(plan.groups, held_batch)
        held = AttributionPlan(models, held_batch, positions=selections, **settings)
    search_scale = _Scale.of(plan, reference)
    if search_scale.gap <= 0:
        raise AttributionError(
            f"The {_REFERENCE_NAMES[reference]} does not beat the base on this metric "
            f"(mean {search_scale.top:.4g} vs the base's {search_scale.bottom:.4g}), so there "
            "is nothing to recover. Check the metric's sign (higher must be better) and the "
            "donor's index."
        )
    limit = max_cells or len(plan.cells)

    # Beam search: each beam member is (cells in order, exact recovery).
    beams: list[tuple[tuple[Cell, ...], float]] = [((), 0.0)]
    log: list[dict[str, Any]] = []
    step = 0
    bar = tqdm(desc="graft search", disable=not show_progress(progress), unit="step")
    while beams[0][1] < fraction and len(beams[0][0]) < limit:
        step += 1
        bar.update()
        candidates: dict[frozenset, tuple[tuple[Cell, ...], float]] = {}
        for cells, _ in beams:
            estimates = plan.estimates(method=method, steps=steps, start_cells=cells)[0].mean(1)
            taken = set(cells)
            ranked = [
                i for i in estimates.argsort(descending=True).tolist() if plan.cells[i] not in taken
            ][:proposals]
            for i in ranked:
                grown = (*cells, plan.cells[i])
                candidates.setdefault(frozenset(grown), (grown, float(estimates[i])))
        if not candidates:
            break
        tried = list(candidates.values())
        recoveries = search_scale.recovery(plan.exact([cells for cells, _ in tried]))
        order = sorted(range(len(tried)), key=lambda i: -recoveries[i])
        kept = set(order[:beam])
        for i, (cells, estimate) in enumerate(tried):
            log.append(
                {
                    "step": step,
                    "cells": " + ".join(cell_label(*cell) for cell in cells),
                    "cell": cell_label(*cells[-1]),
                    "estimate": estimate,
                    "recovery": recoveries[i],
                    "kept": i in kept,
                }
            )
        if recoveries[order[0]] <= beams[0][1]:
            break  # no candidate improves on the best set
        beams = [(tried[i][0], recoveries[i]) for i in order[:beam]]
        bar.set_postfix(cells=len(beams[0][0]), recovery=f"{beams[0][1]:.3f}")
    bar.close()

    chosen = list(beams[0][0])
    if prune and beams[0][1] >= fraction:
        chosen = _prune(plan, search_scale, chosen, fraction)
    prefixes = [tuple(chosen[:k]) for k in range(len(chosen) + 1)]
    curve = _curve(plan, search_scale, prefixes, "search")
    held_out_recovery = None
    if held is not None:
        held_curve = _curve(held, _Scale.of(held, reference), prefixes, "held_out")
        curve = pd.concat([curve, held_curve], ignore_index=True)
        held_out_recovery = float(held_curve["recovery"].iloc[-1])
    recovery = float(curve[curve.prompts == "search"]["recovery"].iloc[-1])
    reached = recovery >= fraction
    if not reached:
        warnings.warn(
            f"The search stopped at a recovery of {recovery:.3f}, short of {fraction}: no "
            "candidate improved further. Allow more proposals or a wider beam, more "
            "components or positions, or reference='all_cells'.",
            stacklevel=2,
        )
    cells_frame = pd.DataFrame(chosen, columns=["component", "layer", "positions"])
    cells_frame.insert(0, "cell", [cell_label(*cell) for cell in chosen])
    cells_frame.insert(0, "order", range(1, len(chosen) + 1))
    cells_frame["layer"] = cells_frame["layer"].astype("Int64")  # <NA> for global components
    return MinimalGraft(
        cells=cells_frame,
        curve=curve,
        search=pd.DataFrame(log, columns=["step", "cells", "cell", "estimate", "recovery", "kept"]),
        fraction=float(fraction),
        recovery=recovery,
        held_out_recovery=held_out_recovery,
        reached=reached,
        reference=reference,
        groups=dict(plan.groups),
        source=source,
    )


@dataclass(frozen=True)
class _Scale:
    """The metric's means at the base (recovery 0) and at the reference (recovery 1)."""

    bottom: float
    top: float

    @classmethod
    def of(cls, plan: AttributionPlan, reference: str) -> _Scale:
        if reference == "all_cells":
            start, every = plan.exact([(), tuple(plan.cells)]).mean(dim=1).tolist()
            return cls(start, every)
        return cls(float(plan.exact([()]).mean()), _donor_metric(plan))

    @property
    def gap(self) -> float:
        return self.top - self.bottom

    def recovery(self, values: Float[torch.Tensor, "configs prompts"]) -> list[float]:
        """The recovery of each configuration, from its metric per prompt."""
        if self.gap <= 0:
            return [float("nan")] * values.shape[0]
        return ((values.mean(dim=1) - self.bottom) / self.gap).tolist()


@torch.no_grad()
def _donor_metric(plan: AttributionPlan) -> float:
    """The metric's mean with every component from the donor (the donor, to float rounding)."""
    values = []
    for _, rows in plan.chunks():
        mask = GraftMask.build(
            plan.models, rows.tokens, source=plan.source, attention_mask=rows.attention_mask
        )
        logits = graft_forward(
            plan.models,
            rows.tokens,
            mask,
            attention_mask=rows.attention_mask,
            logits="last" if plan.last_only else "all",
        )
        values.append(plan.metric(logits, rows).float().cpu())
    return float(torch.cat(values).mean())


def _prune(plan: AttributionPlan, scale: _Scale, cells: list[Cell], fraction: float) -> list[Cell]:
    """Drop cells while the rest still reaches ``fraction``, the least costly first."""
    while len(cells) > 1:
        without = [tuple(c for c in cells if c != dropped) for dropped in cells]
        recoveries = scale.recovery(plan.exact(without))
        best = max(range(len(without)), key=lambda i: recoveries[i])
        if recoveries[best] < fraction:
            break
        cells = list(without[best])
    return cells


def _curve(
    plan: AttributionPlan, scale: _Scale, prefixes: list[tuple[Cell, ...]], prompts: str
) -> pd.DataFrame:
    """The exact metric and recovery of each prefix of the cells found."""
    values = plan.exact(prefixes)
    columns = {
        "prompts": [prompts] * len(prefixes),
        "cells": [len(prefix) for prefix in prefixes],
        "cell": [cell_label(*prefix[-1]) if prefix else "" for prefix in prefixes],
        "metric": values.mean(dim=1).tolist(),
        "recovery": scale.recovery(values),
    }
    return pd.DataFrame(columns, columns=list(CURVE_COLUMNS))
