"""The roofline of a grafted pass, on paper: the numbers behind docs/design/scale.md.

Nothing runs on a device. For Llama-3-8B and Llama-3-70B in bfloat16 (their
published configurations, written out below) and an O+FFN graft of the last half of
the layers at the last token, it computes:

* parameters and bytes of one checkpoint, and of the donor's grafted components;
* the FLOPs of one forward pass over ``batch x pos`` tokens (every matrix product,
  attention's ``q k^T`` and ``a v``, and the unembedding at every position, as
  ``graft_forward`` returns every position's logits);
* the weight bytes one pass reads: a plain forward reads the base's matrices once
  (the embedding only at the looked-up rows); a grafted pass also reads the donor's
  grafted matrices, once, however many rows use them; a LoRA donor reads its
  factors, and either the base's matrix a second time (a LoRA module run on the
  donor's rows, as ``grafting_lens.models.adapters`` does) or not (the base's product shared
  by every row, the delta added on the donor's rows: Punica's decomposition);
* lower bounds on the time of one pass on one H100 SXM or H200 (a pass split over
  devices by layers runs them one after another, so the bound holds for it too):
  the sum, over the pass's matrix products, of ``max(FLOPs / peak, weight bytes /
  bandwidth)`` at peak dense bfloat16 throughput and full memory bandwidth, plus
  attention at peak. A product of fewer rows than ``peak / bandwidth`` (the ridge,
  about 295 rows on an H100) is bound by reading its weight.

Prints one JSON object. Run: ``python benchmarks/graft_roofline.py [--batch 8] [--pos 20]``
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

BYTES = 2  # bfloat16


@dataclass(frozen=True)
class Shape:
    """What the roofline needs of a Llama-style configuration."""

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_mlp: int
    vocab: int

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def matrices(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each matrix of one block."""
        d, q, kv = self.d_model, self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        return {
            "q": (d, q),
            "k": (d, kv),
            "v": (d, kv),
            "o": (q, d),
            "mlp_gate": (d, self.d_mlp),
            "mlp_in": (d, self.d_mlp),
            "mlp_out": (self.d_mlp, d),
        }

    def block_params(self, components: tuple[str, ...] | None = None) -> int:
        return sum(
            d_in * d_out
            for name, (d_in, d_out) in self.matrices().items()
            if components is None or name in components
        )

    def params(self) -> int:
        norms = (2 * self.n_layers + 1) * self.d_model
        return self.n_layers * self.block_params() + 2 * self.vocab * self.d_model + norms


