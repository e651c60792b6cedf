"""Figures of grafting results, fit for a paper.

The paper's figures are grouped bar charts: one group per graft configuration (PRE, SFT,
FE, LT...), one bar per prompt, the height the top-5 accuracy (:func:`plot_accuracy`), with
bootstrap whiskers; :func:`plot_mean_rank` shows the rank, which still moves where accuracy
sits at the floor. The style and ``save_figure`` are :mod:`~grafting_lens.analysis.figure_style`'s.

Examples:
    >>> fig = plot_accuracy(metrics.summarize(results), k=5, caption="toy world, reference")
    >>> figure_style.save_figure(fig, "out/position_grafting")
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from grafting_lens.analysis.figure_style import (
    PALETTE,
    add_reference_line,
    axis_range,
    check_text,
    column_title,
    display_label,
    figure_style,
    subtitle,
)
from grafting_lens.analysis.metrics import MIN_INTERVAL_ROWS, column_names, summarize
from grafting_lens.core.arguments import check_table, is_integer, is_number, shown
from grafting_lens.core.errors import (
    ArgumentTypeError,
    GraftingLensError,
    SelectionError,
    check_known,
    refuse_first,
)

__all__ = [
    "plot_accuracy",
    "plot_attribution",
    "plot_comparison",
    "plot_directions",
    "plot_dose_response",
    "plot_mean_rank",
    "plot_graft",
    "plot_recovery",
    "plot_score",
]


def _check_table(table: Any, columns: Iterable[str], what: str, name: str = "summary") -> None:
    """Refuse anything but a non-empty DataFrame with ``columns``, argument ``name``."""
    check_table(table, name, f"a non-empty {what}")
    missing = [column for column in columns if column not in table.columns]
    if table.empty or missing:
        raise GraftingLensError(
            f"Expected {name}= a non-empty {what}; got a DataFrame lacking the columns {missing}."
        )


def _check_options(title: Any, caption: Any, **columns: Any) -> None:
    """Refuse a column argument that is no column's name, then a title or caption not text."""
    for name, column in columns.items():
        if not isinstance(column, str):
            raise ArgumentTypeError(
                f"{name}= must be the name of a column of the summary, got {shown(column)}."
            )
    check_text("title", title)
    check_text("caption", caption)


def _styled(fig: go.Figure, title: str, caption: str | None, summary: pd.DataFrame) -> go.Figure:
    """The house style, with the caption and the summary's ``n`` as the subtitle."""
    counts = summary["n"].tolist() if "n" in summary else []
    return figure_style(fig, title, subtitle(caption, counts))


def _whiskers(group: pd.DataFrame, value: str, **style: Any) -> dict[str, Any]:
    """Error bars to the interval's ends; none from too few rows (2 rows give no interval)."""
    few = group["n"] < MIN_INTERVAL_ROWS if "n" in group else pd.Series(False, index=group.index)
    return dict(
        type="data",
        symmetric=False,
        array=(group[f"{value}_high"] - group[value]).clip(lower=0).mask(few),
        arrayminus=(group[value] - group[f"{value}_low"]).clip(lower=0).mask(few),
        **style,
    )


