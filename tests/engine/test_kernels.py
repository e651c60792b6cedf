"""Grafted linear layers: oneDNN only where it is the same arithmetic, chosen by a kept decision.

No test here times anything: the selection tests inject the timings a measurement
would have produced (``conftest.kernel_decisions_without_timing`` does so for every test).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import random_mask, random_tokens
from torch import nn
from transformers.pytorch_utils import Conv1D

import grafting_lens as gl
from grafting_lens.core import files
from grafting_lens.engine import kernels

MEASURE = kernels._measure  # the probe itself; the suite replaces it in every test


@pytest.fixture(autouse=True)
def fresh_policy(monkeypatch, tmp_path):
    """No pinned kernel, no environment variable, no decision remembered, an empty cache."""
    monkeypatch.setattr(kernels, "_pinned", None)
    monkeypatch.delenv(kernels.ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.setattr(kernels, "_decided", {})
    monkeypatch.setattr(kernels, "cache_root", files.cache_root)
    monkeypatch.setenv("GRAFTING_LENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_measure", refuse_to_time)


def refuse_to_time(module, rows):
    raise AssertionError(f"a kernel test timed a {type(module).__name__}; inject timings")


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
def pinned_onednn():
    """oneDNN for every product where it is the same arithmetic, whatever its size."""
    with kernels.use("onednn"):
        yield


class Timings:
    """Injected measurements: the (PyTorch, oneDNN) best times a probe would report."""

    def __init__(self, monkeypatch, torch_s: float, onednn_s: float) -> None:
        self.torch_s, self.onednn_s = torch_s, onednn_s
        self.calls: list[tuple[str, int]] = []
        monkeypatch.setattr(kernels, "_measure", self)

    def __call__(self, module, rows):
        self.calls.append((type(module).__name__, rows))
        return self.torch_s, self.onednn_s, 7


def large_linear(kind: str, bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    if kind == "conv1d":
        return Conv1D(384, 256)  # GPT-2's layout: weight [d_in=256, d_out=384]
    return nn.Linear(256, 384, bias=bias)


def test_the_pinned_torch_has_the_onednn_operator():
    # Every other test here would pass vacuously through the fallback without it.
    assert kernels._onednn_available(), "this PyTorch build has no usable oneDNN linear operator"


# --- oneDNN computes what the module computes --------------------------------------


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
def test_run_module_equals_the_module(onednn_calls, pinned_onednn, kind, bias, shape):
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
def test_non_contiguous_input_is_read_correctly(onednn_calls, pinned_onednn):
    module = large_linear("linear")
    wide = torch.randn(96, 512)
    input = wide[:, ::2]  # noqa: A001
    assert not input.is_contiguous()
    assert torch.allclose(kernels.run_module(module, input), module(input), rtol=1e-5, atol=1e-5)
    assert onednn_calls


def test_grafted_pass_through_onednn_equals_oracle_and_torch_kernels(three_models, onednn_calls):
    tokens = random_tokens(3, 9, seed=21)
    mask = random_mask(three_models, tokens.shape, seed=22)
    with torch.inference_mode():
        with kernels.use("onednn"):
            fast = gl.graft_forward(three_models, tokens, mask)
        assert onednn_calls, "no grafted linear layer went through oneDNN"
        oracle = gl.graft_forward_reference(three_models, tokens, mask)
        onednn_calls.clear()
        with kernels.use("torch"):
            torch_kernels = gl.graft_forward(three_models, tokens, mask)
        assert not onednn_calls
    assert (fast - oracle).abs().max() <= 1e-4
    assert (fast - torch_kernels).abs().max() <= 1e-4
    assert (fast - three_models.base(tokens).detach()).abs().max() > 1.0


def test_graft_generate_through_onednn_matches_torch_kernels(three_models, onednn_calls):
    tokens = random_tokens(2, 5, seed=23)
    mask = random_mask(three_models, tokens.shape, seed=24)
    with kernels.use("onednn"):
        fast = gl.graft_generate(three_models, tokens, mask, max_new_tokens=4)
    assert onednn_calls
    with kernels.use("torch"):
        assert torch.equal(fast, gl.graft_generate(three_models, tokens, mask, max_new_tokens=4))


# --- where oneDNN never runs, whatever the policy ------------------------------------


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


FALLBACKS = [_requires_grad, _hooked, _float64, _subclass, _strided_weight]


@pytest.mark.parametrize("policy", ["onednn", "auto"])
@pytest.mark.parametrize("setup", FALLBACKS)
def test_falls_back_to_the_module(onednn_calls, monkeypatch, policy, setup):
    timings = Timings(monkeypatch, torch_s=1.0, onednn_s=0.1)  # "auto" would pick oneDNN
    module, input, mode = setup(large_linear("linear"), torch.randn(96, 256))
    with kernels.use(policy), mode:
        output = kernels.run_module(module, input)
        expected = module(input)
    assert not onednn_calls
    assert not timings.calls, "an ineligible product was measured"
    assert torch.equal(output, expected)


@torch.inference_mode()
def test_auto_leaves_small_products_unmeasured_on_torch(onednn_calls, monkeypatch):
    timings = Timings(monkeypatch, torch_s=1.0, onednn_s=0.1)
    module, input = nn.Linear(32, 16), torch.randn(8, 32)  # noqa: A001
    assert torch.equal(kernels.run_module(module, input), module(input))
    assert not onednn_calls and not timings.calls


def test_gradients_flow_where_autograd_records(onednn_calls, pinned_onednn):
    module = large_linear("linear")
    kernels.run_module(module, torch.randn(96, 256)).sum().backward()
    assert module.weight.grad is not None
    assert not onednn_calls


def test_global_forward_hooks_see_every_call(onednn_calls, pinned_onednn):
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
def test_disabled_mkldnn_means_torch_kernels(onednn_calls, pinned_onednn, monkeypatch):
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
        with pytest.raises(gl.errors.KernelError, match="no working oneDNN"):
            kernels.use("onednn")
    finally:
        monkeypatch.undo()
        kernels._onednn_available.cache_clear()
    assert kernels._onednn_available()


# --- the policy: kernels.use and GRAFTING_LENS_KERNEL ---------------------------------


@torch.inference_mode()
def test_torch_policy_never_measures_nor_calls_onednn(onednn_calls, monkeypatch):
    timings = Timings(monkeypatch, torch_s=1.0, onednn_s=0.1)
    module, input = large_linear("linear"), torch.randn(96, 256)  # noqa: A001
    with kernels.use("torch"):
        assert torch.equal(kernels.run_module(module, input), module(input))
    assert not onednn_calls and not timings.calls


@torch.inference_mode()
def test_onednn_policy_does_not_measure(onednn_calls, monkeypatch):
    timings = Timings(monkeypatch, torch_s=0.1, onednn_s=1.0)  # "auto" would pick PyTorch
    with kernels.use("onednn"):
        kernels.run_module(large_linear("linear"), torch.randn(96, 256))
    assert onednn_calls and not timings.calls


def test_use_pins_for_the_process_or_for_a_block():
    assert kernels.policy() == "auto"
    with kernels.use("torch"):
        assert kernels.policy() == "torch"
        with kernels.use("onednn"):
            assert kernels.policy() == "onednn"
        assert kernels.policy() == "torch"
    assert kernels.policy() == "auto"
    kernels.use("torch")
    assert kernels.policy() == "torch"
    kernels.use(None)
    assert kernels.policy() == "auto"


@pytest.mark.parametrize("value", ["torch", "onednn", "auto"])
def test_the_environment_variable_sets_the_policy_and_use_wins(monkeypatch, value):
    monkeypatch.setenv("GRAFTING_LENS_KERNEL", value)
    assert kernels.policy() == value
    other = "torch" if value != "torch" else "onednn"
    with kernels.use(other):
        assert kernels.policy() == other
    assert kernels.policy() == value


@torch.inference_mode()
def test_the_environment_variable_reaches_run_module(onednn_calls, monkeypatch):
    timings = Timings(monkeypatch, torch_s=1.0, onednn_s=0.1)
    monkeypatch.setenv("GRAFTING_LENS_KERNEL", "torch")
    kernels.run_module(large_linear("linear"), torch.randn(96, 256))
    assert not onednn_calls and not timings.calls


@torch.inference_mode()
def test_an_unknown_environment_value_is_refused(monkeypatch):
    monkeypatch.setenv("GRAFTING_LENS_KERNEL", "mkl")
    with pytest.raises(
        gl.errors.KernelError, match=r"GRAFTING_LENS_KERNEL='mkl' names no kernel.*'torch'"
    ):
        kernels.run_module(large_linear("linear"), torch.randn(96, 256))


def test_use_refuses_unknown_kernels():
    with pytest.raises(gl.errors.KernelError, match=r"kernels.use='oneDNN' names no kernel"):
        kernels.use("oneDNN")
    with pytest.raises(TypeError, match="string or None"):
        kernels.use(True)  # type: ignore[arg-type]
    assert kernels.policy() == "auto"


# --- "auto": the rule, the buckets, the kept decision ---------------------------------


@pytest.mark.parametrize(
    ("torch_s", "onednn_s", "kernel"),
    [
        (1.0, 0.5, "onednn"),
        (1.0, 0.89, "onednn"),
        (1.0, 0.9, "torch"),  # a 10% win is not enough: within the noise of a shared machine
        (1.0, 0.95, "torch"),
        (1.0, 1.0, "torch"),
        (1.0, 1.3, "torch"),
    ],
)
def test_the_rule_needs_a_clear_win_for_onednn(torch_s, onednn_s, kernel):
    assert kernels._decide(torch_s, onednn_s) == kernel


@pytest.mark.parametrize(
    ("rows", "top", "label"),
    [(1, 1, "1"), (2, 2, "2"), (3, 4, "3-4"), (64, 64, "33-64"), (65, 128, "65-128"),
     (300, 512, "257+"), (100_000, 512, "257+")],
)  # fmt: skip
def test_rows_are_bucketed_by_powers_of_two(rows, top, label):
    bucket = kernels._Bucket.of(large_linear("conv1d"), rows)
    assert (bucket.rows, bucket.rows_label()) == (top, label)
    assert (bucket.layout, bucket.d_in, bucket.d_out, bucket.bias) == ("conv1d", 256, 384, True)


@torch.inference_mode()
@pytest.mark.parametrize(
    ("torch_s", "onednn_s", "kernel"), [(2.0, 1.0, "onednn"), (1.0, 2.0, "torch")]
)
def test_auto_follows_the_measurement_and_keeps_it(
    onednn_calls, monkeypatch, tmp_path, torch_s, onednn_s, kernel
):
    timings = Timings(monkeypatch, torch_s, onednn_s)
    module, input = large_linear("conv1d"), torch.randn(4, 24, 256)  # noqa: A001
    output = kernels.run_module(module, input)
    assert torch.allclose(output, module(input), rtol=1e-5, atol=1e-4)
    assert timings.calls == [("Conv1D", 128)]  # 96 rows: the bucket 65-128, measured at 128
    assert bool(onednn_calls) == (kernel == "onednn")

    table = kernels.decisions()
    assert len(table) == 1
    row = table.iloc[0]
    assert (row.layout, row.d_in, row.d_out, row.rows, row.kernel) == (
        "conv1d", 256, 384, "65-128", kernel
    )  # fmt: skip
    assert (row.torch_ms, row.onednn_ms, row.runs, row.measured) == (
        torch_s * 1e3, onednn_s * 1e3, 7, "now"
    )  # fmt: skip
    kept = json.loads(open(row.path).read())
    assert kept["kernel"] == kernel and kept["machine"]["threads"] == torch.get_num_threads()
    assert row.path.startswith(str(tmp_path / "cache" / "kernels"))

    # The same bucket again: no second measurement, the same kernel.
    kernels.run_module(module, torch.randn(70, 256))
    assert len(timings.calls) == 1


@torch.inference_mode()
def test_a_kept_decision_is_never_measured_again(onednn_calls, monkeypatch):
    module, input = large_linear("linear"), torch.randn(96, 256)  # noqa: A001
    Timings(monkeypatch, torch_s=2.0, onednn_s=1.0)
    kernels.run_module(module, input)
    assert onednn_calls

    # A new process (nothing remembered) on a machine whose timings would now say PyTorch.
    monkeypatch.setattr(kernels, "_decided", {})
    onednn_calls.clear()
    later = Timings(monkeypatch, torch_s=1.0, onednn_s=2.0)
    kernels.run_module(module, input)
    assert onednn_calls, "the kept decision (oneDNN) was not followed"
    assert not later.calls
    assert kernels.decisions().measured.tolist() == ["earlier"]


@torch.inference_mode()
def test_each_bucket_and_machine_has_its_own_decision(monkeypatch):
    timings = Timings(monkeypatch, torch_s=2.0, onednn_s=1.0)
    linear, conv1d = large_linear("linear"), large_linear("conv1d")
    kernels.run_module(linear, torch.randn(96, 256))
    kernels.run_module(linear, torch.randn(200, 256))  # more rows: another bucket
    kernels.run_module(conv1d, torch.randn(96, 256))  # another layout
    kernels.run_module(large_linear("linear", bias=False), torch.randn(96, 256))
    real_machine = kernels._machine
    monkeypatch.setattr(
        kernels, "_machine", lambda: kernels._Machine(**{**vars(real_machine()), "threads": 64})
    )
    kernels.run_module(linear, torch.randn(96, 256))  # another thread count: another machine
    assert timings.calls == [("Linear", 128), ("Linear", 256), ("Conv1D", 128), ("Linear", 128),
                             ("Linear", 128)]  # fmt: skip
    paths = kernels.decisions().path
    assert paths.nunique() == 5
    assert len({str(p).rsplit("/", 2)[-2] for p in paths}) == 2  # two machine directories


@torch.inference_mode()
def test_the_first_decision_written_wins(monkeypatch):
    # Another process wrote its decision between our read and our write.
    module = large_linear("linear")
    bucket = kernels._Bucket.of(module, 96)
    folder = kernels.cache_root() / "kernels" / kernels._machine().directory()
    folder.mkdir(parents=True)
    earlier = {"kernel": "torch", "torch_s": 1.0, "onednn_s": 0.95, "runs": 7}
    (folder / bucket.file_name()).write_text(json.dumps(earlier))
    monkeypatch.setattr(kernels, "_read", lambda path, machine, bucket: None)
    Timings(monkeypatch, torch_s=2.0, onednn_s=1.0)
    kernels.run_module(module, torch.randn(96, 256))
    decision = kernels.decisions().iloc[0]
    assert (decision.kernel, decision.measured, decision.onednn_ms) == ("torch", "earlier", 950.0)


@torch.inference_mode()
def test_an_unwritable_cache_decides_for_the_process_and_says_so(
    onednn_calls, monkeypatch, tmp_path
):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("GRAFTING_LENS_CACHE", str(blocker))
    timings = Timings(monkeypatch, torch_s=2.0, onednn_s=1.0)
    with pytest.warns(UserWarning, match="holds for this process only.*GRAFTING_LENS_CACHE"):
        kernels.run_module(large_linear("linear"), torch.randn(96, 256))
    kernels.run_module(large_linear("linear"), torch.randn(96, 256))  # remembered: no warning
    assert len(timings.calls) == 1 and len(onednn_calls) == 2
    assert kernels.decisions().path.tolist() == [None]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "is not JSON"),
        ('{"kernel": "torch"}', "lacks a field"),
        ('{"kernel": "mkl", "torch_s": 1, "onednn_s": 1, "runs": 3}', "names kernel 'mkl'"),
    ],
)
@torch.inference_mode()
def test_a_broken_decision_file_is_refused_with_its_path(monkeypatch, content, match):
    module = large_linear("linear")
    folder = kernels.cache_root() / "kernels" / kernels._machine().directory()
    folder.mkdir(parents=True)
    path = folder / kernels._Bucket.of(module, 96).file_name()
    path.write_text(content)
    with pytest.raises(gl.errors.KernelError, match=match) as raised:
        kernels.run_module(module, torch.randn(96, 256))
    assert str(path) in str(raised.value) and "Delete it to measure again" in str(raised.value)


def test_the_machine_names_cpu_instruction_set_torch_and_threads():
    machine = kernels._machine()
    assert machine.cpu and machine.capability
    assert (machine.torch, machine.threads) == (torch.__version__, torch.get_num_threads())
    assert machine.directory() == kernels._machine().directory()  # stable within a process


def test_measure_returns_best_times_of_both_kernels():
    # The probe itself, on a tiny product: what it returns, never how fast anything is.
    torch_s, onednn_s, runs = MEASURE(nn.Linear(16, 8), 4)
    assert kernels._PROBE_MIN_RUNS <= runs <= kernels._PROBE_RUNS
    assert all(0 < t < math.inf for t in (torch_s, onednn_s))
