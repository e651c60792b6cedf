"""Reports of named experiments: tables, a markdown summary, the paper's figures.

:func:`write_experiment_report` is what ``grafting-lens run`` writes after a run:
``results.csv`` (one row per example and configuration), ``summary.csv`` (top-1 and
top-5 accuracy with 95% bootstrap intervals and the mean rank, grouped as the
experiment says), ``summary.md`` (the same table, the command that made it, notes on
the run, and what the paper reports next to it), and the experiment's figures as HTML
(and PNG where a Chrome is installed). Every file is written under a temporary name
and renamed into place.

The figure builders here draw the paper's figures from a summary:
:func:`accuracy_bars` (figures 2, 3a and 5) and :func:`component_heatmap` /
:func:`component_bars` (figure 4).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from grafting_lens import metrics, plots
from grafting_lens.experiments.configs import COMPONENT_LAYER_RANGES, COMPONENT_SETS
from grafting_lens.experiments.specs import ExperimentSpec, get_experiment
from grafting_lens.files import atomic_write

__all__ = [
    "ExperimentReport",
    "accuracy_bars",
    "component_bars",
    "component_figures",
    "component_heatmap",
    "figure_lines",
    "report_settings",
    "summary_markdown",
    "write_experiment_report",
    "write_report",
    "write_table",
]

_BASELINES = ("BASE", "DONOR")
_COLORS = qualitative.Plotly


@dataclass
class ExperimentReport:
    """What :func:`write_experiment_report` wrote.

    Attributes:
        summary: The summary table (also in ``summary.csv``).
        files: Every file written.
        problems: Lines a reader should see (a figure without its PNG, and why).
    """

    summary: pd.DataFrame
    files: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def save_figure(self, figure: go.Figure, path: Path, png: bool = True) -> dict[str, Any]:
        """Save a figure (see :func:`grafting_lens.plots.save_figure`) and note what was written."""
        saved = plots.save_figure(figure, path, png=png, warn=False)
        self.files.append(Path(saved["html"]))
        if saved["png"] is not None:
            self.files.append(Path(saved["png"]))
        elif saved["png_error"]:
            self.problems.append(f"No PNG: {path.name} ({saved['png_error']})")
        return saved


def report_settings(
    spec: ExperimentSpec,
    label: str,
    command: str | None,
    notes: Sequence[str],
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """What an experiment's ``summary.md`` records about its run, in the order it shows them.

    The experiment's title, the models, the command and the notes, then ``settings``
    (what ran), then the threads, Python and torch versions and the time of writing.
    """
    return {
        "title": spec.title,
        "models": label,
        "command": command,
        "notes": list(notes),
        **settings,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def figure_lines(figures: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One markdown line per saved figure: its HTML file, and its PNG or why there is none."""
    lines = []
    for written in figures.values():
        if written["png"]:
            png = Path(written["png"]).name
        else:
            png = f"no PNG: {written['png_error']}" if written["png_error"] else "HTML only"
        lines.append(f"- `{Path(written['html']).name}` ({png})")
    return lines


def write_experiment_report(
    experiment: str | ExperimentSpec,
    tables: Mapping[str, Any],
    out: str | os.PathLike,
    *,
    label: str,
    command: str | None = None,
    notes: Sequence[str] = (),
    png: bool = True,
) -> ExperimentReport:
    """Write a named experiment's tables, summary and figures into ``out``.

    Args:
        experiment: The experiment (its own ``report`` is used if it has one).
        tables: What the run returned; ``tables["results"]`` is summarized.
        out: The directory.
        label: The models in a few words, for titles.
        command: The command that made it, shown in ``summary.md``.
        notes: Lines listed under the table.
        png: Also export each figure as PNG.

    Returns:
        The summary, the files written and what a reader should know.
    """
    spec = get_experiment(experiment)
    if spec.report is not None:
        report: ExperimentReport = spec.report(
            spec, tables, out, label=label, command=command, notes=notes, png=png
        )
        return report
    results = tables["results"]
    summary = metrics.summarize(results, by=spec.summary_by, seed=0)
    markdown = summary_markdown(summary, spec.title, command, notes, spec.paper)
    report = ExperimentReport(summary, write_report(out, results, summary, markdown))
    for figure in spec.figures:
        rows = summary if figure.part is None else summary[summary.part == figure.part]
        if not rows.empty:
            report.save_figure(figure.draw(rows, label), Path(out) / figure.name, png=png)
    return report


