"""Benchmark: the single grafted pass against the token-by-token reference and a plain forward.

Builds two GPT-2-small-shaped checkpoints with random weights (12 layers,
d_model 768, vocabulary 50,257; nothing is downloaded), grafts ``--batch`` prompts of
``--pos`` tokens on ``--threads`` threads, and prints one JSON line:

* ``speedup``: reference time / single-pass time, a random mask over every component;
* ``max_abs_diff``: the largest logit difference between single pass and reference;
* ``overhead``: a pass with half of the positions grafted in every component, over a
  plain forward of the base, both with every position's logits (``logits="all"``);
* ``overhead_last``: the same with the last token's logits alone on both sides
  (``graft_forward``'s default ``logits="last"``; the base with ``logits_to_keep=1``);
* ``routing_overhead``: a pass taking every component from the donor at every position,
  over the donor's own plain forward: what routing costs when no product is split
  (checks, installing the dispatchers, Python per module);
* ``gather_scatter``: the share of the half-grafted pass spent in the dispatcher's
  gathers and scatters (``index_select``/``index_copy_``), from ``torch.profiler``.

What a half graft cannot avoid: every grafted linear layer reads both checkpoints'
weights, once for the base's positions and once for the donor's. At batch 1 a pass is
bound by reading weights (a GPT-2 768x3072 product on 12 rows takes about as long as on
6), so ``overhead`` tends to the share of the pass that is grafted products plus one;
``routing_overhead`` is what the engine adds on top, and tends to 1.

Timings are taken in rounds: each round runs every variant once, in turn, so a slow
spell on a shared machine slows all of them. ``times`` gives each variant's best,
median and worst of ``--repeats`` rounds (the reference: ``--reference-repeats``);
ratios use the best, as ``timeit`` advises: noise only ever adds time.

Run: ``python benchmarks/graft_speed.py [--batch 8] [--pos 16] [--threads 1] [--device cuda]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

# A benchmark never downloads: its checkpoints are made here, with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from devices import add_device_option, clock, describe, resolve
from tokenizers import Tokenizer, models
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import grafting_lens as gl


def gpt2_small(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config()).eval()


CPU = torch.device("cpu")


def placeholder_tokenizer() -> PreTrainedTokenizerFast:
    """The bridge wants a tokenizer; the benchmark feeds token ids directly."""
    vocab = {"<|endoftext|>": 0, "a": 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


def rounds(
    variants: dict[str, Callable[[], object]],
    repeats: int,
    device: torch.device = CPU,
) -> dict[str, list[float]]:
    """Seconds of each variant in ``repeats`` rounds, every variant once per round, after a warm-up.

    The clock is read with ``device`` synchronised, so a GPU's queued work counts.
    """
    for function in variants.values():
        function()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, function in variants.items():
            start = clock(device)
            function()
            times[name].append(clock(device) - start)
    return times


def spread(times: list[float]) -> dict[str, float]:
    return {
        "best": round(min(times), 4),
        "median": round(statistics.median(times), 4),
        "worst": round(max(times), 4),
    }


def gather_scatter_share(function: Callable[[], object]) -> dict[str, float]:
    """Seconds of one run inside the dispatcher's gathers and scatters, and their share of it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        function()
        total = time.perf_counter() - start
    copies = sum(
        event.self_cpu_time_total
        for event in profile.key_averages()
        if event.key in ("aten::index_select", "aten::index_copy_")
    )
    return {"seconds": round(copies / 1e6, 4), "share": round(copies / 1e6 / total, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pos", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--reference-repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    add_device_option(parser)
    args = parser.parse_args()
    device = resolve(args.device)
    torch.set_num_threads(args.threads)

    model_set = gl.load_models(
        gpt2_small(0), gpt2_small(1), tokenizer=placeholder_tokenizer(), device=device
    )
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.pos)
    tokens = torch.randint(0, model_set.base.cfg.d_vocab, shape, generator=generator)
    tokens = tokens.to(device)
    pairs = model_set.pairs
    random_mask = gl.GraftMask.from_dict(
        model_set, {pair: torch.randint(0, 2, shape, generator=generator) for pair in pairs}
    )
    half = torch.zeros(shape, dtype=torch.long)
    half[:, ::2] = 1
    half_mask = gl.GraftMask.from_dict(model_set, {pair: half for pair in pairs})
    donor_mask = gl.GraftMask.from_dict(model_set, {pair: torch.ones_like(half) for pair in pairs})

    def graft(mask: gl.GraftMask, logits: str = "all") -> Callable[[], object]:
        return lambda: gl.graft_forward(model_set, tokens, mask, logits=logits)

    with torch.inference_mode():
        single = graft(random_mask)()
        reference = gl.graft_forward_reference(model_set, tokens, random_mask)
        reference_s = rounds(
            {"reference": lambda: gl.graft_forward_reference(model_set, tokens, random_mask)},
            args.reference_repeats,
            device,
        )["reference"]
        times = rounds(
            {
                "single": graft(random_mask),
                "half": graft(half_mask),
                "half_last": graft(half_mask, "last"),
                "donor_graft": graft(donor_mask),
                "plain": lambda: model_set.base(tokens),
                "plain_last": lambda: model_set.base(tokens, logits_to_keep=1),
                "donor_plain": lambda: model_set[1](tokens),
            },
            args.repeats,
            device,
        )
        copies = gather_scatter_share(graft(half_mask))

    best = {name: min(values) for name, values in times.items()}
    print(
        json.dumps(
            {
                "speedup": round(min(reference_s) / best["single"], 2),
                "max_abs_diff": float((single - reference).abs().max()),
                "overhead": round(best["half"] / best["plain"], 3),
                "overhead_last": round(best["half_last"] / best["plain_last"], 3),
                "routing_overhead": round(best["donor_graft"] / best["donor_plain"], 3),
                "gather_scatter": copies,
                "times": {
                    "reference": spread(reference_s),
                    **{name: spread(values) for name, values in times.items()},
                },
                "batch": args.batch,
                "pos": args.pos,
                "repeats": args.repeats,
                "model": "gpt2-small-shaped, random weights",
                **describe(device),
            }
        )
    )


if __name__ == "__main__":
    main()
