"""Reports of named experiments: tables, a markdown summary, the paper's figures.

:func:`write_experiment_report` writes ``results.csv``, ``summary.csv`` (top-k with 95%
bootstrap intervals, the mean rank), ``summary.md`` and the experiment's figures, each
renamed into place; ``report.json`` names the one run a report directory holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
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

from grafting_lens.analysis import figure_style, metrics, plots
from grafting_lens.core.errors import RunError
from grafting_lens.core.files import DirectoryLock, atomic_write, writing
from grafting_lens.study import markdown
from grafting_lens.study.configs import COMPONENT_LAYER_RANGES, COMPONENT_SETS
from grafting_lens.study.run_directory import describe_differences
from grafting_lens.study.semantics import as_semantics
from grafting_lens.study.specs import ExperimentSpec, get_experiment

__all__ = [
    "REPORT_MANIFEST",
    "ExperimentReport",
    "accuracy_bars",
    "component_bars",
    "component_figures",
    "component_heatmap",
    "figure_caption",
    "interval_text",
    "mean_rank_bars",
    "prepare_report_directory",
    "figure_lines",
    "report_settings",
    "summary_markdown",
    "summary_table",
    "write_experiment_report",
    "write_report",
    "write_table",
]

REPORT_MANIFEST = "report.json"
"""The file in a report directory that says which run wrote it and lists its files."""

_REPORT_TABLES = ("results.csv", "summary.csv", "summary.md")
"""Files that mark a directory as holding a report, with or without ``report.json``."""

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
        """Save a figure (:func:`~grafting_lens.analysis.figure_style.save_figure`), noting it."""
        saved = figure_style.save_figure(figure, path, png=png, warn=False)
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
    """What an experiment's ``summary.md`` records about its run, in order: title, models,
    command, notes, then ``settings``, then threads, Python and torch versions and the time."""
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
        lines.append(f"- {markdown.code(Path(written['html']).name)} ({markdown.escape(png)})")
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
    fingerprint: str | None = None,
    overwrite: bool = False,
) -> ExperimentReport:
    """Write a named experiment's tables, summary and figures into ``out``, which holds
    one run's report (see :func:`prepare_report_directory`); a rewrite of the same run's
    report deletes what the new one no longer writes (a PNG from before ``--no-png``).

    Args:
        experiment: The experiment (its own ``report`` is used if it has one).
        tables: What the run returned; ``tables["results"]`` is summarized.
        out: The directory.
        label: The models in a few words, for titles.
        command: The command that made it, shown in ``summary.md``.
        notes: Lines listed under the table.
        png: Also export each figure as PNG.
        fingerprint: What makes the run this run (default: a hash of the experiment's
            name and of ``tables``).
        overwrite: Replace the report of another run.

    Returns:
        The summary, the files written and what a reader should know.

    Raises:
        RunError: ``out`` holds another run's report (and no ``overwrite``), is an empty
            path, or another process is writing into it.
    """
    spec = get_experiment(experiment)
    out = _report_path(out)
    if fingerprint is None:
        fingerprint = _tables_fingerprint(spec.name, tables)
    with DirectoryLock(out, "The report directory"):
        before = prepare_report_directory(
            out, spec.name, fingerprint, command=command, overwrite=overwrite
        )
        if spec.report is not None:
            report: ExperimentReport = spec.report(
                spec, tables, out, label=label, command=command, notes=notes, png=png
            )
        else:
            results = tables["results"]
            summary = metrics.summarize(results, by=spec.summary_by, seed=0)
            markdown = summary_markdown(summary, spec.title, command, notes, spec.paper)
            report = ExperimentReport(summary, write_report(out, results, summary, markdown))
            caption = figure_caption(label, results)
            for figure in spec.figures:
                rows = summary if figure.part is None else summary[summary.part == figure.part]
                if not rows.empty:
                    report.save_figure(figure.draw(rows, caption), out / figure.name, png=png)
            for column in (c for c in metrics.AVERAGED if c in summary):  # a score's own
                drawn = plots.plot_score(summary, column, title=f"{spec.title}: {column}")
                report.save_figure(drawn, out / f"{spec.name}_{column}", png=png)
        _finish_report(out, before, report.files)
    return report


def prepare_report_directory(
    out: str | os.PathLike,
    experiment: str,
    fingerprint: str,
    *,
    description: Mapping[str, Any] | None = None,
    command: str | None = None,
    overwrite: bool = False,
    runs: bool = False,
) -> dict[str, Any]:
    """Make ``out`` ready for the report of the run ``fingerprint``, before the run starts.

    A directory holding the same run's report is left as it is (the run resumes). One
    holding another run's (``report.json`` with another fingerprint, or, without one,
    ``results.csv`` or a summary) is refused, or with ``overwrite`` cleared: the files the
    old report lists (or its tables and figures) and its ``runs/``. Then ``report.json``
    names this run.

    Args:
        out: The report directory (created if needed).
        experiment: The experiment's name.
        fingerprint: What makes the run this run.
        description: What the fingerprint is a hash of, JSON-ready (a refusal says what
            differs).
        command: The command that runs it.
        overwrite: Clear another run's report instead of refusing.
        runs: The run keeps its resumable run directories in ``out/runs``.

    Returns:
        ``report.json`` as it is now.

    Raises:
        RunError: Another run's report and no ``overwrite``; a run directory under
            ``runs/`` that another process is writing; ``out`` cannot be written.
    """
    out = _report_path(out)
    with DirectoryLock(out, "The report directory"):
        _check_table_places(out)
        manifest = _read_report_manifest(out)
        if manifest is not None and manifest.get("fingerprint") == fingerprint:
            return manifest
        found = _report_files(out, manifest)
        if found:
            if not overwrite:
                raise RunError(_another_report(out, manifest, experiment, description, found))
            _clear_report(out, found)
        manifest = {
            "format": 1,
            "experiment": experiment,
            "fingerprint": fingerprint,
            "description": dict(description or {}),
            "command": command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "runs": bool(runs),
            "files": [],
        }
        _write_report_manifest(out, manifest)
        return manifest


def _check_table_places(out: Path) -> None:
    """Refuse, before the run, anything but a file where a table goes (its rename would fail)."""
    for name in (*_REPORT_TABLES, REPORT_MANIFEST):
        path = out / name
        if path.is_symlink() or (path.exists() and not path.is_file()):
            kind = "a link" if path.is_symlink() else "a directory"
            raise RunError(
                f"{path} is {kind} where the report writes its file {name}. Remove or rename "
                "it, or choose another output directory."
            )


def _report_path(out: str | os.PathLike) -> Path:
    if not str(out).strip():
        raise RunError(
            "The report directory is an empty path (it would be the working directory); name "
            "a directory."
        )
    return Path(out).expanduser()


def _tables_fingerprint(experiment: str, tables: Mapping[str, Any]) -> str:
    """A hash of an experiment's name and of what its run returned."""
    digest = hashlib.sha256(experiment.encode())
    for name in sorted(tables):
        value = tables[name]
        text = (
            value.to_csv(index=False)
            if isinstance(value, pd.DataFrame)
            else json.dumps(value, sort_keys=True, default=str)
        )
        digest.update(f"\n{name}\n{text}".encode())
    return digest.hexdigest()[:20]