def _bars(
    summary: pd.DataFrame, x: str, color: str, value: str, hover: str, extra: tuple[str, ...] = ()
) -> tuple[go.Figure, list[float]]:
    """Grouped bars of ``value`` with its interval, and every plotted end; ``hover`` (then
    ``n``) reads ``customdata``: the interval's ends, ``n``, then the ``extra`` columns."""
    categories = list(dict.fromkeys(summary[x].tolist()))
    low, high = f"{value}_low", f"{value}_high"
    fig = go.Figure()
    ends: list[float] = []
    for index, (name, group) in enumerate(summary.groupby(color, sort=False)):
        counts = group["n"] if "n" in group else pd.Series([None] * len(group), index=group.index)
        shade = PALETTE[index % len(PALETTE)]
        whiskers = _whiskers(group, value, color="#333", thickness=1.2, width=3)
        fig.add_trace(
            go.Bar(
                name=display_label(name),
                x=[display_label(v) for v in group[x]],
                y=group[value],
                # A bar of height 0 has no area; its outline still draws a line at 0.
                marker=dict(color=shade, line=dict(color=shade, width=1.5)),
                error_y=whiskers,
                customdata=list(zip(group[low], group[high], counts, *(group[c] for c in extra))),
                hovertemplate=(
                    f"{column_title(color)}: {display_label(name)}<br>{column_title(x)}: "
                    f"%{{x}}<br>{hover}<br>n = %{{customdata[2]}}<extra></extra>"
                ),
            )
        )
        ends += [*group[value], *(group[value] + whiskers["array"].fillna(0))]
    fig.update_layout(
        barmode="group",
        bargap=0.25,
        xaxis=dict(
            title=column_title(x),
            categoryorder="array",
            categoryarray=[display_label(c) for c in categories],
        ),
        legend_title_text=column_title(color),
    )
    return fig, ends


def plot_accuracy(
    summary: pd.DataFrame,
    k: int = 5,
    x: str = "config",
    color: str = "prompt",
    title: str | None = None,
    caption: str | None = None,
) -> go.Figure:
    """Grouped bar chart of top-k accuracy: groups along ``x``, one bar per ``color``.

    Args:
        summary: From :func:`grafting_lens.analysis.metrics.summarize`, with ``x``,
            ``color``, ``top{k}`` and its interval, and ``n``.
        k: Which top-k accuracy to plot (``summarize`` must have computed it).
        x: Column along the horizontal axis (its values in table order).
        color: Column giving one bar (and legend entry) per value in each group.
        title: Figure title (default: "Top-{k} accuracy"); ``caption``: the setting.

    Raises:
        ArgumentTypeError: ``k`` not an integer; ``x``, ``color``, ``title`` or ``caption``
            not a string.
        GraftingLensError: An empty table or missing columns.
    """
    if not is_integer(k):
        raise ArgumentTypeError(f"k= must be an integer (a top-k of the summary), got {shown(k)}.")
    k = int(k)  # a torch k would read 'toptensor(5)'
    _check_options(title, caption, x=x, color=color)
    value = f"top{k}"
    columns = getattr(summary, "columns", ())
    available = sorted(c for c in columns if c.startswith("top") and c[3:].isdigit())
    _check_table(
        summary,
        (x, color, value, f"{value}_low", f"{value}_high"),
        f"summary with top-{k}: it has {available}; pass k=... or summarize(results, ks=(..., {k}))",
    )
    hover = f"top-{k}: %{{y:.1%}} (95% CI %{{customdata[0]:.1%}} to %{{customdata[1]:.1%}})"
    fig, ends = _bars(summary, x, color, value, hover)
    fig.update_yaxes(title_text=f"top-{k} accuracy", range=axis_range(ends), tickformat=".0%")
    return _styled(fig, title if title is not None else f"Top-{k} accuracy", caption, summary)


