"""Graft attribution: every cell's effect on a metric from one forward and one backward pass.

Which weights should one graft?
-------------------------------
A graft takes a *cell* (a component at a layer, at a group of token positions such as
the first entity FE or the last token LT) from the donor. A model of ``L`` layers with
a dozen components and three position groups has a few hundred cells, and a sweep
that grafts each one alone costs one forward pass per cell over every prompt. On
GPT-2 small with every position its own group there are 1,600 of them.

Attribution patching met the same wall with activations, and answered it with a
first-order estimate (Nanda, "Attribution patching", 2023; Syed et al. 2023;
Kramar et al. 2024, AtP*). This module does the same for weights.

The estimate
------------
Give each (component, layer) a mixing weight ``alpha`` per token position. At those
positions, the component's output is

    out = base_out + alpha * (donor_out - base_out)

where ``base_out`` is what the component computes in the run as it stands and
``donor_out`` what the donor's module computes from the same input
(:mod:`grafting_lens.engine.relaxation`). ``alpha = 0`` is the run as it stands, exactly;
``alpha = 1`` at a cell's positions is the graft of that cell. The metric (one value
per prompt, for instance the answer's log-probability at the last token) is a
differentiable function of every ``alpha``, and one backward pass gives
``d metric / d alpha`` at every (component, layer, position) at once. A cell's
*estimate* is the sum of that gradient over its positions: the first-order change of
the metric when the cell is switched,

    metric(cell switched) - metric(start)  ~=  sum over the cell's positions of d metric / d alpha

The *exact* effect is the left side, measured with a graft (:func:`graft_forward`).

Two directions, as for patching (:mod:`grafting_lens.patching.patch`):

* ``"sufficiency"`` starts from the base and switches a cell to the donor: does the
  donor's weight there *suffice* to move the metric? (The gradient at ``alpha = 0``.)
* ``"necessity"`` starts from the donor (every component, every position) and
  switches a cell back to the base: does the donor *need* its own weight there? (The
  gradient at ``alpha = 1``, read as the change when the cell goes back to the base,
  so an important cell has a negative estimate.)

A start other than the plain base may be given as a graft mask (``start=``): the
estimates are then the effects of switching further cells on top of that graft.

When the first order fails
--------------------------
The estimate is the tangent at the start. It misleads where the metric is far from
linear along the path from the start to the graft: when the metric saturates (a
log-probability near 0, a softmax already decided) the gradient is near zero though
the effect is large; when a component's effect depends on another's (attention at
the last token needs the enriched first entity) a cell's gradient at the start says
nothing about its effect together with others. ``method="integrated"`` averages the
gradient over ``steps`` points along the straight path on which every attributed
position moves together from the start to the graft of every cell (integrated
gradients): by construction the estimates of disjoint cells then add up to the
effect of grafting all of them, and a cell that matters only in company gets its
share. See the concept page "What a graft attribution estimates" for when each
fails, and verify: ``verify=k`` re-measures the ``k`` cells with the largest
estimates exactly, ``verify="all"`` every cell, and :func:`attribution_agreement`
reports the rank agreement.

How it runs
-----------
:func:`~grafting_lens.engine.relaxation.relaxing` installs the relaxation (see
:mod:`grafting_lens.engine.relaxation`): each slot of each attributed component computes
both checkpoints' outputs and mixes them per position, hooks firing as usual.
:func:`attribute_grafts` runs it over a batch of prompts, ``batch_size`` at a time,
takes one backward pass per chunk (``steps`` for the integrated variant), and
returns one row per cell; :class:`AttributionPlan` holds the checked settings and
the passes, for :func:`~grafting_lens.analysis.graft_search.find_minimal_graft` too.

Examples:
    >>> attribution = attribute_grafts(models, batch, positions=("FE", "LT"), verify=10)
    >>> attribution.frame.sort_values("estimate", ascending=False).head()
    >>> plots.plot_attribution(attribution.frame)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union, cast

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from tqdm.auto import tqdm

from grafting_lens.analysis import metrics
from grafting_lens.analysis.batch import TokenizedExamples, as_batch
from grafting_lens.core.arguments import is_integer
from grafting_lens.core.console import show_progress
from grafting_lens.core.errors import AttributionError, did_you_mean
from grafting_lens.engine.graft import graft_forward, grafting
from grafting_lens.engine.masks import GraftMask, Key
from grafting_lens.engine.positions import PositionSets, position_sets
from grafting_lens.engine.relaxation import check_source, relaxing
from grafting_lens.models.layers import LayerSpec
from grafting_lens.models.model_set import ModelSet
from grafting_lens.patching.patch import DIRECTIONS

__all__ = [
    "ATTRIBUTION_COLUMNS",
    "METHODS",
    "METRICS",
    "BatchMetric",
    "GraftAttribution",
    "attribute_grafts",
    "attribution_agreement",
    "cell_label",
    "target_logit",
    "target_logprob",
]

BatchMetric = Callable[[Float[torch.Tensor, "batch pos d_vocab"], TokenizedExamples], torch.Tensor]
"""``(logits, batch) -> [batch]``: one differentiable value per prompt.

