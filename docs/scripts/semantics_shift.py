"""How much each difference between the authors' code and this library moves the toy world.

The figure of docs/concepts/paper-code-library.md. Runs the position experiment (figure 2
and its movie-title part) on the toy world under ``REFERENCE`` (the authors' released code),
under ``CLEAN`` (the library's reading), and under ``REFERENCE`` with one switch set to
``CLEAN``'s value, for each switch where the two presets differ. Each variant is compared
with ``REFERENCE`` row by row (same relation, prompt and configuration): the change in
top-5 accuracy per configuration and prompt, the mean absolute change of the answer's
probability, and the share of rows whose rank changes.

Writes ``docs/assets/semantics_shift.png`` (and a small HTML of the same figure) and prints
one JSON line per variant. Builds the toy world on first use (cached; set
``GRAFTING_LENS_CACHE`` to reuse one). About 16 runs of 15 to 30 s each on one thread.

Run: ``python docs/scripts/semantics_shift.py [--out docs/assets] [--threads 1]``; with
``--from-json FILE`` (its printed lines, saved) it only redraws the figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from grafting_lens import study as experiments
from grafting_lens.analysis import figure_style, metrics

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["part", "prompt", "config", "relation_id"]


def variants() -> dict[str, experiments.Semantics]:
    """REFERENCE, each single switch set to CLEAN's value, and CLEAN."""
    chosen = {"reference (the authors' code)": experiments.REFERENCE}
    for name, value in experiments.CLEAN.differences(experiments.REFERENCE).items():
        was = getattr(experiments.REFERENCE, name)
        label = f"{name}: {_text(was)} → {_text(value)}"
        chosen[label] = dataclasses.replace(experiments.REFERENCE, **{name: value})
    chosen["clean (every switch)"] = experiments.CLEAN
    return chosen


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def shift(reference: pd.DataFrame, table: pd.DataFrame) -> dict:
    """What ``table`` changes against ``reference``, row by row and per configuration."""
    joined = reference.merge(table, on=KEYS, suffixes=("_ref", ""))
    probability = (joined.target_prob - joined.target_prob_ref).abs()
    ranks_moved = (joined.target_rank != joined.target_rank_ref).mean()
    by = ["part", "prompt", "config"]
    top5 = (
        metrics.summarize(table, by=by, n_resamples=1).set_index(by).top5
        - metrics.summarize(reference, by=by, n_resamples=1).set_index(by).top5
    )
    return {
        "rows_compared": len(joined),
        "rows_reference": len(reference),
        "rows": len(table),
        "mean_abs_delta_prob": float(probability.mean()),
        "max_abs_delta_prob": float(probability.max()),
        "share_of_ranks_moved": float(ranks_moved),
        "max_abs_delta_top5": float(top5.abs().max()),
        "delta_top5": {" / ".join(key): float(value) for key, value in top5.items()},
    }


COLUMN_WIDTH = 640
"""The docs' text column at a 1280-px window is about 620 CSS px wide: drawn at that width,
the figure's text reads at the size it is set in (a wider figure is shrunk into the column,
its text with it)."""


def rows_shown(shifts: dict[str, dict]) -> dict[str, dict]:
    """The variants to draw: every switch that moves something, then one row standing for
    the switches that move nothing at all (no top-5 and no probability change), then CLEAN."""
    names = [name for name in shifts if not name.startswith("reference (")]
    still = [
        name
        for name in names
        if not name.startswith("clean")
        and shifts[name]["mean_abs_delta_prob"] == 0
        and not any(shifts[name]["delta_top5"].values())
    ]
    shown = {name: shifts[name] for name in names if name not in still}
    if still:
        merged = {f"every other switch ({len(still)})": shifts[still[0]]}
        clean = {name: value for name, value in shown.items() if name.startswith("clean")}
        moving = {name: value for name, value in shown.items() if name not in clean}
        shown = {**moving, **merged, **clean}
    return shown


