"""One plot style for every figure, the checks that it fits, and saving figures.

:func:`figure_style` scales the value axis to the data, labels axes as a reader says them,
puts ``n`` and the whiskers' meaning in the subtitle, wraps titles (plotly cuts them) and
labels reference lines in the margin (:func:`add_reference_line`). :func:`figure_problems`
lists what a figure hides; the tests run it on every figure. :func:`save_figure` writes the
HTML always and a PNG where kaleido finds a Chrome, each complete or absent.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from grafting_lens.analysis.metrics import MIN_INTERVAL_ROWS
from grafting_lens.core.arguments import shown
from grafting_lens.core.errors import ArgumentTypeError, GraftingLensError
from grafting_lens.core.files import atomic_write

__all__ = [
    "COLUMN_TITLES",
    "FONT",
    "INTERVAL_NOTE",
    "NOTEBOOK_WIDTH",
    "NO_CHROME_HINT",
    "PALETTE",
    "VALUE_LABELS",
    "add_reference_line",
    "axis_range",
    "axis_span",
    "check_text",
    "column_title",
    "display_label",
    "extend_range",
    "figure_problems",
    "figure_style",
    "save_figure",
    "subtitle",
    "wrap_text",
    "yaxis_name",
]

NO_CHROME_HINT = (
    "no Chrome found: run `plotly_get_chrome` or `apt-get install chromium` "
    "(or set BROWSER_PATH to a Chrome/Chromium binary), then save again"
)
"""Why a PNG is missing when kaleido finds no browser, and how to fix it."""

COLUMN_TITLES: dict[str, str] = {
    "config": "graft configuration",
    "prompt": "test prompt",
    "component_set": "components grafted at the last token",
    "layer_range": "layers",
    "positions": "positions",
    "pair": "components",
    "method": "method",
    "model": "model",
    "layer": "layer",
    "semantics": "semantics",
}
"""What a summary's columns are called on a figure's axes and legends."""

VALUE_LABELS: dict[str, str] = {
    "all": "all layers",
    "first_half": "first half",
    "last_half": "last half",
    "first_quarter": "1st quarter",
    "second_quarter": "2nd quarter",
    "third_quarter": "3rd quarter",
    "last_quarter": "4th quarter",
}
"""How the layer ranges read on a figure."""

PALETTE: tuple[str, ...] = tuple(qualitative.Plotly)
"""Colours, one per trace, in order."""

FONT = dict(family="Helvetica, Arial, sans-serif", size=13)

INTERVAL_NOTE = "whiskers: 95% bootstrap interval"


def display_label(value: Any) -> str:
    """A value as a figure shows it: ``"(FE+LT)^C"`` -> ``"(FE+LT)<sup>C</sup>"``,
    ``"last_quarter"`` -> ``"4th quarter"``; anything else as ``str`` gives it."""
    text = str(value)
    if text in VALUE_LABELS:
        return VALUE_LABELS[text]
    return re.sub(r"\^(\w+)", r"<sup>\1</sup>", text)


def column_title(column: str) -> str:
    """A column's name as an axis or legend title (:data:`COLUMN_TITLES`, else spaced words)."""
    return COLUMN_TITLES.get(column, column.replace("_", " "))