``batch`` holds the prompts the logits are for (a few rows of the whole batch at a
time), so a metric reads each prompt's answer from ``batch.target_ids`` and its real
length from ``batch.attention_mask``.
"""


def target_logprob(
    logits: Float[torch.Tensor, "batch pos d_vocab"], batch: TokenizedExamples
) -> Float[torch.Tensor, " batch"]:
    """The log-probability of each prompt's answer at its last real token (float32)."""
    final = metrics.last_token_logits(logits, batch.attention_mask.to(logits.device))
    targets = batch.target_ids.to(logits.device)[:, None]
    return torch.log_softmax(final.float(), dim=-1).gather(1, targets).squeeze(1)


def target_logit(
    logits: Float[torch.Tensor, "batch pos d_vocab"], batch: TokenizedExamples
) -> Float[torch.Tensor, " batch"]:
    """The logit of each prompt's answer at its last real token (float32)."""
    final = metrics.last_token_logits(logits, batch.attention_mask.to(logits.device))
    return final.float().gather(1, batch.target_ids.to(logits.device)[:, None]).squeeze(1)


METRICS: dict[str, BatchMetric] = {"logprob": target_logprob, "logit": target_logit}
"""The metrics named by a string: the answer's log-probability or logit at the last token."""

METHODS: tuple[str, ...] = ("gradient", "integrated")
"""``"gradient"``: the first-order estimate at the start; ``"integrated"``: integrated
gradients along the path to the graft of every cell."""

ATTRIBUTION_COLUMNS: tuple[str, ...] = (
    "cell",
    "component",
    "layer",
    "positions",
    "estimate",
    "estimate_se",
    "exact",
    "exact_se",
    "n",
    "direction",
    "method",
)
"""Columns of the ``frame`` of a :class:`GraftAttribution`, in order."""

PositionGroups = Union[str, PositionSets]
"""``"each"`` (every position index alone), or labelled position sets (see
:func:`grafting_lens.engine.positions.position_sets`)."""

Cell = tuple[str, Union[int, None], str]
"""``(component, layer, position group)``; ``layer`` is None for global components."""


def cell_label(component: str, layer: int | None, positions: str) -> str:
    """A cell's name in tables and figures: ``"mlp_out[3]@LT"``, ``"unembed@LT"``."""
    where = component if layer is None else f"{component}[{layer}]"
    return f"{where}@{positions}"


# ----------------------------------------------------------------- attribution


