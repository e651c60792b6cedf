"""Build (or load) the default toy world and check it against its accuracy targets.

The targets: the finetuned model (SFT) recalls at least 95% of the trained
relations in its top 5 with both test prompts, the pretrained model (PRE) at most
10%. Prints the build times and the evaluation table the manifest records, with
95% bootstrap intervals, and exits non-zero if a target is missed.

Run: ``python builds/toy_world.py [--arch llama|gpt2] [--force]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The toy world is built here from scratch: there is nothing to download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from grafting_lens.metrics import bootstrap_ci
from grafting_lens.toy import ToyWorldConfig, build_toy_world


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=("llama", "gpt2"))
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args()
    start = time.perf_counter()
    world = build_toy_world(ToyWorldConfig(arch=args.arch), force=args.force)
    elapsed = time.perf_counter() - start
    evaluation = world.manifest["evaluation"]
    ok = True
    rows = []
    for model in ("base", "sft"):
        for prompt in ("headline", "qa"):
            cell = evaluation[model][f"{prompt}/A2B/all"]
            hits = [1] * cell["top5_correct"] + [0] * (cell["total"] - cell["top5_correct"])
            low, high = bootstrap_ci(hits)
            target_met = (
                cell["top5_accuracy"] >= 0.95 if model == "sft" else cell["top5_accuracy"] <= 0.10
            )
            ok &= target_met
            rows.append(
                {
                    "model": model,
                    "prompt": prompt,
                    "top5": cell["top5_accuracy"],
                    "ci95": [round(low, 3), round(high, 3)],
                    "n": cell["total"],
                    "target_met": target_met,
                }
            )
    for row in rows:
        print(json.dumps(row))
    print(
        json.dumps(
            {
                "key": world.manifest["key"],
                "seconds_this_call": round(elapsed, 1),
                "build_seconds": world.manifest["build_seconds"],
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
