"""Graft attribution: every cell's effect on a metric from one forward and one backward pass.

A *cell* is a component at a layer at a group of token positions (``mlp_out[3]@LT``). As
attribution patching does for activations (Nanda 2023; Syed et al. 2023; Kramar et al. 2024),
each attributed slot mixes its two checkpoints' outputs with a weight ``alpha`` per position
(:mod:`grafting_lens.engine.relaxation`); a cell's estimate is ``d metric / d alpha`` summed
over its positions, from the base (``"sufficiency"``) or the donor (``"necessity"``).
``docs/concepts/attribution.md`` says when the first order fails.

Examples:
    >>> attribution = attribute_grafts(models, batch, positions=("FE", "LT"), verify=10)
    >>> plots.plot_attribution(attribution.frame)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from tqdm.auto import tqdm

from grafting_lens.analysis import metrics
from grafting_lens.analysis.batch import TokenizedExamples, as_batch
from grafting_lens.analysis.scoring import SCORES, Score, score_metric
from grafting_lens.core import ranks
from grafting_lens.core.arguments import is_integer
from grafting_lens.core.console import show_progress
from grafting_lens.core.errors import (
    ArgumentTypeError,
    AttributionError,
    check_known,
    did_you_mean,
    kind,
)
from grafting_lens.engine.graft import graft_forward, grafting
from grafting_lens.engine.masks import GraftMask, Key
from grafting_lens.engine.positions import PositionSets, position_sets
from grafting_lens.engine.relaxation import check_source, relaxing
from grafting_lens.models.layers import LayerSpec
from grafting_lens.models.model_set import ModelSet, check_model_set
from grafting_lens.patching.patch import check_direction, reads_other_positions

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
"""``(logits, batch) -> [batch]``: one differentiable value per prompt, from each row's last
real token's logits, ``[batch, 1, d_vocab]`` (with ``logits="all"`` every position's); each
answer is ``batch.target_ids``."""


def target_logprob(
    logits: Float[torch.Tensor, "batch pos d_vocab"], batch: TokenizedExamples
) -> Float[torch.Tensor, " batch"]:
    """The log-probability of each prompt's answer at its last real token (float32)."""
    final = metrics.last_token_logits(logits, batch.attention_mask).float()
    targets = batch.target_ids.to(logits.device)[:, None]
    return torch.log_softmax(final, dim=-1).gather(1, targets).squeeze(1)


def target_logit(
    logits: Float[torch.Tensor, "batch pos d_vocab"], batch: TokenizedExamples
) -> Float[torch.Tensor, " batch"]:
    """The logit of each prompt's answer at its last real token (float32)."""
    final = metrics.last_token_logits(logits, batch.attention_mask).float()
    return final.gather(1, batch.target_ids.to(logits.device)[:, None]).squeeze(1)


METRICS: dict[str, BatchMetric] = {"logprob": target_logprob, "logit": target_logit}
"""The metrics named by a string: the answer's log-probability or logit at the last token."""

METHODS: tuple[str, ...] = ("gradient", "integrated")
"""The first-order estimate at the start, or integrated gradients to the graft of every cell."""

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
"""``"each"`` (every position index alone), or position sets (span expressions...)."""

Cell = tuple[str, Union[int, None], str]
"""``(component, layer, position group)``; ``layer`` is None for global components."""

_Config = Union[Sequence[Cell], Mapping[Cell, int]]  # cells switched, or each cell's source


def cell_label(component: str, layer: int | None, positions: str) -> str:
    """A cell's name in tables and figures: ``"mlp_out[3]@LT"``, ``"unembed@LT"``."""
    where = component if layer is None else f"{component}[{layer}]"
    return f"{where}@{positions}"


