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
``--cells`` also writes the cells found, one row each: layer, component, positions). Under
``torchrun`` the ranks share the exact grafts and the attribution's chunks; ``--compare-ranks``
runs one process with one thread, one with two and two ranks of one thread each, one after
another, and prints the three with the speed-ups over the first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a benchmark never downloads

import torch
from devices import compare_ranks

import grafting_lens as gl
from grafting_lens import study
from grafting_lens.core import ranks
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.core.files import check_writable
from grafting_lens.study.graft_attribution import POSITIONS
from grafting_lens.study.named import real_world_setup
from grafting_lens.study.testsets import library_batches
from grafting_lens.worlds.real_recipe import WORLDS as REAL_WORLDS

WORLDS = ("toy", *REAL_WORLDS)


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {least}")
        return value

    return parse


def fraction(text: str) -> float:
    """An argparse type: a recovery to reach, in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1]")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", default="smollm2", choices=WORLDS)
    parser.add_argument("--relations", type=at_least(1), default=64, help="relations per prompt")
    parser.add_argument("--fraction", type=fraction, default=0.8, help="in (0, 1]")
    parser.add_argument("--verify", type=at_least(0), default=20, help="cells grafted exactly")
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument("--batch-size", type=at_least(1), default=16)
    parser.add_argument("--cells", metavar="FILE", help="write the cells found here (CSV)")
    parser.add_argument(
        "--compare-ranks", action="store_true", help="1x1 thread, 1x2 threads, 2 ranks x 1"
    )
    args = parser.parse_args(argv)
    if args.compare_ranks:
        compare_ranks(__file__, [a for a in (argv or sys.argv[1:]) if a != "--compare-ranks"])
        return 0
    if args.cells is not None:  # checked now: the search takes minutes, then the write failed
        cells = Path(args.cells).expanduser()
        try:
            check_writable(cells.parent, "The directory of --cells")
        except GraftingLensError as error:
            parser.error(str(error))
        if cells.is_dir() or (cells.exists() and not os.access(cells, os.W_OK)):
            parser.error(f"--cells {args.cells!r} is a directory or a file that cannot be written.")
    # Under torchrun the ranks share the work: asked for, as a user's script asks.
    with ranks.shared_ranks() as share:
        torch.set_num_threads(args.threads)
        gl.notebook(threads=args.threads, grad=True)  # attribution differentiates

        loaded = time.perf_counter()
        if args.world == "toy":
            models, relations, _ = study.toy_setup("graft_attribution", progress=False)
        else:
            models, relations, _ = real_world_setup("graft_attribution", world=args.world)
        batches = library_batches(relations, models.tokenizer, ("headline", "qa"), args.relations)
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
        if not ranks.first():
            return 0
        if args.cells:
            cells.parent.mkdir(parents=True, exist_ok=True)
            found.cells.to_csv(cells, index=False)
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
                    "seconds": round(total, 1),
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
                    "ranks": 1 if share is None else share.world,
                    "torch": torch.__version__,
                    "machine": platform.processor() or platform.machine(),
                }
            )
        )
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