def axis_range(values: Iterable[float], *, fraction: bool = True) -> list[float]:
    """A value axis from 0 that fits ``values`` (bars and interval ends) with a little room:
    for fractions up to the first of 5%, 10%, 20%, 25%, 50%, 75% or 105% above them all,
    else up to the highest value plus 10%."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    top = max(finite, default=0.0)
    if not fraction:
        return [0.0, top * 1.1 if top > 0 else 1.0]
    for step in (0.05, 0.1, 0.2, 0.25, 0.5, 0.75):
        if top * 1.08 <= step:
            return [0.0, step]
    return [0.0, 1.05]


def subtitle(caption: str | None, counts: Sequence[Any], interval: bool = True) -> str:
    """The caption, then ``n`` per bar and what the whiskers are (none under too few rows).

    Raises:
        ArgumentTypeError: A ``caption`` that is not a string or ``None``.
    """
    check_text("caption", caption)
    parts = [caption] if caption else []
    distinct = sorted({int(n) for n in counts if n is not None and not pd.isna(n)})
    if len(distinct) == 1:
        parts.append(f"n = {distinct[0]} per bar")
    elif distinct:
        parts.append(f"n = {distinct[0]} to {distinct[-1]} per bar")
    if interval:
        if distinct and distinct[-1] < MIN_INTERVAL_ROWS:
            parts.append(f"no interval: too few rows (under {MIN_INTERVAL_ROWS})")
        elif distinct and distinct[0] < MIN_INTERVAL_ROWS:
            parts.append(INTERVAL_NOTE + f", none under {MIN_INTERVAL_ROWS} rows")
        else:
            parts.append(INTERVAL_NOTE)
    if caption and len(parts) > 1:  # the setting on its own line, the counts under it
        return caption + "<br>" + "; ".join(parts[1:])
    return "; ".join(parts)


def wrap_text(text: str, width: int) -> str:
    """``text`` broken with ``<br>`` at spaces into lines of at most ``width`` characters
    (existing breaks kept; markup such as ``<sup>C</sup>`` has no width)."""
    lines: list[str] = []
    for line in text.split("<br>"):
        current: list[str] = []
        length = 0
        for word in line.split(" "):
            size = len(re.sub(r"<[^>]+>", "", word))
            if current and length + 1 + size > width:
                lines.append(" ".join(current))
                current, length = [], 0
            current.append(word)
            length += size + (1 if length else 0)
        lines.append(" ".join(current))
    return "<br>".join(lines)


def check_text(name: str, text: object, optional: bool = True) -> None:
    """Refuse a title, subtitle or caption that is not a string (nor ``None`` where optional):
    a number would fail far from the call, in :func:`wrap_text`. Every figure's door uses it."""
    if not (isinstance(text, str) or (optional and text is None)):
        allowed = "a string or None" if optional else "a string"
        raise ArgumentTypeError(f"{name}= must be {allowed}, got {shown(text)}.")


NOTEBOOK_WIDTH = 760
"""The width a figure gets when none is set: about the docs' column at 1280 px."""


def figure_style(fig: go.Figure, title: str, subtitle: str = "", **layout: Any) -> go.Figure:
    """The house style: the title and subtitle wrapped to the figure's width, the legend
    under the plot; ``layout`` overrides any of it (``width``, ``height``...). Returns ``fig``.

    Raises:
        ArgumentTypeError: A ``title`` or ``subtitle`` that is not a string.
    """
    check_text("title", title, optional=False)
    check_text("subtitle", subtitle, optional=False)
    width = layout.get("width") or fig.layout.width or NOTEBOOK_WIDTH
    fig.update_layout(
        template="plotly_white",
        font=FONT,
        title=dict(
            # Pinned to the top: plotly centres a title in the top margin by default, and a
            # margin grown for a long subtitle then pushes it onto the panels' titles.
            y=1.0,
            yref="container",
            yanchor="top",
            pad=dict(t=24),
            text=wrap_text(title, max(30, int(width / 10.5))),
            subtitle=dict(
                text=wrap_text(subtitle, max(40, int(width / 7.2))),
                font=dict(size=12, color="#555"),
            ),
        ),
        legend=dict(
            orientation="h", yref="container", yanchor="bottom", y=0.0, x=0.0, xanchor="left"
        ),
    )
    lines = 1 + fig.layout.title.text.count("<br>")
    if subtitle:
        lines += 1 + fig.layout.title.subtitle.text.count("<br>")
    margin_right = max(fig.layout.margin.r or 0, 40)
    # Panels' titles (above the plot area) need a line of their own under the subtitle.
    panel_titles = any(
        a.yref == "paper" and a.y is not None and a.y >= 1 for a in fig.layout.annotations
    )
    fig.update_layout(
        margin=dict(t=50 + 20 * lines + 24 * panel_titles, r=margin_right, b=110), **layout
    )
    return fig


