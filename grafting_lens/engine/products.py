"""A split linear layer's rows through oneDNN, on CPUs where MKL leaves AVX-512 aside.

Why: where a mask splits a linear layer's positions between checkpoints, the layer runs
once per checkpoint, each on its own rows, and two calls of a CPU's matrix product on
half the rows cost more than one on all of them. PyTorch's float32 ``addmm`` (what
``nn.Linear`` and transformers' ``Conv1D`` call) goes to MKL's ``sgemm``, which picks its
code by the CPU's vendor: on an AMD CPU it runs its AVX2 code even where AVX-512 is there.
oneDNN, which ships inside the same PyTorch and which ``torch.compile`` uses for linear
layers, picks its code by instruction set, and on an AMD EPYC with AVX-512 (family 25 model
17, one thread, GPT-2 shapes at 128 rows) computes the two halves in less time than
``sgemm`` takes for the whole: 6.9 against 7.6 ms for a 768x3072 layer, 111 against 171 ms
for the 50,257-token unembedding. Where there is no AVX-512 to gain, oneDNN's cost per
call makes a pass slower: a grafted pass on an AMD EPYC without it (family 25 model 1)
cost 1.28-1.43 plain forwards through oneDNN against 1.21 on the modules' own kernel, and
on an Intel Xeon, whose AVX-512 MKL uses, 0.28 s against 0.24 s. So the kernel is chosen
by a fixed rule, the same on every run of a machine (a choice measured per run could flip
and change the rounding): MKL's products, on an x86-64 CPU not made by Intel that has
AVX-512 (``avx512f`` in ``/proc/cpuinfo``). Everywhere else every module computes itself.
:data:`WHY` says which and why; ``benchmarks/graft_speed.py`` prints it and a pass's cost
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

Where it applies: a module that is exactly what its class computes, a linear map
(:func:`linear_weights`: an ``nn.Linear`` or transformers' ``Conv1D`` as constructed, with
plain parameters, and nothing that ``module(x)`` would run besides its class's forward), on
float32 CPU tensors with a dense weight, without autograd, CPU autocast or a torch function
or dispatch mode, in a product of at least :data:`MIN_PRODUCT` multiply-adds. Anything else,
known or not (an instance's own ``forward``, accelerate's hooks, a parametrization, a LoRA or
quantised layer), calls the module.
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
    return (
        True,
        f"AVX-512 on a CPU by {', '.join(sorted(vendors))}: MKL leaves it aside, oneDNN uses it",
    )


_ON, WHY = _choose()
# torch.compile's oneDNN linear layer (a private operator since torch 2.0); None: every
# module computes itself.
KERNEL: Callable[..., torch.Tensor] | None = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None) if _ON else None
)


# oneDNN's fixed cost per call (about 12 us more than MKL's here) outweighs its faster
# arithmetic below a few million multiply-adds: AMD EPYC, one thread, 64x256 by 256 rows
# (4.2M) took 1.09 times MKL's time, 64x256 by 1024 (16.8M) 0.96, 8x768 by 3072 (18.9M) 0.85.
MIN_PRODUCT = 1 << 23  # rows x inputs x outputs, about 8.4M

# The classes whose forward is a linear map, with that forward and the attributes a new
# instance holds (and the flag transformers sets on what it loads): an instance holding
# any other (its own ``forward``, accelerate's ``_hf_hook``, ``compile()``'s call) may
# compute something else.
_PLAIN: dict[type[nn.Module], tuple[Callable, frozenset[str]]] = {
    cls: (cls.forward, frozenset(vars(cls(1, 1))) | {"_is_hf_initialized"})
    for cls in (nn.Linear, Conv1D)
}


def linear_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The ``[out, in]`` weight and the bias of a module that is exactly its class's linear map.

    ``None`` unless ``module(x)`` is exactly ``x @ weight.T + bias``: the class is
    ``nn.Linear`` or ``Conv1D`` itself (a parametrization makes a subclass) with its own
    forward, the instance holds nothing a new one lacks, there is no hook (the module's or
    global: torch's ``__call__`` would run it) and no submodule, it holds a weight and a bias
    and nothing else (the bias a parameter or a buffer), and they are plain tensors (a
    quantised weight's subclass computes its own way).
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
    if type(weight) is not nn.Parameter or type(bias) not in (
        nn.Parameter,
        torch.Tensor,
        type(None),
    ):
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