def summary_markdown(
    summary: pd.DataFrame,
    title: str,
    command: str | None = None,
    notes: Sequence[str] = (),
    paper: Sequence[str] = (),
) -> str:
    """A short markdown report: the summary table (top-1, top-5 with intervals, mean rank).

    Args:
        summary: From :func:`grafting_lens.metrics.summarize`.
        title: The heading.
        command: The command that made it, shown verbatim.
        notes: Lines to list under the table.
        paper: What the paper reports, listed for comparison.
    """
    group_columns = [
        c for c in summary.columns if c != "n" and not c.startswith(("top", "mean_rank"))
    ]
    header = [*group_columns, "n", "top-1", "top-5 [95% CI]", "mean rank"]
    lines = [f"# {title}", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in summary.iterrows():
        cells = [str(row[c]) for c in group_columns]
        top5 = f"{row['top5']:.0%} [{row['top5_low']:.0%}, {row['top5_high']:.0%}]"
        cells += [
            str(int(row["n"])),
            f"{row['top1']:.0%}" if "top1" in row else "",
            top5 if "top5" in row else "",
            f"{row['mean_rank']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", *[f"- {note}" for note in notes]]
    if paper:
        lines += ["", "What the paper reports:", "", *[f"- {line}" for line in paper]]
    return "\n".join(lines) + "\n"


def write_table(frame: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write a DataFrame as CSV under a temporary name, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, frame.to_csv(index=False).encode())
    return path


def write_report(
    out: str | os.PathLike, results: pd.DataFrame, summary: pd.DataFrame, markdown: str
) -> list[Path]:
    """Write ``results.csv``, ``summary.csv`` and ``summary.md`` into ``out``, each atomically."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_table(results, out / "results.csv"), write_table(summary, out / "summary.csv")]
    path = out / "summary.md"
    atomic_write(path, markdown.encode())
    return [*written, path]


# ----------------------------------------------------------------------------- figures


def accuracy_bars(title: str, k: int = 5) -> Callable[[pd.DataFrame, str], go.Figure]:
    """A figure builder: top-``k`` bars per configuration and prompt, titled ``title (label)``."""

    def draw(summary: pd.DataFrame, label: str) -> go.Figure:
        return plots.plot_accuracy(summary, k=k, title=f"{title}, top-{k} accuracy ({label})")

    return draw


def component_heatmap(summary: pd.DataFrame, title: str, k: int = 5) -> go.Figure:
    """Top-k accuracy per layer range (rows) and component set (columns), one panel per prompt."""
    grid = summary[~summary.component_set.isin(_BASELINES)]
    prompts = list(dict.fromkeys(grid.prompt))
    figure = make_subplots(
        rows=1, cols=len(prompts), subplot_titles=prompts, horizontal_spacing=0.12
    )
    for column, prompt in enumerate(prompts, start=1):
        values = grid[grid.prompt == prompt].pivot(
            index="layer_range", columns="component_set", values=f"top{k}"
        )
        rows = [r for r in COMPONENT_LAYER_RANGES if r in values.index]
        columns = [c for c in COMPONENT_SETS if c in values.columns]
        values = values.loc[rows, columns]
        baselines = summary[(summary.prompt == prompt) & summary.component_set.isin(_BASELINES)]
        frame = ", ".join(f"{r.component_set} {r[f'top{k}']:.0%}" for _, r in baselines.iterrows())
        figure.add_trace(
            go.Heatmap(
                z=values.to_numpy(),
                x=columns,
                y=rows,
                zmin=0,
                zmax=1,
                colorscale="Blues",
                text=[[f"{v:.0%}" for v in row] for row in values.to_numpy()],
                texttemplate="%{text}",
                showscale=column == len(prompts),
                colorbar=dict(title=f"top-{k}", tickformat=".0%"),
                hovertemplate="%{y}, %{x}: %{z:.1%}<extra>" + prompt + "</extra>",
            ),
            row=1,
            col=column,
        )
        figure.layout.annotations[column - 1].text = f"{prompt} ({frame})"
        figure.update_yaxes(autorange="reversed", row=1, col=column)
    figure.update_layout(
        title=f"{title}: top-{k} accuracy",
        template="plotly_white",
        width=560 * len(prompts) + 120,
    )
    return figure


def component_bars(summary: pd.DataFrame, title: str, k: int = 5) -> go.Figure:
    """Bars with 95% intervals, one panel per prompt: a group per component set, a bar per layer
    range; dotted lines mark BASE (nothing grafted) and DONOR (the donor everywhere)."""
    prompts = list(dict.fromkeys(summary.prompt))
    figure = make_subplots(rows=len(prompts), cols=1, subplot_titles=prompts, vertical_spacing=0.12)
    for row, prompt in enumerate(prompts, start=1):
        rows = summary[summary.prompt == prompt]
        panel = plots.plot_accuracy(
            rows[~rows.component_set.isin(_BASELINES)],
            k=k,
            x="component_set",
            color="layer_range",
        )
        for trace in panel.data:
            # One colour per layer range in every panel.
            position = list(COMPONENT_LAYER_RANGES).index(trace.name)
            trace.marker.color = _COLORS[position % len(_COLORS)]
            trace.showlegend = row == 1
            trace.legendgroup = trace.name
            figure.add_trace(trace, row=row, col=1)
        for _, baseline in rows[rows.component_set.isin(_BASELINES)].iterrows():
            figure.add_hline(
                y=baseline[f"top{k}"],
                line_dash="dot",
                row=row,
                col=1,
                annotation_text=f"{baseline.component_set} {baseline[f'top{k}']:.0%}",
                annotation_position="top right",
            )
        figure.update_yaxes(
            range=[0, 1.05], tickformat=".0%", title_text=f"top-{k}", row=row, col=1
        )
    figure.update_layout(
        barmode="group",
        template="plotly_white",
        title=f"{title}: top-{k} accuracy",
        legend_title_text="layer range",
        width=1300,
        height=420 * len(prompts),
    )
    return figure


def component_figures(title: str) -> tuple[Callable[[pd.DataFrame, str], go.Figure], ...]:
    """Figure 4's two figures for an experiment titled ``title``: the heatmap and the bars."""

    def heatmap(summary: pd.DataFrame, label: str) -> go.Figure:
        return component_heatmap(summary, f"{title}, {label}")

    def bars(summary: pd.DataFrame, label: str) -> go.Figure:
        return component_bars(summary, f"{title}, {label}")

    return heatmap, bars