def plot_mean_rank(
    summary: pd.DataFrame,
    x: str = "config",
    color: str = "prompt",
    title: str | None = None,
    caption: str | None = None,
    log: bool = True,
) -> go.Figure:
    """Grouped bar chart of the answer's mean rank (0 = the top token; lower is better).

    ``x``, ``color``, ``title`` and ``caption`` are as for :func:`plot_accuracy`.

    Args:
        summary: From :func:`grafting_lens.analysis.metrics.summarize`, with ``x``,
            ``color``, ``mean_rank`` and its interval, and ``n``.
        log: A logarithmic value axis (bars drawn at rank + 1, ticks labelled with the rank).

    Raises:
        ArgumentTypeError: A column, ``title`` or ``caption`` not a string, ``log`` not a bool.
        GraftingLensError: An empty table or missing columns.
    """
    _check_options(title, caption, x=x, color=color)
    if not isinstance(log, (bool, np.bool_)):
        raise ArgumentTypeError(f"log= must be True or False, got {shown(log)}.")
    _check_table(
        summary,
        (x, color, "mean_rank", "mean_rank_low", "mean_rank_high"),
        "table from summarize(results)",
    )
    drawn = summary.copy()
    ranks = ("mean_rank", "mean_rank_low", "mean_rank_high")
    # The hover quotes the ranks themselves, as ticks and tables do, not the rank + 1 drawn.
    for column in ranks:
        drawn[f"{column}_as_ranked"] = summary[column]
        if log:
            drawn[column] = summary[column] + 1
    hover = (
        "mean rank: %{customdata[3]:,.1f} (95% CI %{customdata[4]:,.1f} to "
        "%{customdata[5]:,.1f}; 0 = the top token)"
    )
    as_ranked = tuple(f"{column}_as_ranked" for column in ranks)
    fig, ends = _bars(drawn, x, color, "mean_rank", hover, extra=as_ranked)
    if log:
        top = max(ends, default=10.0)
        decades = range(int(math.log10(max(top, 10.0))) + 1)
        fig.update_yaxes(
            type="log",
            title_text="mean rank (0 = top; lower is better)",
            range=[0, math.log10(max(top, 10.0)) + 0.15],
            # Drawn at rank + 1, labelled with the rank itself (0, 10, 100...), as tables read.
            tickvals=[1 + (10**d if d else 0) for d in decades],
            ticktext=[f"{10**d:,}" if d else "0" for d in decades],
        )
    else:
        fig.update_yaxes(
            title_text="mean rank of the answer (lower is better)",
            range=axis_range(ends, fraction=False),
        )
    return _styled(fig, title if title is not None else "Mean rank of the answer", caption, summary)


SCORE_TITLES = {
    "answer_logprob": "log-probability of the whole answer",
    "answer_logprob_mean": "log-probability per answer token",
    "logit_diff": "logit difference, answer - counter",
    "kl": "KL(donor || run), nats (lower is closer to the donor)",
    "kl_recovered": "share of the base-to-donor KL closed",
    "score": "score",
}
"""The value axis of each score's figure (:func:`plot_score`)."""


def plot_score(
    summary: pd.DataFrame,
    column: str,
    x: str = "config",
    color: str = "prompt",
    title: str | None = None,
    caption: str | None = None,
) -> go.Figure:
    """Grouped bar chart of a score's mean per group (``kl``, ``answer_logprob``...), with its
    interval.

    ``x``, ``color``, ``title`` and ``caption`` are as for :func:`plot_accuracy`.

    Raises:
        ArgumentTypeError: An argument not a string.
        GraftingLensError: An empty table, missing columns, or a column that is no score.
    """
    _check_options(title, caption, x=x, color=color)
    check_known(column, SCORE_TITLES, "score column")
    _check_table(summary, (x, color, column, f"{column}_low", f"{column}_high"), "summary")
    hover = f"{column}: %{{y:.3f}} (95% CI %{{customdata[0]:.3f}} to %{{customdata[1]:.3f}})"
    fig, ends = _bars(summary, x, color, column, hover)
    fig.update_yaxes(title_text=SCORE_TITLES[column], range=axis_range(ends, fraction=False))
    return _styled(fig, title or SCORE_TITLES[column].capitalize(), caption, summary)


_METHOD_COLORS = {"graft": "#1f77b4", "patch": "#ff7f0e"}

_VALUE_TITLES = {
    "top1": "top-1 accuracy",
    "top5": "top-5 accuracy",
    "target_prob": "probability of the answer",
    "mean_rank": "mean rank of the answer",
}


