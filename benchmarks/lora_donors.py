"""Benchmark: a LoRA donor against the same adapter merged into a full donor.

For GPT-2-, Llama- and Gemma-shaped models (12 layers, d_model 768, random weights;
nothing is downloaded) and adapters of rank 8 and 64 on every attention and MLP
matrix (PEFT, random factors), saves the base, each adapter and, with PEFT's
``merge_and_unload``, each merged donor as directories. Then, each in a fresh
process, it loads ``load_models(base, adapter)`` or ``load_models(base, merged)`` and
measures, on 8 prompts of 16 tokens:

* ``graft_seconds``: a graft of every component at half of the positions (best of
  ``--repeats``); ``alone_seconds``: the donor run alone (``models[1]``);
* ``donor_resident_bytes``: what the donor holds (:meth:`ModelSet.memory`), and the
  process's resident memory after the runs minus a base-only baseline;
* the logits of both, compared in the parent: ``graft_max_abs_diff`` and
  ``alone_max_abs_diff`` (LoRA against merged, float32; target <= 1e-4), beside
  ``donor_effect`` (how far the donor's logits are from the base's, so that the
  comparison means something) and the logits' scale.

Prints one JSON object. Run: ``python benchmarks/lora_donors.py [--dir DIR]``.
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
from graft_speed import placeholder_tokenizer, timed
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


def measure(root: Path, donor: str, repeats: int, out: Path) -> dict:
    models_ = gl.load_models(root / "base", root / donor, tokenizer=placeholder_tokenizer())
    tokens = torch.randint(1, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    half = torch.zeros(tokens.shape, dtype=torch.long)
    half[:, ::2] = 1
    mask = gl.GraftMask.from_dict(models_, {pair: half for pair in models_.pairs})
    with torch.no_grad():
        graft = gl.graft_forward(models_, tokens, mask)
        alone = models_[1](tokens)
        base = models_.base(tokens)
        graft_seconds = timed(lambda: gl.graft_forward(models_, tokens, mask), repeats)
        alone_seconds = timed(lambda: models_[1](tokens), repeats)
    torch.save({"graft": graft, "alone": alone, "base": base}, out)
    memory = models_.memory()
    return {
        "donor": donor,
        "kind": str(memory.loc[1, "kind"]),
        "graft_seconds": round(graft_seconds, 4),
        "alone_seconds": round(alone_seconds, 4),
        "donor_resident_bytes": int(memory.loc[1, "resident_bytes"]),
        "base_resident_bytes": int(memory.loc[0, "resident_bytes"]),
        "rss_after_bytes": rss_now(),
    }


def base_only(root: Path) -> dict:
    """The baseline process: the base alone, run once."""
    bridge = gl.load_models(
        root / "base", root / "base", tokenizer=placeholder_tokenizer(), lazy=True, components="o"
    ).base
    tokens = torch.randint(1, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bridge(tokens)
    return {"rss_after_bytes": rss_now()}


def child(root: Path, donor: str, repeats: int, out: Path) -> dict:
    arguments = ("--dir", str(root), "--donor", donor, "--repeats", str(repeats), "--out", str(out))
    return run_child(__file__, *arguments)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--donor", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.donor is not None:  # a child
        if args.donor == "none":
            print(json.dumps(base_only(args.dir)))
        else:
            print(json.dumps(measure(args.dir, args.donor, args.repeats, args.out)))
        return
    results: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = args.dir or Path(scratch)
        for family in SHAPES:
            save_models(root, family)
            here = root / family
            baseline = child(here, "none", args.repeats, here / "none.pt")["rss_after_bytes"]
            rows = {}
            for rank in RANKS:
                runs = {
                    kind: child(here, f"{kind}{rank}", args.repeats, here / f"{kind}{rank}.pt")
                    for kind in ("lora", "merged")
                }
                logits = {kind: torch.load(here / f"{kind}{rank}.pt") for kind in runs}
                lora, merged = logits["lora"], logits["merged"]
                for run in runs.values():
                    run["donor_rss_bytes"] = run.pop("rss_after_bytes") - baseline
                rows[f"rank{rank}"] = {
                    "graft_max_abs_diff": float((lora["graft"] - merged["graft"]).abs().max()),
                    "alone_max_abs_diff": float((lora["alone"] - merged["alone"]).abs().max()),
                    "logit_scale": float(merged["alone"].abs().max()),
                    "donor_effect": float((merged["alone"] - merged["base"]).abs().max()),
                    "graft_time_ratio_lora_to_merged": round(
                        runs["lora"]["graft_seconds"] / runs["merged"]["graft_seconds"], 3
                    ),
                    "lora": runs["lora"],
                    "merged": runs["merged"],
                }
            results[family] = rows
    print(
        json.dumps(
            {
                "benchmark": "lora_donors",
                "shapes": "12 layers, d_model 768, vocabulary 32,000, float32, random weights",
                "graft": "every component at half of the positions, 8 prompts x 16 tokens",
                "target": "max_abs_diff <= 1e-4",
                **results,
                "machine": platform.processor() or platform.machine(),
                "torch_threads": torch.get_num_threads(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
