"""A split linear layer's rows through oneDNN, on CPUs where MKL runs below its best.

Why: where a mask splits a linear layer's positions between checkpoints, the layer runs
once per checkpoint, each on its own rows, and two calls of a CPU's matrix product on
half the rows cost more than one on all of them. PyTorch's float32 ``addmm`` (what
``nn.Linear`` and transformers' ``Conv1D`` call) goes to MKL's ``sgemm``, which picks its
code by the CPU's vendor: on an AMD CPU it leaves AVX-512 aside. oneDNN, which ships
inside the same PyTorch and which ``torch.compile`` uses for linear layers, picks its code
by instruction set, and there computes the two halves in less time than ``sgemm`` takes
for the whole (AMD EPYC, one thread, GPT-2 shapes at 128 rows: 6.9 against 7.6 ms for a
768x3072 layer, 111 against 171 ms for the 50,257-token unembedding). On an Intel Xeon a
grafted pass measured slower through oneDNN (0.28 s against 0.24 s, 2026-11-24, when the
choice was still measured per machine), so there, and wherever the products are not
MKL's, every module computes itself. ``benchmarks/graft_speed.py`` prints a pass's cost
with either kernel.

What it changes: the order in which a product's float32 sums are rounded, in the slots a
mask splits (a slot one source computes whole runs its module: an empty mask still equals
the base's own forward bit for bit). There, positions of the base too differ from the
base's own forward within float32 rounding (a relative 1e-6 in a layer's outputs), as
positions already did where a split left a source a single row (a one-row product is
another kernel too) and as the token-by-token reference does. A pass with
autograd on (a ``grafting`` block outside ``torch.no_grad()``) runs every module itself,
since oneDNN's operator has no backward. ``torch.backends.mkldnn.enabled = False`` turns
this off, as it does oneDNN everywhere in PyTorch.

Where it applies: a module whose forward is exactly a linear map (``nn.Linear``,
transformers' ``Conv1D``; not a subclass, a LoRA layer or a quantised one) with a dense
weight (or its transpose) held as a plain tensor and no hook, on float32 CPU tensors,
without CPU autocast, in a product of at least :data:`MIN_PRODUCT` multiply-adds. Anything
else calls the module.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules import module as _module
from transformers.pytorch_utils import Conv1D


def _mkl_on_another_vendor(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this PyTorch's float32 products are MKL's on an x86-64 CPU not made by Intel (Linux)."""
    if (
        platform.machine().lower() not in ("x86_64", "amd64")
        or not torch.backends.mkl.is_available()
    ):
        return False
    try:
        with open(cpuinfo) as info:
            vendors = {
                line.split(":", 1)[1].strip() for line in info if line.startswith("vendor_id")
            }
    except OSError:
        return False
    return bool(vendors) and "GenuineIntel" not in vendors


# torch.compile's oneDNN linear layer (a private operator since torch 2.0); None: every
# module computes itself.
KERNEL: Callable[..., torch.Tensor] | None = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if torch.backends.mkldnn.is_available() and _mkl_on_another_vendor()
    else None
)


# oneDNN's fixed cost per call (about 12 us more than MKL's here) outweighs its faster
# arithmetic below a few million multiply-adds: AMD EPYC, one thread, 64x256 by 256 rows
# (4.2M) took 1.09 times MKL's time, 64x256 by 1024 (16.8M) 0.96, 8x768 by 3072 (18.9M) 0.85.
MIN_PRODUCT = 1 << 23  # rows x inputs x outputs, about 8.4M


def linear_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The ``[out, in]`` weight and the bias of a module whose forward is exactly a linear map."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    if type(module) is Conv1D:
        return module.weight.t(), module.bias  # Conv1D holds [in, out]: addmm(bias, x, weight)
    return None


def call(module: nn.Module, args: list, kwargs: dict):
    """``module(*args, **kwargs)``, through oneDNN where this module says it applies."""
    kernel = KERNEL
    if kernel is not None and len(args) == 1 and not kwargs:
        weights = linear_weights(module)
        if weights is not None and _applies(module, args[0], weights[0]):
            return kernel(args[0], weights[0], weights[1], "none", [], "")
    return module(*args, **kwargs)


def _applies(module: nn.Module, x: object, weight: torch.Tensor) -> bool:
    return (
        # Plain tensors: a subclass (a quantised weight kept in an nn.Linear) computes its own way.
        type(x) is torch.Tensor
        and type(weight) in (torch.Tensor, nn.Parameter)
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and x.numel() * weight.shape[0] >= MIN_PRODUCT
        # Dense, either way round: a weight that is a slice of a fused one (the bridge's Q, K and
        # V of GPT-2's c_attn) makes oneDNN reorder it element by element, a second a call.
        and (weight.is_contiguous() or weight.t().is_contiguous())
        and not torch.is_grad_enabled()
        and torch._C._get_mkldnn_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not (module._forward_hooks or module._forward_pre_hooks)
        and not (_module._global_forward_hooks or _module._global_forward_pre_hooks)
    )
