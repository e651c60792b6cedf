"""Tests for grafting_lens.analysis.plots: the accuracy bar chart and saving figures without a browser."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

from grafting_lens.analysis import figure_style, plots
from grafting_lens.analysis.metrics import summarize
from grafting_lens.core.errors import ArgumentTypeError, GraftingLensError

CONFIGS = ["PRE", "SFT", "FE", "LT"]


def _summary() -> pd.DataFrame:
    rows = []
    for prompt, offset in (("headline", 0), ("qa", 3)):
        for index, config in enumerate(CONFIGS):
            ranks = [index * 2 + offset + i for i in range(12)]  # enough rows for an interval
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
        saved = figure_style.save_figure(fig, tmp_path / "sub" / "figure")
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
        saved = figure_style.save_figure(go.Figure(go.Bar(x=[1], y=[1])), tmp_path / "figure.html")
    assert saved["png"] is None
    assert (
        "no Chrome found" in saved["png_error"] and "apt-get install chromium" in saved["png_error"]
    )
    assert (tmp_path / "figure.html").exists() and not (tmp_path / "figure.png").exists()

    saved = figure_style.save_figure(go.Figure(), tmp_path / "plain", png=False)
    assert saved == {"html": str(tmp_path / "plain.html"), "png": None, "png_error": None}


def test_save_figure_refuses_a_directory(tmp_path):
    with pytest.raises(GraftingLensError, match="is a directory"):
        figure_style.save_figure(go.Figure(), tmp_path, png=False)


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
    with pytest.raises(GraftingLensError, match="lacking the columns"):
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


def _rows(values: dict[tuple[str, str], list[int]]) -> pd.DataFrame:
    rows = []
    for (config, prompt), ranks in values.items():
        rows += [{"config": config, "prompt": prompt, "target_rank": r} for r in ranks]
    return pd.DataFrame(rows)


def test_the_value_axis_fits_the_data():
    """Every bar under 10%: the axis ends at 10%, not 100%, and still holds every whisker."""
    ranks = {("PRE", "headline"): [0] + [50] * 19, ("(FE+LT)^C", "headline"): [50] * 20}
    summary = summarize(_rows(ranks), n_resamples=200)
    fig = plots.plot_accuracy(summary)
    low, high = fig.layout.yaxis.range
    assert low == 0 and high < 0.5
    assert high >= summary.top5_high.max()
    assert list(figure_style.axis_range([0.2, 0.97])) == [0, 1.05]


def test_labels_read_as_in_the_paper_and_the_subtitle_says_n_and_the_setting():
    ranks = {("(FE+LT)^C", "qa"): [9] * 12, ("FE", "qa"): [0] * 12}
    summary = summarize(_rows(ranks), n_resamples=50)
    fig = plots.plot_accuracy(summary, caption="toy world, semantics clean")
    assert list(fig.data[0].x) == ["(FE+LT)<sup>C</sup>", "FE"]
    assert fig.layout.xaxis.title.text == "graft configuration"  # not "config"
    assert fig.layout.legend.title.text == "test prompt"
    subtitle = fig.layout.title.subtitle.text
    assert "toy world, semantics clean" in subtitle and "n = 12 per bar" in subtitle
    assert "95% bootstrap" in subtitle
    assert figure_style.display_label("last_quarter") == "4th quarter"


def test_a_zero_bar_is_drawn_as_a_line():
    summary = summarize(_rows({("PRE", "qa"): [99] * 5}), n_resamples=20)
    bar = plots.plot_accuracy(summary).data[0]
    assert list(bar.y) == [0.0]
    assert bar.marker.line.width > 0 and bar.marker.line.color == bar.marker.color


def test_mean_rank_bars_on_a_log_axis_from_rank_zero():
    ranks = {("PRE", "qa"): [900, 1100], ("SFT", "qa"): [0, 0]}
    summary = summarize(_rows(ranks), n_resamples=20)
    fig = plots.plot_mean_rank(summary, caption="setting")
    assert fig.layout.yaxis.type == "log"
    assert list(fig.data[0].y) == [1001.0, 1.0]  # rank + 1, so that rank 0 has a place
    assert 10 ** fig.layout.yaxis.range[1] > 1001  # the highest bar fits
    assert "lower is better" in fig.layout.yaxis.title.text
    # Ticks read as the tables' 0-based ranks: rank 0 at 1, rank 10 at 11...
    assert list(fig.layout.yaxis.ticktext) == ["0", "10", "100", "1,000"]
    assert list(fig.layout.yaxis.tickvals) == [1, 11, 101, 1001]
    # The hover text quotes the same 0-based ranks as the ticks, not the drawn rank + 1.
    bar = fig.data[0]
    assert "+ 1" not in bar.hovertemplate and "%{y" not in bar.hovertemplate
    pre, sft = bar.customdata
    assert pre[3] == 1000.0 and sft[3] == 0.0
    assert (pre[4], pre[5]) == (summary["mean_rank_low"][0], summary["mean_rank_high"][0])
    linear = plots.plot_mean_rank(summary, log=False)
    assert list(linear.data[0].y) == [1000.0, 0.0]
    with pytest.raises(GraftingLensError, match="mean_rank"):
        plots.plot_mean_rank(summary.drop(columns="mean_rank_low"))


def _component_summary() -> pd.DataFrame:
    from grafting_lens.study.configs import COMPONENT_SETS

    rows = []
    for prompt in ("headline", "qa"):
        cells = [("BASE", "all", 99), ("DONOR", "all", 0)]
        cells += [(c, r, 99) for c in list(COMPONENT_SETS)[:3] for r in ("all", "last_half")]
        for component_set, layer_range, rank in cells:
            rows += [
                {
                    "component_set": component_set,
                    "layer_range": layer_range,
                    "prompt": prompt,
                    "target_rank": rank if i else 0,
                }  # one hit in four: 25%
                for i in range(4)
            ]
    return summarize(
        pd.DataFrame(rows), by=("component_set", "layer_range", "prompt"), n_resamples=20
    )


def test_the_heatmap_colour_scale_fits_the_cells_and_references_sit_in_the_margin():
    from grafting_lens.study import report

    summary = _component_summary()
    heatmap = report.component_heatmap(summary, "Component grafting", caption="setting")
    assert heatmap.data[0].zmax == pytest.approx(0.5)  # cells at 25%, not a 0-100% scale
    assert "DONOR 100%" in heatmap.layout.annotations[0].text
    cell = summary[(summary.component_set == "O+FFN") & (summary.layer_range == "all")].iloc[0]
    columns, rows = list(heatmap.data[0].x), list(heatmap.data[0].y)
    text = heatmap.data[0].text[rows.index("all layers")][columns.index("O+FFN")]
    # Every cell carries its own interval, not only the value (a heatmap has no whiskers).
    assert text == f"25%<br>[{cell.top5_low:.0%}, {cell.top5_high:.0%}]"
    assert "95% bootstrap interval" in heatmap.layout.title.subtitle.text
    bars = report.component_bars(summary, "Component grafting")
    labels = [a for a in bars.layout.annotations if a.text and "BASE" in a.text]
    assert labels and all(a.x == 1.0 and a.xanchor == "left" for a in labels)  # right of the bars
    assert [t.name for t in bars.data[:2]] == ["all layers", "last half"]


def test_figure_captions_leave_out_the_cache_hash_and_say_the_decoding():
    from grafting_lens.study import report

    results = pd.DataFrame({"semantics": ["clean+unembed=donor"] * 2})
    caption = report.figure_caption("toy world 42c05be14603190d", results)
    assert "42c05be" not in caption
    assert caption.startswith("toy world, semantics clean+unembed=donor")
    assert "donor's unembedding" in caption


def test_comparison_references_are_drawn_in_every_panel_and_labelled_once_per_row():
    rows = [
        dict(
            positions=p,
            pair=pair,
            method=m,
            layer=layer,
            top5=0.1,
            top5_low=0.05,
            top5_high=0.2,
            n=10,
        )
        for p in ("LT", "FE")
        for pair in ("block", "mlp", "attn")
        for m in ("graft", "patch")
        for layer in range(2)
    ]
    references = pd.DataFrame(
        [dict(model="SFT stream, PRE readout", top5=0.4), dict(model="sft", top5=0.4)]
    )
    fig = plots.plot_comparison(pd.DataFrame(rows), references=references)
    assert len(fig.layout.shapes) == 2 * 3  # one line per value in each of the six panels
    # References at one value share a label, one per row, in the right margin of the last
    # panel (not inside a panel, on the data).
    labels = [a for a in fig.layout.annotations if a.name == "reference"]
    assert [a.text for a in labels] == ["SFT stream, PRE readout = sft 40%"] * 2
    assert all(a.xref.endswith("domain") and a.x == 1.0 and a.xanchor == "left" for a in labels)
    assert {a.xref for a in labels} == {"x3 domain", "x6 domain"}
    low, high = fig.layout.yaxis.range
    assert high == 0.5 and low < 0  # fitted to the data and the reference, not 0-100%
    assert figure_style.figure_problems(fig) == []


# ------------------------------------------------------------ every figure fits its data


def _comparison_summary(top: float = 0.2) -> pd.DataFrame:
    return pd.DataFrame(
        [
            dict(
                positions=p,
                pair=pair,
                method=m,
                layer=layer,
                top5=top / 2,
                top5_low=0.0,
                top5_high=top,
                mean_rank=40.0 + layer,
                mean_rank_low=30.0,
                mean_rank_high=60.0 + layer,
                n=12,
            )
            for p in ("LT", "FE")
            for pair in ("block", "attn")
            for m in ("graft", "patch")
            for layer in range(16)
        ]
    )


def _figures() -> dict[str, go.Figure]:
    """One of each figure the library makes, with references outside the data's range."""
    from grafting_lens.study import report

    summary = _summary()
    component = _component_summary()
    few = summarize(_rows({("PRE", "qa"): [0, 0], ("SFT", "qa"): [3, 900]}), n_resamples=20)
    # A DONOR far above bars under 50%: the tutorial's component figure.
    donor = plots.plot_accuracy(component[component.component_set == "O+FFN"], x="layer_range")
    figure_style.add_reference_line(donor, 0.98, "DONOR 98%")
    figure_style.add_reference_line(donor, 0.94, "SFT 94%")
    references = pd.DataFrame([dict(model="sft", top5=0.97), dict(model="base", top5=0.01)])
    recovery = pd.DataFrame(
        {"prompts": ["search"] * 3, "cells": [0, 1, 2], "cell": ["", "a", "b"]}
    ).assign(recovery=[0.0, 0.6, 1.3])
    return {
        "accuracy": plots.plot_accuracy(summary),
        "accuracy, n = 2": plots.plot_accuracy(few),
        "mean rank (log)": plots.plot_mean_rank(summary),
        "mean rank (linear)": plots.plot_mean_rank(few, log=False),
        "accuracy with a DONOR line": donor,
        "comparison": plots.plot_comparison(_comparison_summary(), references=references),
        "comparison, mean rank": plots.plot_comparison(
            _comparison_summary(),
            value="mean_rank",
            references=pd.DataFrame([dict(model="sft", mean_rank=500.0)]),
        ),
        "attribution": plots.plot_attribution(_attribution_frame()),
        "recovery": plots.plot_recovery(recovery, fraction=0.8),
        "component bars": report.component_bars(component, "Component grafting"),
        "component heatmap": report.component_heatmap(component, "Component grafting"),
    }