def add_reference_line(
    fig: go.Figure, y: float, text: str, row: int | None = None, col: int | None = None
) -> None:
    """A dotted horizontal line at ``y``, labelled in the right margin (widened to fit, a
    label moved off a near one's), a set value axis grown to hold it."""
    target = {} if row is None else dict(row=row, col=col)
    axis = "y" if row is None else yaxis_name(fig, row, col)
    extend_range(fig, axis, y)
    fig.add_hline(y=y, line=dict(dash="dot", color="#555", width=1.2), **target)
    xref = "x domain" if row is None else axis.replace("y", "x") + " domain"
    low, high = axis_span(fig, axis)
    close = [
        a
        for a in fig.layout.annotations
        if a.name == "reference" and a.yref == axis and abs(float(a.y) - y) < 0.06 * (high - low)
    ]
    shift = 0
    if close:
        above = y >= max(float(a.y) for a in close)
        shift = (1 if above else -1) * 14 * len(close)
    fig.add_annotation(
        x=1.0,
        xref=xref,
        xanchor="left",
        y=y,
        yref=axis,
        yshift=shift,
        text=text,
        name="reference",
        showarrow=False,
        font=dict(size=11, color="#333"),
        xshift=4,
    )
    width = 6.5 * len(re.sub(r"<[^>]+>", "", text)) + 16
    # An unset margin is not plotly's default 80 px here: figure_style sets 40 where none is.
    if (fig.layout.margin.r or 0) < width:
        fig.update_layout(margin_r=int(width))


def axis_span(fig: go.Figure, axis: str) -> tuple[float, float]:
    """The range a linear axis shows (set, else 0 to 1), in data units."""
    layout_axis = fig.layout[axis.replace("y", "yaxis")]
    if layout_axis.range is not None and layout_axis.type != "log":
        return float(layout_axis.range[0]), float(layout_axis.range[1])
    return 0.0, 1.0


def extend_range(fig: go.Figure, axis: str, y: float) -> None:
    """Grow a set range of ``axis`` ("y", "y2"...) so that it holds ``y``, with a little room."""
    layout_axis = fig.layout[axis.replace("y", "yaxis")]
    if layout_axis.range is None or not math.isfinite(y):
        return
    low, high = (float(v) for v in layout_axis.range)
    value = math.log10(y) if layout_axis.type == "log" and y > 0 else y
    if low <= value <= high:
        return
    room = 0.06 * (max(high, value) - min(low, value))
    layout_axis.range = [min(low, value - room), max(high, value + room)]


def yaxis_name(fig: go.Figure, row: int, col: int | None) -> str:
    """The y axis of a subplot, as an annotation names it ("y", "y2"...)."""
    return fig.get_subplot(row, col or 1).yaxis.plotly_name.replace("axis", "")  # "yaxis2"


def save_figure(
    fig: go.Figure,
    path: str | os.PathLike,
    png: bool = True,
    scale: float = 2.0,
    include_plotlyjs: bool | str = True,
    warn: bool = True,
) -> dict[str, Any]:
    """Write ``path.html`` always, and ``path.png`` when a browser for kaleido is available.

    Args:
        fig: The figure to save.
        path: Destination without suffix, e.g. ``"out/position_grafting"`` (made as needed).
        png: Also try the static PNG.
        scale: PNG resolution multiplier.
        include_plotlyjs: ``Figure.to_html``'s: ``True`` embeds plotly.js, ``"cdn"`` links it.
        warn: Warn when the PNG could not be written.

    Returns:
        ``{"html": str, "png": str | None, "png_error": str | None}``: the paths written
        and, for a PNG asked for but not written, why (with the fix).

    Raises:
        GraftingLensError: ``path`` is an existing directory.
        OSError: The HTML cannot be written.
    """
    base = Path(path)
    if base.suffix.lower() in (".html", ".png"):
        base = base.with_suffix("")
    if base.is_dir():
        raise GraftingLensError(
            f"{base} is a directory; pass a file path without suffix, e.g. {base / 'figure'}."
        )
    base.parent.mkdir(parents=True, exist_ok=True)
    html_path = base.with_name(base.name + ".html")
    png_path = base.with_name(base.name + ".png")
    atomic_write(html_path, fig.to_html(include_plotlyjs=include_plotlyjs, full_html=True).encode())
    result: dict[str, Any] = {"html": str(html_path), "png": None, "png_error": None}
    if not png:
        return result
    try:
        atomic_write(png_path, fig.to_image(format="png", scale=scale))
        result["png"] = str(png_path)
    except Exception as error:  # noqa: BLE001, any export failure must leave the HTML usable
        result["png_error"] = _png_failure_reason(error)
        if warn:
            warnings.warn(
                f"Wrote {html_path} but no PNG: {result['png_error']}.",
                RuntimeWarning,
                stacklevel=2,
            )
    return result


