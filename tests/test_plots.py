"""Tests for grafting_lens.plots: the accuracy bar chart and saving figures without a browser."""

from __future__ import annotations

import warnings

import pandas as pd
import plotly.graph_objects as go
import pytest

from grafting_lens import plots
from grafting_lens.errors import GraftingLensError
from grafting_lens.metrics import summarize

CONFIGS = ["PRE", "SFT", "FE", "LT"]


def _summary() -> pd.DataFrame:
    rows = []
    for prompt, offset in (("headline", 0), ("qa", 3)):
        for index, config in enumerate(CONFIGS):
            ranks = [index * 2 + offset + i for i in range(6)]
            rows += [{"config": config, "prompt": prompt, "target_rank": r} for r in ranks]
    return summarize(pd.DataFrame(rows), n_resamples=100)


def test_plot_accuracy_groups_configs_with_one_bar_per_prompt():
    summary = _summary()
    fig = plots.plot_accuracy(summary, k=5)
    assert [trace.name for trace in fig.data] == ["headline", "qa"]
    headline = fig.data[0]
    assert list(headline.x) == CONFIGS
    assert list(headline.y) == summary[summary.prompt == "headline"].top5.tolist()
    # Error bars reach exactly the interval's ends.
    rows = summary[summary.prompt == "headline"].reset_index(drop=True)
    assert [y + up for y, up in zip(headline.y, headline.error_y.array)] == pytest.approx(
        rows.top5_high
    )
    assert [y - down for y, down in zip(headline.y, headline.error_y.arrayminus)] == pytest.approx(
        rows.top5_low
    )
    assert fig.layout.barmode == "group"
    assert list(fig.layout.xaxis.categoryarray) == CONFIGS


def test_plot_accuracy_explains_a_missing_k():
    with pytest.raises(GraftingLensError, match=r"top1.*top5.*ks="):
        plots.plot_accuracy(_summary(), k=10)
    with pytest.raises(GraftingLensError, match="non-empty"):
        plots.plot_accuracy(_summary().iloc[:0])


def test_save_figure_writes_html_and_a_png_or_a_reason(tmp_path):
    fig = plots.plot_accuracy(_summary())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-PNG warning, when there is no browser
        saved = plots.save_figure(fig, tmp_path / "sub" / "figure")
    html = tmp_path / "sub" / "figure.html"
    assert saved["html"] == str(html)
    text = html.read_text()
    assert (
        text.lstrip().lower().startswith(("<!doctype html", "<html")) and "Plotly.newPlot" in text
    )
    if saved["png"] is not None:
        assert saved["png_error"] is None
        assert (tmp_path / "sub" / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert saved["png_error"]  # a reason, never silence
        assert not (tmp_path / "sub" / "figure.png").exists()
    # No temporary file is left behind.
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == sorted(
        ["figure.html"] + (["figure.png"] if saved["png"] else [])
    )


def test_save_figure_without_a_browser_keeps_the_html_and_says_why(tmp_path, monkeypatch):
    def no_chrome(self, *args, **kwargs):
        raise RuntimeError("Kaleido requires Google Chrome to be installed.")

    monkeypatch.setattr(go.Figure, "to_image", no_chrome)
    with pytest.warns(RuntimeWarning, match="plotly_get_chrome"):
        saved = plots.save_figure(go.Figure(go.Bar(x=[1], y=[1])), tmp_path / "figure.html")
    assert saved["png"] is None
    assert (
        "no Chrome found" in saved["png_error"] and "apt-get install chromium" in saved["png_error"]
    )
    assert (tmp_path / "figure.html").exists() and not (tmp_path / "figure.png").exists()

    saved = plots.save_figure(go.Figure(), tmp_path / "plain", png=False)
    assert saved == {"html": str(tmp_path / "plain.html"), "png": None, "png_error": None}


def test_save_figure_refuses_a_directory(tmp_path):
    with pytest.raises(GraftingLensError, match="is a directory"):
        plots.save_figure(go.Figure(), tmp_path, png=False)


def _attribution_frame() -> pd.DataFrame:
    """Two groups; per-layer components at layers 0 and 1, and a global component."""
    rows = []
    for group, sign in (("FE", 1.0), ("LT", -1.0)):
        for layer, component in [
            (None, "embed"),
            (0, "q"),
            (0, "mlp_out"),
            (1, "q"),
            (1, "mlp_out"),
        ]:
            value = sign * (1 + (layer or 0) + len(component) / 10)
            rows.append(
                {
                    "cell": f"{component}[{layer}]@{group}",
                    "component": component,
                    "layer": layer,
                    "positions": group,
                    "estimate": value,
                    "estimate_se": 0.1,
                    "exact": value / 2 if group == "FE" else float("nan"),
                    "exact_se": 0.05,
                    "direction": "sufficiency",
                }
            )
    frame = pd.DataFrame(rows)
    frame["layer"] = frame["layer"].astype("Int64")
    return frame


def test_plot_attribution_puts_each_cell_at_its_layer_and_component():
    frame = _attribution_frame()
    fig = plots.plot_attribution(frame)
    assert [trace.type for trace in fig.data] == ["heatmap", "heatmap"]
    fe = fig.data[0]
    assert list(fe.x) == ["embed", "q", "mlp_out"] and list(fe.y) == [
        "global",
        "layer 0",
        "layer 1",
    ]
    for _, cell in frame[frame.positions == "FE"].iterrows():
        row = 0 if pd.isna(cell.layer) else int(cell.layer) + 1
        assert fe.z[row][list(fe.x).index(cell.component)] == cell.estimate
    assert pd.isna(fe.z[0][1])  # no q outside the layers
    # One colour scale for every panel, centred on 0.
    extent = frame.estimate.abs().max()
    assert all(trace.zmin == -extent and trace.zmax == extent for trace in fig.data)
    exact = plots.plot_attribution(frame, value="exact")
    assert all(pd.isna(value) for row in exact.data[1].z for value in row)  # LT unverified
    with pytest.raises(GraftingLensError, match="Did you mean 'exact'"):
        plots.plot_attribution(frame, value="exakt")
    with pytest.raises(GraftingLensError, match="lacks the columns"):
        plots.plot_attribution(frame.drop(columns="estimate_se"))


def test_plot_recovery_draws_one_line_per_set_of_prompts_and_the_target():
    curve = pd.DataFrame(
        {
            "prompts": ["search"] * 3 + ["held_out"] * 3,
            "cells": [0, 1, 2] * 2,
            "cell": ["", "a", "b"] * 2,
            "recovery": [0.0, 0.5, 0.9, 0.0, 0.4, 0.7],
        }
    )
    fig = plots.plot_recovery(curve, fraction=0.8)
    assert [trace.name for trace in fig.data] == ["search", "held-out"]
    assert list(fig.data[0].y) == [0.0, 0.5, 0.9]
    assert fig.layout.shapes[0].y0 == 0.8
    with pytest.raises(GraftingLensError, match="non-empty"):
        plots.plot_recovery(curve.iloc[:0])
