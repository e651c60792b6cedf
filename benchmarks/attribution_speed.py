"""Benchmark: graft attribution against the exhaustive exact sweep, and its agreement with it.

Two measurements, printed as one JSON line:

* **Speed.** Two GPT-2-small-shaped checkpoints with random weights (12 layers,
  d_model 768, vocabulary 50,257; nothing is downloaded), ``--batch`` prompts of
  ``--pos`` random tokens, the answer's log-probability at the last token as the
  metric. Every cell is attributed: every component (embeddings, the 8 per-layer
  components at each of the 12 layers, the final norm, the unembedding) at every
  position alone (``positions="each"``), 1,600 cells for 16 tokens, in one
  :func:`attribute_grafts` call. The
  exhaustive exact sweep grafts each cell alone over the same prompts, batched the way
  ``verify=`` does (``--rows-per-forward`` rows a pass: several cells' blocks of prompts);
  it is timed on ``--measured-cells`` cells spread over every component, layer and
  position, and extrapolated to all cells (``exact_sweep_s``): ``speedup`` is its ratio
  to the attribution's time.
* **Agreement.** On the toy world (pretrained and finetuned, every trained fact asked
  with the headline prompt), every component at every layer at FE, LT and (FE+LT)^C is
  attributed and every cell grafted exactly (``verify="all"``); ``toy_spearman`` is the
  Spearman correlation of estimates and exact effects per position group (the target is
  at least 0.8 at LT), for the first-order estimate and for integrated gradients.

Times are the best of ``--repeats`` runs (noise on a shared machine only adds time).

On a machine shared with other jobs, ``--threads 1`` keeps the two measurements
comparable (several threads waiting on busy cores slow each pass unevenly).

Run: ``python benchmarks/attribution_speed.py [--batch 8] [--pos 16] [--measured-cells 64]
[--threads 1]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings

# A benchmark never downloads: its GPT-2 checkpoints are made here, with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from devices import add_device_option, clock, describe, resolve
from graft_speed import gpt2_small, placeholder_tokenizer

import grafting_lens as gl
from grafting_lens import study as experiments
from grafting_lens.analysis.attribution import AttributionPlan
from grafting_lens.analysis.batch import TokenizedExamples, tokenize_examples
from grafting_lens.worlds import data


def best_of(function, repeats: int, device: torch.device) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = clock(device)
        result = function()
        times.append(clock(device) - start)
    return min(times), result


def speed(args: argparse.Namespace) -> dict:
    device = resolve(args.device)
    model_set = gl.load_models(
        gpt2_small(0), gpt2_small(1), tokenizer=placeholder_tokenizer(), device=device
    )
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.pos)
    vocabulary = model_set.base.cfg.d_vocab
    batch = TokenizedExamples(
        examples=None,
        tokens=torch.randint(1, vocabulary, shape, generator=generator),
        attention_mask=torch.ones(shape, dtype=torch.long),
        target_ids=torch.randint(1, vocabulary, (args.batch,), generator=generator),
        target_full_ids=None,
        spans={},
    )
    options = dict(
        components="all",
        layers="all",
        positions="each",
        batch_size=args.batch,
        rows_per_forward=args.rows_per_forward,
        progress=False,
    )
    attribution_s, result = best_of(
        lambda: gl.attribute_grafts(model_set, batch, **options), args.repeats, device
    )
    cells = len(result.frame)
    # The exact sweep: each cell grafted alone, blocks of cells per pass, timed on a
    # subset spread over components, layers and positions.
    plan = AttributionPlan(
        model_set,
        batch,
        metric="logprob",
        direction="sufficiency",
        source=1,
        start=None,
        **options,
    )
    stride = max(1, cells // args.measured_cells)
    subset = [(cell,) for cell in plan.cells[::stride][: args.measured_cells]]
    with torch.inference_mode():
        plan.exact(subset[:2])  # warm up
        subset_s, _ = best_of(lambda: plan.exact(subset), args.repeats, device)
    exact_sweep_s = subset_s / len(subset) * cells
    return {
        "cells": cells,
        "prompts": args.batch,
        "tokens": args.pos,
        "attribution_s": round(attribution_s, 3),
        "exact_measured_cells": len(subset),
        "exact_measured_s": round(subset_s, 3),
        "exact_sweep_s": round(exact_sweep_s, 1),
        "exact_sweep_extrapolated": True,
        "speedup": round(exact_sweep_s / attribution_s, 1),
    }


def agreement() -> dict:
    model_set, relations, _ = experiments.toy_setup("position", progress=False)
    batch = tokenize_examples(data.make_examples(relations, prompt="headline"), model_set.tokenizer)
    found = {}
    for method in ("gradient", "integrated"):
        start = time.perf_counter()
        result = gl.attribute_grafts(
            model_set,
            batch,
            positions=("FE", "LT", "(FE+LT)^C"),
            method=method,
            verify="all",
            progress=False,
        )
        found[method] = {
            "seconds": round(time.perf_counter() - start, 1),
            "spearman": {
                row.positions: round(float(row.spearman), 3)
                for row in result.agreement.itertuples()
            },
        }
    return {"toy_prompts": len(batch), "toy_cells": len(result.frame), "toy": found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pos", type=int, default=16)
    parser.add_argument("--measured-cells", type=int, default=64)
    parser.add_argument("--rows-per-forward", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--skip-toy", action="store_true", help="only the speed measurement")
    add_device_option(parser)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    line = speed(args)
    if not args.skip_toy:
        line.update(agreement())
    line.update(
        {
            **describe(resolve(args.device)),
            "python": platform.python_version(),
            "machine": platform.machine(),
        }
    )
    print(json.dumps(line))


if __name__ == "__main__":
    main()
