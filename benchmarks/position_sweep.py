"""Benchmark: the paper's full position sweep on the toy world's checkpoints.

Eight position configurations (PRE, SFT, FE, LT, FE+LT and the complements) x 1,000
examples x 2 prompts (headline, QA), through :func:`grafting_lens.study.run_experiment`
under ``semantics="clean"`` (as the documented times were measured), in memory. The examples are 1,000 relations made for the purpose (the toy models were
finetuned on fewer; only the time is measured). Builds the toy world on first use.
Prints one JSON line: rows, seconds, rows per second and the settings.

Run: ``python benchmarks/position_sweep.py [--batch-size 8] [--threads 2] [--device cuda]``

Under ``torchrun`` the ranks share the sweep (each its share of the chunks, the table gathered):
``torchrun --nproc-per-node 2 benchmarks/position_sweep.py --threads 1`` prints the same JSON
from rank 0, with ``ranks``. ``--compare-ranks`` runs the three settings issue 43 compares, one
after another, on this machine: one process with one thread, one with two, and two ranks of
one thread each, and prints one JSON line with the three and the speed-ups over the first.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from devices import add_device_option, clock, compare_ranks, describe, resolve

from grafting_lens import study as experiments
from grafting_lens.core import ranks
from grafting_lens.worlds import data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8, help="examples per forward pass")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--cache-dir", help="where toy worlds are cached")
    parser.add_argument("--examples", type=int, default=1000, help="relations asked (1000)")
    parser.add_argument(
        "--compare-ranks", action="store_true", help="1x1 thread, 1x2 threads, 2 ranks x 1"
    )
    add_device_option(parser)
    args = parser.parse_args()
    if args.compare_ranks:
        compare_ranks(__file__, [a for a in sys.argv[1:] if a != "--compare-ranks"])
        return
    torch.set_num_threads(args.threads)
    # Under torchrun the ranks share the work: asked for, as a user's script asks.
    with ranks.shared_ranks() as share:
        gpu = share is not None and args.device.startswith("cuda")
        device = resolve(str(share.device) if gpu else args.device)  # a rank: its own GPU

        models, _, world = experiments.toy_setup(
            "position", cache_dir=args.cache_dir, device=str(device), progress=False
        )
        relations = data.make_relations(world["dataset"], n=args.examples, seed=world["seed"])
        # The sweep the documented times measured: the library's reading and wording (the
        # default semantics, the authors' code's, tokenizes and words the prompts otherwise).
        test_sets = experiments.make_test_sets(
            relations, prompts=("headline", "qa"), dataset=world["dataset"], templates="library"
        )
        configs = list(experiments.PAPER_POSITION_CONFIGS)
        ranks.gather(None)  # every rank loaded: the clock starts together
        started = clock(device)
        results = experiments.run_experiment(
            models,
            test_sets,
            configs,
            batch_size=args.batch_size,
            semantics="clean",
            progress=False,
        )
        seconds = clock(device) - started
        if not ranks.first():
            return
        print(
            json.dumps(
                {
                    "rows": len(results),
                    "seconds": round(seconds, 2),
                    "rows_per_second": round(len(results) / seconds),
                    "configurations": len(configs),
                    "examples": [len(test_set.examples) for test_set in test_sets],
                    "batch_size": args.batch_size,
                    "ranks": 1 if share is None else share.world,
                    "threads_per_rank": torch.get_num_threads(),
                    "models": f"toy world {world['root'].rsplit('/', 1)[-1]}",
                    **describe(device),
                }
            )
        )


if __name__ == "__main__":
    main()