def plot_comparison(
    summary: pd.DataFrame,
    value: str = "top5",
    row: str | Sequence[str] = "positions",
    col: str = "pair",
    references: pd.DataFrame | None = None,
    title: str | None = None,
    caption: str | None = None,
) -> go.Figure:
    """Grafting and patching layer by layer, side by side, one panel per position set and pair.

    Each panel has one line per method over the layers, with bootstrap error bars, and
    dotted lines at the references (the base and the donor, from ``reference_scores``).

    Args:
        summary: From ``summarize_comparison``, grouped by ``method``, ``layer`` and the
            ``row`` and ``col`` columns.
        value: ``"top5"``, ``"top1"``, ``"target_prob"`` or ``"mean_rank"``.
        row: Column (or columns, joined with " / ") giving one row of panels per value.
        col: Column giving one column of panels per value.
        references: A summary with ``model`` and ``value`` columns (and with the ``row``/``col``
            columns, drawn in the matching panels only).
        title: Figure title; ``caption``: the setting, shown under it before ``n``.

    Raises:
        ArgumentTypeError: ``row``, ``col``, ``title`` or ``caption`` of the wrong type.
        GraftingLensError: An unknown ``value``, an empty summary or missing columns.
    """
    check_known(value, _VALUE_TITLES, "value")
    rows = column_names(row, "row", "'positions'")
    _check_options(title, caption, col=col)
    if references is not None:
        _check_table(
            references,
            ("model", value),
            "table: summarize_comparison(reference_scores(...))",
            "references",
        )
    by = [*rows, col, "method", "layer"]
    _check_table(
        summary,
        [*by, value, f"{value}_low", f"{value}_high"],
        f"table from summarize_comparison(results, by={tuple(by)})",
    )
    row_keys = list(dict.fromkeys(map(tuple, summary[rows].itertuples(index=False))))
    col_keys = list(dict.fromkeys(summary[col]))
    fig = make_subplots(
        rows=len(row_keys),
        cols=len(col_keys),
        shared_xaxes=True,
        shared_yaxes=True,
        column_titles=[display_label(key) for key in col_keys],
        horizontal_spacing=0.03,
        vertical_spacing=0.06,
    )
    legend_shown: set[str] = set()
    for r, row_key in enumerate(row_keys, start=1):
        in_row = (summary[rows] == pd.Series(row_key, index=rows)).all(axis=1)
        for c, col_key in enumerate(col_keys, start=1):
            panel = summary[in_row & (summary[col] == col_key)]
            for method, group in panel.groupby("method", sort=False):
                group = group.sort_values("layer")
                fig.add_trace(
                    go.Scatter(
                        x=group["layer"],
                        y=group[value],
                        mode="lines+markers",
                        name=str(method),
                        legendgroup=str(method),
                        showlegend=str(method) not in legend_shown,
                        line=dict(color=_METHOD_COLORS.get(str(method))),
                        error_y=_whiskers(group, value),
                        hovertemplate=(
                            f"{method}<br>layer %{{x}}<br>{_VALUE_TITLES[value]}: %{{y:.3f}}"
                            "<extra></extra>"
                        ),
                    ),
                    row=r,
                    col=c,
                )
                legend_shown.add(str(method))
    layers = summary["layer"].nunique()
    # About one tick per 40 px of a panel: every layer of a small model, fewer of a deep one.
    fig.update_xaxes(dtick=max(1, math.ceil(layers / 7)))
    fig.update_xaxes(title_text="layer", row=len(row_keys))
    if value in ("top1", "top5", "target_prob"):
        ends = [*summary[value], *summary[f"{value}_high"]]
        if references is not None and value in references.columns:
            ends += list(references[value])
        low, high = axis_range(ends)
        fig.update_yaxes(range=[low - 0.03 * high, high], tickformat=".0%")
    for r, row_key in enumerate(row_keys, start=1):
        # Each row's title on its axis: in the right margin it would hit the references' labels.
        label = " / ".join(map(display_label, row_key))
        fig.update_yaxes(title_text=f"{label}<br>{_VALUE_TITLES[value]}", row=r, col=1)
        for c, col_key in enumerate(col_keys, start=1):
            if references is None:
                break
            matching = references
            for column, key in [*zip(rows, row_key), (col, col_key)]:
                if column in matching.columns:
                    matching = matching[matching[column] == key]
            # References at one value (the donor and its stream, say) share a line and a label.
            by_value: dict[float, list[str]] = {}
            for y, model in zip(matching[value], matching["model"]):
                by_value.setdefault(round(float(y), 4), []).append(str(model))
            for y, models in sorted(by_value.items()):
                text = " = ".join(models) + (f" {y:,.1f}" if value == "mean_rank" else f" {y:.0%}")
                if c == len(col_keys):
                    # Labelled in the margin of the row's last panel: the lines align across
                    # a row, and labels inside narrow panels would run into the data.
                    add_reference_line(fig, y, text, row=r, col=c)
                else:
                    fig.add_hline(y=y, line=dict(dash="dot", color="#555", width=1.2), row=r, col=c)
    counts = summary["n"].tolist() if "n" in summary else []
    figure_style(
        fig,
        title if title is not None else f"Grafting vs patching: {_VALUE_TITLES[value]}",
        subtitle(caption, counts).replace("per bar", "per point"),
        # At most a page column at scale 2 (960 px): wider, the page shrinks labels unreadably.
        height=260 * len(row_keys) + 160,
        width=min(960, 280 * len(col_keys) + 240),
        legend_title_text="method",
    )
    return fig


