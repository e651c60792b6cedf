"""oneDNN for grafted linear layers: same arithmetic as the module, used only where safe."""

from __future__ import annotations

import pytest
import torch
from conftest import random_mask, random_tokens
from torch import nn
from transformers.pytorch_utils import Conv1D

import grafting_lens as gl
from grafting_lens import kernels


def test_the_pinned_torch_has_the_onednn_operator():
    # Every other test here would pass vacuously through the fallback without it.
    assert kernels._onednn_available(), "this PyTorch build has no usable oneDNN linear operator"


@pytest.fixture
def onednn_calls(monkeypatch) -> list[tuple[int, ...]]:
    """Record the input shape of every oneDNN product."""
    calls: list[tuple[int, ...]] = []
    real = kernels._onednn_linear

    def spy(input, weight, bias):  # noqa: A002
        calls.append(tuple(input.shape))
        return real(input, weight, bias)

    monkeypatch.setattr(kernels, "_onednn_linear", spy)
    return calls


@pytest.fixture
def any_size(monkeypatch) -> None:
    """Route products of every size to oneDNN, so tiny test models exercise it."""
    monkeypatch.setattr(kernels, "_MIN_MULTIPLY_ADDS", 0)


def large_linear(kind: str, bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    if kind == "conv1d":
        return Conv1D(384, 256)  # GPT-2's layout: weight [d_in=256, d_out=384]
    return nn.Linear(256, 384, bias=bias)


@pytest.mark.parametrize(
    ("kind", "bias", "shape"),
    [
        ("linear", True, (96, 256)),
        ("linear", False, (96, 256)),
        ("linear", True, (4, 24, 256)),
        ("conv1d", True, (96, 256)),
        ("conv1d", True, (4, 24, 256)),
    ],
)
@torch.inference_mode()
def test_run_module_equals_the_module(onednn_calls, kind, bias, shape):
    module = large_linear(kind, bias)
    nn.init.normal_(module.weight)
    input = torch.randn(*shape)  # noqa: A001
    expected = module(input)
    output = kernels.run_module(module, input)
    assert onednn_calls == [(96, 256)]
    assert output.shape == expected.shape
    # float32 sums of 256 terms in another order: equal to rounding, not bitwise.
    assert torch.allclose(output, expected, rtol=1e-5, atol=1e-4)


@torch.inference_mode()
def test_non_contiguous_input_is_read_correctly(onednn_calls):
    module = large_linear("linear")
    wide = torch.randn(96, 512)
    input = wide[:, ::2]  # noqa: A001
    assert not input.is_contiguous()
    assert torch.allclose(kernels.run_module(module, input), module(input), rtol=1e-5, atol=1e-5)
    assert onednn_calls


def test_grafted_pass_through_onednn_equals_oracle_and_torch_kernels(
    three_models, onednn_calls, any_size, monkeypatch
):
    tokens = random_tokens(3, 9, seed=21)
    mask = random_mask(three_models, tokens.shape, seed=22)
    with torch.inference_mode():
        fast = gl.graft_forward(three_models, tokens, mask)
        assert onednn_calls, "no grafted linear layer went through oneDNN"
        oracle = gl.graft_forward_reference(three_models, tokens, mask)
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
        onednn_calls.clear()
        torch_kernels = gl.graft_forward(three_models, tokens, mask)
        assert not onednn_calls
    assert (fast - oracle).abs().max() <= 1e-4
    assert (fast - torch_kernels).abs().max() <= 1e-4
    assert (fast - three_models.base(tokens).detach()).abs().max() > 1.0


def test_graft_generate_through_onednn_matches_torch_kernels(
    three_models, onednn_calls, any_size, monkeypatch
):
    tokens = random_tokens(2, 5, seed=23)
    mask = random_mask(three_models, tokens.shape, seed=24)
    fast = gl.graft_generate(three_models, tokens, mask, max_new_tokens=4)
    assert onednn_calls
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert torch.equal(fast, gl.graft_generate(three_models, tokens, mask, max_new_tokens=4))


class ScaledLinear(nn.Linear):
    """A subclass computing something else (as LoRA or quantized layers do)."""

    def forward(self, input):  # noqa: A002
        return 2 * super().forward(input)


def _requires_grad(module, input):
    return module, input, torch.enable_grad()


def _hooked(module, input):
    module.register_forward_hook(lambda mod, args, output: output + 1.0)
    return module, input, torch.inference_mode()


def _float64(module, input):
    return module.double(), input.double(), torch.inference_mode()


def _subclass(module, input):
    torch.manual_seed(0)
    return ScaledLinear(256, 384), input, torch.inference_mode()


def _strided_weight(module, input):
    # As the bridge's Q cut out of GPT-2's fused c_attn: a view with row stride 1.
    fused = torch.randn(256, 3 * 384)
    module.weight = nn.Parameter(fused[:, :384].t(), requires_grad=False)
    return module, input, torch.inference_mode()


def _small(module, input):
    return nn.Linear(32, 16), torch.randn(8, 32), torch.inference_mode()


@pytest.mark.parametrize(
    "setup", [_requires_grad, _hooked, _float64, _subclass, _strided_weight, _small]
)
def test_falls_back_to_the_module(onednn_calls, setup):
    module, input, mode = setup(large_linear("linear"), torch.randn(96, 256))
    with mode:
        output = kernels.run_module(module, input)
        expected = module(input)
    assert not onednn_calls
    assert torch.equal(output, expected)


def test_gradients_flow_where_autograd_records(onednn_calls):
    module = large_linear("linear")
    kernels.run_module(module, torch.randn(96, 256)).sum().backward()
    assert module.weight.grad is not None
    assert not onednn_calls


def test_global_forward_hooks_see_every_call(onednn_calls):
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, output: seen.append(type(module))
    )
    try:
        with torch.inference_mode():
            kernels.run_module(large_linear("linear"), torch.randn(96, 256))
    finally:
        handle.remove()
    assert seen == [nn.Linear]
    assert not onednn_calls


@torch.inference_mode()
def test_disabled_mkldnn_means_torch_kernels(onednn_calls, monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    module = large_linear("conv1d")
    input = torch.randn(96, 256)  # noqa: A001
    assert torch.equal(kernels.run_module(module, input), module(input))
    assert not onednn_calls


@torch.inference_mode()
def test_an_operator_that_fails_its_probe_is_never_used(monkeypatch):
    def broken(input, weight, bias):  # noqa: A002
        raise RuntimeError("no such operator")

    monkeypatch.setattr(kernels, "_onednn_linear", broken)
    kernels._onednn_available.cache_clear()
    try:
        module = large_linear("linear")
        input = torch.randn(96, 256)  # noqa: A001
        assert not kernels._onednn_available()
        assert torch.equal(kernels.run_module(module, input), module(input))
    finally:
        monkeypatch.undo()
        kernels._onednn_available.cache_clear()
    assert kernels._onednn_available()
