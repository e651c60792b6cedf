"""Benchmark: the minimal-graft search on a built world, from attribution to a 1-minimal graft.

What ``grafting-lens run graft_attribution --world WORLD`` does for its search, timed phase
by phase, on the world's pretrained (PRE) and finetuned (SFT) models: ``--relations``
relations asked with the headline prompt (the search's prompts) and with the QA prompt (held
out), the library's wording with a BOS (the experiment's CLEAN reading), every component at
every layer at FE, LT and (FE+LT)^C, the answer's log-probability as the metric.

* ``attribution_s``: :func:`attribute_grafts` on the search prompts, its ``--verify``
  largest cells grafted exactly (the estimates a reader looks at first);
* ``search_s``: :func:`find_minimal_graft` growing its set until it recovers ``--fraction``
  of the gap between PRE and SFT;
* ``verification_s``: its pruning to 1-minimal (the graft without each of its cells,
  measured exactly, falls short) and its recovery curve on both sets of prompts, every
  point an exact graft.

The target (issue 34): all three within 10 minutes on 2 CPU cores for the SmolLM2 world at
64 relations per prompt. Prints one JSON line: the seconds, the cells found (and how many
per position group), the recovery on the search and held-out prompts, the machine.

Run: ``python benchmarks/minimal_graft.py [--world smollm2] [--relations 64]
[--fraction 0.8] [--verify 20] [--threads 2] [--cells FILE.csv]`` (the world must be built:
``grafting-lens world build smollm2``; ``--world toy`` runs on the shipped toy world;
``--cells`` also writes the cells found, one row each: layer, component, positions).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a benchmark never downloads

import torch

import grafting_lens as gl
from grafting_lens import study
from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.study.graft_attribution import POSITIONS
from grafting_lens.study.named import real_world_setup
from grafting_lens.study.semantics import CLEAN
from grafting_lens.worlds import data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", default="smollm2", help="toy, smollm2 or gemma3")
    parser.add_argument("--relations", type=int, default=64, help="relations per prompt")
    parser.add_argument("--fraction", type=float, default=0.8)
    parser.add_argument("--verify", type=int, default=20, help="cells the attribution grafts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cells", metavar="FILE", help="write the cells found here (CSV)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gl.notebook(threads=args.threads, grad=True)  # attribution differentiates

    loaded = time.perf_counter()
    if args.world == "toy":
        models, relations, _ = study.toy_setup("graft_attribution", progress=False)
    else:
        models, relations, _ = real_world_setup("graft_attribution", world=args.world)
    batches = {
        prompt: tokenize_examples(
            data.make_examples(relations, prompt=prompt, templates=CLEAN.prompts)[: args.relations],
            models.tokenizer,
            **CLEAN.tokenization(),
        )
        for prompt in ("headline", "qa")
    }
    loaded = time.perf_counter() - loaded

    started = time.perf_counter()
    attribution = gl.attribute_grafts(
        models,
        batches["headline"],
        positions=POSITIONS,
        verify=args.verify,
        batch_size=args.batch_size,
        progress=False,
    )
    attribution_s = time.perf_counter() - started
    found = gl.find_minimal_graft(
        models,
        batches["headline"],
        held_out=batches["qa"],
        fraction=args.fraction,
        positions=POSITIONS,
        batch_size=args.batch_size,
    )
    seconds = {
        "attribution_s": round(attribution_s, 1),
        "search_s": round(found.seconds["search"], 1),
        "verification_s": round(found.seconds["prune"] + found.seconds["curve"], 1),
    }
    total = sum(seconds.values())
    if args.cells:
        found.cells.to_csv(args.cells, index=False)
    print(
        json.dumps(
            {
                "benchmark": "minimal_graft",
                "world": args.world,
                "relations": {prompt: len(batch) for prompt, batch in batches.items()},
                "layers": models.n_layers,
                "candidate_cells": len(attribution.frame),
                **seconds,
                "total_s": round(total, 1),
                "target_s": 600,
                "met": total <= 600,
                "load_s": round(loaded, 1),
                "cells": len(found.cells),
                "cells_by_positions": found.cells["positions"].value_counts().to_dict(),
                "cells_file": args.cells,
                "fraction": args.fraction,
                "recovery": round(found.recovery, 4),
                "held_out_recovery": round(found.held_out_recovery or float("nan"), 4),
                "reached": found.reached,
                "sets_measured": len(found.search),
                "spearman": attribution.agreement.set_index("positions")["spearman"]
                .round(3)
                .to_dict()
                if attribution.agreement is not None
                else None,
                "threads": args.threads,
                "torch": torch.__version__,
                "machine": platform.processor() or platform.machine(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