@pytest.mark.parametrize("name", list(_figures()))
def test_every_figure_holds_its_data_and_its_reference_lines(name):
    fig = _figures()[name]
    assert figure_style.figure_problems(fig) == []
    # Never a cut title: wrapped to the figure's width.
    width = fig.layout.width or 760
    title = fig.layout.title.text
    assert title and max(len(line) for line in title.split("<br>")) <= max(30, width / 10.5)


def test_figure_problems_names_a_hidden_line_and_a_washed_out_colour_scale():
    fig = go.Figure(go.Bar(x=["a"], y=[0.3], error_y=dict(array=[0.1])))
    fig.update_yaxes(range=[0, 0.5])
    assert figure_style.figure_problems(fig) == []
    fig.add_hline(y=0.98)  # plotly's own line does not grow the range
    assert figure_style.figure_problems(fig) == [
        "a reference line at 0.98 is outside the axis y's range [0, 0.5]"
    ]
    heatmap = go.Figure(go.Heatmap(z=[[-4.0, 7.0]], zmin=-60, zmax=60, name="shift"))
    assert "nearly blank" in figure_style.figure_problems(heatmap)[0]
    heatmap.data[0].update(zmin=-7, zmax=7)
    assert figure_style.figure_problems(heatmap) == []


def test_a_reference_line_grows_the_axis_and_close_labels_move_apart():
    summary = summarize(_rows({("PRE", "qa"): [9] * 12}), n_resamples=20)
    fig = plots.plot_accuracy(summary)
    assert fig.layout.yaxis.range[1] < 0.1
    figure_style.add_reference_line(fig, 0.98, "DONOR 98%")
    figure_style.add_reference_line(fig, 0.96, "SFT 96%")
    assert fig.layout.yaxis.range[1] >= 0.98
    labels = [a for a in fig.layout.annotations if a.name == "reference"]
    assert [a.yshift for a in labels] == [0, -14]  # the lower one moved under the other