_ATTRIBUTION_VALUES = {
    "estimate": "estimated change of the metric",
    "exact": "measured change of the metric",
}


def plot_attribution(
    frame: pd.DataFrame, value: str = "estimate", title: str | None = None, columns: int = 3
) -> go.Figure:
    """Heatmaps of a graft attribution: layers x components, one panel per position group,
    on one diverging scale centred on 0 (global components in a row above layer 0).

    Args:
        frame: The ``frame`` of a :class:`~grafting_lens.analysis.attribution.GraftAttribution`.
        value: ``"estimate"`` or ``"exact"`` (verified cells only; the others are blank).
        title: Figure title (default: what is shown, and the direction).
        columns: Panels per row at most (fewer where a 760 px page column holds fewer).

    Raises:
        ArgumentTypeError: ``title`` not a string or ``columns`` not an integer.
        GraftingLensError: An unknown ``value``, ``columns < 1``, an empty table or missing
            columns.
    """
    check_known(value, _ATTRIBUTION_VALUES, "value")
    check_text("title", title)
    if not is_integer(columns) or columns < 1:
        error = GraftingLensError if is_integer(columns) else ArgumentTypeError
        raise error(f"columns= must be an integer >= 1 (panels per row), got {shown(columns)}.")
    columns = int(columns)
    _check_table(
        frame,
        ("component", "layer", "positions", "cell", value, f"{value}_se"),
        "GraftAttribution.frame",
        "frame",
    )
    groups = list(dict.fromkeys(frame["positions"]))
    components = list(dict.fromkeys(frame["component"]))
    layers = sorted(int(layer) for layer in frame["layer"].dropna().unique())
    has_global = bool(frame["layer"].isna().any())
    row_labels = (["global"] if has_global else []) + [f"layer {layer}" for layer in layers]
    # Only as many panels side by side as a page column (760 px) holds at 26 px a
    # component: a wider figure is squeezed by the page, and its labels run together.
    fit = max(1, (760 - 120) // (26 * len(components) + 90))
    columns = max(1, min(columns, len(groups), fit))
    panel_rows = -(-len(groups) // columns)
    fig = make_subplots(
        rows=panel_rows,
        cols=columns,
        subplot_titles=[f"positions {group}" for group in groups],
        horizontal_spacing=0.06,
        vertical_spacing=0.12 if panel_rows > 1 else 0.08,
    )
    extent = float(np.nan_to_num(frame[value].abs().max())) or 1.0  # all NaN or 0: 1
    for index, group in enumerate(groups):
        part = frame[frame["positions"] == group]
        z = [[float("nan")] * len(components) for _ in row_labels]
        text = [[""] * len(components) for _ in row_labels]
        for _, cell in part.iterrows():
            r = 0 if pd.isna(cell["layer"]) else layers.index(int(cell["layer"])) + has_global
            c = components.index(cell["component"])
            z[r][c] = float(cell[value])
            error = cell[f"{value}_se"]
            text[r][c] = f"{cell['cell']}: {cell[value]:+.4f}" + (
                "" if pd.isna(error) else f" (se {error:.4f})"
            )
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=components,
                y=row_labels,
                text=text,
                zmid=0,
                zmin=-extent,
                zmax=extent,
                colorscale="RdBu",
                showscale=index == 0,
                # The colour bar's title along it: across its top it would hit a panel's title.
                colorbar=dict(title=dict(text=value, side="right"), thickness=14),
                hovertemplate="%{text}<extra></extra>",
                xgap=1,
                ygap=1,
            ),
            row=index // columns + 1,
            col=index % columns + 1,
        )
    # Every tick named: plotly labels every other one of a crowded categorical axis.
    fig.update_xaxes(tickmode="array", tickvals=components, ticktext=components, tickangle=-90)
    fig.update_yaxes(
        autorange="reversed", tickmode="array", tickvals=row_labels, ticktext=row_labels
    )
    for index in range(len(groups)):  # the rows named once, left of each row of panels
        if index % columns:
            fig.update_yaxes(
                showticklabels=False, row=index // columns + 1, col=index % columns + 1
            )
    direction = frame["direction"].iloc[0] if "direction" in frame.columns else ""
    figure_style(
        fig,
        title
        if title is not None
        else f"Graft attribution ({direction}): {_ATTRIBUTION_VALUES[value]} per cell",
        height=max(300, (24 * len(row_labels) + 170) * panel_rows + 80),
        width=max(420, (26 * len(components) + 90) * columns + 120),
    )
    fig.update_layout(margin_b=40)  # no legend under a heatmap
    return fig


