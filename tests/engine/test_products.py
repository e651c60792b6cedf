"""Split linear layers through oneDNN (grafting_lens.engine.products): the values of the
modules' own forwards to float32 rounding, taken only where nothing can tell them apart.

The kernel is on where MKL runs on a CPU by another vendor than Intel that has AVX-512;
these tests put it on (or off) whatever CPU runs them, so both paths are tested on every
machine (tests/fuzz/test_kernel.py: modules modified at random).
"""

from __future__ import annotations

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from conftest import random_mask, random_tokens
from torch import nn
from transformers.pytorch_utils import Conv1D

import grafting_lens as gl
from grafting_lens.engine import products

ONEDNN = torch.ops.mkldnn._linear_pointwise


@pytest.fixture
def onednn(monkeypatch) -> list[torch.Size]:
    """The oneDNN kernel on, counting the weights it is called with."""
    calls: list[torch.Size] = []

    def counted(x, weight, *rest):
        calls.append(weight.shape)
        return ONEDNN(x, weight, *rest)

    monkeypatch.setattr(products, "KERNEL", counted)
    monkeypatch.setattr(products, "MIN_PRODUCT", 0)  # the test models' products are small
    return calls


def test_the_locked_torch_has_the_kernel():
    """A release that drops the operator would silently fall back: this says so first."""
    assert torch.backends.mkldnn.is_available()
    assert hasattr(torch.ops.mkldnn, "_linear_pointwise")


def test_split_slots_run_on_onednn_and_equal_the_modules_to_rounding(
    three_models, onednn, monkeypatch
):
    tokens = random_tokens(3, 9, seed=1)
    mask = random_mask(three_models, tuple(tokens.shape), seed=2)
    fast = gl.graft_forward(three_models, tokens, mask, logits="all")
    assert len(onednn) >= 3 * three_models.base.cfg.n_layers  # the MLP's and O's parts at least
    monkeypatch.setattr(products, "KERNEL", None)
    modules = gl.graft_forward(three_models, tokens, mask, logits="all")
    reference = gl.graft_forward_reference(three_models, tokens, mask)
    scale = modules.abs().max()
    assert scale > 3  # logits vary by units: a wrong product could not hide
    assert (fast - modules).abs().max() <= 1e-5 * scale
    assert (fast - reference).abs().max() <= 1e-5 * scale


def test_a_slot_one_source_computes_runs_its_module(three_models, onednn):
    """An empty mask and a full one are the models' own forwards, bit for bit."""
    tokens = random_tokens(2, 7, seed=3)
    empty = gl.GraftMask.from_dict(three_models, {}, shape=tokens.shape)
    assert torch.equal(
        gl.graft_forward(three_models, tokens, empty, logits="all"), three_models.base(tokens)
    )
    full = gl.GraftMask.build(three_models, tokens, components="all", source=1)
    gl.graft_forward(three_models, tokens, full, logits="all")
    assert onednn == []