def test_fewer_than_ten_rows_draw_no_interval_and_say_so():
    few = summarize(_rows({("PRE", "qa"): [0, 0], ("SFT", "qa"): [0] * 12}), n_resamples=20)
    fig = plots.plot_accuracy(few)
    bar = fig.data[0]
    assert pd.isna(bar.error_y.array[0]) and pd.isna(bar.error_y.arrayminus[0])
    assert not pd.isna(bar.error_y.array[1])  # 12 rows: an interval
    assert "none under 10 rows" in fig.layout.title.subtitle.text
    only_few = plots.plot_accuracy(few[few.config == "PRE"])
    assert "no interval: too few rows" in only_few.layout.title.subtitle.text
    assert "bootstrap interval" not in only_few.layout.title.subtitle.text


def test_a_long_title_wraps_at_words():
    text = figure_style.wrap_text(
        "Relation model grafted into the task model (headline prompt)", 30
    )
    assert text.split("<br>") == [
        "Relation model grafted into",
        "the task model (headline",
        "prompt)",
    ]
    assert (
        figure_style.wrap_text("(FE+LT)<sup>C</sup> is short", 12)
        == "(FE+LT)<sup>C</sup> is<br>short"
    )


def test_a_reference_label_gets_a_right_margin_wide_enough_for_it():
    import plotly.graph_objects as go

    from grafting_lens.analysis import figure_style

    # A short label on a figure with no margin set yet: the margin must still hold it, not
    # count on plotly's default 80 px, which figure_style replaces with 40.
    figure = go.Figure(go.Bar(x=["a"], y=[0.5]))
    figure_style.add_reference_line(figure, 0.3, "DONOR 94%")
    styled = figure_style.figure_style(figure, "t")
    assert styled.layout.margin.r >= 6.5 * len("DONOR 94%") + 4


