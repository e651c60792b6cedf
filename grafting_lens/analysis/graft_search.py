"""The smallest graft that recovers the donor: attribution proposes, exact grafts decide.

:func:`find_minimal_graft` looks for a small set ``S`` of cells whose graft recovers at least
``fraction`` of the gap, ``recovery(S) = (metric(base + S) - metric(base)) / (metric(donor) -
metric(base))`` averaged over prompts. Each step attributes the remaining cells and grafts
the best-estimated ones exactly; the result is pruned to 1-minimal. Every reported recovery
is an exact graft. See ``docs/concepts/attribution.md``, "The smallest graft that works".

Examples:
    >>> found = find_minimal_graft(models, batch, fraction=0.8, held_out=other_batch)
    >>> found.cells, found.recovery, found.held_out_recovery
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
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
from grafting_lens.analysis.directions import keep_directions
from grafting_lens.core import ranks
from grafting_lens.core.arguments import is_number
from grafting_lens.core.console import progress_line, show_progress
from grafting_lens.core.errors import (
    ArgumentTypeError,
    AttributionError,
    GraftingLensError,
    check_known,
    refuse_first,
)
from grafting_lens.core.files import atomic_write, writing
from grafting_lens.engine.masks import GraftMask
from grafting_lens.models.layers import LayerSpec
from grafting_lens.models.model_set import ModelSet

__all__ = ["REFERENCES", "SEARCHES", "MinimalGraft", "find_minimal_graft"]

REFERENCES: tuple[str, ...] = ("donor", "all_cells")
"""What a recovery of 1 means: the donor run whole, or the graft of every candidate cell."""

_REFERENCE_NAMES = {"donor": "donor", "all_cells": "graft of every candidate cell"}

SEARCHES: tuple[str, ...] = ("doubling", "greedy")
"""How the search grows its set: blocks of 1, 2, 4... cells, or one cell per step."""

SEARCH_COLUMNS: tuple[str, ...] = (
    "step",
    "phase",
    "size",
    "cells",
    "cell",
    "estimate",
    "recovery",
    "kept",
)
"""Columns of the ``search`` log of a :class:`MinimalGraft`."""

CURVE_COLUMNS: tuple[str, ...] = ("prompts", "cells", "cell", "metric", "recovery")
"""Columns of the ``curve`` of a :class:`MinimalGraft`."""


@dataclass(frozen=True)
class MinimalGraft:
    """A small set of cells whose graft recovers a fraction of the donor's metric.

    Attributes:
        cells: In the order added: ``order`` (1, 2...), ``cell`` (its label),
            ``component``, ``layer`` (``<NA>`` for global components), ``positions``.
        curve: The exact recovery of the first ``k`` cells (:data:`CURVE_COLUMNS`), for
            every ``k`` from 0 to ``len(cells)`` or ``curve_points`` of them evenly spread,
            on the ``"search"`` and ``"held_out"`` prompts.
        search: One row per set of cells measured (:data:`SEARCH_COLUMNS`): its ``phase``
            (``"block"``, ``"shortest prefix"`` or ``"single"``), ``size`` and ``cells``,
            the ``cell`` added last, the ``estimate`` of what was added, the set's exact
            ``recovery`` and whether it was ``kept``.
        fraction: The recovery asked for.
        recovery: The recovery of all the cells on the search prompts.
        held_out_recovery: The same on the held-out prompts (``None`` without them).
        reached: Whether ``recovery >= fraction``.
        reference: What a recovery of 1 is (:data:`REFERENCES`).
        groups: Each position group's label and specification (to select in other prompts).
        source: The donor's index in the model set.
        seconds: Wall time of the ``search``, the ``prune`` and the ``curve``.
        directions: With ``directions=True``, each cell cut to its fewest top directions of
            the donor's change that still recover ``fraction`` (``keep_directions``).
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
    seconds: Mapping[str, float]
    directions: pd.DataFrame | None = None

    def mask(self, models: ModelSet, tokenized: Any) -> GraftMask:
        """The graft of these cells for a batch of prompts, on the search's model set.

        Raises:
            AttributionError: A position group given as a tensor over the search's prompts.
        """
        batch = as_batch(tokenized, models)
        selections = resolve_groups(self.groups, batch)
        shape = tuple(batch.tokens.shape)
        entries: dict[Any, torch.Tensor] = {}
        layers = [None if pd.isna(layer) else int(layer) for layer in self.cells["layer"]]
        for component, layer, label in zip(self.cells["component"], layers, self.cells.positions):
            value = entries.setdefault((component, layer), torch.zeros(shape, dtype=torch.long))
            value[selections[label]] = self.source
        return GraftMask.from_dict(
            models, entries, (shape[0], shape[1]), attention_mask=batch.attention_mask
        )


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
    search: str = "doubling",
    proposals: int = 8,
    beam: int | None = None,
    method: str = "gradient",
    steps: int = 8,
    max_cells: int | None = None,
    prune: bool = True,
    curve_points: int | None = 25,
    directions: bool = False,
    state: str | os.PathLike | None = None,
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
        held_out: Other prompts to report the recovery of the cells found on (their
            position groups selected afresh: no tensors over the search's rows).
        reference: ``"donor"`` (recovery 1 is the donor whole) or ``"all_cells"`` (the graft
            of every candidate cell, which may fall short of the donor).
        search: ``"doubling"`` (each step grafts the next 1, 2, 4... best-estimated cells,
            the last block cut to its shortest prefix that reaches ``fraction``) or
            ``"greedy"`` (each step grafts the best of ``proposals`` single cells; slower).
        proposals: Candidates tried one by one: every step of a greedy search, and a
            doubling step when its single best cell does not help.
        beam: Sets kept per step of a greedy search (default 1).
        method: The attribution proposing candidates: ``"gradient"`` or ``"integrated"``.
        max_cells: Stop after this many cells (default: every candidate).
        prune: Drop cells the result can do without, until it is 1-minimal.
        directions: Then cut each cell to its fewest directions (``MinimalGraft.directions``).
        curve_points: Prefixes of the result the curve measures (``None``: every one).
        state: A JSON file of the search's progress: a search started again with it goes
            on from its last step (its cells are measured again and must recover as said).
        progress: A progress bar (``True``), nothing (``False``), or by default a bar where
            someone watches and one line per step on standard error elsewhere.

    Returns:
        A :class:`MinimalGraft`.

    Raises:
        AttributionError: A fraction outside (0, 1], a reference that does not beat the
            base on the metric, a bad option, a ``state`` file of another search (and all
            ``attribute_grafts`` refuses).
    """
    wrong_fraction = (
        "fraction must be a number in (0, 1] (the share of the gap between the base and the "
        f"donor to recover), got {fraction!r}."
    )
    refuse_first(
        ArgumentTypeError,
        [
            (not isinstance(prune, bool), f"prune={prune!r}: True or False."),
            (not isinstance(directions, bool), f"directions={directions!r}: True or False."),
            (not is_number(fraction), wrong_fraction),
        ],
    )
    refuse_first(AttributionError, [(not 0 < fraction <= 1, wrong_fraction)])
    fraction = float(fraction)  # a numpy float too; kept in the result as Python's
    check_known(reference, REFERENCES, "reference", AttributionError)
    check_known(search, SEARCHES, "search", AttributionError)
    check_known(method, METHODS, "method", AttributionError)
    for name, count in (("proposals", proposals), ("steps", steps)):
        _check_count(name, count)
    for name, given in (("beam", beam), ("max_cells", max_cells), ("curve_points", curve_points)):
        if given is not None:
            _check_count(name, given)
    refuse_first(
        AttributionError,
        [
            (
                beam is not None and search != "greedy",
                "beam is a setting of search='greedy'; leave it out.",
            ),
            (
                curve_points is not None and curve_points < 2,
                f"curve_points must be at least 2 (no cells and all of them), got {curve_points}.",
            ),
        ],
    )
    beam = 1 if beam is None else beam
    journal = _Journal.open(
        state, search=search, fraction=fraction, reference=reference, method=method
    )
    settings: dict[str, Any] = dict(
        metric=metric,
        components=components,
        layers=layers,
        source=source,
        batch_size=batch_size,
        rows_per_forward=rows_per_forward,
        progress=False,
        logits=logits,
    )
    plan = AttributionPlan(models, tokenized, positions=positions, **settings)
    held = None
    if held_out is not None:
        try:
            held_batch = as_batch(held_out, models)
        except GraftingLensError as error:  # named: it is not the search's batch
            raise type(error)(f"held_out: {error}") from None
        selections = resolve_groups(plan.groups, held_batch)
        held = AttributionPlan(models, held_batch, positions=selections, **settings)
    saved = journal.load(plan)
    report = _Progress(progress)
    report.say(f"{len(plan.cells)} cells, {len(plan.batch)} prompts: measuring the references")
    scale = _Scale.of(plan, reference)
    if scale.gap <= 0:
        raise AttributionError(
            f"The {_REFERENCE_NAMES[reference]} does not beat the base on this metric "
            f"(mean {scale.top:.4g} vs the base's {scale.bottom:.4g}), so there "
            "is nothing to recover. Check the metric's sign (higher must be better) and the "
            "donor's index."
        )
    searcher = _Search(
        plan, scale, fraction, max_cells or len(plan.cells), method, steps, proposals, report
    )
    started = time.perf_counter()
    journal.resume(searcher, saved)
    if search == "greedy":
        searcher.greedy(beam, journal)
    else:
        searcher.doubling(journal)
    found, recovery = searcher.beams[0]
    chosen = list(found)
    seconds = {"search": time.perf_counter() - started}
    started = time.perf_counter()
    if prune and recovery >= fraction:
        chosen = searcher.prune(chosen, journal)
    seconds["prune"] = time.perf_counter() - started
    started = time.perf_counter()
    report.say(f"{len(chosen)} cells: measuring the recovery curve")
    prefixes = [tuple(chosen[:k]) for k in _curve_lengths(len(chosen), curve_points)]
    curve = _curve(plan, scale, prefixes, "search")
    held_out_recovery = None
    if held is not None:
        held_curve = _curve(held, _Scale.of(held, reference), prefixes, "held_out")
        curve = pd.concat([curve, held_curve], ignore_index=True)
        held_out_recovery = float(held_curve["recovery"].iloc[-1])
    recovery = float(curve[curve.prompts == "search"]["recovery"].iloc[-1])
    reached = recovery >= fraction
    seconds["curve"] = time.perf_counter() - started
    kept = None
    if directions:
        kept = keep_directions(plan, chosen, fraction=fraction, bottom=scale.bottom, top=scale.top)
        seconds["directions"] = time.perf_counter() - started - seconds["curve"]
    report.close(f"done: {len(chosen)} cells recover {recovery:.3f}")
    if not reached:
        warnings.warn(
            f"The search stopped at a recovery of {recovery:.3f}, short of {fraction}: no "
            "candidate improved further. Allow more proposals (or search='greedy' with a "
            "wider beam), more components or positions, or reference='all_cells'.",
            stacklevel=2,
        )
    cells_frame = pd.DataFrame(chosen, columns=["component", "layer", "positions"])
    cells_frame.insert(0, "cell", [cell_label(*cell) for cell in chosen])
    cells_frame.insert(0, "order", range(1, len(chosen) + 1))
    cells_frame["layer"] = cells_frame["layer"].astype("Int64")  # <NA> for global components
    return MinimalGraft(
        cells=cells_frame,
        curve=curve,
        search=pd.DataFrame(searcher.log, columns=list(SEARCH_COLUMNS)),
        fraction=float(fraction),
        recovery=recovery,
        held_out_recovery=held_out_recovery,
        reached=reached,
        reference=reference,
        groups=dict(plan.groups),
        source=source,
        seconds={name: round(value, 3) for name, value in seconds.items()},
        directions=kept,
    )


class _Progress:
    """A bar where someone watches, a line per step on standard error elsewhere, or nothing."""

    def __init__(self, progress: bool | None) -> None:
        self.progress = progress
        self.started = time.perf_counter()
        self.bar = tqdm(desc="graft search", disable=not show_progress(progress), unit="step")

    def say(self, text: str) -> None:
        self.bar.update()
        self.bar.set_postfix_str(text[:60], refresh=False)
        seconds = time.perf_counter() - self.started
        progress_line(self.progress, "graft search", f"{text} ({seconds:.0f} s)")

    def close(self, text: str) -> None:
        self.say(text)
        self.bar.close()


class _Search:
    """The search's state: the cells accepted so far, their exact recovery, every set tried."""

    def __init__(
        self,
        plan: AttributionPlan,
        scale: _Scale,
        fraction: float,
        limit: int,
        method: str,
        steps: int,
        proposals: int,
        report: _Progress,
    ) -> None:
        self.plan, self.scale, self.fraction, self.limit = plan, scale, fraction, limit
        self.method, self.steps, self.proposals, self.report = method, steps, proposals, report
        self.beams: list[tuple[tuple[Cell, ...], float]] = [((), 0.0)]
        self.size = 1  # the doubling search's next block
        self.step = 0
        self.log: list[dict[str, Any]] = []
        self.pruned: tuple[Cell, ...] | None = None
        self.last_ranking: tuple[tuple[Cell, ...] | None, list[tuple[Cell, float]]] = (None, [])

    def measure(self, sets: Sequence[Sequence[Cell]]) -> list[float]:
        """The exact recovery of each set of cells."""
        return self.scale.recovery(self.plan.exact([tuple(cells) for cells in sets]))

    def ranked(self, cells: Sequence[Cell]) -> list[tuple[Cell, float]]:
        """The cells not in ``cells``, best estimate first, attributed from their graft."""
        if self.last_ranking[0] == tuple(cells):  # a smaller block after one that failed
            return self.last_ranking[1]
        estimates = self.plan.estimates(method=self.method, steps=self.steps, start_cells=cells)
        means = estimates[0].mean(1)
        taken = set(cells)
        ranking = [
            (self.plan.cells[i], float(means[i]))
            for i in means.argsort(descending=True).tolist()
            if self.plan.cells[i] not in taken
        ]
        self.last_ranking = (tuple(cells), ranking)
        return ranking

    def record(
        self,
        cells: Sequence[Cell],
        added: Cell,
        estimate: float,
        recovery: float,
        kept: bool,
        phase: str,
    ) -> None:
        """One row of the search log (:data:`SEARCH_COLUMNS`)."""
        labels = " + ".join(cell_label(*cell) for cell in cells)
        row = (self.step, phase, len(cells), labels, cell_label(*added), estimate, recovery, kept)
        self.log.append(dict(zip(SEARCH_COLUMNS, row)))

    def done(self) -> bool:
        cells, recovery = self.beams[0]
        return recovery >= self.fraction or len(cells) >= self.limit

    def doubling(self, journal: _Journal) -> None:
        """Blocks of 2, 4, 8... cells in the order of their estimates, re-attributed from the
        cells accepted so far, the last block cut to its shortest prefix that reaches; where
        a block does not help, half of it; at one cell, the best of ``proposals``."""
        while not self.done():
            self.step += 1
            cells, recovery = self.beams[0]
            ranked = self.ranked(cells)
            if not ranked:
                break
            block = ranked[: min(self.size, self.limit - len(cells))]
            if len(block) == 1:
                # One cell: the best of the first few, each measured (estimates misjudge).
                trials = [(*cells, cell) for cell, _ in ranked[: self.proposals]]
                values = self.measure(trials)
                best = max(range(len(trials)), key=lambda i: values[i])
                for i, trial in enumerate(trials):
                    self.record(trial, trial[-1], ranked[i][1], values[i], i == best, "single")
                if values[best] <= recovery:
                    break  # nothing improves on the set
                self.beams = [(trials[best], values[best])]
                self.size = 2
            else:
                grown = (*cells, *(cell for cell, _ in block))
                (value,) = self.measure([grown])
                estimate = sum(e for _, e in block)
                self.record(grown, block[-1][0], estimate, value, value > recovery, "block")
                if value >= self.fraction:
                    self.beams = [self.shortest_prefix(cells, block, value)]
                elif value > recovery:
                    self.beams = [(grown, value)]
                    self.size *= 2
                else:
                    self.size = len(block) // 2  # too coarse a step: a smaller one
                    continue
            journal.save(self)
            self.report.say(
                f"step {self.step}: {len(self.beams[0][0])} cells recover {self.beams[0][1]:.3f}"
            )

    def shortest_prefix(
        self, cells: tuple[Cell, ...], block: list[tuple[Cell, float]], value: float
    ) -> tuple[tuple[Cell, ...], float]:
        """``cells`` and the shortest prefix of ``block`` that reaches, by bisection."""
        low, high = 0, len(block)  # the prefix of `low` cells falls short, `high`'s reaches
        while high - low > 1:
            middle = (low + high) // 2
            trial = (*cells, *(cell for cell, _ in block[:middle]))
            (reached,) = self.measure([trial])
            kept = reached >= self.fraction
            self.record(
                trial, block[middle - 1][0], block[middle - 1][1], reached, kept, "shortest prefix"
            )
            if kept:
                high, value = middle, reached
            else:
                low = middle
        return (*cells, *(cell for cell, _ in block[:high])), value

    def greedy(self, beam: int, journal: _Journal) -> None:
        """Each step: the ``proposals`` best-estimated single cells added to each set kept."""
        while not self.done():
            self.step += 1
            candidates: dict[frozenset, tuple[tuple[Cell, ...], float]] = {}
            for cells, _ in self.beams:
                for cell, estimate in self.ranked(cells)[: self.proposals]:
                    grown = (*cells, cell)
                    candidates.setdefault(frozenset(grown), (grown, estimate))
            if not candidates:
                break
            tried = list(candidates.values())
            recoveries = self.measure([cells for cells, _ in tried])
            order = sorted(range(len(tried)), key=lambda i: -recoveries[i])
            kept = set(order[:beam])
            for i, (cells, estimate) in enumerate(tried):
                self.record(cells, cells[-1], estimate, recoveries[i], i in kept, "single")
            if recoveries[order[0]] <= self.beams[0][1]:
                break  # no candidate improves on the best set
            self.beams = [(tried[i][0], recoveries[i]) for i in order[:beam]]
            journal.save(self)
            self.report.say(
                f"step {self.step}: {len(self.beams[0][0])} cells recover {self.beams[0][1]:.3f}"
            )

    def prune(self, cells: list[Cell], journal: _Journal) -> list[Cell]:
        """Drop cells while the rest reaches the fraction, until no single one can go."""
        if self.pruned is not None:
            return list(self.pruned)
        while len(cells) > 1:
            self.report.say(f"pruning: {len(cells)} cells, measuring each one's absence")
            without = [[c for c in cells if c != dropped] for dropped in cells]
            recoveries = self.measure(without)
            order = sorted(range(len(cells)), key=lambda i: -recoveries[i])
            removable = [i for i in order if recoveries[i] >= self.fraction]
            if not removable:
                break  # 1-minimal: measured on exactly this set
            kept = [c for c in cells if c != cells[removable[0]]]
            for i in removable[1:]:  # more drops, each measured before it is taken
                trial = [c for c in kept if c != cells[i]]
                (value,) = self.measure([trial])
                if value >= self.fraction:
                    kept = trial
            cells = kept
        self.pruned = tuple(cells)
        journal.save(self)
        return cells


class _Journal:
    """The search's progress in a JSON file, to go on from after a kill (no file: none)."""

    def __init__(self, path: Path | None, settings: dict[str, Any]) -> None:
        self.path, self.settings = path, settings

    @classmethod
    def open(cls, path: str | os.PathLike | None, **settings: Any) -> _Journal:
        if path is None:
            return cls(None, settings)
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentTypeError(f"state must be a file path, got {type(path).__name__}.")
        path = Path(path)
        if path.is_dir():
            raise AttributionError(f"state must be a file, and {path} is a directory.")
        return cls(path, settings)

    def load(self, plan: AttributionPlan) -> dict[str, Any] | None:
        """The saved state, checked against this search's settings (no forward pass)."""
        if self.path is None or not self.path.exists():
            return None
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            problem = _state_problem(saved, plan)
        except (OSError, ValueError) as error:
            problem = str(error)
        expected = {**self.settings, "candidates": _candidates_key(plan)}
        if problem is not None:
            problem = f"The search's state file {self.path} cannot be used ({problem})"
        elif saved["settings"] != expected:
            differences = ", ".join(
                f"{key} {saved['settings'].get(key)!r} there, {value!r} here"
                for key, value in expected.items()
                if saved["settings"].get(key) != value
            )
            problem = f"The state file {self.path} belongs to another search ({differences})"
        if problem is not None:
            raise AttributionError(
                f"{problem}; give another path, or move this one away to start afresh."
            )
        saved["cells"] = [_cell(cell) for cell in saved["cells"]]
        if saved["pruned"] is not None:
            saved["pruned"] = tuple(_cell(cell) for cell in saved["pruned"])
        return saved

    def resume(self, search: _Search, saved: dict[str, Any] | None) -> None:
        """Carry on from ``saved``, once its cells are measured to recover what it says."""
        if saved is None:
            return
        recovery = saved["recovery"]
        chosen = saved["cells"]
        (measured,) = search.measure([chosen])
        if not abs(measured - recovery) <= 1e-4:  # NaN measured fails too
            raise AttributionError(
                f"The state file {self.path} says its {len(chosen)} cells recover "
                f"{recovery:.4f}; here they recover {measured:.4f}, so it was written for other "
                "models, prompts or metric. Give another path, or move it away to start afresh."
            )
        search.beams = [(tuple(chosen), measured)]
        search.size, search.step, search.log = saved["size"], saved["step"], saved["log"]
        search.pruned = saved["pruned"]
        search.report.say(f"resumed at step {search.step}: {len(chosen)} cells, {measured:.3f}")

    def save(self, search: _Search) -> None:
        if self.path is None or not ranks.first():  # under ranks, one file, rank 0's
            return
        cells, recovery = search.beams[0]
        state = {
            "settings": {**self.settings, "candidates": _candidates_key(search.plan)},
            "cells": [list(cell) for cell in cells],
            "recovery": recovery,
            "size": search.size,
            "step": search.step,
            "pruned": None if search.pruned is None else [list(c) for c in search.pruned],
            "log": search.log,
        }
        with writing("The graft search's state", self.path):
            atomic_write(self.path, json.dumps(state, indent=1).encode("utf-8"))


def _cell(stored: Any) -> Cell:
    component, layer, label = stored
    return str(component), None if layer is None else int(layer), str(label)


_STATE_FIELDS = ("settings", "cells", "recovery", "size", "step", "pruned", "log")


def _state_problem(saved: Any, plan: AttributionPlan) -> str | None:
    """Why a state file is unusable, read whole before anything resumes (None: it is not)."""
    if not isinstance(saved, dict):
        return f"it holds a {type(saved).__name__}, not the search's fields"
    missing = [field for field in _STATE_FIELDS if field not in saved]
    if missing:
        return f"it has no {', '.join(map(repr, missing))}"
    recovery, size, step = saved["recovery"], saved["size"], saved["step"]
    if not isinstance(saved["settings"], dict):
        return "'settings' is not a mapping"
    if isinstance(recovery, bool) or not isinstance(recovery, (int, float)):
        return f"'recovery' is {recovery!r}, not a number"
    if not math.isfinite(recovery):
        return f"'recovery' is {recovery!r}, not a finite number"
    for name, value, least in (("size", size, 1), ("step", step, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            return f"{name!r} is {value!r}, not a whole number >= {least}"
    if not isinstance(saved["log"], list) or not all(isinstance(e, dict) for e in saved["log"]):
        return "'log' is not a list of steps"
    candidates = {tuple(cell) for cell in plan.cells}
    plain = (str, int, type(None))
    for field in ("cells", "pruned"):
        stored = saved[field]
        if stored is None and field == "pruned":
            continue
        if not isinstance(stored, list):
            return f"{field!r} is not a list of cells"
        for cell in stored:
            known = isinstance(cell, list) and all(isinstance(part, plain) for part in cell)
            if not (known and tuple(cell) in candidates):
                return (
                    f"{field!r} holds {cell!r}, not one of this search's candidate cells "
                    "(component, layer, label)"
                )
    return None


def _candidates_key(plan: AttributionPlan) -> str:
    """A short hash of the candidate cells, in order (a state file's cells index into them)."""
    labels = "\n".join(cell_label(*cell) for cell in plan.cells)
    return hashlib.sha256(labels.encode("utf-8")).hexdigest()[:16]


def _curve_lengths(count: int, points: int | None) -> list[int]:
    """The prefix lengths the curve measures: every one, or ``points`` evenly spread."""
    if points is None or count + 1 <= points:
        return list(range(count + 1))
    return sorted({round(i * count / (points - 1)) for i in range(points)})


@dataclass(frozen=True)
class _Scale:
    """The metric's means at the base (recovery 0) and at the reference (recovery 1)."""

    bottom: float
    top: float

    @classmethod
    def of(cls, plan: AttributionPlan, reference: str) -> _Scale:
        if reference == "all_cells":
            return cls(*plan.exact([(), tuple(plan.cells)]).mean(dim=1).tolist())
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
        values.append(plan.metric(plan.grafted(rows, mask), rows).float().cpu())
    return float(torch.cat(values).mean())


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
