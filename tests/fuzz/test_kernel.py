"""The oneDNN kernel of split slots (grafting_lens.engine.products) against the module it
stands in for.

A linear layer is changed at random, in the ways users and libraries change one after
loading (its own ``forward``, accelerate's hook, a parametrization, hooks of its own or
global ones, a subclass, a weight held as a tensor subclass, its class's forward patched, a
torch function mode), each of which changes what ``module(x)`` computes. The kernel's path
(:func:`products.call`) gives what ``module(x)`` gives, to float32 rounding, and takes the
kernel only where nothing was changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode
from transformers.pytorch_utils import Conv1D

from fuzz.strategies import budget
from grafting_lens.engine import products

ONEDNN = torch.ops.mkldnn._linear_pointwise
PRODUCTS = (F.linear, torch.addmm)  # what nn.Linear's and Conv1D's forwards call
CHANGES = (
    "instance_forward",
    "accelerate_hook",
    "parametrization",
    "forward_hook",
    "forward_hook_with_kwargs",
    "forward_pre_hook",
    "global_forward_hook",
    "global_forward_pre_hook",
    "subclass",
    "tensor_subclass_weight",
    "class_forward",
    "function_mode",
)


class Shifted(torch.Tensor):
    """A weight that computes its own way, as a quantised one does: its products shifted by 1."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        output = super().__torch_function__(func, types, args, kwargs)
        return output + 1 if func in PRODUCTS else output


class Shifting(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        return output + 1 if func in PRODUCTS else output


class Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


class Halved(ModelHook):
    def post_forward(self, module, output):
        return output / 2


def halved(forward):
    return lambda *args: forward(*args) / 2


@contextlib.contextmanager
def changed(module: nn.Module, change: str) -> Iterator[None]:
    """``module`` with ``change`` made; what reaches beyond it is undone on exit."""
    hooks = nn.modules.module
    with contextlib.ExitStack() as undo:
        if change == "instance_forward":
            module.forward = halved(module.forward)
        elif change == "accelerate_hook":
            add_hook_to_module(module, Halved())
        elif change == "parametrization":
            parametrize.register_parametrization(module, "weight", Doubled())
        elif change == "forward_hook":
            module.register_forward_hook(lambda _, args, output: output / 2)
        elif change == "forward_hook_with_kwargs":
            module.register_forward_hook(
                lambda _, args, kwargs, output: output / 2, with_kwargs=True
            )
        elif change == "forward_pre_hook":
            module.register_forward_pre_hook(lambda _, args: (args[0] / 2,))
        elif change == "global_forward_hook":
            handle = hooks.register_module_forward_hook(lambda _, args, output: output / 2)
            undo.callback(handle.remove)
        elif change == "global_forward_pre_hook":
            # Every module's inputs (a parametrization's list is called with none).
            handle = hooks.register_module_forward_pre_hook(
                lambda _, args: tuple(x / 2 for x in args)
            )
            undo.callback(handle.remove)
        elif change == "subclass":
            cls = type(module)
            module.__class__ = type(
                f"Halved{cls.__name__}", (cls,), {"forward": halved(cls.forward)}
            )
        elif change == "tensor_subclass_weight":
            module.weight = nn.Parameter(module.weight.detach().as_subclass(Shifted))
        elif change == "class_forward":
            undo.enter_context(
                mock.patch.object(type(module), "forward", halved(type(module).forward))
            )
        elif change == "function_mode":
            undo.enter_context(Shifting())
        yield


@budget(60)
@given(
    kind=st.sampled_from(["linear", "linear_without_bias", "conv1d"]),
    changes=st.lists(st.sampled_from(CHANGES), unique=True, max_size=3),
    leading=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_computes_what_the_module_computes(kind, changes, leading, seed):
    torch.manual_seed(seed)
    module = Conv1D(12, 8) if kind == "conv1d" else nn.Linear(8, 12, bias=kind == "linear")
    nn.init.normal_(module.weight)
    rows = torch.randn(*leading, 8)
    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return ONEDNN(*args)

    with contextlib.ExitStack() as stack, torch.no_grad():
        stack.enter_context(mock.patch.object(products, "KERNEL", counted))
        stack.enter_context(mock.patch.object(products, "MIN_PRODUCT", 0))  # the product is small
        # A weight is replaced before a parametrization takes it (after, it would be its input).
        for change in sorted(changes, key=lambda change: change != "tensor_subclass_weight"):
            stack.enter_context(changed(module, change))
        got = products.call(module, [rows], {})
        expected = module(rows)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == (not changes)  # the kernel where, and only where, nothing changed