def plot_recovery(
    curve: pd.DataFrame, fraction: float | None = None, title: str | None = None
) -> go.Figure:
    """The recovery curve of a minimal graft against the number of cells grafted, one line
    per set of prompts (search, held out).

    Args:
        curve: The ``curve`` of a :class:`~grafting_lens.analysis.graft_search.MinimalGraft`.
        fraction: The recovery the search asked for, drawn as a dashed line.
        title: Figure title.

    Raises:
        ArgumentTypeError: ``fraction`` not a number or ``title`` not a string.
        GraftingLensError: A ``fraction`` not finite, an empty table or missing columns.
    """
    if fraction is not None:
        if not is_number(fraction):
            raise ArgumentTypeError(
                f"fraction= must be a number (the recovery asked for) or None, got "
                f"{shown(fraction)}."
            )
        if not math.isfinite(float(fraction)):
            raise GraftingLensError(f"fraction= must be finite, got {shown(fraction)}.")
        fraction = float(fraction)
    check_text("title", title)
    _check_table(curve, ("prompts", "cells", "cell", "recovery"), "MinimalGraft.curve", "curve")
    fig = go.Figure()
    for prompts, group in curve.groupby("prompts", sort=False):
        fig.add_trace(
            go.Scatter(
                x=group["cells"],
                y=group["recovery"],
                mode="lines+markers",
                name=str(prompts).replace("_", "-"),
                customdata=group["cell"],
                hovertemplate=(
                    "%{x} cells (added: %{customdata})<br>recovery %{y:.1%}<extra></extra>"
                ),
            )
        )
    values = [float(v) for v in curve["recovery"] if math.isfinite(float(v))]
    values += [0.0, 1.0] + ([] if fraction is None else [fraction])
    low, high = min(values), max(values)
    room = 0.05 * (high - low)
    cells = int(curve["cells"].max()) if len(curve) else 1
    fig.update_layout(
        xaxis=dict(title="cells grafted", dtick=max(1, math.ceil(cells / 12))),
        yaxis=dict(
            title="recovery (0 = base, 1 = the donor)",
            tickformat=".0%",
            range=[low - room, high + room],
        ),
    )
    if fraction is not None:
        add_reference_line(fig, fraction, f"target {fraction:.0%}")
    return figure_style(
        fig,
        title if title is not None else "Minimal graft: recovery of the donor's metric",
        legend_title_text="prompts",
    )


