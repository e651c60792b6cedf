"""Benchmark: a lazily loaded donor's resident memory through ``grafting-lens run ... --lazy``.

``benchmarks/lazy_memory.py`` measures one graft called from Python; this one runs a
whole experiment through the command (the runner, the run directory, the precision
check of the REFERENCE semantics, the report), where any door that reads the donor
whole would show. It saves two Llama-shaped checkpoints with random weights (12
layers, d_model 1,024, d_mlp 2,816, vocabulary 4,096: 168M parameters) in bfloat16,
with a byte-level tokenizer, and runs ``grafting-lens run component_baseline --model
BASE --donor DONOR --quick --lazy`` in a fresh process (REFERENCE semantics: the models
run in float32, so every tensor read is a copy, not a memory-mapped page).

Measured in that process: resident memory (``/proc/self/statm``, after handing freed
heap back) right after the models load and after the run. The donor's resident memory
is that growth less the run's own residue (caches, tables, about 90 MB here), measured
as the growth of the same run without ``--lazy``, whose donor was resident before it
started. ``grafted_bytes`` is what the run's grafts took from the donor:
the float32 bytes of the checkpoint tensors of every slot the grafts asked the donor
for (the experiment's DONOR configuration grafts every component, so here that is
the whole donor: what is measured is that no door reads it a second time, whole).
Target: ``ratio_to_grafted`` <= 1.1. The same run without ``--lazy`` is measured
for comparison (the donor then loads whole, before the run).

Prints one JSON object. Run: ``python benchmarks/lazy_run_memory.py [--dir DIR]``
(``DIR`` keeps the checkpoints between runs; default: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from lazy_memory import rss_now
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 4096


def save_checkpoints(root: Path) -> None:
    """Base and donor (random, bfloat16) with a byte-level tokenizer trained on the world's text."""
    from grafting_lens.worlds import data

    if all((root / name / "model.safetensors").is_file() for name in ("base", "donor")):
        return
    relations = data.make_relations("fake_movies_real_actors", n=200, seed=0)
    corpus = [" ".join(str(value) for value in vars(r).values()) for r in relations]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus * 4, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    config = LlamaConfig(
        vocab_size=len(wrapped),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    for name, seed in (("base", 0), ("donor", 1)):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(root / name)
        wrapped.save_pretrained(root / name)


def measure(root: Path, lazy: bool) -> dict:
    """One command run, in this (fresh) process."""
    import grafting_lens.study as study
    from grafting_lens.models.sources import LazySource
    from grafting_lens.study.run_command import run_experiment_command

    seen: dict = {}
    setup = study.setup_experiment

    def recording_setup(*args, **kwargs):
        made = setup(*args, **kwargs)
        seen["models"] = made.models
        seen["rss_loaded"] = rss_now()
        return made

    asked: set[str] = set()
    module = LazySource.module

    def recording_module(self, slot):
        asked.add(slot.path)
        return module(self, slot)

    out = root / ("out_lazy" if lazy else "out_whole")
    shutil.rmtree(out, ignore_errors=True)  # a finished run would be read back, not run
    study.setup_experiment = recording_setup  # what run_command calls
    LazySource.module = recording_module  # type: ignore[method-assign]
    argv = [
        "--model",
        str(root / "base"),
        "--donor",
        str(root / "donor"),
        "--quick",
        "--n-relations",
        "8",
        "--n-examples",
        "8",
        "--out",
        str(out),
        "--no-png",
        "--no-progress",
        "--threads",
        "2",
    ] + (["--lazy"] if lazy else [])
    start = time.perf_counter()
    status = run_experiment_command("component_baseline", argv)
    seconds = time.perf_counter() - start
    if status:
        raise SystemExit(f"grafting-lens run exited with {status}")
    after = rss_now()
    models_ = seen["models"]
    donor = models_.sources[1]
    memory = models_.memory()
    result = {
        "lazy": lazy,
        "seconds": round(seconds, 1),
        "rss_loaded_bytes": seen["rss_loaded"],
        "rss_after_run_bytes": after,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "donor_full_bytes": int(donor.full_bytes()),
        "donor_resident_bytes_by_memory": int(memory.iloc[1]["resident_bytes"]),
    }
    if lazy:
        every = [slot for key_slots in models_.layout.slots.values() for slot in key_slots]
        slots = [slot for slot in every if slot.path in asked]
        result["grafted_bytes"] = sum(donor._nbytes(name) for name in donor._slot_names(slots))
        result["slots_read"] = len(asked)
    return result


def run_child(root: Path, lazy: bool) -> dict:
    arguments = [sys.executable, __file__, "--dir", str(root), "--child"]
    run = subprocess.run(
        arguments + (["--lazy"] if lazy else []), check=True, capture_output=True, text=True
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--lazy", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.dir, args.lazy)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        root = args.dir or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        save_checkpoints(root)
        lazy = run_child(root, lazy=True)
        whole = run_child(root, lazy=False)
    # What a run keeps besides the donor (caches, tables): the growth of the run whose
    # donor was resident before it started.
    residue = whole["rss_after_run_bytes"] - whole["rss_loaded_bytes"]
    donor = lazy["rss_after_run_bytes"] - lazy["rss_loaded_bytes"] - residue
    print(
        json.dumps(
            {
                "benchmark": "lazy_run_memory",
                "command": "grafting-lens run component_baseline --model BASE --donor DONOR "
                "--quick --n-relations 8 --n-examples 8 --lazy",
                "shape": "Llama, 12 layers, d_model 1024, d_mlp 2816, vocab 4096, stored "
                "bfloat16, run in float32 (REFERENCE semantics)",
                "target": "ratio_to_grafted <= 1.1",
                "grafted_bytes": lazy["grafted_bytes"],
                "donor_full_bytes": lazy["donor_full_bytes"],
                "run_residue_bytes": residue,
                "donor_rss_bytes": donor,
                "ratio_to_grafted": round(donor / lazy["grafted_bytes"], 3),
                "lazy": lazy,
                "whole": whole,
                "machine": platform.processor() or platform.machine(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
