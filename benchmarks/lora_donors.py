"""Benchmark: a LoRA donor against the same adapter merged into a full donor.

For GPT-2-, Llama- and Gemma-shaped models (12 layers, d_model 768, random weights;
nothing is downloaded) and adapters of rank 8 and 64 on every attention and MLP
matrix (PEFT, random factors), saves the base, each adapter and, with PEFT's
``merge_and_unload``, each merged donor as directories. On 8 prompts of 16 tokens it
then measures:

* logits: ``graft_max_abs_diff``, a graft of every component at half of the
  positions, and ``alone_max_abs_diff``, the donor run alone (``models[1]``), LoRA
  against merged in float32 (target <= 1e-4), beside ``donor_effect`` (how far the
  donor's logits are from the base's, so that the comparison means something) and
  the logits' scale;
* time: the graft and the donor alone, both donors loaded in one process and timed
  in turn, best of ``--repeats`` each, so that the load of a shared machine weighs
  on both alike;
* memory, each donor in a fresh process: what it holds (``resident_bytes`` of
  :meth:`ModelSet.memory`) and the process's resident memory after a graft and a
  run alone, minus that of a process holding the base alone.

Prints one JSON object. Run: ``python benchmarks/lora_donors.py [--dir DIR] [--device cuda]``
(timings on the device; memory is measured on the CPU, as a child process's resident set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from devices import add_device_option, clock, describe, resolve
from graft_speed import placeholder_tokenizer
from lazy_memory import rss_now, run_child
from transformers import AutoModelForCausalLM, GemmaConfig, GPT2Config, LlamaConfig

import grafting_lens as gl

VOCAB = 32000
SHAPES = {
    "gpt2": GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=VOCAB),
    "llama": LlamaConfig(
        num_hidden_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=VOCAB,
    ),
    "gemma": GemmaConfig(
        num_hidden_layers=12,
        hidden_size=768,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=96,
        intermediate_size=3072,
        vocab_size=VOCAB,
    ),
}
TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
RANKS = (8, 64)


def save_models(root: Path, family: str) -> None:
    import peft  # the parent only: it makes the adapters

    if (root / family / "merged64" / "config.json").is_file():
        return
    config = SHAPES[family]
    config.initializer_range = 0.05  # logits that vary by several units
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).eval()
    base.save_pretrained(root / family / "base")
    for rank in RANKS:
        torch.manual_seed(rank)
        lora = peft.get_peft_model(
            AutoModelForCausalLM.from_pretrained(root / family / "base"),
            peft.LoraConfig(
                r=rank,
                lora_alpha=2 * rank,
                target_modules=TARGETS[family],
                init_lora_weights=False,
                fan_in_fan_out=family == "gpt2",
            ),
        )
        with torch.no_grad():
            for name, parameter in lora.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(0.05)  # an update a few percent of the weights
        lora.save_pretrained(root / family / f"lora{rank}")
        lora.merge_and_unload().save_pretrained(root / family / f"merged{rank}")


def workload(models_: gl.ModelSet) -> tuple[torch.Tensor, gl.GraftMask]:
    """8 prompts of 16 tokens, and every component grafted at every other position."""
    tokens = torch.randint(1, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    half = torch.zeros(tokens.shape, dtype=torch.long)
    half[:, ::2] = 1
    return tokens, gl.GraftMask.from_dict(models_, {pair: half for pair in models_.pairs})


def memory_of(root: Path, donor: str) -> dict:
    """One donor (or none: the base alone) in this fresh process: what it holds."""
    if donor == "none":
        models_ = gl.load_models(
            root / "base", root / "base", tokenizer=placeholder_tokenizer(), lazy=True
        )
        with torch.no_grad():
            models_.base(workload(models_)[0])
        return {"rss_after_bytes": rss_now()}
    models_ = gl.load_models(root / "base", root / donor, tokenizer=placeholder_tokenizer())
    tokens, mask = workload(models_)
    with torch.no_grad():
        gl.graft_forward(models_, tokens, mask, logits="all")
        models_[1](tokens)
    memory = models_.memory()
    return {
        "kind": str(memory.loc[1, "kind"]),
        "donor_resident_bytes": int(memory.loc[1, "resident_bytes"]),
        "base_resident_bytes": int(memory.loc[0, "resident_bytes"]),
        "rss_after_bytes": rss_now(),
    }


def compare(root: Path, rank: int, repeats: int, device: torch.device) -> dict:
    """The LoRA donor and the merged one, in this process: logits and interleaved times."""
    sets = {
        kind: gl.load_models(
            root / "base", root / f"{kind}{rank}", tokenizer=placeholder_tokenizer(), device=device
        )
        for kind in ("lora", "merged")
    }
    tokens, mask = workload(sets["lora"])
    tokens = tokens.to(device)
    runs = {
        f"{kind}_{what}": run
        for kind, models_ in sets.items()
        for what, run in (
            ("graft", lambda m=models_: gl.graft_forward(m, tokens, mask, logits="all")),
            ("alone", lambda m=models_: m[1](tokens)),
        )
    }
    with torch.no_grad():
        logits = {name: run() for name, run in runs.items()}  # also the warm-up
        base = sets["merged"].base(tokens)
        times: dict[str, float] = {name: float("inf") for name in runs}
        for _ in range(repeats):
            for name, run in runs.items():
                start = clock(device)
                run()
                times[name] = min(times[name], clock(device) - start)
    return {
        "graft_max_abs_diff": float((logits["lora_graft"] - logits["merged_graft"]).abs().max()),
        "alone_max_abs_diff": float((logits["lora_alone"] - logits["merged_alone"]).abs().max()),
        "logit_scale": float(logits["merged_alone"].abs().max()),
        "donor_effect": float((logits["merged_alone"] - base).abs().max()),
        "seconds": {name: round(value, 4) for name, value in times.items()},
        "graft_time_ratio_lora_to_merged": round(times["lora_graft"] / times["merged_graft"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-of", default=None)
    parser.add_argument("--compare-rank", type=int, default=None)
    add_device_option(parser)
    args = parser.parse_args()
    device = resolve(args.device)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.memory_of is not None:  # a child
        print(json.dumps(memory_of(args.dir, args.memory_of)))
        return
    if args.compare_rank is not None:  # a child
        print(json.dumps(compare(args.dir, args.compare_rank, args.repeats, device)))
        return
    results: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = args.dir or Path(scratch)
        for family in SHAPES:
            save_models(root, family)
            here = str(root / family)
            baseline = run_child(__file__, "--dir", here, "--memory-of", "none")
            rows = {}
            for rank in RANKS:
                row = run_child(
                    __file__,
                    "--dir",
                    here,
                    "--compare-rank",
                    str(rank),
                    "--repeats",
                    str(args.repeats),
                    "--device",
                    args.device,
                )
                for kind in ("lora", "merged"):
                    held = run_child(__file__, "--dir", here, "--memory-of", f"{kind}{rank}")
                    held["donor_rss_bytes"] = (
                        held.pop("rss_after_bytes") - baseline["rss_after_bytes"]
                    )
                    row[kind] = held
                rows[f"rank{rank}"] = row
            results[family] = rows
    print(
        json.dumps(
            {
                "benchmark": "lora_donors",
                "shapes": "12 layers, d_model 768, vocabulary 32,000, float32, random weights",
                "graft": "every component at half of the positions, 8 prompts x 16 tokens",
                "target": "max_abs_diff <= 1e-4",
                "timed_on": describe(device),
                "memory_measured_on": "cpu (resident set size of a child process)",
                **results,
                "machine": platform.processor() or platform.machine(),
                "torch_threads": torch.get_num_threads(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