# The published configurations (config.json of meta-llama/Meta-Llama-3-8B and -70B).
LLAMA_3_8B = Shape("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256)
LLAMA_3_70B = Shape("Llama-3-70B", 8192, 80, 64, 8, 28672, 128256)

# Peak dense bfloat16 matrix throughput and HBM bandwidth (NVIDIA's data sheets).
HARDWARE = {
    "H100 SXM (80 GB)": {"flops": 989.4e12, "bandwidth": 3.35e12, "memory": 80e9},
    "H200 (141 GB)": {"flops": 989.4e12, "bandwidth": 4.8e12, "memory": 141e9},
}

O_FFN = ("o", "mlp_gate", "mlp_in", "mlp_out")


def product_s(rows: int, params: int, spec: dict) -> float:
    """Lower bound on one matrix product: its FLOPs at peak, or its weight read at full bandwidth."""
    return max(2 * rows * params / spec["flops"], BYTES * params / spec["bandwidth"])


def roofline(shape: Shape, batch: int, pos: int, rank: int) -> dict:
    tokens = batch * pos
    grafted_layers = shape.n_layers - shape.n_layers // 2  # the last half
    matrices = shape.matrices()
    grafted_params = grafted_layers * shape.block_params(O_FFN)
    lora = {name: rank * (d_in + d_out) for name, (d_in, d_out) in matrices.items()}
    lora_params = grafted_layers * sum(lora[name] for name in O_FFN)
    # FLOPs: 2 per multiply-add. Attention: q k^T and a v over p earlier positions.
    matmul = 2 * tokens * shape.n_layers * shape.block_params()
    attention = shape.n_layers * batch * 4 * shape.n_heads * shape.d_head * pos * (pos + 1) // 2
    unembed = 2 * tokens * shape.d_model * shape.vocab
    flops = matmul + attention + unembed
    # Weight bytes read once per pass: every matrix, the unembedding, the looked-up rows.
    plain_bytes = BYTES * (
        shape.n_layers * shape.block_params() + shape.vocab * shape.d_model + tokens * shape.d_model
    )
    bytes_read = {
        "plain forward": plain_bytes,
        "graft, full donor": plain_bytes + BYTES * grafted_params,
        f"graft, LoRA r={rank}, W read twice": plain_bytes + BYTES * (grafted_params + lora_params),
        f"graft, LoRA r={rank}, W shared": plain_bytes + BYTES * lora_params,
    }

    def pass_s(variant: str, spec: dict) -> float:
        """Sum of the lower bounds of the pass's products, run one after another."""
        total = product_s(tokens, shape.d_model * shape.vocab, spec)  # the unembedding
        total += attention / spec["flops"]
        for layer in range(shape.n_layers):
            grafted = layer >= shape.n_layers // 2
            for name, (d_in, d_out) in matrices.items():
                params = d_in * d_out
                if not grafted or name not in O_FFN or variant == "plain forward":
                    total += product_s(tokens, params, spec)
                    continue
                factors = (
                    2 * batch * lora[name] / spec["flops"],
                    BYTES * lora[name] / spec["bandwidth"],
                )
                if variant == "graft, full donor" or "twice" in variant:
                    # The base's rows through the base's matrix, the donor's rows
                    # (one per prompt, the last token) through the donor's.
                    total += product_s(tokens - batch, params, spec) + product_s(
                        batch, params, spec
                    )
                else:  # every row through the base's matrix once
                    total += product_s(tokens, params, spec)
                if "LoRA" in variant:
                    total += max(factors)
        return total

    hardware = {}
    for device, spec in HARDWARE.items():
        times = {variant: pass_s(variant, spec) for variant in bytes_read}
        hardware[device] = {
            "ms": {name: round(t * 1e3, 2) for name, t in times.items()},
            "over_plain": {name: round(t / times["plain forward"], 3) for name, t in times.items()},
            "at_least_devices_for_pair": -(-2 * BYTES * shape.params() // int(spec["memory"])),
            "at_least_devices_for_base_and_grafted": -(
                -BYTES * (shape.params() + grafted_params) // int(spec["memory"])
            ),
        }
    return {
        "params": shape.params(),
        "checkpoint_gb": round(BYTES * shape.params() / 1e9, 2),
        "pair_gb": round(2 * BYTES * shape.params() / 1e9, 2),
        "grafted_params": grafted_params,
        "grafted_gb": round(BYTES * grafted_params / 1e9, 2),
        "grafted_share_of_donor": round(grafted_params / shape.params(), 3),
        "lora_grafted_gb": round(BYTES * lora_params / 1e9, 3),
        "tokens": tokens,
        "tflop": {
            "total": round(flops / 1e12, 3),
            "matrices": round(matmul / 1e12, 3),
            "attention": round(attention / 1e12, 4),
            "unembed": round(unembed / 1e12, 3),
        },
        "weight_gb_read": {name: round(b / 1e9, 2) for name, b in bytes_read.items()},
        "ridge_rows": {
            device: round(spec["flops"] / spec["bandwidth"] * BYTES / 2)
            for device, spec in HARDWARE.items()
        },
        "hardware": hardware,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="prompts (rows) per pass")
    parser.add_argument("--pos", type=int, default=20, help="tokens per prompt")
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank")
    args = parser.parse_args()
    print(
        json.dumps(
            {
                shape.name: roofline(shape, args.batch, args.pos, args.rank)
                for shape in (LLAMA_3_8B, LLAMA_3_70B)
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
