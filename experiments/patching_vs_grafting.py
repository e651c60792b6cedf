"""Activation patching vs weight grafting, layer by layer, on the toy world (or real checkpoints).

For the same configurations (position set x component pair x layer) the
pretrained model (PRE) is run with the finetuned model's (SFT) weights grafted
in, and with SFT's activations patched in; both are scored on the paper's two
test prompts (headline and QA). See :mod:`grafting_lens.comparison` for which
patch goes with which graft and why they differ.

Writes to ``--out``:

* ``results.csv``: one row per example, configuration and method;
* ``references.csv``: PRE's and SFT's own scores per example;
* ``summary.csv``: accuracy, rank and probability per group, with bootstrap intervals;
* ``top5_<direction>.{html,png}`` and ``prob_<direction>.{html,png}``: the two
  methods side by side, one panel per (prompt, position set) and pair;
* ``summary.md``: the tables in markdown, and the run's settings.

Usage:
    python experiments/patching_vs_grafting.py --out runs/patching_vs_grafting
    python experiments/patching_vs_grafting.py --out /tmp/pvg --quick
    python experiments/patching_vs_grafting.py --out runs/gpt2 --model gpt2 --donor gpt2-sft-dir
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd
import torch

import grafting_lens as gl
from grafting_lens import data, experiments, plots
from grafting_lens.comparison import (
    DEFAULT_PAIRS,
    STREAM_PAIR,
    compare_graft_and_patch,
    reference_scores,
    summarize_comparison,
)
from grafting_lens.errors import GraftingLensError

PROMPTS = ("headline", "qa")
POSITIONS = ("LT", "FE", "FE+LT")
PAIRS = (*DEFAULT_PAIRS, STREAM_PAIR)
READOUT = "SFT stream, PRE readout"
"""The reference that keeps PRE's final norm and unembedding, as every intervention does."""
QUICK_EXAMPLES = 16
"""Examples per prompt with ``--quick``."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # The options every experiment script takes (--model/--donor, --toy-config, --dtype,
    # --no-png...), as for position grafting: the same two checkpoints.
    experiments.add_script_arguments(parser, "position")
    parser.add_argument("--directions", nargs="+", default=["sufficiency", "necessity"],
                        choices=["sufficiency", "necessity"])  # fmt: skip
    parser.add_argument("--rows-per-forward", type=int, default=512,
                        help="Rows of one forward pass (default 512).")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.include_unembed or args.base_embeddings:
            raise GraftingLensError(
                "--include-unembed and --base-embeddings do not apply here: grafts and patches "
                "are compared with PRE's embeddings and readout (see grafting_lens.comparison)."
            )
        setup = experiments.setup_from_arguments("position", args)
    except GraftingLensError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    models, relations, label = setup["models"], setup["relations"], setup["label"]
    models.names = ("PRE", "SFT")
    progress = not args.no_progress
    directions = ["sufficiency"] if args.quick else list(dict.fromkeys(args.directions))
    n_examples = QUICK_EXAMPLES if args.quick else args.n_examples
    started = time.perf_counter()

    batches = {}
    for prompt in PROMPTS:
        examples = data.make_examples(relations, prompt=prompt)[:n_examples]
        batches[prompt] = data.tokenize_examples(examples, models.tokenizer)

    tables, references = [], []
    for prompt, tokenized in batches.items():
        references.append(reference_scores(models, tokenized, sources=[0, 1]))
        references.append(readout_ceiling(models, tokenized))
        for direction in directions:
            print(f"{prompt}, {direction}: {len(tokenized)} examples", file=sys.stderr)
            tables.append(
                compare_graft_and_patch(
                    models, tokenized, positions=POSITIONS, layers="all", pairs=PAIRS,
                    direction=direction, batch_size=args.batch_size,
                    rows_per_forward=args.rows_per_forward, progress=progress,
                )  # fmt: skip
            )
    results = pd.concat(tables, ignore_index=True)
    references = pd.concat(references, ignore_index=True)
    elapsed = time.perf_counter() - started

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results.to_csv(out / "results.csv", index=False)
    references.to_csv(out / "references.csv", index=False)
    by = ("direction", "prompt", "positions", "pair", "method", "layer")
    summary = summarize_comparison(results, by=by)
    summary.to_csv(out / "summary.csv", index=False)
    reference_summary = summarize_comparison(references, by=("prompt", "model"))
    reference_summary.to_csv(out / "references_summary.csv", index=False)

    figures = {}
    for direction in directions:
        panel = summary[summary.direction == direction]
        for value, stem in (("top5", "top5"), ("target_prob", "prob")):
            fig = plots.plot_comparison(
                panel, value=value, row=("prompt", "positions"), col="pair",
                references=reference_summary,
                title=f"{label}: grafting vs patching SFT into PRE ({direction})",
            )  # fmt: skip
            name = f"{stem}_{direction}"
            figures[name] = gl.save_figure(fig, out / name, png=not args.no_png, warn=False)

    settings = {
        "models": label,
        "names": list(models.names),
        "n_layers": models.n_layers,
        "examples": {prompt: len(tokenized) for prompt, tokenized in batches.items()},
        "dropped": {prompt: len(tokenized.dropped) for prompt, tokenized in batches.items()},
        "positions": list(POSITIONS),
        "pairs": [
            {"name": p.name, "graft": p.components, "patch": p.site, "cumulative": p.cumulative}
            for p in PAIRS
        ],
        "directions": directions,
        "quick": args.quick,
        "dtype": args.dtype,
        "seconds": round(elapsed, 1),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    (out / "summary.md").write_text(markdown(summary, reference_summary, settings, figures))
    print(f"Wrote {out} ({elapsed:.0f} s).", file=sys.stderr)
    for name, written in figures.items():
        if written["png"] is None:
            print(f"  {name}: HTML only ({written['png_error']})", file=sys.stderr)
    return 0


def readout_ceiling(models: gl.ModelSet, tokenized) -> pd.DataFrame:
    """SFT's final residual stream read out by PRE's final norm and unembedding.

    Every intervention here keeps PRE's readout, so this, not SFT itself, is the
    most any of them can reach: it is the graft of the embeddings and every block
    at every position, and equally the patch of the last ``resid_post`` there.
    """
    rows = compare_graft_and_patch(
        models, tokenized, positions={"all": tokenized.attention_mask.bool()}, layers=-1,
        pairs=[STREAM_PAIR], methods="graft", progress=False,
    )  # fmt: skip
    columns = ["example", "relation_id", "prompt", "target_rank", "target_prob", "top1", "top5"]
    return rows[columns].assign(model=READOUT, source=None)


def markdown(summary: pd.DataFrame, references: pd.DataFrame, settings: dict, figures: dict) -> str:
    """Top-5 accuracy (and answer probability) per layer, graft next to patch, per table."""
    lines = ["# Patching vs grafting", "", "```json", json.dumps(settings, indent=1), "```", ""]
    lines += ["## References (no intervention)", "", "| prompt | model | n | top-5 | P(answer) |",
              "|---|---|---|---|---|"]  # fmt: skip
    for _, row in references.iterrows():
        lines.append(
            f"| {row.prompt} | {row.model} | {row.n} | {_interval(row, 'top5')} | "
            f"{_interval(row, 'target_prob', '.3f')} |"
        )
    for (direction, prompt, positions), group in summary.groupby(
        ["direction", "prompt", "positions"], sort=False
    ):
        lines += ["", f"## {direction}, {prompt} prompt, positions {positions}", ""]
        lines += ["Top-5 accuracy [95% bootstrap CI]; mean P(answer) in parentheses.", ""]
        pairs = list(dict.fromkeys(group.pair))
        methods = ("graft", "patch")
        header = ["layer"] + [f"{pair}: {method}" for pair in pairs for method in methods]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for layer in sorted(group.layer.unique()):
            cells = [str(layer)]
            for pair in pairs:
                for method in methods:
                    chosen = (group.pair == pair) & (group.method == method)
                    match = group[chosen & (group.layer == layer)]
                    if match.empty:
                        cells.append("")
                        continue
                    row = match.iloc[0]
                    cells.append(f"{_interval(row, 'top5')} ({row.target_prob:.3f})")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Figures", ""]
    for name, written in figures.items():
        png = Path(written["png"]).name if written["png"] else f"no PNG: {written['png_error']}"
        lines.append(f"- `{Path(written['html']).name}` ({png})")
    return "\n".join(lines) + "\n"


def _interval(row: pd.Series, value: str, spec: str = ".0%") -> str:
    return (
        f"{format(row[value], spec)} [{format(row[value + '_low'], spec)}, "
        f"{format(row[value + '_high'], spec)}]"
    )


if __name__ == "__main__":
    sys.exit(main())
