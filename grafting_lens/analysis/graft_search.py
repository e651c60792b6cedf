"""The smallest graft that recovers the donor: attribution proposes, exact grafts decide.

The question
------------
Which cells (a component at a layer at a group of positions) must come from the
donor for the base to do what the donor does? :func:`find_minimal_graft` answers
with a small set of cells whose graft recovers at least a given ``fraction`` of the
gap between the base's metric and the donor's (averaged over prompts):

    recovery(S) = (metric(base + S) - metric(base)) / (metric(donor) - metric(base))

Finding the smallest such set exactly means trying subsets of hundreds of cells; the
search here is greedy, with attribution to keep each step cheap, and a pruning pass
to make the result *1-minimal* (no single cell of it can be dropped without falling
below the fraction). It is not guaranteed to be the smallest set: a pair of cells
that only helps together, each useless alone, can be missed by a greedy step.

The search
----------
Each step starts from the cells accepted so far, grafted into the base:

1. **Propose by attribution.** One relaxed forward and backward pass
   (:func:`~grafting_lens.analysis.attribution.attribute_grafts`'s estimate, from the current
   graft) ranks every remaining cell; the ``proposals`` with the largest estimates
   are the candidates.
2. **Accept by exact grafts.** Each candidate is added to the current set and the
   result grafted exactly (one batched pass for all candidates); the candidate with
   the highest exact recovery is accepted.

With ``beam=b > 1`` the search keeps the ``b`` best sets of each size instead of one
(a beam search; each beam member proposes its own candidates). It stops when the
best set reaches ``fraction``, when no candidate improves on the best set (then the
result is returned with ``reached=False`` and a warning), or after ``max_cells``
cells. Then, with ``prune=True``, it drops cells while the recovery stays at or
above ``fraction``, the one whose removal costs least first.

Since attribution only proposes, a poor first-order estimate costs search steps, not
correctness: every accepted set and every reported recovery is an exact graft.

The result, :class:`MinimalGraft`, holds the cells in the order they were added, the
recovery curve (recovery against the number of cells, on the search prompts and on
held-out prompts, each point an exact graft of the first ``k`` cells), the log of the
search and a :meth:`MinimalGraft.mask` to graft the cells on any batch.
:func:`grafting_lens.analysis.plots.plot_recovery` draws the curve.

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
    _check_choice,
    _check_count,
    cell_label,
    resolve_groups,
)
from grafting_lens.analysis.batch import as_batch
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
        cells: The cells in the order they were added: ``order`` (1, 2...), ``cell``
            (its label), ``component``, ``layer`` (``<NA>`` for global components) and
            ``positions`` (the group's label).
        curve: The recovery of the first ``k`` cells, ``k = 0..len(cells)``, each an
            exact graft: ``prompts`` (``"search"`` or ``"held_out"``), ``cells``
            (``k``), ``cell`` (the ``k``-th cell's label, empty for ``k = 0``),
            ``metric`` (mean over prompts) and ``recovery``.
        search: The log of the search: one row per candidate set tried, with its
            ``step``, its ``cells`` (labels joined with " + "), the ``cell`` it added,
            that cell's ``estimate``, the set's exact ``recovery`` and whether it was
            ``kept`` in the beam.
        fraction: The recovery asked for.
        recovery: The recovery of all the cells on the search prompts.
        held_out_recovery: The same on the held-out prompts (``None`` without them).
        reached: Whether ``recovery >= fraction``.
        reference: What a recovery of 1 is (:data:`REFERENCES`).
        groups: Each position group's label and specification, to select the cells'
            positions in other prompts.
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
        """The graft of these cells for a batch of prompts (the search's or others).

        Args:
            models: The model set the search ran on.
            tokenized: A tokenized batch; the cells' position groups select their
                positions in it.

        Raises:
            AttributionError: A position group given as a tensor over the search's
                prompts, for other prompts.
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
) -> MinimalGraft:
    """The smallest set of cells found whose graft recovers ``fraction`` of the donor's metric.

    Cells are proposed by attribution and accepted by exact grafts (see the module
    docstring); every reported recovery is measured, on the search prompts and, when
    given, on held-out prompts.

    Args:
        models: The aligned checkpoints.
        tokenized: The search prompts (a tokenized batch).
        fraction: The recovery to reach, in (0, 1].
        held_out: Other prompts on which to report the recovery of the cells found
            (position groups are selected afresh in them, so they must be span
            expressions, position functions or ``"each"``).
        metric: As for :func:`~grafting_lens.analysis.attribution.attribute_grafts`; higher
            must be better (the donor's value is the target).
        components: The candidate cells' components (as for :meth:`GraftMask.build`).
        layers: Their layers.
        positions: Their position groups (as for ``attribute_grafts``).
        source: The donor's index in the model set.
        reference: ``"donor"`` (recovery 1 is the donor run whole) or ``"all_cells"``
            (the graft of every candidate cell, which may fall short of the donor when
            the candidates leave out, say, the unembedding).
        proposals: Candidates per beam member and step, by attribution.
        beam: Sets kept per step (1: greedy).
        method: The attribution proposing candidates: ``"gradient"`` or ``"integrated"``.
        steps: Points of the integrated path.
        max_cells: Stop after this many cells (default: every candidate).
        prune: Drop cells the result can do without.
        batch_size: Prompts per pass.
        rows_per_forward: Rows of one exact graft pass.
        progress: Show a progress bar over the search's steps (``None``: only where
            someone watches, see :func:`~grafting_lens.core.console.show_progress`).

    Returns:
        A :class:`MinimalGraft`.

    Raises:
        AttributionError: A fraction outside (0, 1], a reference that does not beat the
            base on the metric, or a bad option (and everything ``attribute_grafts``
            refuses).
    """
    if not is_number(fraction) or not 0 < fraction <= 1:
        raise AttributionError(
            f"fraction must be a number in (0, 1] (the share of the gap between the base and "
            f"the donor to recover), got {fraction!r}."
        )
    fraction = float(fraction)  # a numpy float too; kept in the result as Python's
    _check_choice("reference", reference, REFERENCES)
    _check_choice("method", method, METHODS)
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
    cells_frame = pd.DataFrame(
        [
            {
                "order": order + 1,
                "cell": cell_label(*cell),
                "component": cell[0],
                "layer": cell[1],
                "positions": cell[2],
            }
            for order, cell in enumerate(chosen)
        ],
        columns=["order", "cell", "component", "layer", "positions"],
    )
    cells_frame["layer"] = cells_frame["layer"].astype("Int64")
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
            plan.models, rows.tokens, mask, attention_mask=rows.attention_mask, logits="all"
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
    recoveries = scale.recovery(values)
    rows = [
        {
            "prompts": prompts,
            "cells": len(prefix),
            "cell": cell_label(*prefix[-1]) if prefix else "",
            "metric": float(values[i].mean()),
            "recovery": recoveries[i],
        }
        for i, prefix in enumerate(prefixes)
    ]
    return pd.DataFrame(rows, columns=list(CURVE_COLUMNS))