@dataclass(frozen=True)
class GraftAttribution:
    """The estimated (and, where verified, exact) effect of switching each cell.

    Attributes:
        frame: One row per cell (:data:`ATTRIBUTION_COLUMNS`): ``cell`` (its label,
            :func:`cell_label`), ``component``, ``layer`` (``<NA>`` for global
            components), ``positions`` (the group's label), ``estimate`` (the mean over
            prompts of the estimated change of the metric when the cell is switched)
            and ``estimate_se`` (its standard error over prompts), ``exact`` and
            ``exact_se`` (the measured change, NaN where not verified), ``n``
            (prompts), ``direction`` and ``method``.
        agreement: :func:`attribution_agreement` of the verified cells (``None``
            without verification).
        start_metric: The metric's mean over prompts at the start (the base in the
            sufficiency direction, the donor in the necessity direction): from an exact
            graft where cells were verified or the method is ``"integrated"``, else from
            the relaxed pass itself (the same run, to the kernels' float rounding).
        all_cells_metric: Its mean with every attributed cell switched, measured by a
            graft where cells were verified or the method is ``"integrated"`` (the
            whole that integrated estimates add up to), else ``None``: a plain
            attribution runs no graft at all.
        steps: Gradient evaluations per prompt (1 for ``"gradient"``).
    """

    frame: pd.DataFrame
    agreement: pd.DataFrame | None
    start_metric: float
    all_cells_metric: float | None
    steps: int


def attribute_grafts(
    models: ModelSet,
    tokenized: Any,
    *,
    metric: str | BatchMetric = "logprob",
    components: str | Sequence[str] = "all",
    layers: LayerSpec = "all",
    positions: PositionGroups = ("FE", "LT"),
    direction: str = "sufficiency",
    source: int = 1,
    start: GraftMask | None = None,
    method: str = "gradient",
    steps: int = 8,
    verify: int | str | None = None,
    batch_size: int = 16,
    rows_per_forward: int = 64,
    progress: bool | None = None,
) -> GraftAttribution:
    """Estimate the effect of grafting every cell, from one forward and backward pass.

    A cell is a component at a layer at a group of positions. Every cell of the grid
    ``components x layers x positions`` is attributed at once (see the module
    docstring): ``metric`` runs through the relaxed model, one backward pass gives its
    gradient with respect to every cell's mixing weight, and a cell's estimate is that
    gradient summed over its positions, averaged over prompts. With ``verify`` the
    cells with the largest estimates are also grafted one at a time, exactly.

    Args:
        models: The aligned checkpoints.
        tokenized: A :class:`~grafting_lens.analysis.batch.TokenizedExamples` (or anything
            :func:`~grafting_lens.analysis.batch.as_batch` accepts): right-padded prompts ending
            before the answer.
        metric: ``"logprob"`` (the answer's log-probability at the last token, the
            default), ``"logit"``, or a function ``(logits, batch) -> [batch]``
            (:data:`BatchMetric`) that is differentiable in the logits.
        components: What to attribute: names, groups or a ``+``-joined string, as for
            :meth:`GraftMask.build` (``"all"``: every component the model has).
        layers: The layers of per-layer components (see
            :func:`~grafting_lens.models.layers.resolve_layers`).
        positions: The position groups: span expressions (``("FE", "LT",
            "(FE+LT)^C")``), a mapping ``{label: expression, [batch, pos] boolean tensor
            or position function}``, or ``"each"``: every position index alone
            (labels ``"0"``, ``"1"``...). Groups may overlap; each is its own cell.
        direction: ``"sufficiency"`` (start from the base, switch a cell to the
            donor) or ``"necessity"`` (start from the donor everywhere, switch a cell
            back to the base); TransformerLens's ``"denoising"``/``"noising"`` too.
        source: The donor's index in the model set.
        start: Start from this graft instead (a mask for the whole batch): cells are
            switched to the donor (sufficiency) or to the base (necessity) on top of it.
        method: ``"gradient"`` (the first-order estimate at the start) or
            ``"integrated"`` (integrated gradients over ``steps`` points between the
            start and the graft of every cell).
        steps: Points of the integrated path (``method="integrated"`` only).
        verify: Also measure the exact effect of the ``verify`` cells with the
            largest absolute estimates (an int), or of every cell (``"all"``).
        batch_size: Prompts per relaxed pass (memory grows with it).
        rows_per_forward: Rows of one exact graft pass (prompts x verified cells).
        progress: Show a progress bar (``None``: only where someone watches, see
            :func:`~grafting_lens.core.console.show_progress`).

    Returns:
        A :class:`GraftAttribution`.

    Raises:
        AttributionError: A bad metric (not one finite, differentiable value per
            prompt), method, steps, verify, source, start or batch size.
        ComponentError: A component the model lacks (at a layer asked for).
        SelectionError: A layer outside the model, an unknown span, a bad position
            group.
        BatchError: A malformed batch.

    Examples:
        >>> result = attribute_grafts(models, batch, positions=("FE", "LT", "(FE+LT)^C"),
        ...                           verify="all", progress=False)
        >>> result.agreement  # Spearman correlation of estimates and exact effects
    """
    plan = AttributionPlan(
        models,
        tokenized,
        metric=metric,
        components=components,
        layers=layers,
        positions=positions,
        direction=direction,
        source=source,
        start=start,
        batch_size=batch_size,
        rows_per_forward=rows_per_forward,
        progress=progress,
    )
    _check_choice("method", method, METHODS)
    _check_count("steps", steps)
    if verify is not None and verify != "all":
        _check_count("verify", verify, "or 'all'")
    estimates, start_values = plan.estimates(method=method, steps=steps)  # [cells, prompts]
    exact = torch.full_like(estimates, float("nan"))
    all_cells_metric = None
    if verify is not None or start_values is None:
        # Exact grafts of the start and of every cell switched: the reference of exact
        # effects, and the whole that integrated estimates share.
        references = plan.exact([(), tuple(plan.cells)])
        start_values, all_cells_metric = references[0], float(references[1].mean())
    if verify is not None:
        order = estimates.mean(dim=1).abs().argsort(descending=True, stable=True)
        chosen = order if verify == "all" else order[: int(verify)]
        configs = [(plan.cells[i],) for i in chosen.tolist()]
        exact[chosen] = plan.exact(configs) - start_values
    frame = plan.frame(estimates, exact, method=method)
    return GraftAttribution(
        frame=frame,
        agreement=None if verify is None else attribution_agreement(frame),
        start_metric=float(start_values.mean()),
        all_cells_metric=all_cells_metric,
        steps=1 if method == "gradient" else steps,
    )