@dataclass(frozen=True)
class GraftAttribution:
    """The estimated (and, where verified, exact) effect of switching each cell.

    Attributes:
        frame: One row per cell (:data:`ATTRIBUTION_COLUMNS`; ``layer`` ``<NA>`` for global
            components): ``estimate`` (mean over prompts of the estimated change of the
            metric), ``exact`` (measured; NaN where not verified), each with its ``_se``.
        agreement: :func:`attribution_agreement` of the verified cells (``None`` without).
        start_metric: The metric's mean at the start (the base for sufficiency, the donor
            for necessity): from an exact graft where cells were verified or the method
            is ``"integrated"``, else from the relaxed pass (to float rounding).
        all_cells_metric: Its mean with every cell switched, in those same cases (what
            integrated estimates add up to), else ``None``.
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
    logits: str = "last",
) -> GraftAttribution:
    """Estimate the effect of grafting every cell, from one forward and backward pass.

    A cell of ``components x layers x positions`` is estimated by the metric's gradient with
    respect to its mixing weight, summed over its positions and averaged over prompts.

    Args:
        models: The aligned checkpoints.
        tokenized: A :class:`~grafting_lens.analysis.batch.TokenizedExamples` (or what
            :func:`~grafting_lens.analysis.batch.as_batch` takes), ending before the answer.
        metric: ``"logprob"`` (the answer's first token's log-probability), ``"logit"``, a
            score of ``gl.graft``'s (:func:`~grafting_lens.analysis.scoring.score_metric`;
            a teacher-forced one's answer positions switch with the prompt's last token), or
            a :data:`BatchMetric` differentiable in the logits.
        components: Names, groups or a ``+``-joined string, as for :meth:`GraftMask.build`.
        layers: The layers of per-layer components (see :func:`~grafting_lens.resolve_layers`).
        positions: Span expressions (``("FE", "LT", "(FE+LT)^C")``), a mapping ``{label:
            expression, [batch, pos] boolean tensor or position function}``, or ``"each"``
            (every index alone, labelled ``"0"``, ``"1"``...). Groups may overlap.
        direction: ``"sufficiency"`` (``"denoising"``: from the base, switch a cell to the
            donor) or ``"necessity"`` (``"noising"``: from the donor, switch it back).
        source: The donor's index in the model set.
        start: Start from this graft (a mask for the whole batch) instead.
        method: ``"gradient"`` or ``"integrated"`` (to the graft of every cell).
        steps: Points of the integrated path.
        verify: Measure the exact effect of the ``verify`` cells with the largest absolute
            estimates (an int), or of every cell (``"all"``).
        batch_size: Prompts per relaxed pass (memory grows with it).
        rows_per_forward: Rows of one exact graft pass (prompts x verified cells).
        progress: Show a progress bar (``None``: where someone watches).
        logits: ``"last"`` (each row's last real token, ``[batch, 1, d_vocab]``, the
            unembedding run there only unless attributed) or ``"all"``.

    Returns:
        A :class:`GraftAttribution`.

    Raises:
        AttributionError: A bad metric (not one finite, differentiable value per prompt; or
            under ``logits="last"`` one raising there or reading other positions), method,
            steps, verify, source, start, logits or batch size.
        ComponentError: A component the model lacks (at a layer asked for).
        SelectionError: A layer outside the model, an unknown span, a bad position group.
        BatchError: A malformed batch.
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
        logits=logits,
    )
    check_known(method, METHODS, "method", AttributionError)
    _check_count("steps", steps)
    if verify is not None and verify != "all":
        _check_count("verify", verify, "or 'all'")
    estimates, start_values = plan.estimates(method=method, steps=steps)  # [cells, prompts]
    exact = torch.full_like(estimates, float("nan"))
    all_cells_metric = None
    if verify is not None or start_values is None:
        # Exact grafts of the start and of every cell: the references of exact effects.
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
        frame: A :class:`GraftAttribution`'s ``frame`` (cells not verified are left out).

    Returns:
        One row per position group, then ``"all"``: ``positions``, ``cells`` (verified),
        ``spearman`` and ``pearson`` (of estimate and exact effect; NaN with fewer than two
        cells or a constant column), ``sign_agreement`` (the share of the same sign).

    Raises:
        AttributionError: A table without the ``estimate``, ``exact`` and ``positions`` columns.
    """
    missing = {"estimate", "exact", "positions"} - set(getattr(frame, "columns", ()))
    if missing:
        raise AttributionError(
            f"attribution_agreement needs a GraftAttribution.frame; the table lacks "
            f"{sorted(missing)}."
        )
    from scipy import stats  # imported when needed: it takes a second to import

    def correlation(test: Callable, x: np.ndarray, y: np.ndarray) -> float:
        # Undefined for fewer than two cells or a constant column (scipy would warn).
        if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
            return float("nan")
        return float(test(x, y).statistic)

    verified = frame[frame["exact"].notna()]
    rows = []
    for label, part in [*verified.groupby("positions", sort=False), ("all", verified)]:
        estimate, exact = part["estimate"].to_numpy(float), part["exact"].to_numpy(float)
        rows.append(
            {
                "positions": label,
                "cells": len(part),
                "spearman": correlation(stats.spearmanr, estimate, exact),
                "pearson": correlation(stats.pearsonr, estimate, exact),
                "sign_agreement": float(np.mean(np.sign(estimate) == np.sign(exact)))
                if len(part)
                else float("nan"),
            }
        )
    return pd.DataFrame(
        rows, columns=["positions", "cells", "spearman", "pearson", "sign_agreement"]
    )


class AttributionPlan:
    """Checked settings of an attribution over one batch (its arguments as
    :func:`attribute_grafts`'), and its passes: gradient estimates (:meth:`estimates`) and
    exact effects of sets of cells (:meth:`exact`).

    Attributes:
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
        source: int,
        batch_size: int,
        rows_per_forward: int,
        progress: bool | None,
        direction: str = "sufficiency",  # the doors' defaults live in their signatures
        start: GraftMask | None = None,
        logits: str = "last",
    ) -> None:
        check_model_set(models)
        self.models, n = models, len(models)
        self.batch = as_batch(tokenized, models)
        scored = None
        if isinstance(metric, Score) or (isinstance(metric, str) and metric in SCORES):
            scored = Score.of(metric, donor=source)
            metric = score_metric(scored, models, self.batch)
        if not callable(metric) and (not isinstance(metric, str) or metric not in METRICS):
            raise kind(metric, str, AttributionError)(
                f"metric must be one of {', '.join(map(repr, METRICS))} or a function (logits, "
                f"batch) -> [batch], got {metric!r}.{did_you_mean(str(metric), METRICS)}"
            )
        self.metric: BatchMetric = metric if callable(metric) else METRICS[str(metric)]
        self.direction = check_direction(direction, AttributionError)
        check_source(models, source, allow_base=False)
        self.source = source
        self.switch = source if self.direction == "sufficiency" else 0
        for name, value in (("batch_size", batch_size), ("rows_per_forward", rows_per_forward)):
            _check_count(name, value)
        self.last_only = check_known(logits, ("last", "all"), "logits", AttributionError) == "last"
        self.batch_size, self.rows_per_forward = batch_size, rows_per_forward
        self.progress = progress
        shape = tuple(self.batch.tokens.shape)
        # The mask builder checks the components and layers and refuses a grid that
        # would graft every component around uncovered weights.
        self.keys: list[Key] = GraftMask.build(
            models, (1, 1), components=components, layers=layers
        ).keys()
        self.groups, self.selections = _position_groups(positions, self.batch)
        if scored is not None and scored.teacher_forced:
            self._teacher_force(scored, start)
        self.cells: list[Cell] = [
            (component, layer, label) for label in self.groups for component, layer in self.keys
        ]
        if start is not None:
            if not isinstance(start, GraftMask) or start.shape != shape or start.n_sources != n:
                raise kind(start, GraftMask, AttributionError)(
                    f"start must be a GraftMask for this batch, [batch, pos] = {list(shape)}, and "
                    f"the model set's {n} sources; got {start!r:.80}. Build it from "
                    "this batch's tokens."
                )
            start.check_rows(self.batch.attention_mask)
            GraftMask.from_dict(models, {key: start[key] for key in start.keys()}, shape)
        self.start = start
        if self.last_only and self.metric not in METRICS.values():
            self._probe_metric()

    def _teacher_force(self, score: Score, start: GraftMask | None) -> None:
        """Each prompt followed by its answer, switched with the prompt's last token."""
        if start is not None:
            raise AttributionError(
                f"start= is a mask over the prompts; score={score.name!r} runs each with its "
                "answer after it: leave start= out, or score the last token "
                "(Score.of('kl', at='last'), 'first_token')."
            )
        laid = score.lay_out(self.batch, [list(self.selections.values())])
        width = laid.shape[1]
        spans = {
            name: F.pad(span, (0, width - span.shape[1])) for name, span in self.batch.spans.items()
        }
        self.batch = dataclasses.replace(
            self.batch, tokens=laid.tokens, attention_mask=laid.attention_mask, spans=spans
        )
        self.selections = dict(zip(self.selections, laid.selections[0]))
        self.last_only = False

    @torch.no_grad()
    def _probe_metric(self) -> None:
        """Refuse a metric that ``logits="last"`` would break or mislead (on the first prompt)."""
        index = torch.tensor([0])
        rows = self.batch.rows(index)  # cut to its own length: it ends at the last position
        full = graft_forward(
            self.models,
            rows.tokens,
            self.start_mask(index, rows),
            attention_mask=rows.attention_mask,
            logits="all",
        )
        # Shapes and finiteness are checked on the whole batch, by the passes.
        returned = _call_metric(self.metric, full[:, -1:], rows)
        try:
            at_last = torch.as_tensor(returned).float()
            everywhere = torch.as_tensor(self.metric(full, rows)).float()
        except Exception:
            return  # not numbers (named by the passes), or made for [batch, 1, d_vocab] alone
        if reads_other_positions(at_last, everywhere):
            raise AttributionError(
                f"The metric reads positions other than the last: on the start's run of the "
                f"first prompt it gives {at_last[0].item():.4g} from its last token ([batch, 1, "
                f"d_vocab], what logits='last', the default, passes) but "
                f"{everywhere.flatten()[0].item():.4g} from every position. Pass logits='all'."
            )

    def grafted(self, rows: TokenizedExamples, mask: GraftMask) -> torch.Tensor:
        """The logits the metric reads of ``rows`` grafted by ``mask`` (exactly)."""
        read = "last" if self.last_only else "all"
        return graft_forward(self.models, rows.tokens, mask, rows.attention_mask, logits=read)

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
        self, index: torch.Tensor, rows: TokenizedExamples, cells: _Config = ()
    ) -> GraftMask:
        """The start of a chunk's rows, with ``cells`` switched (or set to their sources) on it."""
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
        sources = cells if isinstance(cells, Mapping) else dict.fromkeys(cells, self.switch)
        for (component, layer, label), source in sources.items():
            value = entries.setdefault((component, layer), torch.zeros(shape, dtype=torch.long))
            value[self.selections[label][index, :length]] = source
        lengths = rows.attention_mask.sum(dim=1)
        return GraftMask(entries, (shape[0], shape[1]), len(self.models), lengths)

    def estimates(
        self, *, method: str = "gradient", steps: int = 1, start_cells: Sequence[Cell] = ()
    ) -> tuple[Float[torch.Tensor, "cells prompts"], Float[torch.Tensor, " prompts"] | None]:
        """Each cell's estimated effect on each prompt's metric, ``start_cells`` switched in
        the start (their estimates 0); and for ``"gradient"`` each prompt's metric at the start,
        from the relaxed pass (to the kernels' rounding), ``None`` for ``"integrated"``."""
        device = self.models.device
        points = [0.0] if method == "gradient" else [(j + 0.5) / steps for j in range(steps)]
        labels = list(self.groups)
        estimates = torch.zeros(len(self.keys), len(labels), len(self.batch))
        start = torch.zeros(len(self.batch)) if method == "gradient" else None

        def chunk(index: torch.Tensor, rows: TokenizedExamples) -> tuple[torch.Tensor, ...]:
            """One chunk's estimates ``[keys, groups, rows]`` and its metric at the start."""
            shape = tuple(rows.tokens.shape)
            groups = torch.stack([self.selections[label][index, : shape[1]] for label in labels])
            moving = groups.any(dim=0).to(device=device, dtype=torch.float32)
            mask = self.start_mask(index, rows, start_cells)
            tokens, attention_mask = rows.tokens.to(device), rows.attention_mask.to(device)
            total = torch.zeros(len(self.keys), *shape)
            at_start = torch.zeros(len(index))
            for point in points:
                weights = {key: (moving * point).requires_grad_() for key in self.keys}
                with grafting(self.models, mask) as model:
                    with relaxing(self.models, weights, source=self.switch):
                        logits = self._logits(model, tokens, attention_mask, mask)
                values = _metric_values(self.metric, logits, rows)
                at_start = values.detach().float().cpu()
                # A metric detached from the run (.detach(), .item(), a tensor rebuilt from
                # .tolist(), a rank) would give every cell an estimate of exactly 0.
                gradients = (
                    torch.autograd.grad(values.sum(), list(weights.values()), allow_unused=True)
                    if values.requires_grad
                    else [None]
                )
                if all(gradient is None for gradient in gradients):
                    raise AttributionError(
                        "The metric's values carry no gradient through the grafted run, so every "
                        "estimate would be 0. Compute a log-probability or a logit from the "
                        "logits it is given with torch operations (no .detach(), .item(), "
                        ".tolist() or ranks)."
                    )
                for position, gradient in enumerate(gradients):
                    if gradient is not None:
                        total[position] += gradient.detach().float().cpu()
            total /= len(points)
            # A cell's estimate: the gradient summed over its positions, per prompt.
            return torch.einsum("kbp,lbp->klb", total, groups.float()), at_start

        chunks = list(self.chunks())
        # Inside shared_ranks() each rank computes every world-th chunk (core/ranks.py).
        computed = ranks.spread(
            "attribute_grafts", self.call(), len(chunks), lambda number: chunk(*chunks[number])
        )
        for (index, _), (per_cell, at_start) in zip(chunks, computed):
            estimates[:, :, index] = per_cell
            if start is not None:
                start[index] = at_start
        # Table order: position group, then the keys in residual order.
        return estimates.transpose(0, 1).reshape(len(self.cells), len(self.batch)), start

    def call(self) -> dict[str, Any]:
        """What makes this plan's passes these passes: the ranks sharing them compare it."""
        return {
            "models": [source.fingerprint() for source in self.models.sources],
            "prompts": vars(self.batch),
            "cells": self.cells,
            "settings": (self.metric, self.direction, self.source, self.last_only),
            "start": None if self.start is None else {k: self.start[k] for k in self.start.keys()},
        }

    def _logits(
        self, model: Any, tokens: torch.Tensor, attention_mask: torch.Tensor, mask: GraftMask
    ) -> torch.Tensor:
        """The relaxed run's logits (the last token's alone where the unembedding allows)."""
        last = attention_mask.sum(dim=1) - 1
        rows = torch.arange(len(last), device=last.device)
        unembed = any(component == "unembed" for component, _ in [*self.keys, *mask.keys()])
        if not self.last_only or unembed:
            logits = model(tokens, attention_mask=attention_mask, return_type="logits")
            return logits[rows, last][:, None] if self.last_only else logits
        kept, column = torch.unique(last, return_inverse=True)
        logits = model(
            tokens, attention_mask=attention_mask, return_type="logits", logits_to_keep=kept
        )
        return logits[rows, column][:, None]

    @torch.no_grad()
    def exact(self, configs: Sequence[_Config]) -> Float[torch.Tensor, "configs prompts"]:
        """Each prompt's metric with each configuration's cells switched on top of the start
        (or, ``{cell: source}``, set to their sources), as exact grafts, blocks of rows of
        ``rows_per_forward``-row passes."""
        configs = [dict(c) if isinstance(c, Mapping) else tuple(c) for c in configs]
        values = torch.zeros(len(configs), len(self.batch))
        blocks = []  # (rows' indices, rows, first configuration, configurations per pass)
        for index, rows in self.chunks():
            per_pass = max(1, self.rows_per_forward // len(index))
            blocks += [(index, rows, first, per_pass) for first in range(0, len(configs), per_pass)]

        def compute(number: int) -> torch.Tensor:
            index, rows, first, per_pass = blocks[number]
            block = configs[first : first + per_pass]
            mask = GraftMask.cat([self.start_mask(index, rows, cells) for cells in block])
            repeated = self.batch.rows(index.repeat(len(block)))
            scores = _metric_values(self.metric, self.grafted(repeated, mask), repeated)
            scores = scores.float().cpu()
            return scores.reshape(len(block), -1)

        # Inside shared_ranks() each rank computes every world-th block (core/ranks.py).
        computed = ranks.spread(
            "the exact grafts", {**self.call(), "grafts": configs}, len(blocks), compute
        )
        for (index, _, first, per_pass), scores in zip(blocks, computed):
            values[first : first + per_pass, index] = scores
        return values

    def frame(
        self,
        estimates: Float[torch.Tensor, "cells prompts"],
        exact: Float[torch.Tensor, "cells prompts"],
        *,
        method: str,
    ) -> pd.DataFrame:
        """One row per cell: its estimate and exact effect, with standard errors over prompts."""
        from scipy import stats  # imported when needed: it takes a second to import

        frame = pd.DataFrame(self.cells, columns=["component", "layer", "positions"])
        frame.insert(0, "cell", [cell_label(*cell) for cell in self.cells])
        for name, values in (("estimate", estimates), ("exact", exact)):
            frame[name] = values.mean(dim=1).tolist()  # NaN for a cell not verified
            # NaN for one prompt (no spread to measure) or an unverified cell (NaN values).
            frame[f"{name}_se"] = [
                stats.sem(row.numpy()) if len(row) > 1 else np.nan for row in values
            ]
        frame["n"], frame["direction"], frame["method"] = len(self.batch), self.direction, method
        frame["layer"] = frame["layer"].astype("Int64")  # <NA> for global components
        return frame


def _position_groups(
    positions: PositionGroups, batch: TokenizedExamples
) -> tuple[dict[str, Any], dict[str, Bool[torch.Tensor, "batch pos"]]]:
    """Label to specification, and label to ``[batch, pos]`` selection."""
    if isinstance(positions, str) and positions == "each":
        specs: dict[str, Any] = {str(index): index for index in range(batch.tokens.shape[1])}
        return specs, resolve_groups(specs, batch)
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
    """The position groups of one batch on another (held-out prompts): span expressions and
    position functions select afresh, an index (``"each"``) takes that column where the row
    reaches it, and a tensor over another batch's rows is an :class:`AttributionError`."""
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


def _call_metric(metric: BatchMetric, logits: torch.Tensor, rows: TokenizedExamples) -> Any:
    """What ``metric`` returns; what else than an AttributionError it raises becomes one."""
    try:
        return metric(logits, rows)
    except AttributionError:
        raise
    except Exception as error:
        lines = str(error).strip().splitlines()
        raised = type(error).__name__ + (f": {lines[0]}" if lines else "")
        raise AttributionError(
            f"The metric raised {raised} on logits of shape {list(logits.shape)}."
            + (
                " Under logits='last' (the default) it gets each row's last real token, "
                "[batch, 1, d_vocab]; a metric that reads other positions needs logits='all'."
                if logits.shape[1] == 1
                else ""
            )
        ) from error


def _metric_values(
    metric: BatchMetric, logits: torch.Tensor, rows: TokenizedExamples
) -> torch.Tensor:
    """The metric of each row, checked: one finite number per prompt."""
    returned = _call_metric(metric, logits, rows)
    batch = len(rows)
    tensor = isinstance(returned, torch.Tensor)
    if not tensor or not returned.is_floating_point() or tuple(returned.shape) != (batch,):
        described = (
            f"{returned.dtype} of shape {list(returned.shape)}"
            if tensor
            else f"{type(returned).__name__} {returned!r:.40}"
        )
        problem = (
            f"The metric returned {described} from logits of shape {list(logits.shape)}; it "
            f"must return one floating-point value per prompt ([{batch}]), not a mean."
        )
    elif bad := (~torch.isfinite(returned.detach())).nonzero().flatten().tolist()[:5]:
        problem = (
            f"The metric is not finite for rows {bad} of a chunk: a NaN or infinite logit, or "
            "a log of zero. Check the checkpoints' weights, or use a metric that stays finite."
        )
    else:
        return returned
    raise AttributionError(problem)


def _check_count(name: str, value: Any, alternative: str = "") -> None:
    if not is_integer(value) or value < 1:
        extra = f" {alternative}" if alternative else ""
        error = AttributionError if isinstance(value, (int, float, str)) else ArgumentTypeError
        raise error(f"{name} must be an integer >= 1{extra}, got {value!r}.")
