"""Component grafting at the last token (paper figure 4, its baselines and the reversal variant).

Grafts sets of matrices (ATTN+O+FFN, ATTN+O, O+FFN, ATTN+FFN, O, FFN, O+FFN-up,
O+FFN-down) at the last token only, over each layer range (all layers, each quarter,
the last half), and asks both test prompts. Three settings:

* ``task-relation`` (default): the model finetuned on the relations under test (relation
  model) grafted into one finetuned on disjoint relations of the same form (task model);
  asked about the relation model's relations. The paper's section 4.3 and its blog post
  describe figure 4 this way.
* ``baseline``: SFT grafted into PRE (the paper's appendix C.5, figure 14).
* ``reversal``: the model finetuned on both directions grafted into the one-direction
  model, asked the reversed (B2A) prompts (figure 4's caption, appendix C.6, figure 15;
  also ``experiments/reversal_grafting.py``).

``BASE`` (nothing grafted) and ``DONOR`` (every weight of the donor everywhere; the
unembedding stays the base's) frame each figure.

Writes into ``--out``: ``results.csv``, ``summary.csv``, ``summary.md``,
``component_heatmap.html``/``.png`` (layer range x component set, top-5 per prompt),
``component_bars.html``/``.png`` (bars with 95% intervals) and ``runs/`` (resumable).

Run:
    python experiments/component_grafting.py --out results/component
    python experiments/component_grafting.py --out results/component_baseline --setting baseline
    python experiments/component_grafting.py --out results/component --quick
    python experiments/component_grafting.py --out results/llama --model task_model_dir \\
        --donor relation_model_dir --device cuda
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import plotly.graph_objects as go
from plotly.colors import qualitative
import torch
from plotly.subplots import make_subplots

from grafting_lens import experiments, metrics, plots
from grafting_lens.errors import GraftingLensError

SETTINGS = {"task-relation": "component", "baseline": "component_baseline", "reversal": "reversal"}
"""--setting -> key of grafting_lens.experiments.EXPERIMENTS."""

COLORS = qualitative.Plotly


def main(argv: list[str] | None = None, setting: str | None = None, script: str = "component_grafting.py") -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The three settings share --model/--donor; only their meaning differs.
    experiments.add_script_arguments(parser, "component")
    if setting is None:
        parser.add_argument("--setting", choices=tuple(SETTINGS), default="task-relation",
                            help="Which checkpoints graft into which (default: task-relation).")  # fmt: skip
    args = parser.parse_args(argv)
    experiment = SETTINGS[setting or args.setting]
    spec = experiments.EXPERIMENTS[experiment]
    command = f"python experiments/{script} " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        setup, results, computed, elapsed = experiments.run_from_arguments(experiment, args)
    except GraftingLensError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1

    summary = metrics.summarize(results, by=("config", "component_set", "layer_range", "prompt"), seed=0)
    names = setup["models"].names
    notes = [
        f"Models: {setup['label']}; base {names[0]!r}, donor {names[1]!r}; "
        f"{spec.direction} prompts about the {spec.relations!r} relations.",
        f"{computed} of {len(results)} rows computed in {elapsed:.1f} s on "
        f"{torch.get_num_threads()} CPU threads (the others read back from {args.out}/runs).",
        "Grafts at the last token only; ATTN = Q, K, V; FFN = every MLP matrix (gate included); "
        "FFN-up = up projection (+ gate); FFN-down = down projection.",
    ]
    markdown = experiments.summary_markdown(
        summary, spec.title, command, notes, experiments.PAPER_NUMBERS[experiment]
    )
    experiments.write_report(args.out, results, summary, markdown)
    label = f"{spec.title}, {setup['label']}"
    for figure, name in ((heatmap(summary, label), "component_heatmap"), (bars(summary, label), "component_bars")):
        saved = plots.save_figure(figure, os.path.join(args.out, name), png=not args.no_png, warn=False)
        if saved["png_error"]:
            print(f"No PNG for {name}: {saved['png_error']}", file=sys.stderr)
    grid = summary[~summary.component_set.isin(["BASE", "DONOR"])]
    table = grid.pivot_table(index=["prompt", "layer_range"], columns="component_set", values="top5", sort=False)
    print(f"Top-5 accuracy at the last token ({setup['label']}):")
    print(table.map(lambda v: f"{v:.0%}").to_string())
    for _, row in summary[summary.component_set.isin(["BASE", "DONOR"])].iterrows():
        print(f"{row.prompt}: {row.component_set} {row.top5:.0%}")
    print(f"Wrote {args.out}/results.csv, summary.csv, summary.md and figures ({elapsed:.1f} s).")
    return 0


def heatmap(summary, title: str, k: int = 5) -> go.Figure:
    """Top-k accuracy per layer range (rows) and component set (columns), one panel per prompt."""
    grid = summary[~summary.component_set.isin(["BASE", "DONOR"])]
    prompts = list(dict.fromkeys(grid.prompt))
    figure = make_subplots(rows=1, cols=len(prompts), subplot_titles=prompts, horizontal_spacing=0.12)
    for column, prompt in enumerate(prompts, start=1):
        values = grid[grid.prompt == prompt].pivot(index="layer_range", columns="component_set", values=f"top{k}")
        rows = [r for r in experiments.COMPONENT_LAYER_RANGES if r in values.index]
        columns = [c for c in experiments.COMPONENT_SETS if c in values.columns]
        values = values.loc[rows, columns]
        baselines = summary[(summary.prompt == prompt) & summary.component_set.isin(["BASE", "DONOR"])]
        frame = ", ".join(f"{r.component_set} {r[f'top{k}']:.0%}" for _, r in baselines.iterrows())
        figure.add_trace(
            go.Heatmap(
                z=values.to_numpy(), x=columns, y=rows, zmin=0, zmax=1, colorscale="Blues",
                text=[[f"{v:.0%}" for v in row] for row in values.to_numpy()], texttemplate="%{text}",
                showscale=column == len(prompts), colorbar=dict(title=f"top-{k}", tickformat=".0%"),
                hovertemplate="%{y}, %{x}: %{z:.1%}<extra>" + prompt + "</extra>",
            ),  # fmt: skip
            row=1,
            col=column,
        )
        figure.layout.annotations[column - 1].text = f"{prompt} ({frame})"
        figure.update_yaxes(autorange="reversed", row=1, col=column)
    figure.update_layout(title=f"{title}: top-{k} accuracy", template="plotly_white", width=560 * len(prompts) + 120)
    return figure


def bars(summary, title: str, k: int = 5) -> go.Figure:
    """Bars with 95% intervals, one panel per prompt: a group per component set, a bar per layer
    range; dotted lines mark BASE (nothing grafted) and DONOR (the donor everywhere)."""
    prompts = list(dict.fromkeys(summary.prompt))
    figure = make_subplots(rows=len(prompts), cols=1, subplot_titles=prompts, vertical_spacing=0.12)
    for row, prompt in enumerate(prompts, start=1):
        rows = summary[summary.prompt == prompt]
        panel = plots.plot_accuracy(rows[~rows.component_set.isin(["BASE", "DONOR"])], k=k,
                                    x="component_set", color="layer_range")  # fmt: skip
        for trace in panel.data:
            # One colour per layer range in every panel.
            trace.marker.color = COLORS[list(experiments.COMPONENT_LAYER_RANGES).index(trace.name) % len(COLORS)]
            trace.showlegend = row == 1
            trace.legendgroup = trace.name
            figure.add_trace(trace, row=row, col=1)
        for _, baseline in rows[rows.component_set.isin(["BASE", "DONOR"])].iterrows():
            figure.add_hline(
                y=baseline[f"top{k}"], line_dash="dot", row=row, col=1,
                annotation_text=f"{baseline.component_set} {baseline[f'top{k}']:.0%}",
                annotation_position="top right",
            )  # fmt: skip
        figure.update_yaxes(range=[0, 1.05], tickformat=".0%", title_text=f"top-{k}", row=row, col=1)
    figure.update_layout(
        barmode="group", template="plotly_white", title=f"{title}: top-{k} accuracy",
        legend_title_text="layer range", width=1300, height=420 * len(prompts),
    )  # fmt: skip
    return figure


if __name__ == "__main__":
    sys.exit(main())