def linear(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "conv1d":
        module = Conv1D(12, 8)  # [in=8, out=12]
        nn.init.normal_(module.weight)
        nn.init.normal_(module.bias)
        return module
    return nn.Linear(8, 12, bias=kind == "linear")


@pytest.mark.parametrize("kind", ["linear", "linear_without_bias", "conv1d"])
def test_the_kernel_computes_the_modules_map(kind, onednn):
    module = linear(kind)
    rows = torch.randn(2, 5, 8)
    with torch.no_grad():
        got = products.call(module, [rows], {})
        expected = module(rows)
    assert len(onednn) == 1
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_a_bias_held_as_a_buffer_is_the_modules_own(onednn):
    """The bridge's unembedding holds its zero bias as a buffer: still exactly a linear map,
    so it runs on the kernel (once it did not, and a half graft cost a fifth more)."""
    module = nn.Linear(8, 700, bias=False)
    del module._parameters["bias"]
    module.register_buffer("bias", torch.randn(700))
    rows = torch.randn(2, 5, 8)
    with torch.no_grad():
        got = products.call(module, [rows], {})
        expected = module(rows)
    assert len(onednn) == 1
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    module.register_buffer("scale", torch.ones(1))  # anything more: the module computes it
    assert products.linear_weights(module) is None


@pytest.mark.parametrize(
    "case",
    [
        "autograd",
        "float64",
        "strided_weight",
        "mkldnn_off",
        "autocast",
        "keyword_argument",
        "small_product",
    ],
)
def test_anything_else_calls_the_module(case, onednn, monkeypatch):
    """Where oneDNN's result could be told apart (autograd, another map), the module runs.

    Modules changed after loading (hooks, subclasses, accelerate...): tests/fuzz/test_kernel.py.
    """
    module = linear("linear")
    rows = torch.randn(4, 8)
    if case == "float64":
        module, rows = module.double(), rows.double()
    if case == "strided_weight":
        fused = torch.randn(8, 36)  # GPT-2's c_attn: the bridge's Q is a slice of it
        module.weight = nn.Parameter(fused[:, :12].t())
    if case == "small_product":
        monkeypatch.setattr(products, "MIN_PRODUCT", 4 * 8 * 12 + 1)
    if case == "mkldnn_off":
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    args, kwargs = ([], {"input": rows}) if case == "keyword_argument" else ([rows], {})
    with torch.set_grad_enabled(case == "autograd"):
        with torch.autocast("cpu", enabled=case == "autocast"):
            got = products.call(module, args, kwargs)
            expected = module(*args, **kwargs)
    assert onednn == []
    assert torch.equal(got, expected)


class Halved(ModelHook):
    def post_forward(self, module, output):
        return output / 2


@pytest.mark.parametrize("change", ["instance_forward", "accelerate_hook"])
def test_a_linear_layer_changed_after_loading_is_grafted_as_it_computes(
    three_models, onednn, change
):
    """``module(x)`` is what the layer computes, whatever its class says: oneDNN skips it."""
    layers = {
        id(m): m
        for model in three_models
        for m in model.modules()
        if type(m) in (nn.Linear, Conv1D)
    }.values()
    tokens = random_tokens(3, 9, seed=4)
    mask = random_mask(three_models, tuple(tokens.shape), seed=5)
    try:
        for layer in layers:
            if change == "instance_forward":
                layer.forward = lambda x, forward=layer.forward: forward(x) / 2
            else:
                add_hook_to_module(layer, Halved())
        grafted = gl.graft_forward(three_models, tokens, mask, logits="all")
        reference = gl.graft_forward_reference(three_models, tokens, mask)
    finally:
        for layer in layers:
            if change == "accelerate_hook":
                remove_hook_from_module(layer)
            del layer.forward  # accelerate's removal leaves the class's forward on the instance
    assert float((grafted - reference).abs().max()) <= 1e-5 * float(reference.abs().max())
    assert onednn == []


FLAGS = "flags\t\t: fpu sse avx avx2 fma"
AVX512 = FLAGS + " avx512f avx512dq avx512bw avx512vl"
INTEL = "vendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\n"


@pytest.mark.parametrize(
    ("machine", "cpuinfo", "on", "why"),
    [
        ("x86_64", f"vendor_id\t: AuthenticAMD\n{AVX512}\n" * 2, True, "AVX-512 on a CPU by"),
        ("x86_64", f"vendor_id\t: AuthenticAMD\n{FLAGS}\n" * 2, False, "no AVX-512"),
        ("x86_64", f"vendor_id\t: HygonGenuine\n{AVX512}\n", True, "HygonGenuine"),
        ("x86_64", f"{INTEL}{AVX512}\n", False, "an Intel CPU"),
        ("aarch64", "processor\t: 0\nBogoMIPS\t: 50.00\n", False, "not an x86-64"),
        ("x86_64", None, False, "no "),  # no /proc/cpuinfo: nothing is assumed
    ],
)
def test_the_kernel_is_chosen_where_the_cpu_has_avx512_that_mkl_leaves_aside(
    tmp_path, monkeypatch, machine, cpuinfo, on, why
):
    """By instruction set and vendor, never vendor alone: without AVX-512 oneDNN was slower."""
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    monkeypatch.setattr(products.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    chosen, reason = products._choose(path)
    assert chosen is on
    assert why in reason
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert products._choose(path)[0] is False  # OpenBLAS, Accelerate: not measured