def plot_dose_response(
    table: pd.DataFrame, value: str = "recovery", title: str | None = None
) -> go.Figure:
    """A :func:`~grafting_lens.analysis.directions.dose_response` table: ``value``
    (``"recovery"`` or ``"metric"``) against strength or rank, with its interval as a band.

    Raises:
        GraftingLensError: Not such a table; ``value`` neither of those.
    """
    check_known(value, ("recovery", "metric"), "value")
    check_text("title", title)
    axis = "strength" if "strength" in getattr(table, "columns", ()) else "rank"
    _check_table(
        table, (axis, value, f"{value}_low", f"{value}_high", "n"), "dose_response table", "table"
    )
    x = [display_label(v) if not pd.isna(v) else "all" for v in table[axis]]
    fig = go.Figure()
    band = dict(mode="lines", line=dict(width=0), hoverinfo="skip", showlegend=False)
    fig.add_trace(go.Scatter(x=x, y=table[f"{value}_high"], **band))
    fig.add_trace(
        go.Scatter(
            x=x, y=table[f"{value}_low"], fill="tonexty", fillcolor="rgba(31,119,180,0.2)", **band
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x, y=table[value], mode="lines+markers", name=value, line=dict(color=PALETTE[0])
        )
    )
    fraction = value == "recovery"
    fig.update_layout(
        xaxis=dict(
            title="strength of the change" if axis == "strength" else "directions grafted",
            type="category" if axis == "rank" else "-",
        ),
        yaxis=dict(
            title="recovery (0 = base, 1 = the whole graft)" if fraction else "metric (mean)",
            tickformat=".0%" if fraction else None,
        ),
    )
    default = f"Dose-response: {value} against the {axis} of the change"
    return figure_style(fig, title or default, subtitle(None, table["n"]))


def plot_directions(table: pd.DataFrame, tokens: int = 3, title: str | None = None) -> go.Figure:
    """A :func:`~grafting_lens.analysis.directions.read_directions` table: each direction's
    share of ``||dW||^2`` as a bar, labelled with its top ``tokens`` tokens (the output
    side's, else the input side's); one panel per cell, answers found starred.

    Raises:
        GraftingLensError: Not such a table; ``tokens`` not a count.
    """
    check_text("title", title)
    _check_table(
        table,
        ("component", "layer", "direction", "share", "output_top", "input_top"),
        "read_directions table",
        "table",
    )
    if not (is_integer(tokens) and tokens >= 1):
        raise SelectionError(f"tokens={shown(tokens)}: give a count of 1 or more.")
    cells = list(table.groupby(["component", "layer"], sort=False, dropna=False))
    fig = make_subplots(
        rows=len(cells),
        cols=1,
        subplot_titles=[c if pd.isna(layer) else f"{c}[{layer}]" for (c, layer), _ in cells],
        vertical_spacing=0.3 / len(cells),
    )
    for row, (_, group) in enumerate(cells, 1):
        words = [
            ", ".join((out if len(out) else into)[: int(tokens)])
            for out, into in zip(group["output_top"], group["input_top"])
        ]
        found = group["answers_found"] if "answers_found" in group else [[]] * len(group)
        fig.add_trace(
            go.Bar(
                x=group["direction"].astype(str),
                y=group["share"],
                text=[w + (" *" if f else "") for w, f in zip(words, found)],
                textposition="outside",
                marker_color=PALETTE[0],
                showlegend=False,
                hovertemplate="direction %{x}: %{y:.1%} of ||dW||²<br>%{text}<extra></extra>",
            ),
            row=row,
            col=1,
        )
        fig.update_yaxes(range=[0, 1.25 * float(group["share"].max())], row=row, col=1)
    fig.update_yaxes(title_text="share of ||dW||²", tickformat=".0%")
    fig.update_xaxes(title_text="direction (largest first)")
    note = "bars: a direction's share of the change; labels: the tokens it writes (or reads)"
    note += "; *: an answer's first token among them" if "answers_found" in table else ""
    return figure_style(
        fig, title or "What the change's top directions write", note, height=200 + 260 * len(cells)
    )


