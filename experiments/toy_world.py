"""Load (or rebuild) the default toy world and print its checkpoints' own accuracy.

The default world ships with the package (``grafting_lens/toy_world/``, see
:mod:`grafting_lens.worlds.toy_shipped`): loading it takes seconds. ``--force`` runs the recipe
(:func:`grafting_lens.worlds.toy.build_toy_world`, 5 to 13 minutes on one core: 297 s and 748 s measured) into the
cache instead; ``--ship`` then writes that build into the package, with the targets
measured on it by ``experiments/toy_targets.py --json`` (``--targets``).

Prints the top-5 accuracy of each checkpoint on the test prompts (both wordings: the
library's and the released code's) with 95% bootstrap intervals, and the build times.
The paper's targets, measured through the experiments, are ``experiments/toy_targets.py``'s.

Run::

    python experiments/toy_world.py                     # the shipped world
    python experiments/toy_world.py --force             # rebuild from the recipe
    python experiments/toy_world.py --force --cache-dir DIR --ship --targets targets.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# The toy world ships with the package or is built here: there is nothing to download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from grafting_lens.analysis.metrics import bootstrap_ci
from grafting_lens.worlds.toy import ToyWorldConfig, build_toy_world
from grafting_lens.worlds.toy_shipped import export_world, shipped_root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=("llama", "gpt2"))
    parser.add_argument("--force", action="store_true", help="rebuild from the recipe")
    parser.add_argument("--cache-dir", type=Path, default=None, help="toy-world cache directory")
    parser.add_argument(
        "--ship",
        action="store_true",
        help="write the (built, default) world into the package, grafting_lens/toy_world/",
    )
    parser.add_argument(
        "--targets",
        type=Path,
        default=None,
        help="experiments/toy_targets.py --json output to ship",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    config = ToyWorldConfig(arch=args.arch)
    world = build_toy_world(config, cache_dir=args.cache_dir, force=args.force)
    elapsed = time.perf_counter() - start
    for model, cells in world.manifest["evaluation"].items():
        if model == "a2b":
            continue
        for test, cell in cells.items():
            hits = [1] * cell["top5_correct"] + [0] * (cell["total"] - cell["top5_correct"])
            low, high = bootstrap_ci(hits)
            row = {
                "model": model,
                "test": test,
                "top5": cell["top5_accuracy"],
                "ci95": [round(low, 3), round(high, 3)],
                "n": cell["total"],
            }
            print(json.dumps(row))
    print(
        json.dumps(
            {
                "key": world.manifest["key"],
                "source": world.manifest.get("source", "built"),
                "seconds_this_call": round(elapsed, 1),
                "build_seconds": world.manifest["build_seconds"],
            }
        )
    )
    if args.ship:
        if config != ToyWorldConfig() or world.manifest.get("source") == "shipped":
            print("--ship needs the default world, built here (--force).", file=sys.stderr)
            return 2
        extra = {}
        if args.targets is not None:
            measured = json.loads(args.targets.read_text())
            if measured.get("world", {}).get("key") != world.manifest["key"]:
                print(f"{args.targets} was measured on another world.", file=sys.stderr)
                return 2
            measured.pop("world", None)
            extra["targets"] = measured
        manifest = export_world(world.root, shipped_root(), extra)
        size = sum(p.stat().st_size for p in shipped_root().rglob("*") if p.is_file())
        print(json.dumps({"shipped": str(shipped_root()), "bytes": size, "key": manifest["key"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
