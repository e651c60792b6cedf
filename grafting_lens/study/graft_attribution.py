"""The graft-attribution experiment: every cell's effect estimated, checked, and the minimal graft.

Every cell (a component of SFT at a layer, at FE, LT or (FE+LT)^C) is attributed
(:func:`~grafting_lens.analysis.attribution.attribute_grafts`) and grafted alone into PRE,
on both test prompts; then :func:`~grafting_lens.analysis.graft_search.find_minimal_graft`
searches the headline prompts for a small graft that recovers ``--fraction`` of SFT's
log-probability, held out on the QA prompts (docs/concepts/attribution.md). Registered as
``graft_attribution``; its report writes ``results.csv``, ``references.csv``,
``agreement.csv``, ``minimal_graft.csv``, ``recovery.csv``, ``search.csv``, ``summary.md``
and the figures ``attribution_<prompt>``, ``exact_<prompt>`` and ``recovery``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from grafting_lens.analysis import plots
from grafting_lens.analysis.attribution import attribute_grafts
from grafting_lens.analysis.graft_search import find_minimal_graft
from grafting_lens.core import ranks
from grafting_lens.core.console import progress_line
from grafting_lens.core.errors import ExperimentError
from grafting_lens.core.files import atomic_write, writing
from grafting_lens.study import markdown
from grafting_lens.study.report import (
    ExperimentReport,
    figure_caption,
    figure_lines,
    report_settings,
    write_table,
)
from grafting_lens.study.runner import ChunkInfo, RunOptions
from grafting_lens.study.semantics import CLEAN
from grafting_lens.study.specs import QUICK_RELATIONS, ExperimentSetup, ExperimentSpec
from grafting_lens.study.testsets import library_batches

__all__ = ["POSITIONS", "PROMPTS", "report", "run"]

PROMPTS = ("headline", "qa")
"""The test prompts it asks; the search runs on the first and is checked on the second."""

POSITIONS = ("FE", "LT", "(FE+LT)^C")
"""The position groups of its cells."""


def run(
    spec: ExperimentSpec,
    setup: ExperimentSetup,
    *,
    out: str | os.PathLike | None = None,
    quick: bool = False,
    n_examples: int | None = None,
    options: RunOptions,
    extras: Mapping[str, Any],
    on_chunk: Callable[[ChunkInfo], None] | None = None,
) -> dict[str, Any]:
    """Attribute and verify every cell on both prompts; search for the minimal graft.

    ``extras``: ``method`` (``"gradient"``, the default, or ``"integrated"``), ``steps``
    (default 8), ``fraction`` (default 0.8) and ``verify`` (``"all"``, the default, or how
    many cells). With ``out``, each prompt's attribution and the search's steps are kept
    there, so a killed run goes on where it stopped.

    Returns:
        ``{"results", "references", "agreement", "minimal_graft", "recovery", "search",
        "settings"}``.

    Raises:
        ExperimentError: A ``verify`` that is neither ``"all"`` nor a positive number.
    """
    del spec, on_chunk
    keep = None if out is None else Path(out) / "graft_attribution"
    if keep is not None:
        with writing("The run directory", keep):
            keep.mkdir(parents=True, exist_ok=True)
    models = setup.models
    method = extras.get("method") or "gradient"
    steps = extras.get("steps") or 8
    fraction = extras.get("fraction") or 0.8
    verify = _verify(extras.get("verify"))
    count = QUICK_RELATIONS if quick else n_examples
    batches = library_batches(setup.relations, models.tokenizer, PROMPTS, count)
    frames, agreements, references = [], [], []
    seconds = {}
    for prompt, batch in batches.items():
        stored = None if keep is None else keep / f"attribution_{prompt}.json"
        # Under ranks, rank 0's view decides, and rank 0 alone writes (core/ranks.py).
        if stored is not None and ranks.gather(stored.exists())[0]:
            frame, agreement, reference = _read_attribution(stored)
            progress_line(options.progress, "graft attribution", f"{prompt}: read from {stored}")
        else:
            progress_line(
                options.progress,
                "graft attribution",
                f"{prompt}: attributing {len(batch)} prompts, verifying {verify} cells",
            )
            started = time.perf_counter()
            result = attribute_grafts(
                models,
                batch,
                positions=POSITIONS,
                method=method,
                steps=steps,
                verify=verify,
                batch_size=options.batch_size,
                progress=options.progress,
            )
            frame = result.frame.assign(prompt=prompt)
            agreement = None if result.agreement is None else result.agreement.assign(prompt=prompt)
            reference = {
                "prompt": prompt,
                "n": len(batch),
                "start_metric": result.start_metric,
                "all_cells_metric": result.all_cells_metric,
                "seconds": round(time.perf_counter() - started, 1),
            }
            if stored is not None and ranks.first():
                _write_attribution(stored, frame, agreement, reference)
        seconds[prompt] = reference.pop("seconds")
        frames.append(frame)
        if agreement is not None:
            agreements.append(agreement)
        references.append(reference)
    first, second = PROMPTS
    started = time.perf_counter()
    found = find_minimal_graft(
        models,
        batches[first],
        held_out=batches[second],
        fraction=fraction,
        positions=POSITIONS,
        method=method,
        steps=steps,
        state=None if keep is None else keep / "search.json",
        batch_size=options.batch_size,
        progress=options.progress,
    )
    seconds["search"] = round(time.perf_counter() - started, 1)
    settings = {
        "examples": {prompt: len(batch) for prompt, batch in batches.items()},
        "dropped": {prompt: len(batch.dropped) for prompt, batch in batches.items()},
        "method": method,
        "steps": steps if method == "integrated" else 1,
        "verify": verify,
        "fraction": fraction,
        "reached": found.reached,
        "seconds": seconds,
        "quick": quick,
        "semantics": CLEAN.label,
    }
    results = pd.concat(frames, ignore_index=True)
    # Tokenized, relaxed and grafted the library's way (see the spec's inapplicable options).
    results.insert(0, "semantics", CLEAN.label)
    return {
        "results": results,
        "references": pd.DataFrame(references),
        "agreement": pd.concat(agreements, ignore_index=True) if agreements else pd.DataFrame(),
        "minimal_graft": found.cells,
        "recovery": found.curve,
        "search": found.search,
        "settings": settings,
    }


def _write_attribution(
    path: Path, frame: pd.DataFrame, agreement: pd.DataFrame | None, reference: dict
) -> None:
    """One prompt's attribution as JSON (Python's floats, read back bit for bit)."""

    def table(value: pd.DataFrame | None) -> dict | None:
        if value is None:
            return None
        split = value.astype(object).where(value.notna(), None).to_dict("split")
        return {**split, "dtypes": {c: str(t) for c, t in value.dtypes.items()}}

    content = {"frame": table(frame), "agreement": table(agreement), "reference": reference}
    with writing("The attribution", path):
        atomic_write(path, json.dumps(content).encode("utf-8"))


def _read_attribution(path: Path) -> tuple[pd.DataFrame, pd.DataFrame | None, dict]:
    def table(value: dict | None) -> Any:
        if value is None:
            return None
        frame = pd.DataFrame(value["data"], index=value["index"], columns=value["columns"])
        return frame.astype(value["dtypes"])

    try:
        content = json.loads(path.read_text(encoding="utf-8"))
        frame = table(content["frame"] or {})  # {}: a file without a frame is refused
        agreement, reference = table(content["agreement"]), dict(content["reference"])
        problem = _attribution_problem(frame, reference)
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem = f"{type(error).__name__}: {error}"
    if problem is not None:
        raise ExperimentError(
            f"{path} cannot be read back ({problem}); move it away and run again to compute it."
        )
    return frame, agreement, reference


def _attribution_problem(frame: pd.DataFrame, reference: dict) -> str | None:
    """What is wrong with an attribution read back, checked whole (None if nothing)."""
    numbers = [reference.get(key) for key in ("n", "start_metric", "all_cells_metric", "seconds")]
    if "prompt" not in reference or not all(
        isinstance(x, (int, float)) and math.isfinite(x) for x in numbers
    ):
        return f"its reference holds a value that is not a finite number: {numbers}"
    needed = {"cell", "component", "layer", "positions", "estimate", "exact", "prompt"}
    if not needed <= set(frame.columns) or frame.empty:
        return f"its table lacks {sorted(needed - set(frame.columns)) or 'rows'}"
    finite = np.isfinite(frame["estimate"].to_numpy(dtype=float)).all()
    return None if finite else "its estimates hold a value that is not a finite number"


def _verify(value: Any) -> int | str | None:
    if value is None or value == "all":
        return "all"
    if str(value).isdigit() and int(value) > 0:
        return int(value)
    raise ExperimentError(f"--verify takes 'all' or a number of cells >= 1, got {value!r}.")


def report(
    spec: ExperimentSpec,
    tables: Mapping[str, Any],
    out: str | os.PathLike,
    *,
    label: str,
    command: str | None = None,
    notes: Sequence[str] = (),
    png: bool = True,
) -> ExperimentReport:
    """Write the tables, the heatmaps and the recovery curve, and ``summary.md``."""
    out = Path(out)
    results, agreement = tables["results"], tables["agreement"]
    files = [
        write_table(results, out / "results.csv"),
        write_table(tables["references"], out / "references.csv"),
        write_table(agreement, out / "agreement.csv"),
        write_table(tables["minimal_graft"], out / "minimal_graft.csv"),
        write_table(tables["recovery"], out / "recovery.csv"),
        write_table(tables["search"], out / "search.csv"),
    ]
    written = ExperimentReport(agreement, files)
    caption = figure_caption(label, results)  # the setting, without a cache's hash
    figures = {}
    for prompt, frame in results.groupby("prompt", sort=False):
        for value, stem in (("estimate", "attribution"), ("exact", "exact")):
            if value == "exact" and frame["exact"].isna().all():
                continue
            figure = plots.plot_attribution(
                frame,
                value=value,
                title=f"The {value} of grafting each SFT cell into PRE ({prompt} prompt)",
            )
            figure.update_layout(title_subtitle_text=caption)
            figures[f"{stem}_{prompt}"] = written.save_figure(
                figure, out / f"{stem}_{prompt}", png=png
            )
    settings = dict(tables.get("settings", {}))
    figures["recovery"] = written.save_figure(
        plots.plot_recovery(
            tables["recovery"],
            fraction=settings.get("fraction"),
            title="The minimal graft's recovery of SFT's log P(answer)",
        ).update_layout(title_subtitle_text=caption),
        out / "recovery",
        png=png,
    )
    settings = report_settings(
        spec, label, command, notes, {**settings, "positions": list(POSITIONS)}
    )
    path = out / "summary.md"
    with writing("The summary", path):
        atomic_write(path, _markdown(tables, settings, figures).encode())
    written.files.append(path)
    return written


def _markdown(tables: Mapping[str, Any], settings: dict, figures: dict) -> str:
    results, references = tables["results"], tables["references"]
    lines = ["# Graft attribution", "", *markdown.fence(json.dumps(settings, indent=1), "json")]
    # Numbers only: nothing in them is Markdown, so table() shows them as they are.
    lines += ["", "## The metric: log P(answer) at the last token", ""]
    rows = [
        [r.prompt, r.n, f"{r.start_metric:.3f}", f"{r.all_cells_metric:.3f}"]
        for r in references.itertuples()
    ]
    lines += markdown.table(["prompt", "n", "PRE", "every cell grafted"], rows)
    agreement = tables["agreement"]
    if not agreement.empty:
        lines += ["", "## How well the estimates rank the exact effects", ""]
        header = ["prompt", "positions", "cells", "Spearman", "Pearson", "same sign"]
        rows = [
            [r.prompt, r.positions, r.cells]
            + [f"{r.spearman:.3f}", f"{r.pearson:.3f}", f"{r.sign_agreement:.0%}"]
            for r in agreement.itertuples()
        ]
        lines += markdown.table(header, rows)
    for prompt, frame in results.groupby("prompt", sort=False):
        ranked = frame.sort_values("estimate", ascending=False).head(10)
        heading = f"The ten cells with the largest estimates ({prompt} prompt)"
        lines += ["", f"## {markdown.escape(heading)}", ""]
        rows = [
            [r.cell, f"{r.estimate:+.3f}"]
            + ["" if pd.isna(r.exact) else f"{r.exact:+.3f} ± {r.exact_se:.3f}"]
            for r in ranked.itertuples()
        ]
        lines += markdown.table(["cell", "estimate", "exact"], rows)
    curve = tables["recovery"]
    lines += ["", "## The minimal graft", ""]
    lines += [
        markdown.escape(
            f"Cells added in blocks of the best-estimated until the graft recovers "
            f"{settings.get('fraction')} of the gap between PRE and SFT on the {PROMPTS[0]} "
            f"prompts (reached: {settings.get('reached')}), then dropped while it still does, "
            f"until none can be (1-minimal); recovery on the {PROMPTS[1]} prompts held out."
        ),
        "",
    ]
    search = curve[curve.prompts == "search"].set_index("cells")
    held = curve[curve.prompts == "held_out"].set_index("cells")
    rows = []
    for cells, row in search.iterrows():
        # + 0.0 turns a -0.0 (the empty graft, to rounding) into 0.0.
        other = f"{held.loc[cells, 'recovery'] + 0.0:.1%}" if cells in held.index else ""
        rows.append([cells, row.cell, f"{row.recovery + 0.0:.1%}", other])
    lines += markdown.table(["cells", "cell added", "recovery", "held out"], rows)
    lines += ["", "## Figures", ""]
    lines += figure_lines(figures)
    return "\n".join(lines) + "\n"