def _read_report_manifest(out: Path) -> dict[str, Any] | None:
    """``report.json``, ``None`` without one; an unreadable one reads as an unknown run's."""
    path = out / REPORT_MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", []), list):
        return {"fingerprint": None, "unreadable": True}
    return manifest


def _write_report_manifest(out: Path, manifest: Mapping[str, Any]) -> None:
    with writing("The report directory's", out / REPORT_MANIFEST):
        atomic_write(out / REPORT_MANIFEST, json.dumps(manifest, indent=1).encode())


_REPORT_SUFFIXES = (".csv", ".md", ".html", ".png")
"""What a report writes: tables, a summary and figures, directly in its directory."""


def _report_file(out: Path, name: object) -> Path | None:
    """The file ``name`` of the report in ``out``, if it exists. ``report.json`` may come from
    anywhere, so a name is refused unless it is a plain file name with a report's suffix and
    the path a regular file (not a link) in ``out``."""
    path = None
    if isinstance(name, str) and name not in ("", ".", "..") and "\\" not in name:
        if Path(name).name == name and Path(name).suffix in _REPORT_SUFFIXES:
            path = out / name
    if path is not None and not path.is_symlink() and (path.is_file() or not path.exists()):
        return path if path.exists() else None
    raise RunError(
        f"{out / REPORT_MANIFEST} lists {name!r} as a file of its report, which is not a file a "
        f"report writes (a {', '.join(_REPORT_SUFFIXES)} file directly in {out}, not a link or a "
        f"directory): it was edited or damaged, and grafting-lens deletes nothing else. Delete "
        f"{out / REPORT_MANIFEST} (and what you do not want kept), or choose another directory."
    )