def _comparison_summary() -> pd.DataFrame:
    summary = _summary().rename(columns={"config": "positions", "prompt": "pair"})
    return pd.concat([summary.assign(method="graft", layer=layer) for layer in (0, 1)])


_CURVE = pd.DataFrame(
    {"prompts": ["search"] * 3, "cells": [0, 1, 2], "cell": ["", "a", "b"], "recovery": [0, 0.5, 1]}
)


# A title, caption, column or count of the wrong type is refused by its name, at the call,
# not by plotly or a string method deep inside (the front-door fuzzer's property).
@pytest.mark.parametrize(
    "plot, options, error, message",
    [
        (
            "plot_accuracy",
            dict(color=[]),
            ArgumentTypeError,
            r"color= must be the name of a column",
        ),
        ("plot_accuracy", dict(x={}), ArgumentTypeError, r"x= must be the name of a column"),
        ("plot_accuracy", dict(title=0), ArgumentTypeError, r"title= must be a string or None"),
        ("plot_accuracy", dict(caption=np.int64(-1)), ArgumentTypeError, r"caption= .*int64\(-1\)"),
        ("plot_accuracy", dict(k=None), ArgumentTypeError, r"k= must be an integer"),
        (
            "plot_mean_rank",
            dict(x=0),
            ArgumentTypeError,
            r"x= must be the name of a column .*got 0",
        ),
        ("plot_mean_rank", dict(title=1.5), ArgumentTypeError, r"title= must be a string or None"),
        ("plot_mean_rank", dict(caption=b"c"), ArgumentTypeError, r"caption= .*got b'c'"),
        ("plot_mean_rank", dict(log=torch.tensor([1, 2])), ArgumentTypeError, r"log= must be True"),
        ("plot_comparison", dict(row=None), ArgumentTypeError, r"row=None cannot be read"),
        ("plot_comparison", dict(row=()), GraftingLensError, r"row=\(\) holds nothing"),
        ("plot_comparison", dict(col=[]), ArgumentTypeError, r"col= must be the name of a column"),
        ("plot_comparison", dict(title=[]), ArgumentTypeError, r"title= must be a string or None"),
        ("plot_recovery", dict(fraction="0.5"), ArgumentTypeError, r"fraction= must be a number"),
        (
            "plot_recovery",
            dict(fraction=float("inf")),
            GraftingLensError,
            r"fraction= must be finite",
        ),
        ("plot_recovery", dict(title=0), ArgumentTypeError, r"title= must be a string or None"),
        ("plot_attribution", dict(columns=None), ArgumentTypeError, r"columns= must be an integer"),
        ("plot_attribution", dict(columns=0), GraftingLensError, r"columns= must be .*got 0"),
        ("plot_attribution", dict(title=()), ArgumentTypeError, r"title= must be a string or None"),
    ],
)
def test_plots_refuse_each_bad_argument_by_name(plot, options, error, message):
    table = {
        "plot_accuracy": _summary,
        "plot_mean_rank": _summary,
        "plot_comparison": _comparison_summary,
        "plot_recovery": lambda: _CURVE,
        "plot_attribution": _attribution_frame,
    }[plot]()
    with pytest.raises(error, match=message):
        getattr(plots, plot)(table, **options)


