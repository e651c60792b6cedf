"""The grafting-versus-patching experiment: both methods, layer by layer, on the same prompts.

For each position set x component pair x layer, PRE runs with SFT's weights grafted in and
with SFT's activations patched in (:mod:`grafting_lens.analysis.comparison`), on both test
prompts, beside each checkpoint's own scores and the readout ceiling. Registered as
``patching_vs_grafting``; its report writes ``results.csv``, ``references.csv``,
``summary.csv``, ``references_summary.csv``, ``summary.md`` and, per direction,
``top5_<direction>`` and ``prob_<direction>`` figures.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from grafting_lens.analysis import plots
from grafting_lens.analysis.batch import TokenizedExamples
from grafting_lens.analysis.comparison import (
    DEFAULT_PAIRS,
    STREAM_PAIR,
    compare_graft_and_patch,
    reference_scores,
    summarize_comparison,
)
from grafting_lens.core import ranks
from grafting_lens.core.files import atomic_write, writing
from grafting_lens.models.model_set import ModelSet
from grafting_lens.study import markdown
from grafting_lens.study.markdown import Markup
from grafting_lens.study.report import (
    ExperimentReport,
    figure_caption,
    figure_lines,
    interval_text,
    report_settings,
    write_table,
)
from grafting_lens.study.runner import ChunkInfo, RunOptions
from grafting_lens.study.semantics import CLEAN
from grafting_lens.study.specs import QUICK_RELATIONS, ExperimentSetup, ExperimentSpec
from grafting_lens.study.testsets import library_batches

__all__ = ["PAIRS", "POSITIONS", "PROMPTS", "READOUT", "readout_ceiling", "report", "run"]

PROMPTS = ("headline", "qa")
"""The test prompts it asks."""

POSITIONS = ("LT", "FE", "FE+LT")
"""Where it grafts and patches."""

PAIRS = (*DEFAULT_PAIRS, STREAM_PAIR)
"""What it compares at each layer."""

READOUT = "SFT stream, PRE readout"
"""The reference that keeps PRE's final norm and unembedding, as every intervention does."""

DIRECTIONS = ("sufficiency", "necessity")
"""Both directions by default; a quick run asks the first only."""


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
    """Graft and patch every configuration on both prompts, in each direction asked.

    ``extras``: ``directions`` (default both; a quick run: sufficiency only) and
    ``rows_per_forward`` (default 512). Inside :func:`~grafting_lens.core.ranks.shared_ranks`
    the comparisons are shared by the ranks.

    Returns:
        ``{"results": one row per example, configuration and method, "references":
        each checkpoint's own scores and the readout ceiling, "settings": what ran}``.
    """
    del spec, out, on_chunk  # a comparison runs in memory
    models = setup.models
    directions = list(dict.fromkeys(extras.get("directions") or DIRECTIONS))
    if quick:
        directions = ["sufficiency"]
    count = QUICK_RELATIONS if quick else n_examples
    batches = library_batches(setup.relations, models.tokenizer, PROMPTS, count)
    # Each prompt's comparisons, then its references: shared by ranks as ranks.spread shares.
    units = [(p, d) for p in PROMPTS for d in directions] + [(p, None) for p in PROMPTS]
    sweep: dict[str, Any] = dict(batch_size=options.batch_size, progress=options.progress)
    sweep.update(rows_per_forward=extras.get("rows_per_forward") or 512)

    def compute(number: int) -> pd.DataFrame:
        prompt, direction = units[number]
        batch = batches[prompt]
        if direction is None:
            scores = reference_scores(models, batch, sources=[0, 1])
            return pd.concat([scores, readout_ceiling(models, batch)], ignore_index=True)
        return compare_graft_and_patch(
            models, batch, POSITIONS, "all", PAIRS, direction=direction, **sweep
        )

    computed = ranks.spread("patching_vs_grafting", {"prompts": batches}, len(units), compute)
    tables, references = computed[: -len(PROMPTS)], computed[-len(PROMPTS) :]
    settings = {
        "examples": {prompt: len(batch) for prompt, batch in batches.items()},
        "dropped": {prompt: len(batch.dropped) for prompt, batch in batches.items()},
        "directions": directions,
        "quick": quick,
    }
    results = pd.concat(tables, ignore_index=True)
    # Tokenized and scored the library's way (the paper's code has no patching to follow).
    results.insert(results.columns.get_loc("text") + 1, "semantics", CLEAN.label)
    return {
        "results": results,
        "references": pd.concat(references, ignore_index=True),
        "settings": settings,
    }