def attribution_agreement(frame: pd.DataFrame) -> pd.DataFrame:
    """How well estimates rank the exact effects: per position group and over all cells.

    Args:
        frame: The ``frame`` of a :class:`GraftAttribution` (rows without an exact effect
            are left out).

    Returns:
        One row per position group, then ``"all"``: ``positions``, ``cells`` (verified
        cells), ``spearman`` (rank correlation of estimate and exact effect), ``pearson``
        and ``sign_agreement`` (the share of cells whose estimate has the exact
        effect's sign). Correlations are NaN with fewer than two cells or a constant column.

    Raises:
        AttributionError: A table without the ``estimate``, ``exact`` and ``positions`` columns.
    """
    missing = [
        c for c in ("estimate", "exact", "positions") if c not in getattr(frame, "columns", ())
    ]
    if missing:
        raise AttributionError(
            f"attribution_agreement needs a GraftAttribution.frame; the table lacks {missing}."
        )
    verified = frame[frame["exact"].notna()]
    groups = [(label, part) for label, part in verified.groupby("positions", sort=False)]
    rows = []
    for label, part in [*groups, ("all", verified)]:
        estimate, exact = part["estimate"].to_numpy(float), part["exact"].to_numpy(float)
        rows.append(
            {
                "positions": label,
                "cells": len(part),
                "spearman": _spearman(estimate, exact),
                "pearson": _pearson(estimate, exact),
                "sign_agreement": float(np.mean(np.sign(estimate) == np.sign(exact)))
                if len(part)
                else float("nan"),
            }
        )
    return pd.DataFrame(
        rows, columns=["positions", "cells", "spearman", "pearson", "sign_agreement"]
    )


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation of the ranks (ties take their mean rank), as scipy computes it."""
    ranks = [pd.Series(values).rank(method="average").to_numpy() for values in (x, y)]
    return _pearson(*ranks)


# ----------------------------------------------------------------- the plan


class AttributionPlan:
    """Validated settings of an attribution over one batch, and the passes it runs.

    :func:`attribute_grafts` and :func:`~grafting_lens.analysis.graft_search.find_minimal_graft`
    stand on it: it holds the cells, resolves their position groups on the batch,
    computes gradient estimates (:meth:`estimates`) and exact effects of any sets of
    cells switched together (:meth:`exact`). Every argument is checked in the
    constructor, before any forward pass.

    Attributes:
        models: The model set.
        batch: The checked batch (on the CPU).
        cells: Every cell, ``(component, layer, group label)``, in table order.
        keys: The ``(component, layer)`` pairs, in the order the residual stream meets them.
        groups: Label to the specification it was given as.
        selections: Label to its ``[batch, pos]`` positions.
        direction: ``"sufficiency"`` or ``"necessity"``.
        switch: The checkpoint a switched cell takes its weights from.
    """

    def __init__(
        self,
        models: ModelSet,
        tokenized: Any,
        *,
        metric: str | BatchMetric,
        components: str | Sequence[str],
        layers: LayerSpec,
        positions: PositionGroups,
        direction: str,
        source: int,
        start: GraftMask | None,
        batch_size: int,
        rows_per_forward: int,
        progress: bool | None,
    ) -> None:
        _check_model_set(models)
        self.models = models
        self.metric = _check_metric(metric)
        if direction not in DIRECTIONS:
            raise AttributionError(
                f"Unknown direction {direction!r}.{did_you_mean(str(direction), DIRECTIONS)} "
                "Use 'sufficiency' (start from the base, switch a cell to the donor) or "
                "'necessity' (start from the donor, switch a cell back to the base)."
            )
        self.direction = DIRECTIONS[direction]
        check_source(models, source, allow_base=False)
        self.source = source
        self.switch = source if self.direction == "sufficiency" else 0
        _check_count("batch_size", batch_size)
        _check_count("rows_per_forward", rows_per_forward)
        self.batch_size, self.rows_per_forward, self.progress = (
            batch_size,
            rows_per_forward,
            progress,
        )
        self.batch = as_batch(tokenized, models)
        shape = tuple(self.batch.tokens.shape)
        # The mask builder checks the components and layers and refuses a grid that
        # would graft every component around uncovered weights.
        self.keys: list[Key] = GraftMask.build(
            models, (1, 1), components=components, layers=layers
        ).keys()
        self.groups, self.selections = _position_groups(positions, self.batch)
        self.cells: list[Cell] = [
            (component, layer, label) for label in self.groups for component, layer in self.keys
        ]
        if start is not None:
            if not isinstance(start, GraftMask):
                raise TypeError(f"start must be a GraftMask, got {type(start).__name__}.")
            if start.shape != shape or start.n_sources != len(models):
                raise AttributionError(
                    f"start is a mask for [batch, pos] = {list(start.shape)} and "
                    f"{start.n_sources} sources; the batch is {list(shape)} and the model set "
                    f"has {len(models)}. Build it from this batch's tokens."
                )
            start.check_rows(self.batch.attention_mask)
            GraftMask.from_dict(models, {key: start[key] for key in start.keys()}, shape)
        self.start = start

    # ------------------------------------------------------------------ chunks
    def chunks(self) -> Iterator[tuple[torch.Tensor, TokenizedExamples]]:
        """Row indices and rows of each chunk of ``batch_size`` prompts (cut to their longest)."""
        total = len(self.batch)
        starts = range(0, total, self.batch_size)
        for first in tqdm(
            starts, desc="attribution", disable=not show_progress(self.progress), unit="chunk"
        ):
            index = torch.arange(first, min(first + self.batch_size, total))
            yield index, self.batch.rows(index)

    def start_mask(
        self, index: torch.Tensor, rows: TokenizedExamples, cells: Sequence[Cell] = ()
    ) -> GraftMask:
        """The start of a chunk's rows, with ``cells`` switched on top of it."""
        shape = tuple(rows.tokens.shape)
        length = shape[1]
        if self.start is not None:
            entries = {key: self.start[key][index, :length].clone() for key in self.start.keys()}
        elif self.direction == "necessity":
            every = GraftMask.build(
                self.models, rows.tokens, source=self.source, attention_mask=rows.attention_mask
            )
            entries = {key: every[key].clone() for key in every.keys()}
        else:
            entries = {}
        for component, layer, label in cells:
            value = entries.get((component, layer))
            if value is None:
                value = entries[(component, layer)] = torch.zeros(shape, dtype=torch.long)
            value[self.selections[label][index, :length]] = self.switch
        lengths = rows.attention_mask.sum(dim=1)
        return GraftMask(entries, (shape[0], shape[1]), len(self.models), lengths)

    # ------------------------------------------------------------------ passes
    def estimates(
        self, *, method: str = "gradient", steps: int = 1, start_cells: Sequence[Cell] = ()
    ) -> tuple[Float[torch.Tensor, "cells prompts"], Float[torch.Tensor, " prompts"] | None]:
        """Each cell's estimated effect on each prompt's metric.

        Args:
            method: ``"gradient"`` or ``"integrated"`` (see :func:`attribute_grafts`).
            steps: Points of the integrated path.
            start_cells: Cells already switched in the start (their estimates are 0).

        Returns:
            The estimates, and for ``"gradient"`` each prompt's metric at the start, which
            the relaxed pass computes with every weight at 0 (the start, to the rounding
            of the kernels: autograd keeps products off oneDNN); ``None`` for
            ``"integrated"``, whose points all lie past the start.
        """
        device = self.models.device
        points = [0.0] if method == "gradient" else [(j + 0.5) / steps for j in range(steps)]
        labels = list(self.groups)
        estimates = torch.zeros(len(self.keys), len(labels), len(self.batch))
        start = torch.zeros(len(self.batch)) if method == "gradient" else None
        for index, rows in self.chunks():
            shape = tuple(rows.tokens.shape)
            length = shape[1]
            groups = torch.stack([self.selections[label][index, :length] for label in labels])
            moving = groups.any(dim=0).to(device=device, dtype=torch.float32)
            mask = self.start_mask(index, rows, start_cells)
            tokens = rows.tokens.to(device)
            attention_mask = rows.attention_mask.to(device)
            total = torch.zeros(len(self.keys), *shape)
            for point in points:
                weights = {key: (moving * point).requires_grad_() for key in self.keys}
                with grafting(self.models, mask) as model:
                    with relaxing(self.models, weights, source=self.switch):
                        logits = model(tokens, attention_mask=attention_mask, return_type="logits")
                values = _metric_values(self.metric, logits, rows)
                if start is not None:
                    start[index] = values.detach().float().cpu()
                if not values.requires_grad:
                    raise AttributionError(
                        "The metric's values carry no gradient to the logits, so nothing can "
                        "be attributed: use a differentiable metric (a log-probability or a "
                        "logit, not a rank or a top-k hit), without .detach() or .item()."
                    )
                gradients = torch.autograd.grad(
                    values.sum(), list(weights.values()), allow_unused=True
                )
                if all(gradient is None for gradient in gradients):
                    # A metric that carries a gradient but not through the run (a tensor
                    # rebuilt from .tolist(), a constant made to require grad) would give
                    # every cell an estimate of exactly 0.
                    raise AttributionError(
                        "The metric's values require a gradient but do not depend on the grafted "
                        "run (no gradient reaches any grafted component), so every estimate "
                        "would be 0. Compute the metric from the logits it is given with torch "
                        "operations (e.g. logits[:, -1].log_softmax(-1)[:, answer]), not from "
                        "values copied out of them (.tolist(), .numpy(), torch.tensor(...))."
                    )
                for position, gradient in enumerate(gradients):
                    if gradient is not None:
                        total[position] += gradient.detach().float().cpu()
            total /= len(points)
            # A cell's estimate: the gradient summed over its positions (times the
            # switch, 1), per prompt.
            per_cell = torch.einsum("kbp,lbp->klb", total, groups.float())
            estimates[:, :, index] = per_cell
        # Table order: position group, then the keys in residual order.
        return estimates.transpose(0, 1).reshape(len(self.cells), len(self.batch)), start

    @torch.no_grad()
    def exact(self, configs: Sequence[Sequence[Cell]]) -> Float[torch.Tensor, "configs prompts"]:
        """Each prompt's metric with each configuration's cells switched (exact grafts).

        Each configuration is a set of cells switched together on top of the start
        (the empty one is the start itself). Configurations of a chunk of prompts run
        as blocks of rows of one graft pass, ``rows_per_forward`` rows at a time.
        """
        configs = [tuple(config) for config in configs]
        values = torch.zeros(len(configs), len(self.batch))
        for index, rows in self.chunks():
            per_pass = max(1, self.rows_per_forward // len(index))
            for first in range(0, len(configs), per_pass):
                block = configs[first : first + per_pass]
                mask = GraftMask.cat([self.start_mask(index, rows, cells) for cells in block])
                repeated = self.batch.rows(index.repeat(len(block)))
                logits = graft_forward(
                    self.models,
                    repeated.tokens,
                    mask,
                    attention_mask=repeated.attention_mask,
                    logits="all",
                )
                scores = _metric_values(self.metric, logits, repeated).float().cpu()
                values[first : first + len(block), index] = scores.reshape(len(block), -1)
        return values

    def frame(
        self,
        estimates: Float[torch.Tensor, "cells prompts"],
        exact: Float[torch.Tensor, "cells prompts"],
        *,
        method: str,
    ) -> pd.DataFrame:
        """One row per cell: its estimate and exact effect, with standard errors over prompts."""
        n = len(self.batch)
        rows = []
        for cell, estimate, measured in zip(self.cells, estimates, exact):
            component, layer, label = cell
            rows.append(
                {
                    "cell": cell_label(*cell),
                    "component": component,
                    "layer": layer,
                    "positions": label,
                    "estimate": float(estimate.mean()),
                    "estimate_se": _standard_error(estimate),
                    "exact": float(measured.mean()),
                    "exact_se": _standard_error(measured),
                    "n": n,
                    "direction": self.direction,
                    "method": method,
                }
            )
        frame = pd.DataFrame(rows, columns=list(ATTRIBUTION_COLUMNS))
        frame["layer"] = frame["layer"].astype("Int64")  # <NA> for global components
        return frame


def _standard_error(values: torch.Tensor) -> float:
    if len(values) < 2 or bool(values.isnan().any()):
        return float("nan")
    return float(values.std() / math.sqrt(len(values)))


def _position_groups(
    positions: PositionGroups, batch: TokenizedExamples
) -> tuple[dict[str, Any], dict[str, Bool[torch.Tensor, "batch pos"]]]:
    """Label to specification, and label to ``[batch, pos]`` selection."""
    if isinstance(positions, str) and positions == "each":
        length = batch.tokens.shape[1]
        real = batch.attention_mask.bool()
        specs: dict[str, Any] = {}
        selections = {}
        for index in range(length):
            selection = torch.zeros_like(real)
            selection[:, index] = real[:, index]
            specs[str(index)] = index
            selections[str(index)] = selection
        return specs, selections
    selections = position_sets(positions, batch.spans, batch.attention_mask)
    if isinstance(positions, str):
        specs = {positions: positions}
    elif isinstance(positions, Mapping):
        specs = {str(label): spec for label, spec in positions.items()}
    else:
        specs = {str(name): name for name in positions}
    return specs, selections


def resolve_groups(
    groups: Mapping[str, Any], batch: TokenizedExamples
) -> dict[str, Bool[torch.Tensor, "batch pos"]]:
    """The position groups of one batch on another (held-out prompts).

    Span expressions and position functions select afresh; an index (``"each"``)
    takes that column where the row is long enough.

    Raises:
        AttributionError: A group given as a tensor over another batch's rows.
    """
    selections: dict[str, torch.Tensor] = {}
    for label, spec in groups.items():
        if is_integer(spec):
            spec = int(spec)
            real = batch.attention_mask.bool()
            selection = torch.zeros_like(real)
            if spec < real.shape[1]:
                selection[:, spec] = real[:, spec]
            selections[label] = selection
        elif isinstance(spec, torch.Tensor):
            raise AttributionError(
                f"The position group {label!r} is a tensor over the search prompts' rows, so "
                "it cannot select positions in other prompts. Give it as a span expression or "
                "a position function."
            )
        else:
            selections.update(position_sets({label: spec}, batch.spans, batch.attention_mask))
    return selections


def _metric_values(
    metric: BatchMetric, logits: torch.Tensor, rows: TokenizedExamples
) -> torch.Tensor:
    """The metric of each row, checked: one finite number per prompt."""
    returned = metric(logits, rows)
    batch = len(rows)
    if not isinstance(returned, torch.Tensor) or not returned.is_floating_point():
        described = (
            f"a tensor of {returned.dtype}"
            if isinstance(returned, torch.Tensor)
            else f"{type(returned).__name__} {returned!r:.40}"
        )
        raise AttributionError(
            f"The metric returned {described}; it must return a floating-point tensor of one "
            f"value per prompt ([{batch}]), e.g. the answer's log-probability at the last token."
        )
    if tuple(returned.shape) != (batch,):
        raise AttributionError(
            f"The metric returned shape {list(returned.shape)}; it must return one value per "
            f"prompt ([{batch}]) from logits of shape {list(logits.shape)}, not a mean or a "
            "value per position (a cell's estimate is averaged over prompts here)."
        )
    finite = torch.isfinite(returned.detach())
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()[:5]
        raise AttributionError(
            f"The metric is not finite for rows {bad} of a chunk: a NaN or infinite logit, or "
            "a log of zero. Check the checkpoints' weights, or use a metric that stays finite."
        )
    return returned


def _check_metric(metric: object) -> BatchMetric:
    if isinstance(metric, str):
        if metric not in METRICS:
            raise AttributionError(
                f"Unknown metric {metric!r}.{did_you_mean(metric, METRICS)} Named metrics: "
                f"{', '.join(METRICS)}; or pass a function (logits, batch) -> [batch]."
            )
        return METRICS[metric]
    if not callable(metric):
        raise TypeError(
            f"metric must be a name ({', '.join(METRICS)}) or a function (logits, batch) -> "
            f"[batch], got {type(metric).__name__}."
        )
    return cast(BatchMetric, metric)


def _check_model_set(models: object) -> None:
    if not isinstance(models, ModelSet):
        raise TypeError(
            f"Expected a ModelSet, got {type(models).__name__}. Load the checkpoints with "
            "grafting_lens.load_models(base, donor, ...)."
        )


def _check_count(name: str, value: Any, alternative: str = "") -> None:
    if not is_integer(value) or value < 1:
        extra = f" {alternative}" if alternative else ""
        raise AttributionError(f"{name} must be an integer >= 1{extra}, got {value!r}.")


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise AttributionError(
            f"Unknown {name} {value!r}.{did_you_mean(str(value), choices)} Choose one of "
            f"{', '.join(choices)}."
        )