def test_a_table_of_the_wrong_kind_is_refused_by_the_arguments_name():
    with pytest.raises(ArgumentTypeError, match=r"summary= takes a non-empty table .*; got list"):
        plots.plot_mean_rank([])
    twice = pd.concat([_CURVE, _CURVE[["cells"]]], axis=1)  # pd.concat(axis=1) names it twice
    with pytest.raises(GraftingLensError, match=r"curve= has two columns named 'cells'"):
        plots.plot_recovery(twice)
    with pytest.raises(GraftingLensError, match=r"Expected curve= a non-empty"):
        plots.plot_recovery(_CURVE.iloc[:0])
    with pytest.raises(ArgumentTypeError, match=r"references= takes a non-empty table"):
        plots.plot_comparison(_comparison_summary(), references="ref")


def test_numpy_and_torch_counts_are_read_as_python_ones():
    assert list(plots.plot_accuracy(_summary(), k=torch.tensor(5)).data[0].y) == list(
        plots.plot_accuracy(_summary(), k=5).data[0].y
    )
    assert plots.plot_recovery(_CURVE, fraction=np.float32(0.5)).layout.shapes[0].y0 == 0.5


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: figure_style.figure_style(go.Figure(), 0), r"title= must be a string, got 0"),
        (lambda: figure_style.figure_style(go.Figure(), "t", None), r"subtitle= must be a string"),
        (lambda: figure_style.subtitle(np.int64(-1), [12]), r"caption= must be a string or None"),
    ],
)
def test_figure_style_refuses_a_title_that_is_not_text(call, message):
    with pytest.raises(ArgumentTypeError, match=message):
        call()
