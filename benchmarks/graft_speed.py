"""Benchmark: the single grafted pass against the token-by-token reference.

Builds two GPT-2-small-shaped checkpoints with random weights (12 layers,
d_model 768, vocabulary 50,257; nothing is downloaded), grafts a random mask over
every component with 16-token prompts, and prints one JSON line:

* ``speedup``: reference time / single-pass time, on the same inputs;
* ``max_abs_diff``: the largest logit difference between the two;
* ``overhead``: single pass with half of the positions grafted in every
  component, over a plain forward of the base.

Grafted linear layers run through oneDNN on CPUs (see ``grafting_lens.kernels``),
the plain forward and the reference through PyTorch's default kernel, so the line
also separates what the kernel buys from what the single pass buys:

* ``speedup_torch_kernels``: the same speedup with oneDNN switched off
  (``torch.backends.mkldnn.enabled = False``), every product on PyTorch's kernel;
* ``dispatch_overhead``: the half-grafted pass over a pass whose mask names the
  base everywhere, on the same kernels: the cost of gathering and scattering.

Every time is the best of several runs (``--repeats`` for the single pass and the
plain forward, ``--reference-repeats`` for the reference), as ``timeit`` advises:
on a shared machine noise only ever adds time.

Run: ``python benchmarks/graft_speed.py [--batch 8] [--pos 16] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

# A benchmark never downloads: its checkpoints are made here, with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tokenizers import Tokenizer, models
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import grafting_lens as gl
from grafting_lens import kernels


def gpt2_small(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config()).eval()


def placeholder_tokenizer() -> PreTrainedTokenizerFast:
    """The bridge wants a tokenizer; the benchmark feeds token ids directly."""
    vocab = {"<|endoftext|>": 0, "a": 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


def timed(function, repeats: int, warm_up: bool = True) -> float:
    """The best of ``repeats`` runs: on a shared machine noise only ever adds time."""
    if warm_up:
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pos", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--reference-repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model_set = gl.load_models(gpt2_small(0), gpt2_small(1), tokenizer=placeholder_tokenizer())
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.pos)
    tokens = torch.randint(0, model_set.base.cfg.d_vocab, shape, generator=generator)
    pairs = model_set.pairs
    random_mask = gl.GraftMask.from_dict(
        model_set, {pair: torch.randint(0, 2, shape, generator=generator) for pair in pairs}
    )
    half = torch.zeros(shape, dtype=torch.long)
    half[:, ::2] = 1
    half_mask = gl.GraftMask.from_dict(model_set, {pair: half for pair in pairs})
    base_mask = gl.GraftMask.from_dict(model_set, {pair: torch.zeros_like(half) for pair in pairs})

    def graft(mask):
        return lambda: gl.graft_forward(model_set, tokens, mask)

    with torch.inference_mode():
        single = gl.graft_forward(model_set, tokens, random_mask)
        reference = gl.graft_forward_reference(model_set, tokens, random_mask)
        reference_s = timed(
            lambda: gl.graft_forward_reference(model_set, tokens, random_mask),
            args.reference_repeats,
            warm_up=False,  # the run above warmed it up
        )
        single_s = timed(graft(random_mask), args.repeats)
        plain_s = timed(lambda: model_set.base(tokens), args.repeats)
        half_s = timed(graft(half_mask), args.repeats)
        base_s = timed(graft(base_mask), args.repeats)
        torch.backends.mkldnn.enabled = False
        try:
            single_torch_s = timed(graft(random_mask), args.repeats)
        finally:
            torch.backends.mkldnn.enabled = True

    print(
        json.dumps(
            {
                "speedup": round(reference_s / single_s, 2),
                "max_abs_diff": float((single - reference).abs().max()),
                "overhead": round(half_s / plain_s, 3),
                "linear_kernel": "onednn" if kernels._onednn_available() else "torch",
                "speedup_torch_kernels": round(reference_s / single_torch_s, 2),
                "dispatch_overhead": round(half_s / base_s, 3),
                "single_pass_s": round(single_s, 4),
                "single_pass_torch_kernels_s": round(single_torch_s, 4),
                "reference_s": round(reference_s, 3),
                "plain_forward_s": round(plain_s, 4),
                "half_grafted_s": round(half_s, 4),
                "base_mask_s": round(base_s, 4),
                "batch": args.batch,
                "pos": args.pos,
                "model": "gpt2-small-shaped, random weights",
                "threads": torch.get_num_threads(),
                "cpu": platform.processor() or platform.machine(),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