def figure(shifts: dict[str, dict], configs: list[str], label: str) -> go.Figure:
    shown = rows_shown(shifts)
    names = list(shown)
    grids = {
        prompt: [
            [100 * shown[name]["delta_top5"][f"paper / {prompt} / {config}"] for config in configs]
            for name in names
        ]
        for prompt in ("headline", "qa")
    }
    # Stacked, not side by side: 8 configurations per panel fit the column's width.
    heat, bars = 34 * len(names), 24 * len(names)
    fig = make_subplots(
        rows=3,
        cols=1,
        row_heights=[heat, heat, bars],
        vertical_spacing=0.09,
        subplot_titles=(
            "Δ top-5 against REFERENCE, headline prompt (points)",
            "Δ top-5 against REFERENCE, QA prompt (points)",
            "mean |Δ P(answer)| per row",
        ),
    )
    # The colour scale fits the shifts (a few points), so that a cell of +7 is not white.
    extent = max(1.0, *(abs(v) for grid in grids.values() for row in grid for v in row))
    for row, prompt in ((1, "headline"), (2, "qa")):
        values = grids[prompt]
        fig.add_trace(
            go.Heatmap(
                z=values,
                x=[figure_style.display_label(c) for c in configs],
                y=names,
                zmid=0,
                zmin=-extent,
                zmax=extent,
                colorscale="RdBu",
                text=[[f"{v:+.0f}" if abs(v) >= 0.5 else "0" for v in r] for r in values],
                texttemplate="%{text}",
                textfont={"size": 13},
                showscale=False,  # every cell is labelled with its value
                xgap=1,
                ygap=1,
            ),
            row=row,
            col=1,
        )
    fig.add_trace(
        go.Bar(
            x=[shown[name]["mean_abs_delta_prob"] for name in names],
            y=names,
            orientation="h",
            marker_color="#555555",
            showlegend=False,
        ),
        row=3,
        col=1,
    )
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(side="top", row=1, col=1)
    fig.update_xaxes(side="top", row=2, col=1)
    fig.update_xaxes(rangemode="tozero", row=3, col=1)
    fig.update_annotations(font_size=13)
    # The subplot titles sit above the top tick labels, not on them.
    for annotation in fig.layout.annotations:
        annotation.yshift = 22
    fig.update_layout(
        title=figure_style.wrap_text(
            f"What each difference moves: position grafting on {label}", 60
        ),
        height=210 + 2 * heat + bars + 150,
        width=COLUMN_WIDTH,
        margin={"l": 210, "r": 20, "t": 140, "b": 40},
        font={"size": 12},
    )
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(ROOT / "docs" / "assets"), help="where the figure goes"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per forward pass")
    parser.add_argument(
        "--from-json",
        metavar="FILE",
        help="redraw from the JSON lines an earlier run printed, without running anything",
    )
    args = parser.parse_args()
    configs = list(experiments.PAPER_POSITION_CONFIGS)
    if args.from_json:
        lines = [json.loads(line) for line in Path(args.from_json).read_text().splitlines()]
        measured = [line for line in lines if "variant" in line]
        shifts = {line["variant"]: line for line in measured}
        _write(figure(shifts, configs, measured[0]["world"]), Path(args.out))
        return
    torch.set_num_threads(args.threads)

    models, relations, world = experiments.toy_setup("position", progress=False)
    label = f"the toy world {Path(world['root']).name}"
    tables = {
        name: experiments.run_named_experiment(
            "position",
            models,
            relations,
            semantics=semantics,
            batch_size=args.batch_size,
            progress=False,
        )
        for name, semantics in variants().items()
    }
    reference = tables["reference (the authors' code)"]
    shifts = {name: shift(reference, table) for name, table in tables.items()}
    for name, measured in shifts.items():
        print(json.dumps({"variant": name, "world": label, **measured}))
    _write(figure(shifts, configs, label), Path(args.out))


def _write(fig: go.Figure, out: Path) -> None:
    written = figure_style.save_figure(fig, out / "semantics_shift", include_plotlyjs="cdn")
    # The page shows the PNG; an HTML left in docs/ would be built into the site, and it
    # loads plotly from a CDN, which an offline reader cannot.
    if written.get("png"):
        Path(written["html"]).unlink(missing_ok=True)
        written["html"] = None
    print(json.dumps({"written": written}))


if __name__ == "__main__":
    main()
