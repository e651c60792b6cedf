"""Benchmark: the position experiment's peak memory with every position's logits or the scored ones.

The position experiment scores each row at its last token. With a 49,152-token
vocabulary (SmolLM2's) the logits of every position are most of a pass's memory:
``rows x pos x 49,152`` floats. The runner computes the scored token's only
(``RunOptions(logits="scored")``, the default, ``logits_to_keep`` in transformers);
``logits="all"`` computes every position's, as before, with the same scores.

A random Llama with SmolLM2-135M's vocabulary (49,152) and a small body (4 layers,
d_model 256) runs ``run_experiment`` over the position configurations, 32 relations,
headline and Q&A prompts, 8 examples a pass (every configuration of them: 8 x 8 = 64
rows), in float32, each mode in a fresh process. Measured: the peak memory a run adds
above the loaded models: on a CPU the peak resident set (``ru_maxrss``) less the
resident set after loading; on CUDA ``torch.cuda.max_memory_allocated`` less what was
allocated after loading (synchronised first). The scores of both modes are compared.

Prints one JSON object. Run: ``python benchmarks/position_memory.py [--device cuda]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from lazy_memory import rss_now
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import grafting_lens as gl
from grafting_lens.study import POSITION_CONFIGS, make_test_sets, run_experiment
from grafting_lens.worlds import data

VOCAB = 49_152


def tokenizer_for(relations: list) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the relations' text (its ids are all below VOCAB)."""
    corpus = [" ".join(str(value) for value in vars(r).values()) for r in relations]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def model(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(mode: str, device: torch.device) -> dict:
    """One run of the experiment, in this (fresh) process."""
    relations = data.make_relations("fake_movies_real_actors", n=32, seed=0)
    test_sets = make_test_sets(relations, prompts=("headline", "qa"))
    pair = gl.load_models(model(0), model(1), tokenizer=tokenizer_for(relations), device=device)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = rss_now()
    start = time.perf_counter()
    results = run_experiment(
        pair, test_sets, POSITION_CONFIGS, batch_size=8, logits=mode, progress=False
    )
    synchronize(device)
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "mode": mode,
        "peak_added_bytes": int(peak),
        "seconds": round(seconds, 2),
        "rows": len(results),
        "rank_sum": int(results["target_rank"].sum()),
        "prob_sum": float(results["target_prob"].sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--mode", choices=("all", "scored"), default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.mode is not None:  # a child: one measurement, one JSON line
        print(json.dumps(measure(args.mode, device)))
        return
    runs = {}
    for mode in ("all", "scored"):
        command = [sys.executable, __file__, "--mode", mode, "--device", args.device]
        run = subprocess.run(command, check=True, capture_output=True, text=True)
        runs[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    before, after = runs["all"]["peak_added_bytes"], runs["scored"]["peak_added_bytes"]
    print(
        json.dumps(
            {
                "benchmark": "position_memory",
                "shape": "Llama, vocab 49,152 (SmolLM2's), 4 layers, d_model 256, float32, tied",
                "run": "run_experiment(POSITION_CONFIGS), 32 relations x (headline, qa), "
                "batch_size 8 (64 rows a pass)",
                "device": str(device),
                "measure": "CUDA max_memory_allocated above the loaded models"
                if device.type == "cuda"
                else "peak resident set (ru_maxrss) above the loaded models",
                "peak_added_bytes_all_positions": before,
                "peak_added_bytes_scored_only": after,
                "reduction": round(before / max(after, 1), 2),
                "same_scores": (runs["all"]["rank_sum"], runs["all"]["prob_sum"])
                == (runs["scored"]["rank_sum"], runs["scored"]["prob_sum"]),
                "runs": runs,
                "machine": torch.cuda.get_device_name(device)
                if device.type == "cuda"
                else platform.processor() or platform.machine(),
                "torch_threads": torch.get_num_threads(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
