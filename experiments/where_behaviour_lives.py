"""Where a behaviour donor's closing phrase lives: the paper's position grafts and the last
token's components, scored by KL to the donor, with 95% bootstrap intervals.

The cells of tutorial 8 ("Where does a finetune's behaviour live?") as a script, for the toy
world's behaviour donor or a real base's behaviour LoRA (built on first use, offline:
``grafting_lens.worlds.behaviour.build_behaviour_donor``). The results page's tables come
from it.

Run::

    python experiments/where_behaviour_lives.py            # the toy world's donor
    python experiments/where_behaviour_lives.py smollm2    # the LoRA on SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import time

import torch

import grafting_lens as gl
from grafting_lens.study import TestSet
from grafting_lens.study.configs import Graft, GraftConfig
from grafting_lens.study.report import summary_table
from grafting_lens.worlds.behaviour import build_behaviour_donor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("world", nargs="?", default="toy", help="toy, smollm2 or gemma3")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    donor = build_behaviour_donor(None if args.world == "toy" else args.world, progress=False)
    models = donor.load_models()  # the base, then the behaviour donor
    test = TestSet(donor.examples())
    # The toy tutorial reads its world as the library does; a real world as its code does.
    semantics = "clean" if args.world == "toy" else None
    positions = ["PRE", "SFT", "FE", "LT", "FE+LT", "(FE+LT)^C"]
    by_position = gl.run_experiment(
        models, test, positions, score="kl", semantics=semantics, progress=False
    )
    print(summary_table(gl.summarize(by_position, by=("config", "prompt"))).to_string())
    parts = {"attention": "attn", "MLP": "ffn", "O": "o"}
    configs = [GraftConfig(f"LT {n}", (Graft("LT", w, "all", source=1),)) for n, w in parts.items()]
    configs += [
        GraftConfig(f"LT {half}", (Graft("LT", "all", half, source=1),))
        for half in ("first_half", "last_half")
    ]
    registry = {config.name: config for config in configs}
    by_component = gl.run_experiment(
        models, test, configs, registry=registry, score="kl", semantics=semantics, progress=False
    )
    print(summary_table(gl.summarize(by_component, by=("config",))).to_string())
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