def plot_graft(table: pd.DataFrame, k: int = 5, title: str | None = None) -> go.Figure:
    """Draw a table from :func:`~grafting_lens.study.graft_text.graft`: for one prompt each
    answer's probability under each run (its rank on the bar), for several each run's
    top-``k`` accuracy with its bootstrap interval (a bar per prompt wording, if named).

    Args:
        table: What :func:`graft` returned (rows may be filtered).
        k: The top-k of the accuracy figure; ``title``: the figure's title.

    Raises:
        SelectionError: A table that is not ``gl.graft``'s, or holds NaN scores; a ``k``
            that is not an integer >= 1, a ``title`` that is not text.
    """
    check_table(table, "table", "the table gl.graft returns", SelectionError)
    check_text("title", title)
    if not is_integer(k):
        raise ArgumentTypeError(f"k={shown(k)}: give the top-k as an integer >= 1, e.g. k=5.")
    missing = {"config", "text", "target", "target_rank", "target_prob"} - set(table.columns)
    refuse_first(
        SelectionError,
        (
            (
                table.empty or missing,
                "plot_graft draws the table gl.graft returns"
                + (f"; this one lacks {sorted(missing)}." if missing else ", non-empty."),
            ),
            (k < 1, f"k={int(k)}: give the top-k as an integer >= 1, e.g. k=5."),
        ),
    )
    unscored = table[["target_rank", "target_prob"]].isna().any(axis=1)
    if unscored.any():
        raise SelectionError(
            f"{int(unscored.sum())} rows of the table have no score (NaN target_rank or "
            f"target_prob; first: run {table['config'][unscored].iloc[0]!r}): drop them, "
            "e.g. table.dropna(subset=['target_rank', 'target_prob'])."
        )
    if table["text"].nunique() == 1:
        return _plot_one_prompt(table, title)
    color = "prompt" if "prompt" in table else "prompts"
    if color == "prompts":
        table = table.assign(prompts=f"{table['text'].nunique()} prompts")
    summary = summarize(table, by=("config", color), ks=(int(k),))
    return plot_accuracy(summary, k=int(k), x="config", color=color, title=title)


def _plot_one_prompt(table: pd.DataFrame, title: str | None) -> go.Figure:
    """One prompt's answers: a group of bars per answer, one bar per run."""
    # The same prompt and answer twice is the same example scored twice (equal numbers).
    table = table.drop_duplicates(["config", "target"])
    answers = list(table["target"].unique())
    fig = go.Figure(
        [
            go.Bar(
                x=rows["config"],
                y=rows["target_prob"],
                name=target.strip(),
                text=[f"rank {rank}" for rank in rows["target_rank"]],
                textposition="outside",
                marker_color="#4C72B0" if len(answers) == 1 else None,
            )
            for target, rows in table.groupby("target", sort=False)
        ]
    )
    fig.update_yaxes(
        title_text=f"P({answers[0].strip()})" if len(answers) == 1 else "P(answer)",
        range=axis_range(table["target_prob"]),
        tickformat=".0%",
    )
    fig.update_xaxes(title_text="run")
    fig.update_layout(barmode="group", showlegend=len(answers) > 1)
    return figure_style(
        fig,
        title or "The answer's probability under each graft",
        subtitle(repr(table["text"].iloc[0]), [1], interval=False),
    )
