"""Benchmark: a batched (layer x position) resid_pre sweep against TransformerLens's loop.

Builds two GPT-2-small-shaped checkpoints with random weights (12 layers,
d_model 768, vocabulary 50,257; nothing is downloaded), and sweeps patching the
donor's ``resid_pre`` into the base at every (layer, position) cell of 16-token
prompts, twice on the same inputs:

* :func:`grafting_lens.patching.patch.resid_patch_sweep`: every cell a block of rows of
  one large batch, at most ``--chunk-size`` rows per forward pass, each pass
  computed only from the first position and the first layer its cells patch;
* TransformerLens's ``get_act_patch_resid_pre`` (one forward pass per cell), with
  the donor cache it needs (``models[1].run_with_cache``) counted in its time, as
  the sweep counts its own donor pass.

The batched sweep runs twice: handing the metric every position's logits, as
TransformerLens does (``speedup``), and with ``logits="last"``, which computes
the unembedding only at the last token the metric reads (``speedup_last_token``).

Prints one JSON line: both speedups (TransformerLens time / batched time),
``max_abs_diff`` (largest difference between either batched sweep and
TransformerLens's values), timings and the settings. The speedup depends on the hardware: TransformerLens's loop
runs 192 small forward passes, which lose most on a GPU or on several CPU threads
(fixed costs per pass) and least on one CPU thread (compute-bound). Compare with
``--threads 1``. Takes a few minutes on a laptop CPU; shrink it for a smoke run:

    python benchmarks/patching_speed.py --layers 2 --pos 4
"""

from __future__ import annotations

import argparse
import json
import os

# A benchmark never downloads: its checkpoints are made here, with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from devices import add_device_option, clock, describe, resolve
from graft_speed import gpt2_small, placeholder_tokenizer
from transformer_lens import patching as tl_patching

import grafting_lens as gl
from grafting_lens.patching.patch import resid_patch_sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="sweep layers 0..N-1 (max 12)")
    parser.add_argument("--pos", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--batch", type=int, default=1, help="prompts per cell")
    parser.add_argument("--chunk-size", type=int, default=64, help="rows per batched forward")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    parser.add_argument("--seed", type=int, default=0)
    add_device_option(parser)
    args = parser.parse_args()
    device = resolve(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    models = gl.load_models(
        gpt2_small(0), gpt2_small(1), tokenizer=placeholder_tokenizer(), device=device
    )
    if not 1 <= args.layers <= models.n_layers:
        parser.error(f"--layers must be in 1..{models.n_layers}")
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, models.base.cfg.d_vocab, (args.batch, args.pos), generator=generator)
    tokens = tokens.to(device)
    answer, distractor = 11, 13

    def per_prompt(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, answer] - logits[:, -1, distractor]

    def scalar(logits: torch.Tensor) -> torch.Tensor:
        return per_prompt(logits).mean()

    layers = list(range(args.layers))
    forwards = {"batched": 0, "last_token": 0, "transformer_lens": 0}
    counting = ["batched"]

    def count(module, args, kwargs):
        forwards[counting[0]] += 1

    for model in models:  # one Hugging Face forward per pass, whoever runs it
        model.original_model.register_forward_pre_hook(count, with_kwargs=True)
    with torch.no_grad():
        models.base(tokens)  # warm-up

        start = clock(device)
        batched, _ = resid_patch_sweep(
            models, tokens, per_prompt, layers=layers, chunk_size=args.chunk_size, progress=False
        )
        batched_s = clock(device) - start
        counting[0] = "last_token"
        start = clock(device)
        last_token, _ = resid_patch_sweep(
            models,
            tokens,
            per_prompt,
            layers=layers,
            chunk_size=args.chunk_size,
            progress=False,
            logits="last",
        )
        last_token_s = clock(device) - start

        counting[0] = "transformer_lens"
        start = clock(device)
        _, donor_cache = models[1].run_with_cache(tokens)
        if args.layers == models.n_layers:
            reference = tl_patching.get_act_patch_resid_pre(
                models.base, tokens, donor_cache, scalar
            )
        else:  # the same loop over fewer cells
            index = tl_patching.make_df_from_ranges([args.layers, args.pos], ["layer", "pos"])
            reference = tl_patching.generic_activation_patch(
                models.base,
                tokens,
                donor_cache,
                scalar,
                patch_setter=tl_patching.layer_pos_patch_setter,
                activation_name="resid_pre",
                index_df=index,
            ).reshape(args.layers, args.pos)
        reference_s = clock(device) - start

    cells = args.layers * args.pos
    print(
        json.dumps(
            {
                "speedup": round(reference_s / batched_s, 2),
                "speedup_last_token": round(reference_s / last_token_s, 2),
                "max_abs_diff": float(
                    max(
                        (batched.cpu() - reference.cpu()).abs().max(),
                        (last_token.cpu() - reference.cpu()).abs().max(),
                    )
                ),
                "value_range": float(reference.max() - reference.min()),
                "batched_s": round(batched_s, 2),
                "last_token_s": round(last_token_s, 2),
                "transformer_lens_s": round(reference_s, 2),
                "cells": cells,
                # Counted: the donor's pass, the unpatched pass that is resumed, its
                # check, the patched passes; TransformerLens: the donor's and one per cell.
                "batched_forwards": forwards["batched"],
                "last_token_forwards": forwards["last_token"],
                "transformer_lens_forwards": forwards["transformer_lens"],
                "layers": args.layers,
                "pos": args.pos,
                "batch": args.batch,
                "chunk_size": args.chunk_size,
                "model": "gpt2-small-shaped, random weights",
                **describe(device),
            }
        )
    )


if __name__ == "__main__":
    main()
