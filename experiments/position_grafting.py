"""Position grafting (paper figures 2 and 3a): which token positions need the finetuned weights?

Grafts every weight of the finetuned model (SFT) onto the pretrained one (PRE) at some
positions only, and asks both test prompts (headline, QA) about every finetuned relation:
PRE, SFT, FE, LT, FE+LT, (FE+LT)^C, FE^C, LT^C. A second part asks prompts that name the
movie, with the movie-title variants (M, FE+M, M+LT, FE+M+LT).

Writes into ``--out``: ``results.csv`` (one row per example and configuration),
``summary.csv`` and ``summary.md`` (top-1/top-5 with bootstrap intervals, mean rank),
``position_grafting.html``/``.png`` and ``position_grafting_movie.html``/``.png`` (bars
with 95% intervals), and ``runs/`` (the resumable runs: run the same command again after
an interruption and it carries on).

Run:
    python experiments/position_grafting.py --out results/position          # toy world
    python experiments/position_grafting.py --out results/position --quick  # smoke run
    python experiments/position_grafting.py --out results/gpt2 --model gpt2-xl \\
        --donor path/to/gpt2-xl-sft --n-relations 1000 --device cuda
    python experiments/position_grafting.py --out results/bench --benchmark --threads 2

``--benchmark`` times the full sweep (8 configurations x 1,000 examples x 2 prompts) on
the toy world's models, with 1,000 relations made for the purpose (the toy models were
finetuned on fewer; only the time is measured), and prints it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from grafting_lens import data, experiments, metrics, plots
from grafting_lens.errors import GraftingLensError

EXPERIMENT = "position"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    experiments.add_script_arguments(parser, EXPERIMENT)
    parser.add_argument("--benchmark", action="store_true",
                        help="Time 8 configurations x 1,000 examples x 2 prompts and print it.")  # fmt: skip
    args = parser.parse_args(argv)
    command = "python experiments/position_grafting.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        if args.benchmark:
            return benchmark(experiments.setup_from_arguments(EXPERIMENT, args), args)
        setup, results, computed, elapsed = experiments.run_from_arguments(EXPERIMENT, args)
    except GraftingLensError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1

    summary = metrics.summarize(results, by=("part", "config", "prompt"), seed=0)
    notes = [
        f"Models: {setup['label']} ({', '.join(setup['models'].names)}).",
        f"{computed} of {len(results)} rows computed in {elapsed:.1f} s on "
        f"{torch.get_num_threads()} CPU threads (the others read back from {args.out}/runs).",
        f"Grafted positions use the {'base' if args.base_embeddings else 'donor'}'s embeddings; "
        + (
            "grafted positions predict through the donor's unembedding (--include-unembed)."
            if args.include_unembed
            else "every position predicts through the base's unembedding (the paper's setting)."
        ),
    ]
    markdown = experiments.summary_markdown(
        summary, "Position grafting", command, notes, experiments.PAPER_NUMBERS[EXPERIMENT]
    )
    experiments.write_report(args.out, results, summary, markdown)
    for part, name in (("paper", "position_grafting"), ("movie", "position_grafting_movie")):
        rows = summary[summary.part == part]
        if rows.empty:
            continue
        figure = plots.plot_accuracy(
            rows, k=5, title=f"Position grafting, top-5 accuracy ({setup['label']})"
        )
        saved = plots.save_figure(figure, os.path.join(args.out, name), png=not args.no_png, warn=False)
        if saved["png_error"]:
            print(f"No PNG for {name}: {saved['png_error']}", file=sys.stderr)
    print(summary.loc[:, ["part", "config", "prompt", "n", "top1", "top5", "mean_rank"]].to_string(index=False))
    print(f"Wrote {args.out}/results.csv, summary.csv, summary.md and figures ({elapsed:.1f} s).")
    return 0


def benchmark(setup: dict, args: argparse.Namespace) -> int:
    """The full position sweep at the paper's size: 8 configurations x 1,000 examples x 2 prompts."""
    relations = data.make_relations(setup["dataset"], n=1000, seed=setup["data_seed"])
    test_sets = experiments.make_test_sets(relations, prompts=("headline", "qa"), dataset=setup["dataset"])
    sizes = [len(test_set.examples) for test_set in test_sets]
    started = time.perf_counter()
    results = experiments.run_experiment(
        setup["models"], test_sets, list(experiments.PAPER_POSITION_CONFIGS), **experiments.run_options(args)
    )
    elapsed = time.perf_counter() - started
    print(
        f"benchmark: position sweep, {len(experiments.PAPER_POSITION_CONFIGS)} configurations x "
        f"{sizes} examples x 2 prompts = {len(results)} rows in {elapsed:.1f} s "
        f"({len(results) / elapsed:.0f} rows/s) on {torch.get_num_threads()} CPU threads, "
        f"batch size {args.batch_size} ({setup['label']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