def _report_runs(out: Path) -> Path | None:
    """``out/runs`` if it is a real directory; refused if it is a link (never followed)."""
    runs = out / "runs"
    if runs.is_symlink():
        raise RunError(
            f"{runs} is a symbolic link; grafting-lens keeps its run directories in a runs/ it "
            "makes itself and never deletes through a link. Remove the link, or choose another "
            "output directory."
        )
    return runs if runs.is_dir() else None


def _report_files(out: Path, manifest: Mapping[str, Any] | None) -> list[Path]:
    """What a report in ``out`` consists of: its listed files, or its tables and figures."""
    listed = (manifest or {}).get("files")  # a list, as _read_report_manifest checked
    found: list[Path | None] = []
    if listed is not None:
        found = [_report_file(out, name) for name in listed]
    elif manifest is not None or any((out / name).exists() for name in _REPORT_TABLES):
        # A report without a list: an unreadable report.json, or an older grafting-lens's
        # (its tables, then its figures beside them; figures alone may be the user's own).
        tables = (*_REPORT_TABLES, "references.csv", "references_summary.csv")
        found = [
            path
            for path in sorted(out.iterdir())
            if path.is_file()
            and not path.is_symlink()
            and (path.name in tables or path.suffix in (".html", ".png"))
        ]
    if listed is None or (manifest or {}).get("runs"):
        found.append(_report_runs(out))
    found.append(None if manifest is None else out / REPORT_MANIFEST)
    return [path for path in found if path is not None]


def _another_report(
    out: Path,
    manifest: Mapping[str, Any] | None,
    experiment: str,
    description: Mapping[str, Any] | None,
    found: Sequence[Path],
) -> str:
    names = ", ".join(path.name for path in found[:6]) + (" ..." if len(found) > 6 else "")
    if manifest is None:
        what = "the report of a run that left no report.json (an older grafting-lens?)"
    elif manifest.get("unreadable"):
        what = "a report whose report.json cannot be read, so which run wrote it is unknown"
    else:
        what = f"the report of another run ({manifest.get('experiment')}"
        if manifest.get("command"):
            what += f", `{manifest['command']}`"
        if manifest.get("started"):
            what += f", started {manifest['started']}"
        what += ")"
        old = manifest.get("description") or {}
        if description and old:
            what += f"; it differs in {describe_differences(old, description)}"
        elif manifest.get("experiment") not in (None, experiment):
            what += f"; this is {experiment}"
    return (
        f"{out} holds {what}: {names}. Writing this run's results there would mix two runs' "
        "files. Pass another output directory, or --overwrite (overwrite=True) to delete that "
        "report, its figures and its runs/ first."
    )


