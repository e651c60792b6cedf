"""The kernel a grafted linear layer runs on: oneDNN on CPUs, where it is the faster one.

Why this module exists
----------------------
A grafted pass computes each grafted component itself: for every source, the
positions that source owns go through that source's module (see
:mod:`grafting_lens.graft`). Most of those modules are linear layers (Q, K, V, O,
the MLP matrices, the unembedding), and on a CPU nearly all of a pass's time is
their matrix products.

PyTorch computes a float32 linear layer on a CPU with MKL's ``sgemm``. On the AMD
EPYC (Zen 4) CPUs this project is developed on, MKL reaches 95-155 GFLOP/s on the
block matrices of a GPT-2-small graft (64-128 rows) and only 60-80 GFLOP/s on its
unembedding, while oneDNN, which ships inside every CPU build of PyTorch and picks
its code by instruction set rather than by vendor, reaches 140-195 GFLOP/s on the
same products. The benchmark's grafted pass (``experiments/benchmark_graft.py``)
takes about 0.28 s instead of 0.38 s. oneDNN computes the same float32 sums in
another order, so results agree with PyTorch's kernel to float32 rounding (relative
differences near 1e-7), as any two BLAS libraries do.

When it is used
---------------
:func:`run_module` calls oneDNN only where the result is the module's own
arithmetic (up to the order of the float32 sums) and neither autograd nor a hook
can tell which kernel ran:

* the module is exactly ``torch.nn.Linear`` or ``transformers``' ``Conv1D`` (GPT-2's
  transposed linear), not a subclass (LoRA, quantized layers) that computes
  something else;
* input, weight and bias are float32 on the CPU, and the weight is a dense matrix
  (or its transpose), not a strided view into a larger one;
* the product is large enough (4M multiply-adds) for oneDNN's faster arithmetic to
  outweigh its larger fixed cost per call;
* autograd has nothing to record (``torch.no_grad()``/``torch.inference_mode()``, or
  nothing requires a gradient): the oneDNN operator has no backward;
* no forward hook is registered on the module, nor globally, so hooks on the
  checkpoint's own modules see every call (the bridge's hooks, ``hook_in`` and
  ``hook_out``, sit outside and always fire);
* ``torch.backends.mkldnn.enabled`` is true, and the operator exists in this
  PyTorch and agreed with ``torch.nn.functional.linear`` on a probe.

Everywhere else the module is simply called. To compute grafted linear layers with
PyTorch's default kernel, the one an ungrafted forward uses, set
``torch.backends.mkldnn.enabled = False`` (and back to ``True`` after).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from jaxtyping import Float
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.pytorch_utils import Conv1D

# oneDNN costs about 10 microseconds more per call than MKL; below a few million
# multiply-adds (a toy model's 64x256 matrix on 64 rows) that outweighs its faster
# arithmetic, so small products stay with PyTorch's kernel.
_MIN_MULTIPLY_ADDS = 1 << 22


def run_module(module: nn.Module, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: A002
    """``module(input, *args, **kwargs)``, through oneDNN where that is the same arithmetic.

    Args:
        module: A source's component module (a linear layer, a norm, an embedding...).
        input: Its input, ``[..., d_in]`` for a linear layer.
        *args: Further positional arguments of the module's forward.
        **kwargs: Keyword arguments of the module's forward.

    Returns:
        What the module returns; for a linear layer ``[..., d_out]``, equal to the
        module's own output to float32 rounding.
    """
    if args or kwargs or not _takes_onednn(module, input):
        return module(input, *args, **kwargs)
    # Conv1D stores its weight as [d_in, d_out]; oneDNN reads the transposed view in place.
    weight, bias = _weight_and_bias(module)
    if type(module) is not nn.Linear:
        weight = weight.t()
    flat = input.reshape(-1, input.shape[-1]).contiguous()
    output = _onednn_linear(flat, weight, bias)
    return output.reshape(*input.shape[:-1], output.shape[-1])


def _onednn_linear(
    input: Float[torch.Tensor, "rows d_in"],  # noqa: A002
    weight: Float[torch.Tensor, "d_out d_in"],
    bias: Float[torch.Tensor, " d_out"] | None,
) -> Float[torch.Tensor, "rows d_out"]:
    """``input @ weight.T + bias`` with oneDNN's matrix product (no post-op)."""
    return torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")


def _takes_onednn(module: nn.Module, input: torch.Tensor) -> bool:
    kind = type(module)
    if kind is not nn.Linear and kind is not Conv1D:
        return False
    weight, bias = _weight_and_bias(module)
    tensors = (input, weight) if bias is None else (input, weight, bias)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    if input.dim() == 0 or input.shape[-1] != weight.shape[1 if kind is nn.Linear else 0]:
        return False  # let the module raise its own shape error
    if input.numel() // input.shape[-1] * weight.numel() < _MIN_MULTIPLY_ADDS:
        return False
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        # A strided view (the bridge's Q, K and V cut out of GPT-2's fused c_attn)
        # sends oneDNN to a reference kernel hundreds of times slower than MKL.
        return False
    return bool(torch.backends.mkldnn.enabled) and _onednn_available()


def _weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer's (or Conv1D's) weight and bias, typed as tensors."""
    weight, bias = module.weight, module.bias
    assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
    return weight, bias


@functools.cache
def _onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's linear operator and it agrees with PyTorch's.

    The operator is internal to PyTorch (its compiler uses it), so it is checked once
    on a small product rather than trusted by version number.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    input = torch.randn(5, 24, generator=generator)  # noqa: A001
    weight = torch.randn(7, 24, generator=generator)
    bias = torch.randn(7, generator=generator)
    try:
        with torch.no_grad():
            output = _onednn_linear(input, weight, bias)
    except (RuntimeError, AttributeError, TypeError):
        return False
    expected = torch.nn.functional.linear(input, weight, bias)
    return output.shape == expected.shape and torch.allclose(output, expected, atol=1e-5)
