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

Run: ``python docs/scripts/semantics_shift.py [--out docs/assets] [--threads 1]``
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
from grafting_lens.analysis import metrics, plots

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


def figure(shifts: dict[str, dict], configs: list[str], label: str) -> go.Figure:
    names = [name for name in shifts if not name.startswith("reference (")]
    fig = make_subplots(
        rows=1,
        cols=3,
        shared_yaxes=True,
        column_widths=[0.38, 0.38, 0.24],
        horizontal_spacing=0.02,
        subplot_titles=(
            "Δ top-5, headline prompt (points)",
            "Δ top-5, QA prompt (points)",
            "mean |Δ P(answer)| per row",
        ),
    )
    grids = {
        prompt: [
            [100 * shifts[name]["delta_top5"][f"paper / {prompt} / {config}"] for config in configs]
            for name in names
        ]
        for prompt in ("headline", "qa")
    }
    # The colour scale fits the shifts (a few points), so that a cell of +7 is not white.
    extent = max(1.0, *(abs(v) for grid in grids.values() for row in grid for v in row))
    for column, prompt in ((1, "headline"), (2, "qa")):
        values = grids[prompt]
        fig.add_trace(
            go.Heatmap(
                z=values,
                x=configs,
                y=names,
                zmid=0,
                zmin=-extent,
                zmax=extent,
                colorscale="RdBu",
                text=[[f"{v:+.0f}" if abs(v) >= 0.5 else "0" for v in row] for row in values],
                texttemplate="%{text}",
                textfont={"size": 15},
                showscale=column == 2,
                colorbar={"title": {"text": "Δ top-5<br>(points)"}, "x": 1.01, "len": 0.9},
            ),
            row=1,
            col=column,
        )
    fig.add_trace(
        go.Bar(
            x=[shifts[name]["mean_abs_delta_prob"] for name in names],
            y=names,
            orientation="h",
            marker_color="#555555",
            showlegend=False,
        ),
        row=1,
        col=3,
    )
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(
        title=plots.wrap_text(
            f"What each difference moves: position grafting on {label}, against REFERENCE", 90
        ),
        # Drawn at about the width of the docs' column, so that its text reads at the
        # size it is set in.
        height=160 + 34 * len(names),
        width=1100,
        margin={"l": 250, "r": 100, "t": 110, "b": 40},
        font={"size": 14},
    )
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(ROOT / "docs" / "assets"), help="where the figure goes"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per forward pass")
    args = parser.parse_args()
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
    configs = list(experiments.PAPER_POSITION_CONFIGS)
    written = plots.save_figure(
        figure(shifts, configs, label),
        Path(args.out) / "semantics_shift",
        include_plotlyjs="cdn",
    )
    # The page shows the PNG; an HTML left in docs/ would be built into the site, and it
    # loads plotly from a CDN, which an offline reader cannot.
    if written.get("png"):
        Path(written["html"]).unlink(missing_ok=True)
        written["html"] = None
    print(json.dumps({"written": written}))


if __name__ == "__main__":
    main()