def _clear_report(out: Path, found: Sequence[Path]) -> None:
    """Delete another run's report: files, figures and run directories, none of whose runs
    another process is writing (every one checked, and held, before anything goes)."""
    with contextlib.ExitStack() as held:
        for path in (p for p in found if p.is_dir()):
            for run in sorted(p for p in path.iterdir() if p.is_dir()):
                held.enter_context(DirectoryLock(run, "The run directory"))
        for path in found:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _finish_report(out: Path, before: Mapping[str, Any], files: Sequence[Path]) -> None:
    """List the files of the report in ``report.json``; delete those the report no longer has."""
    written = [str(Path(path).relative_to(out)) for path in files]
    stale = [name for name in before.get("files", []) if name not in written]
    for path in [_report_file(out, name) for name in stale]:  # all checked, then deleted
        if path is not None:
            path.unlink(missing_ok=True)
    _write_report_manifest(
        out, {**before, "files": written, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    )


def summary_table(summary: pd.DataFrame) -> pd.DataFrame:
    """A summary as a reader sees it: each top-k as ``"40% [31%, 50%]"``, the mean rank
    with one decimal (0 = the top token), every number rounded; a group of fewer than
    :data:`~grafting_lens.analysis.metrics.MIN_INTERVAL_ROWS` rows shows no interval
    (``"100% (no interval, n < 10)"``).

    Args:
        summary: From :func:`grafting_lens.analysis.metrics.summarize`.
    """
    scores = [c for c in metrics.AVERAGED if c in summary]
    numbers = ("top", "mean_rank", *scores)
    groups = [c for c in summary.columns if c != "n" and not c.startswith(numbers)]
    ks = [c for c in summary.columns if re.fullmatch(r"top\d+", c)]
    rows = []
    for _, row in summary.iterrows():
        cells = {column: row[column] for column in groups}
        if "n" in row:
            cells["n"] = int(row["n"])
        for column in ks:
            cells[f"top-{column[3:]}"] = interval_text(row, column)
        if "mean_rank" in row:
            cells["mean rank"] = interval_text(row, "mean_rank", ",.1f")
        for column in scores:
            cells[column] = interval_text(row, column, ".0%" if column == "kl_recovered" else ".3f")
        rows.append(cells)
    return pd.DataFrame(rows, index=summary.index)


def interval_text(row: pd.Series, column: str, number: str = ".0%") -> str:
    """A summary row's ``column`` with its 95% interval, as :func:`summary_table` shows it."""
    value = format(row[column], number)
    if f"{column}_low" not in row or pd.isna(row[f"{column}_low"]):
        return value
    if "n" in row and int(row["n"]) < metrics.MIN_INTERVAL_ROWS:
        return f"{value} (no interval, n < {metrics.MIN_INTERVAL_ROWS})"
    return (
        f"{value} [{format(row[column + '_low'], number)}, {format(row[column + '_high'], number)}]"
    )


def summary_markdown(
    summary: pd.DataFrame,
    title: str,
    command: str | None = None,
    notes: Sequence[str] = (),
    paper: Sequence[str] = (),
) -> str:
    """A short markdown report: the summary table (see :func:`summary_table`).

    Args:
        summary: From :func:`grafting_lens.analysis.metrics.summarize`.
        title: The heading.
        command: The command that made it, shown verbatim.
        notes: Lines to list under the table.
        paper: What the paper reports, listed for comparison.
    """
    shown = summary_table(summary)
    # The grouping columns hold the run's names (prompts, configurations, datasets);
    # the other cells are numbers formatted above.
    named = [c for c in shown.columns if c in summary.columns and c != "n"]
    rows = [
        [cell if column in named else markdown.Markup(cell) for column, cell in row.items()]
        for _, row in shown.iterrows()
    ]
    lines = [f"# {markdown.escape(title)}", ""]
    if command:
        lines += [*markdown.fence(command), ""]
    lines += ["Intervals: 95% bootstrap; mean rank: 0 = the top token.", ""]
    lines += markdown.table(list(shown.columns), rows)
    if notes:
        lines += ["", *[f"- {markdown.escape(note)}" for note in notes]]
    if paper:
        lines += ["", "What the paper reports:", ""]
        lines += [f"- {markdown.escape(line)}" for line in paper]
    return "\n".join(lines) + "\n"


def write_table(frame: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write a DataFrame as CSV under a temporary name, then rename it into place.

    Raises:
        RunError: The file cannot be written (a full disk, a directory in its place...).
    """
    path = Path(path)
    with writing("The table", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, frame.to_csv(index=False).encode())
    return path


def write_report(
    out: str | os.PathLike, results: pd.DataFrame, summary: pd.DataFrame, markdown: str
) -> list[Path]:
    """Write ``results.csv``, ``summary.csv`` and ``summary.md`` into ``out``, each atomically.

    Raises:
        RunError: A file cannot be written (a full disk, a directory in its place...).
    """
    out = Path(out)
    with writing("The report directory", out):
        out.mkdir(parents=True, exist_ok=True)
    written = [write_table(results, out / "results.csv"), write_table(summary, out / "summary.csv")]
    path = out / "summary.md"
    with writing("The summary", path):
        atomic_write(path, markdown.encode())
    return [*written, path]


# ----------------------------------------------------------------------------- figures


_UNEMBEDDINGS = {
    "base": "grafted positions decoded by the base's unembedding",
    "donor": "grafted positions decoded by the donor's unembedding",
    "follow_embed": "the donor's unembedding where the embedding is grafted",
}


def figure_caption(label: str, results: pd.DataFrame | None = None) -> str:
    """The setting a figure shows, for its subtitle: the models, the semantics, which
    unembedding decodes a grafted position, and the prompts' wording.

    Args:
        label: The models in a few words (``"toy world 3f2a..."``; a hexadecimal hash in it
            is left out).
        results: The run's rows; their ``semantics`` column says the rest.
    """
    parts = [re.sub(r"\s*\b[0-9a-f]{12,}\b", "", label).strip()]
    if results is not None and "semantics" in results.columns:
        for text in dict.fromkeys(results["semantics"].dropna().astype(str)):
            semantics = as_semantics(text)
            prompts = f"the {'code' if semantics.prompts == 'code' else 'library'}'s prompts"
            decoding = _UNEMBEDDINGS.get(semantics.unembed, semantics.unembed)
            parts.append(f"semantics {text}: {decoding}, {prompts}")
    return ", ".join(part for part in parts if part)


def accuracy_bars(title: str, k: int = 5) -> Callable[[pd.DataFrame, str], go.Figure]:
    """A figure builder: top-``k`` bars per configuration and prompt, titled ``title``, with
    the setting (see :func:`figure_caption`) under it."""
    heading = f"{title}: top-{k} accuracy"
    return lambda summary, caption: plots.plot_accuracy(
        summary, k=k, title=heading, caption=caption
    )


def mean_rank_bars(title: str) -> Callable[[pd.DataFrame, str], go.Figure]:
    """A figure builder: the answer's mean rank per configuration and prompt."""
    heading = f"{title}: mean rank"
    return lambda summary, caption: plots.plot_mean_rank(summary, title=heading, caption=caption)


def _panels(prompts: Sequence[str], spacing: float) -> go.Figure:
    """One panel per prompt, one above the other, each titled by its prompt."""
    titles = [figure_style.display_label(p) for p in prompts]
    return make_subplots(len(prompts), 1, subplot_titles=titles, vertical_spacing=spacing)


def _range_label(summary: pd.DataFrame, layer_range: str) -> str:
    """A layer range's name with the layers it grafted: ``"last half (8-17)"``."""
    label = figure_style.display_label(layer_range)
    if "layers" not in summary:
        return label
    numbers = list(dict.fromkeys(summary.loc[summary.layer_range == layer_range, "layers"]))
    return f"{label} ({' / '.join(map(str, numbers))})" if numbers else label


def component_heatmap(
    summary: pd.DataFrame, title: str, k: int = 5, caption: str | None = None
) -> go.Figure:
    """Top-k accuracy per layer range (rows) and component set (columns), one panel per prompt.

    The colour scale runs from 0 to just above the highest cell, so cells under 10% are not
    all white; each cell prints its value, each panel's title the BASE and DONOR references.
    """
    grid = summary[~summary.component_set.isin(_BASELINES)]
    prompts = list(dict.fromkeys(grid.prompt))
    # Panels one above the other: the figure keeps a page column's width (760 px), where
    # side by side panels would be shrunk until their cells' values are unreadable.
    figure = _panels(prompts, 0.18 if len(prompts) > 1 else 0.0)
    top = figure_style.axis_range(grid[f"top{k}"])[1]
    for column, prompt in enumerate(prompts, start=1):
        cells = grid[grid.prompt == prompt].pivot(index="layer_range", columns="component_set")
        rows = [r for r in COMPONENT_LAYER_RANGES if r in cells.index]
        columns = [c for c in COMPONENT_SETS if c in cells[f"top{k}"].columns]
        values = cells[f"top{k}"].loc[rows, columns].to_numpy(dtype=float)
        text = [[f"{v:.0%}" for v in row] for row in values]
        if f"top{k}_low" in cells and f"top{k}_high" in cells:
            low, high = (cells[f"top{k}_{side}"].loc[rows, columns] for side in ("low", "high"))
            # Each cell's 95% interval under its value: a heatmap has no whiskers, and a
            # reader compares cells a few points apart (NaN where too few rows for one).
            text = [
                [
                    cell if pd.isna(lo) else f"{cell}<br>[{lo:.0%}, {hi:.0%}]"
                    for cell, lo, hi in zip(*line)
                ]
                for line in zip(text, low.to_numpy(), high.to_numpy())
            ]
        baselines = summary[(summary.prompt == prompt) & summary.component_set.isin(_BASELINES)]
        frame = ", ".join(f"{r.component_set} {r[f'top{k}']:.0%}" for _, r in baselines.iterrows())
        figure.add_trace(
            go.Heatmap(
                z=values,
                x=[figure_style.display_label(c) for c in columns],
                y=[_range_label(grid, r) for r in rows],
                zmin=0,
                zmax=min(top, 1.0),
                colorscale="Blues",
                text=text,
                texttemplate="%{text}",
                showscale=column == len(prompts),
                colorbar=dict(title=f"top-{k}", tickformat=".0%"),
                hovertemplate="%{y}, %{x}: %{z:.1%}<extra>" + str(prompt) + "</extra>",
            ),
            row=column,
            col=1,
        )
        heading = f"{figure_style.display_label(prompt)} ({frame})"
        figure.layout.annotations[column - 1].text = heading
        figure.update_yaxes(autorange="reversed", title_text="layers", row=column, col=1)
        figure.update_xaxes(tickangle=-30, row=column, col=1)
    figure.update_xaxes(title_text="components grafted", row=len(prompts), col=1)
    counts = grid["n"].tolist() if "n" in grid else []
    return figure_style.figure_style(
        figure,
        f"{title}: top-{k} accuracy",
        figure_style.subtitle(caption, counts, interval=False).replace("per bar", "per cell")
        + ("; under each value its 95% bootstrap interval" if f"top{k}_low" in grid else ""),
        width=760,
        height=420 * len(prompts) + 160,
    )


def component_bars(
    summary: pd.DataFrame, title: str, k: int = 5, caption: str | None = None
) -> go.Figure:
    """Bars with 95% intervals, one panel per prompt: a group per component set, a bar per layer
    range; dotted lines mark BASE (nothing grafted) and DONOR (the donor everywhere), labelled
    in the right margin."""
    prompts = list(dict.fromkeys(summary.prompt))
    figure = _panels(prompts, 0.14)
    top = figure_style.axis_range([*summary[f"top{k}"], *summary[f"top{k}_high"]])
    for row, prompt in enumerate(prompts, start=1):
        rows = summary[summary.prompt == prompt]
        panel = plots.plot_accuracy(
            rows[~rows.component_set.isin(_BASELINES)], k=k, x="component_set", color="layer_range"
        )
        names = [figure_style.display_label(r) for r in COMPONENT_LAYER_RANGES]
        for trace in panel.data:
            # One colour per layer range in every panel; the legend names its layers.
            index = names.index(trace.name)
            name = _range_label(summary, COMPONENT_LAYER_RANGES[index])
            shade = _COLORS[index % len(_COLORS)]
            trace.update(name=name, legendgroup=name, showlegend=row == 1)
            trace.update(marker_color=shade, marker_line_color=shade)
            figure.add_trace(trace, row=row, col=1)
        figure.update_yaxes(range=top, tickformat=".0%", title_text=f"top-{k}", row=row, col=1)
        references = rows[rows.component_set.isin(_BASELINES)].sort_values(f"top{k}")
        for _, baseline in references.iterrows():
            y = float(baseline[f"top{k}"])
            # Labelled in the right margin; add_reference_line moves a label clear of a
            # close one and grows the axis to hold the line.
            figure_style.add_reference_line(
                figure, y, f"{baseline.component_set} {y:.0%}", row=row, col=1
            )
    figure.update_xaxes(title_text="components grafted at the last token", row=len(prompts))
    counts = summary["n"].tolist() if "n" in summary else []
    return figure_style.figure_style(
        figure,
        f"{title}: top-{k} accuracy",
        figure_style.subtitle(caption, counts),
        barmode="group",
        legend_title_text="layers",
        width=960,
        height=420 * len(prompts) + 80,
    )


def component_figures(title: str) -> tuple[Callable[[pd.DataFrame, str], go.Figure], ...]:
    """Figure 4's two figures for an experiment titled ``title``: the heatmap and the bars."""
    return (
        lambda summary, caption: component_heatmap(summary, title, caption=caption),
        lambda summary, caption: component_bars(summary, title, caption=caption),
    )