def _png_failure_reason(error: BaseException) -> str:
    """A one-line reason for a failed PNG export, with the fix when one is known."""
    message = " ".join(str(error).split())
    lowered = message.lower()
    if "chrome" in lowered or "chromium" in lowered or "browser" in lowered:
        return f"{NO_CHROME_HINT} (kaleido said: {message})"
    if "kaleido" in lowered and ("install" in lowered or "requires" in lowered):
        return f"kaleido is not installed: `pip install kaleido` (plotly said: {message})"
    return f"PNG export failed with {type(error).__name__}: {message}"


def figure_problems(fig: go.Figure) -> list[str]:
    """What a figure hides, one line each: values, interval ends, reference lines or labels
    outside a set axis range, and heatmap cells outside their colour scale or filling less
    than a quarter of it (nearly white)."""
    problems: list[str] = []
    layout = fig.layout
    plotted: dict[str, list[tuple[str, float]]] = {}
    for index, trace in enumerate(fig.data):
        name = trace.name or f"trace {index}"
        if trace.type == "heatmap":
            problems += _colour_scale_problems(trace, name)
            continue
        if trace.type not in ("bar", "scatter") or getattr(trace, "orientation", None) == "h":
            continue
        values = [float(v) for v in (trace.y if trace.y is not None else ()) if _finite(v)]
        error = trace.error_y
        if error is not None and error.array is not None:
            minus = error.arrayminus if error.arrayminus is not None else error.array
            for sign, ends in ((1.0, error.array), (-1.0, minus)):
                pairs = [(v, e) for v, e in zip(trace.y, ends) if _finite(v) and _finite(e)]
                values += [float(v) + sign * float(e) for v, e in pairs]
        axis = trace.yaxis or "y"
        plotted.setdefault(axis, []).extend((f"{name!r}", v) for v in values)
    for shape in layout.shapes:
        if shape.type == "line" and shape.y0 is not None and shape.y0 == shape.y1:
            axis = (shape.yref or "y").split(" ")[0]
            plotted.setdefault(axis, []).append(("a reference line", float(shape.y0)))
    for annotation in layout.annotations:
        if annotation.name == "reference" and annotation.yref:
            plotted.setdefault(annotation.yref, []).append(
                (f"the label {annotation.text!r}", float(annotation.y))
            )
    for axis, points in plotted.items():
        layout_axis = layout[axis.replace("y", "yaxis")]
        if layout_axis is None or layout_axis.range is None:
            continue
        low, high = (float(v) for v in layout_axis.range)
        log = layout_axis.type == "log"
        for what, value in points:
            shown = math.log10(value) if log and value > 0 else value
            if log and value <= 0:
                problems.append(f"{what} at {value:g} cannot be drawn on the log axis {axis}")
            elif not low - 1e-9 <= shown <= high + 1e-9:
                problems.append(
                    f"{what} at {value:g} is outside the axis {axis}'s range "
                    f"[{low:g}, {high:g}]" + (" (log10)" if log else "")
                )
    return problems


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _colour_scale_problems(trace: Any, name: str) -> list[str]:
    cells = [
        float(v) for row in (trace.z if trace.z is not None else ()) for v in row if _finite(v)
    ]
    if not cells or trace.zmin is None or trace.zmax is None:
        return []
    low, high = float(trace.zmin), float(trace.zmax)
    problems = []
    outside = [v for v in cells if not low - 1e-9 <= v <= high + 1e-9]
    if outside:
        problems.append(
            f"heatmap {name!r}: {len(outside)} cells outside its colour scale [{low:g}, {high:g}]"
        )
    extent = max(abs(low), abs(high))
    if extent > 0 and max(abs(v) for v in cells) < 0.25 * extent:
        problems.append(
            f"heatmap {name!r}: its cells reach {max(abs(v) for v in cells):g}, under a quarter "
            f"of its colour scale [{low:g}, {high:g}], so they are nearly blank"
        )
    return problems
