"""Benchmark: resident memory of a donor loaded whole against one loaded lazily.

Saves two GPT-2-medium-shaped checkpoints with random weights (24 layers, d_model
1,024, vocabulary 50,257: 355M parameters, 1.4 GB each in float32; nothing is
downloaded) as safetensors directories, then measures, each in a fresh process, a
graft of the O projection and the MLP in the last half of the layers at the last
token (the paper's component grafts):

* ``none``: the donor opened lazily and a graft whose mask takes nothing from it:
  the base, the machinery and the activations, the baseline of the others;
* ``lazy``: ``load_models(base, donor, lazy=True, components="o+ffn",
  layers="last_half")`` and the graft;
* ``full``: ``load_models(base, donor)`` (the donor loaded whole) and the graft.

The donor's resident memory is a variant's resident memory minus the baseline's,
after the graft (``/proc/self/statm``) and at the peak (``ru_maxrss``);
``grafted_bytes`` is what the grafted components take (``declared_bytes`` of
:meth:`ModelSet.memory`, the donor's O and MLP tensors in the last 12 layers).
Target: the lazy donor's resident memory <= 1.1x ``grafted_bytes``.

Two storage cases, because transformers memory-maps a float32 safetensors file
loaded as float32: then even a donor "loaded whole" holds, on a CPU, only the pages
a run touches (the OS sees the untouched rest as file cache), while a cast (a
bfloat16 checkpoint analysed in float32) or a GPU copies every tensor:

* ``float32``: checkpoints stored and loaded in float32;
* ``bfloat16_as_float32``: stored in bfloat16, loaded with ``dtype=torch.float32``.

Prints one JSON object. Run: ``python benchmarks/lazy_memory.py [--dir DIR]``
(``DIR`` keeps the checkpoints between runs; default: a temporary directory).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from graft_speed import placeholder_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel

import grafting_lens as gl

MiB = 2**20


STORAGE = {"float32": torch.float32, "bfloat16_as_float32": torch.bfloat16}


def save_checkpoints(root: Path) -> None:
    config = GPT2Config(n_layer=24, n_embd=1024, n_head=16)  # GPT-2 medium's shape
    for storage, dtype in STORAGE.items():
        for name, seed in (("base", 0), ("donor", 1)):
            directory = root / storage / name
            if (directory / "model.safetensors").is_file():
                continue
            torch.manual_seed(seed)
            GPT2LMHeadModel(config).to(dtype).save_pretrained(directory)


def rss_now() -> int:
    """Resident memory now, after handing freed heap back to the OS (glibc keeps it)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_child(script: str, *arguments: str) -> dict:
    """Run ``script`` in a fresh process (its own peak memory) and read its last JSON line."""
    run = subprocess.run(
        [sys.executable, script, *arguments], check=True, capture_output=True, text=True
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure(root: Path, variant: str) -> dict:
    """One variant, in this (fresh) process."""
    start = time.perf_counter()
    options = {"tokenizer": placeholder_tokenizer(), "dtype": torch.float32}
    if variant != "full":
        options.update(lazy=True, components="o+ffn", layers="last_half")
    models_ = gl.load_models(root / "base", root / "donor", **options)
    loaded = time.perf_counter() - start
    tokens = torch.randint(1, 50257, (8, 16), generator=torch.Generator().manual_seed(0))
    mask = gl.GraftMask.build(
        models_,
        tokens,
        positions="last",
        layers="last_half",
        components="o+ffn",
        source=0 if variant == "none" else 1,
    )
    start = time.perf_counter()
    with torch.no_grad():
        logits = gl.graft_forward(models_, tokens, mask, logits="all")
    grafted = time.perf_counter() - start
    memory = models_.memory()
    donor = memory.iloc[1]
    return {
        "variant": variant,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_bytes": rss_now(),
        "load_seconds": round(loaded, 2),
        "graft_seconds": round(grafted, 2),
        "donor_resident_bytes": int(donor["resident_bytes"]),
        "donor_declared_bytes": None if variant == "full" else int(donor["declared_bytes"]),
        "donor_full_bytes": int(donor["full_bytes"]),
        "base_resident_bytes": int(memory.iloc[0]["resident_bytes"]),
        "logits_checksum": float(logits[:, -1].double().sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--variant", choices=("none", "lazy", "full"), default=None)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.variant is not None:  # a child: one measurement, one JSON line
        print(json.dumps(measure(args.dir, args.variant)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        root = args.dir or Path(scratch)
        save_checkpoints(root)
        cases = {storage: run_case(root / storage) for storage in STORAGE}
    print(
        json.dumps(
            {
                "benchmark": "lazy_memory",
                "shape": "GPT-2 medium (24 layers, d_model 1024), random weights, run in float32",
                "graft": "o+ffn, last half of the layers, last token, 8 prompts x 16 tokens",
                "target": "lazy ratio_to_grafted <= 1.1",
                **cases,
                "machine": platform.processor() or platform.machine(),
                "torch_threads": torch.get_num_threads(),
            },
            indent=1,
        )
    )


def run_case(root: Path) -> dict:
    """The three variants on one pair of checkpoints, each in a fresh process."""
    results = {}
    for variant in ("none", "lazy", "full"):
        results[variant] = run_child(__file__, "--dir", str(root), "--variant", variant)
    grafted = results["lazy"]["donor_declared_bytes"]
    summary: dict = {"grafted_bytes": grafted}
    for variant in ("lazy", "full"):
        after = results[variant]["rss_after_bytes"] - results["none"]["rss_after_bytes"]
        peak = results[variant]["peak_rss_bytes"] - results["none"]["peak_rss_bytes"]
        summary[variant] = {
            "donor_rss_after_bytes": after,
            "donor_peak_rss_bytes": peak,
            "ratio_to_grafted": round(after / grafted, 3),
            "peak_ratio_to_grafted": round(peak / grafted, 3),
            "donor_resident_bytes_by_memory": results[variant]["donor_resident_bytes"],
        }
    summary["same_logits"] = (
        results["lazy"]["logits_checksum"] == results["full"]["logits_checksum"]
    )
    summary["variants"] = results
    return summary


if __name__ == "__main__":
    main()
