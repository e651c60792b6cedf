"""The hybrid graft (paper figure 5): task attention plus relation O and FFN on a pretrained model.

Three checkpoints: pretrained (0), a task model finetuned on relations of the same form
but disjoint entities (1), and a relation model finetuned on the relations under test
(2). At the last token, the task model's ATTN (all layers) and the relation model's
O+FFN (last half of the layers); at the first entity, one of: nothing (``LT``), or the
task model's ATTN, ATTN+O, FFN, O+FFN or every weight (``LT+FE:<set>``, all layers).
``PRE``, ``TASK`` and ``RELATION`` are the baselines (each checkpoint alone; the
unembedding stays the pretrained one). Asked about the relation model's relations.

Writes into ``--out``: ``results.csv``, ``summary.csv``, ``summary.md``,
``hybrid_grafting.html``/``.png`` (bars with 95% intervals) and ``runs/`` (resumable).

Run:
    python experiments/hybrid_grafting.py --out results/hybrid
    python experiments/hybrid_grafting.py --out results/hybrid --quick
    python experiments/hybrid_grafting.py --out results/gemma_hybrid --model google/gemma-1.1-2b-it \\
        --task-model task_dir --relation-model relation_dir --device cuda
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from grafting_lens import experiments, metrics, plots
from grafting_lens.errors import GraftingLensError

EXPERIMENT = "hybrid"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    experiments.add_script_arguments(parser, EXPERIMENT)
    args = parser.parse_args(argv)
    command = "python experiments/hybrid_grafting.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        setup, results, computed, elapsed = experiments.run_from_arguments(EXPERIMENT, args)
    except GraftingLensError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1

    summary = metrics.summarize(results, by=("config", "first_entity", "prompt"), seed=0)
    notes = [
        f"Models: {setup['label']} (sources: {', '.join(setup['models'].names)}).",
        f"{computed} of {len(results)} rows computed in {elapsed:.1f} s on "
        f"{torch.get_num_threads()} CPU threads (the others read back from {args.out}/runs).",
        "LT = task ATTN at the last token (all layers) + relation O+FFN there (last half); "
        "LT+FE:<set> adds the task model's <set> at the first entity (all layers).",
    ]
    markdown = experiments.summary_markdown(
        summary, experiments.EXPERIMENTS[EXPERIMENT].title, command, notes,
        experiments.PAPER_NUMBERS[EXPERIMENT],
    )  # fmt: skip
    experiments.write_report(args.out, results, summary, markdown)
    figure = plots.plot_accuracy(summary, k=5, title=f"Hybrid grafting, top-5 accuracy ({setup['label']})")
    saved = plots.save_figure(figure, os.path.join(args.out, "hybrid_grafting"), png=not args.no_png, warn=False)
    if saved["png_error"]:
        print(f"No PNG: {saved['png_error']}", file=sys.stderr)
    print(summary.loc[:, ["config", "prompt", "n", "top1", "top5", "mean_rank"]].to_string(index=False))
    print(f"Wrote {args.out}/results.csv, summary.csv, summary.md and figures ({elapsed:.1f} s).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
