"""Benchmark: the single grafted pass against the token-by-token reference and a plain forward.

Builds two GPT-2-small-shaped checkpoints with random weights (12 layers,
d_model 768, vocabulary 50,257; nothing is downloaded), grafts ``--batch`` prompts of
``--pos`` tokens on ``--threads`` threads, and prints one JSON line:

* ``speedup``: reference time / single-pass time, a random mask over every component;
* ``max_abs_diff``: the largest logit difference between single pass and reference;
* ``overhead``: a pass with half of the positions grafted in every component, over a
  plain forward of the base, both with every position's logits (``logits="all"``). The
  grafted half is one span in the middle of every prompt, shaped as the paper's positions
  are (an entity, the last token, their complements: runs), so the dispatchers take and put
  back rows by slices;
* ``overhead_scattered``: the same with every other position grafted, which forms no runs:
  rows are gathered and put back by index;
* ``overhead_last``: ``overhead``'s pass with the last token's logits alone on both sides
  (``graft_forward``'s default ``logits="last"``; the base with ``logits_to_keep=1``);
* ``split_kernel``: what the split linear layers ran on: ``"onednn"`` where MKL runs on a
  CPU by another vendor than Intel that has AVX-512, else ``"modules"`` (each module's own
  forward; see ``grafting_lens/engine/products.py``), and ``split_kernel_why`` the rule's
  reason on this machine (``overhead`` and ``overhead_last`` are the chosen kernel's);
  ``overhead_onednn`` and ``overhead_last_onednn``, ``overhead_modules`` and
  ``overhead_last_modules``: the same passes with every split layer on oneDNN, or on its
  module's own kernel, whichever this machine chose, measured in the same rounds;
* ``rank_overhead``: a rank-16 graft of every MLP weight (``mlp_in``, ``mlp_out``;
  :meth:`~grafting_lens.ModelSet.directions`) at ``overhead``'s half of the positions, over a
  plain forward (``rank16``) and over the whole-matrix graft of the same cells
  (``rank16_vs_whole``; ``whole``: that graft over a plain forward), with the SVDs' one-time
  ``svd_seconds`` and ``svd_bytes``;
* ``routing_overhead``: a pass taking every component from the donor at every position,
  over the donor's own plain forward: what routing costs when no product is split
  (checks, installing the dispatchers, Python per module);
* ``split_products``: the time ``overhead``'s pass spends in matrix products beyond the
  plain forward's, as a share of the plain forward, from ``torch.profiler``: each grafted
  product runs twice, once per checkpoint on its own rows (negative where the split
  layers' kernel is faster than the plain forward's);
* ``gather_scatter``: the share of ``overhead``'s pass (and of ``overhead_scattered``'s)
  spent in the dispatchers' copies (``index_select``, ``cat``; ``index_copy_`` before), from ``torch.profiler``.

What a half graft cannot avoid: every grafted linear layer reads both checkpoints'
weights, once for the base's positions and once for the donor's. At batch 1 a pass is
bound by reading weights (a GPT-2 768x3072 product on 12 rows takes about as long as on
6), so ``overhead`` tends to the share of the pass that is grafted products plus one.
At batch 8 a product is mostly arithmetic, but two calls on half the rows cost more than
one on all of them: on the AMD EPYC of the development machine MKL's ``sgemm`` takes 7.6 ms
for a 768x3072 product on 128 rows and 8.4 ms as two calls on 64 (``overhead_modules``),
oneDNN 6.9 ms for the two calls (``overhead_onednn``).

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
from grafting_lens.engine import products


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


# The operations the dispatchers copy rows with (index_copy_ until 0.1.x), and the matrix
# products a graft splits.
COPIES = ("aten::index_select", "aten::cat", "aten::index_copy_")
PRODUCTS = ("aten::addmm", "aten::mm", "aten::bmm", "mkldnn::_linear_pointwise")
# The kernels a split linear layer can run on (grafting_lens.engine.products), each measured.
KERNELS = ("onednn", "modules")
ONEDNN = torch.ops.mkldnn._linear_pointwise


def profiled(function: Callable[[], object], repeats: int = 3) -> dict[str, float]:
    """Seconds of one run (the fastest of ``repeats``) in all, in copies and in products."""
    runs = []
    for _ in range(repeats):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            start = time.perf_counter()
            function()
            total = time.perf_counter() - start
        events = profile.key_averages()
        runs.append(
            {
                "total": total,
                **{
                    name: sum(e.self_cpu_time_total for e in events if e.key in keys) / 1e6
                    for name, keys in (("copies", COPIES), ("products", PRODUCTS))
                },
            }
        )
    return min(runs, key=lambda run: run["total"])


def share(seconds: float, total: float) -> dict[str, float]:
    return {"seconds": round(seconds, 4), "share": round(seconds / total, 4)}


def cpu_model() -> str | None:
    """The CPU's model name (Linux), which the matrix products' costs depend on."""
    try:
        with open("/proc/cpuinfo") as info:
            names = [
                line.split(":", 1)[1].strip() for line in info if line.startswith("model name")
            ]
    except OSError:
        return None
    return names[0] if names else None


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
    half[:, args.pos // 4 : args.pos // 4 + args.pos // 2] = 1
    half_mask = gl.GraftMask.from_dict(model_set, {pair: half for pair in pairs})
    scattered = torch.zeros(shape, dtype=torch.long)
    scattered[:, ::2] = 1
    scattered_mask = gl.GraftMask.from_dict(model_set, {pair: scattered for pair in pairs})
    donor_mask = gl.GraftMask.from_dict(model_set, {pair: torch.ones_like(half) for pair in pairs})
    mlp = [pair for pair in pairs if pair[0] in ("mlp_in", "mlp_out")]
    whole_mask = gl.GraftMask.from_dict(model_set, {pair: half for pair in mlp})
    rank_set = model_set.directions(1, rank=16)
    rank_mask = gl.GraftMask.from_dict(rank_set, {pair: 2 * half for pair in mlp})
    start = clock(device)
    for pair in mlp:  # the SVDs, once
        for slot in rank_set.slots(*pair):
            rank_set.sources[2].module(slot)
    svd_seconds = clock(device) - start

    def graft(mask: gl.GraftMask, logits: str = "all") -> Callable[[], object]:
        return lambda: gl.graft_forward(model_set, tokens, mask, logits=logits)

    def on(kernel: str, function: Callable[[], object]) -> Callable[[], object]:
        """``function`` with every split linear layer on ``kernel``: "onednn" or "modules"."""

        def run() -> object:
            chosen = products.KERNEL
            products.KERNEL = ONEDNN if kernel == "onednn" else None
            try:
                return function()
            finally:
                products.KERNEL = chosen

        return run

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
                "half_scattered": graft(scattered_mask),
                **{f"half_{k}": on(k, graft(half_mask)) for k in KERNELS},
                **{f"half_last_{k}": on(k, graft(half_mask, "last")) for k in KERNELS},
                "donor_graft": graft(donor_mask),
                "rank16_mlp": lambda: gl.graft_forward(rank_set, tokens, rank_mask, logits="all"),
                "whole_mlp": graft(whole_mask),
                "plain": lambda: model_set.base(tokens),
                "plain_last": lambda: model_set.base(tokens, logits_to_keep=1),
                "donor_plain": lambda: model_set[1](tokens),
            },
            args.repeats,
            device,
        )
        plain_run = profiled(lambda: model_set.base(tokens))
        half_run = profiled(graft(half_mask))
        scattered_run = profiled(graft(scattered_mask))

    best = {name: min(values) for name, values in times.items()}
    kernel = "onednn" if products.KERNEL is not None else "modules"
    print(
        json.dumps(
            {
                "speedup": round(min(reference_s) / best["single"], 2),
                "max_abs_diff": float((single - reference).abs().max()),
                "overhead": round(best[f"half_{kernel}"] / best["plain"], 3),
                "overhead_scattered": round(best["half_scattered"] / best["plain"], 3),
                "overhead_last": round(best[f"half_last_{kernel}"] / best["plain_last"], 3),
                "split_kernel": kernel,
                "split_kernel_why": products.WHY,
                **{f"overhead_{k}": round(best[f"half_{k}"] / best["plain"], 3) for k in KERNELS},
                **{
                    f"overhead_last_{k}": round(best[f"half_last_{k}"] / best["plain_last"], 3)
                    for k in KERNELS
                },
                "routing_overhead": round(best["donor_graft"] / best["donor_plain"], 3),
                "rank_overhead": {
                    "rank16": round(best["rank16_mlp"] / best["plain"], 3),
                    "whole": round(best["whole_mlp"] / best["plain"], 3),
                    "rank16_vs_whole": round(best["rank16_mlp"] / best["whole_mlp"], 3),
                    "svd_seconds": round(svd_seconds, 2),
                    "svd_bytes": rank_set.sources[2].svd_bytes(),
                },
                "split_products": share(
                    half_run["products"] - plain_run["products"], plain_run["total"]
                ),
                "gather_scatter": share(half_run["copies"], half_run["total"]),
                "gather_scatter_scattered": share(scattered_run["copies"], scattered_run["total"]),
                "times": {
                    "reference": spread(reference_s),
                    **{name: spread(values) for name, values in times.items()},
                },
                "batch": args.batch,
                "pos": args.pos,
                "repeats": args.repeats,
                "model": "gpt2-small-shaped, random weights",
                "cpu_model": cpu_model(),
                **describe(device),
            }
        )
    )


if __name__ == "__main__":
    main()
