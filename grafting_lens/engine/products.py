"""A split linear layer's rows through oneDNN, on CPUs where MKL leaves AVX-512 aside.

Where a mask splits a linear layer's positions between checkpoints, each runs the layer on
its own rows, and two calls of MKL's ``sgemm`` on half the rows cost more than one on all.
On an x86-64 CPU not made by Intel that has AVX-512, MKL runs its AVX2 code while oneDNN
(inside PyTorch, what ``torch.compile`` uses) runs AVX-512: there, and only there (a fixed
rule, so the rounding never flips between runs), :func:`call` computes a split slot's
:func:`linear_weights` parts of at least :data:`MIN_PRODUCT` multiply-adds through oneDNN,
without autograd; :data:`WHY` says which and why. A split slot then equals the models' own
forward to float32 rounding, not to the bit; a slot one source computes whole runs its
module. ``torch.backends.mkldnn.enabled = False`` turns it off. Measurements and the rule's
reasons: docs/design/scale.md, "The batched graft at its limit".
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules import module as _module
from transformers.pytorch_utils import Conv1D


def _choose(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[bool, str]:
    """Whether split linear layers run on oneDNN here, and why (Linux; elsewhere: no)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, "not an x86-64 CPU"
    if not torch.backends.mkl.is_available() or not torch.backends.mkldnn.is_available():
        return False, "this PyTorch's float32 products are not MKL's, or it lacks oneDNN"
    try:
        with open(cpuinfo) as info:
            fields = [line.split(":", 1) for line in info if ":" in line]
    except OSError:
        return False, f"no {cpuinfo} to read the CPU's vendor and instruction set from"
    vendors = {value.strip() for key, value in fields if key.strip() == "vendor_id"}
    flags = {flag for key, value in fields if key.strip() == "flags" for flag in value.split()}
    if not vendors or "GenuineIntel" in vendors:
        return False, "an Intel CPU (or none named): MKL runs its best code for it"
    if "avx512f" not in flags:
        return False, "no AVX-512: MKL's AVX2 code is oneDNN's too, for less cost per call"
    vendor = ", ".join(sorted(vendors))
    return True, f"AVX-512 on a CPU by {vendor}: MKL leaves it aside, oneDNN uses it"


_ON, WHY = _choose()
# torch.compile's oneDNN linear layer (private since torch 2.0); None: modules compute.
KERNEL: Callable[..., torch.Tensor] | None = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None) if _ON else None
)


# oneDNN's fixed cost per call (about 12 us more than MKL's here) outweighs its faster
# arithmetic below a few million multiply-adds: AMD EPYC, one thread, 64x256 by 256 rows
# (4.2M) took 1.09 times MKL's time, 64x256 by 1024 (16.8M) 0.96, 8x768 by 3072 (18.9M) 0.85.
MIN_PRODUCT = 1 << 23  # rows x inputs x outputs, about 8.4M

# The linear classes, with their forward and the attributes a new instance holds (and
# transformers' load flag): an instance holding any other (its own ``forward``,
# accelerate's ``_hf_hook``, ``compile()``'s call) may compute something else.
_PLAIN: dict[type[nn.Module], tuple[Callable, frozenset[str]]] = {
    cls: (cls.forward, frozenset(vars(cls(1, 1))) | {"_is_hf_initialized"})
    for cls in (nn.Linear, Conv1D)
}
_BIAS_TYPES = (nn.Parameter, torch.Tensor, type(None))


def linear_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The ``[out, in]`` weight and the bias of a module that is exactly its class's linear map.

    ``None`` unless ``module(x)`` is exactly ``x @ weight.T + bias``: the class is ``nn.Linear``
    or ``Conv1D`` itself (a parametrization makes a subclass) with its own forward, holding
    nothing a new instance lacks, no hook (its own or global) and no submodule, and a weight
    and a bias (a parameter or a buffer) that are plain tensors (not a quantised subclass).
    """
    plain = _PLAIN.get(type(module))
    if (
        plain is None
        or type(module).forward is not plain[0]
        or not vars(module).keys() <= plain[1]
        or module._forward_hooks or module._forward_pre_hooks
        or module._backward_hooks or module._backward_pre_hooks
        or _module._global_forward_hooks or _module._global_forward_pre_hooks
        or _module._global_backward_hooks or _module._global_backward_pre_hooks
        or module._modules
        or "weight" not in module._parameters
        # The bias a parameter, or a buffer (the bridge's unembedding holds a zero one).
        or {*module._parameters, *module._buffers} != {"weight", "bias"}
        or len(module._parameters) + len(module._buffers) != 2
    ):  # fmt: skip
        return None
    weight = module._parameters["weight"]
    bias = module._parameters["bias"] if "bias" in module._parameters else module._buffers["bias"]
    if type(weight) is not nn.Parameter or type(bias) not in _BIAS_TYPES:
        return None
    return (weight if type(module) is nn.Linear else weight.t()), bias  # Conv1D holds [in, out]


def call(module: nn.Module, args: list, kwargs: dict):
    """``module(*args, **kwargs)``, through oneDNN where this module says it applies."""
    kernel = KERNEL
    if kernel is not None and len(args) == 1 and not kwargs:
        weights = linear_weights(module)
        if weights is not None and _applies(args[0], weights[0]):
            return kernel(args[0], weights[0], weights[1], "none", [], "")
    return module(*args, **kwargs)


def _applies(x: object, weight: torch.Tensor) -> bool:
    return (
        type(x) is torch.Tensor  # a subclass computes its own way
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
        # A mode (a tracer's, an intervention's) would see another operator than the module's.
        and not (torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack())
    )