def readout_ceiling(models: ModelSet, batch: TokenizedExamples) -> pd.DataFrame:
    """SFT's final residual stream read out by PRE's final norm and unembedding: the most an
    intervention that keeps PRE's readout can reach (the graft of every block everywhere)."""
    rows = compare_graft_and_patch(
        models,
        batch,
        positions={"all": batch.attention_mask.bool()},
        layers=-1,
        pairs=[STREAM_PAIR],
        methods="graft",
        progress=False,
    )
    columns = ["example", "relation_id", "prompt", "target_rank", "target_prob", "top1", "top5"]
    return rows[columns].assign(model=READOUT, source=None)


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
    """Write the comparison's tables, summaries, figures and ``summary.md``."""
    out = Path(out)
    results, references = tables["results"], tables["references"]
    settings = dict(tables.get("settings", {}))
    by = ("direction", "prompt", "positions", "pair", "method", "layer")
    summary = summarize_comparison(results, by=by)
    reference_summary = summarize_comparison(references, by=("prompt", "model"))
    written_tables = {
        "results": results,
        "references": references,
        "summary": summary,
        "references_summary": reference_summary,
    }
    files = [write_table(table, out / f"{name}.csv") for name, table in written_tables.items()]
    written = ExperimentReport(summary, files)
    figures = {}
    for direction in dict.fromkeys(summary.direction):
        panel = summary[summary.direction == direction]
        for value, stem in (("top5", "top5"), ("target_prob", "prob")):
            figure = plots.plot_comparison(
                panel,
                value=value,
                row=("prompt", "positions"),
                col="pair",
                references=reference_summary,
                title=f"Grafting vs patching SFT into PRE ({direction})",
                caption=figure_caption(label, results),
            )
            name = f"{stem}_{direction}"
            figures[name] = written.save_figure(figure, out / name, png=png)
    settings = report_settings(
        spec,
        label,
        command,
        notes,
        {
            **settings,
            "positions": list(POSITIONS),
            "pairs": [
                {"name": p.name, "graft": p.components, "patch": p.site, "cumulative": p.cumulative}
                for p in PAIRS
            ],
        },
    )
    path = out / "summary.md"
    with writing("The summary", path):
        atomic_write(path, _markdown(summary, reference_summary, settings, figures).encode())
    written.files.append(path)
    return written


def _markdown(
    summary: pd.DataFrame, references: pd.DataFrame, settings: dict, figures: dict
) -> str:
    """Top-5 accuracy (and answer probability) per layer, graft next to patch, per table."""
    lines = ["# Patching vs grafting", "", *markdown.fence(json.dumps(settings, indent=1), "json")]
    lines += ["", "## References (no intervention)", ""]
    rows = [
        [row.prompt, row.model, row.n, Markup(interval_text(row, "top5"))]
        + [Markup(interval_text(row, "target_prob", ".3f"))]
        for _, row in references.iterrows()
    ]
    lines += markdown.table(["prompt", "model", "n", "top-5", "P(answer)"], rows)
    groups = summary.groupby(["direction", "prompt", "positions"], sort=False)
    for (direction, prompt, positions), group in groups:
        heading = f"{direction}, {prompt} prompt, positions {positions}"
        lines += ["", f"## {markdown.escape(heading)}", ""]
        lines += ["Top-5 accuracy [95% bootstrap CI]; mean P(answer) in parentheses.", ""]
        pairs = list(dict.fromkeys(group.pair))
        methods = ("graft", "patch")
        header = ["layer"] + [f"{pair}: {method}" for pair in pairs for method in methods]
        rows = []
        for layer in sorted(group.layer.unique()):
            cells: list[object] = [layer]
            for pair in pairs:
                for method in methods:
                    chosen = (group.pair == pair) & (group.method == method)
                    match = group[chosen & (group.layer == layer)]
                    if match.empty:
                        cells.append("")
                        continue
                    row = match.iloc[0]
                    cells.append(Markup(f"{interval_text(row, 'top5')} ({row.target_prob:.3f})"))
            rows.append(cells)
        lines += markdown.table(header, rows)
    lines += ["", "## Figures", ""]
    lines += figure_lines(figures)
    return "\n".join(lines) + "\n"
