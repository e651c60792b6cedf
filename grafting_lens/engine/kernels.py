"""The kernel a grafted linear layer runs on: PyTorch's, or oneDNN where it measured faster.

Why this module exists
----------------------
A grafted pass computes each grafted component itself: for every source, the
positions that source owns go through that source's module (see
:mod:`grafting_lens.engine.graft`). Most of those modules are linear layers (Q, K, V, O,
the MLP matrices, the unembedding), and on a CPU nearly all of a pass's time is
their matrix products.

PyTorch computes a float32 linear layer on a CPU with its BLAS (MKL's ``sgemm`` in
the x86 wheels). oneDNN, which ships inside every CPU build of PyTorch, computes the
same product with code picked by instruction set rather than by vendor. Which one
is faster depends on the machine: on the AMD EPYC (Zen 4) CPUs this project is
developed on, oneDNN reached 140-195 GFLOP/s on the products of a GPT-2-small graft
where MKL reached 60-155; on an Intel Xeon the same benchmark ran *slower* with
oneDNN (0.28 s instead of 0.24 s). No fixed choice is right everywhere, so the
choice is measured, once per machine and shape, and remembered.

How the kernel is chosen
------------------------
The policy is ``"auto"`` unless pinned, by :func:`use` (for the process, or for a
``with`` block) or by the environment variable ``GRAFTING_LENS_KERNEL``
(``auto``, ``torch`` or ``onednn``); :func:`use` wins over the variable.

* ``"torch"``: every grafted product runs on PyTorch's kernel, as an ungrafted
  forward does.
* ``"onednn"``: every product where oneDNN is the same arithmetic (below) runs on
  oneDNN, whatever its size or speed.
* ``"auto"``: a product runs on oneDNN only where oneDNN *measured* faster on this
  machine for its shape. Products below 4M multiply-adds stay on PyTorch's kernel
  without a measurement (oneDNN's larger fixed cost per call outweighs its faster
  arithmetic there). For a larger one, the first time its shape bucket is met
  (layout, ``d_in``, ``d_out``, bias, and rows rounded up to a power of two, at
  most 512), both kernels compute that product on random rows, interleaved, best
  of up to 7 runs each; oneDNN is chosen only if its best time is below 0.9 times
  PyTorch's (a tie or a win within noise keeps PyTorch's kernel). The decision is
  written to ``$GRAFTING_LENS_CACHE/kernels/<machine>/<bucket>.json`` (else under
  ``~/.cache/grafting_lens``), where ``<machine>`` hashes the CPU model, its
  instruction set as PyTorch sees it, the torch version and the number of threads.
  The first decision written is the one every later run reads: it is never
  measured again, so on one machine a product always runs on the same kernel and
  results do not change from run to run because a timing was noisy. Delete the
  directory to measure again.

What a user sees: the first grafted pass that meets a new shape bucket on a
machine takes longer (a few milliseconds per bucket for a GPT-2-small block, up to
about a second for a large unembedding); the decision is logged at INFO on the
``grafting_lens.engine.kernels`` logger, and :func:`decisions` lists every decision this
process used. If the cache cannot be written, a warning says so and the decision
holds for the process only. The two kernels sum the same float32 products in
another order, so results agree to float32 rounding (relative differences near
1e-7), as any two BLAS libraries do; pin ``"torch"`` to compute every product
exactly as an ungrafted forward does.

When oneDNN may run at all
--------------------------
:func:`run_module` calls oneDNN only where the result is the module's own
arithmetic (up to the order of the float32 sums) and neither autograd nor a hook
can tell which kernel ran:

* the module is exactly ``torch.nn.Linear`` or ``transformers``' ``Conv1D`` (GPT-2's
  transposed linear), not a subclass (LoRA, quantized layers) that computes
  something else;
* input, weight and bias are float32 on the CPU, and the weight is a dense matrix
  (or its transpose), not a strided view into a larger one;
* autograd has nothing to record (``torch.no_grad()``/``torch.inference_mode()``, or
  nothing requires a gradient): the oneDNN operator has no backward;
* no forward hook is registered on the module, nor globally, so hooks on the
  checkpoint's own modules see every call (the bridge's hooks, ``hook_in`` and
  ``hook_out``, sit outside and always fire);
* ``torch.backends.mkldnn.enabled`` is true (setting it to ``False`` is another way
  to get PyTorch's kernel everywhere), and the operator exists in this PyTorch and
  agreed with ``torch.nn.functional.linear`` on a probe.

Everywhere else the module is simply called.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.pytorch_utils import Conv1D

from grafting_lens.core.errors import KernelError
from grafting_lens.core.files import cache_root, write_once

__all__ = ["KERNELS", "decisions", "policy", "run_module", "use"]

KERNELS = ("auto", "torch", "onednn")
"""The policies :func:`use` and ``GRAFTING_LENS_KERNEL`` accept."""

ENVIRONMENT_VARIABLE = "GRAFTING_LENS_KERNEL"

_logger = logging.getLogger(__name__)

# oneDNN costs about 10 microseconds more per call than MKL; below a few million
# multiply-adds (a toy model's 64x256 matrix on 64 rows) that outweighs its faster
# arithmetic, so "auto" leaves small products with PyTorch's kernel unmeasured.
_MIN_MULTIPLY_ADDS = 1 << 22

# oneDNN must beat PyTorch's kernel by 10% to be chosen: timings on a shared machine
# wobble by a few percent, and a choice within noise buys nothing but a difference
# in rounding from an ungrafted forward.
_MARGIN = 0.9

# Rows are bucketed by powers of two; past 512 a product's speed per row no longer
# depends on the rows, and measuring a large unembedding on more would take seconds.
_MAX_PROBE_ROWS = 512

# Best of up to 7 interleaved runs of each kernel, at least 3, stopping after a
# second: a GPT-2-small block's product takes under a millisecond, a large
# unembedding on 512 rows a quarter of a second.
_PROBE_RUNS = 7
_PROBE_MIN_RUNS = 3
_PROBE_BUDGET_S = 1.0

_pinned: str | None = None


def run_module(module: nn.Module, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: A002
    """``module(input, *args, **kwargs)``, through oneDNN where the policy chooses it.

    Args:
        module: A source's component module (a linear layer, a norm, an embedding...).
        input: Its input, ``[..., d_in]`` for a linear layer.
        *args: Further positional arguments of the module's forward.
        **kwargs: Keyword arguments of the module's forward.

    Returns:
        What the module returns; for a linear layer ``[..., d_out]``, equal to the
        module's own output to float32 rounding.

    Raises:
        KernelError: ``GRAFTING_LENS_KERNEL`` names no kernel, or a decision file in
            the cache is unreadable.
    """
    if args or kwargs or not _takes_onednn(module, input):
        return module(input, *args, **kwargs)
    weight, bias = _oriented(module)
    flat = input.reshape(-1, input.shape[-1]).contiguous()
    output = _onednn_linear(flat, weight, bias)
    return output.reshape(*input.shape[:-1], output.shape[-1])


def use(kernel: str | None) -> _Pinned:
    """Pin the kernel of grafted linear layers: ``"torch"``, ``"onednn"`` or ``"auto"``.

    Called alone, it pins the kernel for the rest of the process. As a context
    manager, it restores the previous policy on exit:

        kernels.use("torch")                  # from now on
        with kernels.use("onednn"):           # only inside the block
            logits = gl.graft_forward(models, tokens, mask)

    Pinning wins over ``GRAFTING_LENS_KERNEL``; ``use(None)`` unpins, so the
    variable (else ``"auto"``) decides again.

    Args:
        kernel: ``"auto"`` (measure once per machine and shape, see the module's
            documentation), ``"torch"`` (PyTorch's kernel everywhere, as an ungrafted
            forward), ``"onednn"`` (oneDNN wherever it is the same arithmetic), or
            ``None``.

    Returns:
        A context manager that restores the policy in force before the call.

    Raises:
        TypeError: ``kernel`` is not a string or None.
        KernelError: ``kernel`` names no kernel, or ``"onednn"`` is asked for in a
            PyTorch whose oneDNN linear operator is missing or failed its check.
    """
    global _pinned
    if kernel is not None:
        if not isinstance(kernel, str):
            raise TypeError(f"kernels.use takes a string or None, got {type(kernel).__name__}.")
        kernel = _checked(kernel, "kernels.use")
        if kernel == "onednn" and not _onednn_available():
            raise KernelError(
                "kernels.use('onednn'): this PyTorch has no working oneDNN linear operator "
                "(torch.backends.mkldnn is unavailable, or the operator failed its check). "
                "Use 'torch' or 'auto'."
            )
    pinned = _Pinned(_pinned)
    _pinned = kernel
    return pinned


class _Pinned:
    """What :func:`use` returns: entering does nothing, leaving restores the earlier policy."""

    def __init__(self, previous: str | None) -> None:
        self._previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        global _pinned
        _pinned = self._previous


def policy() -> str:
    """The policy in force: pinned by :func:`use`, else ``GRAFTING_LENS_KERNEL``, else ``"auto"``.

    Raises:
        KernelError: ``GRAFTING_LENS_KERNEL`` is set to something other than
            ``auto``, ``torch`` or ``onednn``.
    """
    if _pinned is not None:
        return _pinned
    value = os.environ.get(ENVIRONMENT_VARIABLE, "")
    return _checked(value, ENVIRONMENT_VARIABLE) if value else "auto"


def decisions() -> pd.DataFrame:
    """The kernel decisions this process has used under ``"auto"``, one row per shape bucket.

    Returns:
        One row per decision: ``layout`` (``linear`` or ``conv1d``), ``d_in``,
        ``d_out``, ``bias``, ``rows`` (the bucket, e.g. ``"33-64"``), ``kernel``
        (``torch`` or ``onednn``), ``torch_ms`` and ``onednn_ms`` (best times of the
        measurement), ``runs`` (of each kernel), ``measured`` (``"now"`` or
        ``"earlier"``, read from the cache), ``threads`` and ``path`` (the decision
        file, or None where the cache could not be written).
    """
    columns = [
        "layout",
        "d_in",
        "d_out",
        "bias",
        "rows",
        "kernel",
        "torch_ms",
        "onednn_ms",
        "runs",
        "measured",
        "threads",
        "path",
    ]
    return pd.DataFrame([_decided[key].row() for key in sorted(_decided)], columns=columns)


def _checked(kernel: str, where: str) -> str:
    if kernel not in KERNELS:
        raise KernelError(
            f"{where}={kernel!r} names no kernel: use one of {', '.join(map(repr, KERNELS))}."
        )
    return kernel


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
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        # A strided view (the bridge's Q, K and V cut out of GPT-2's fused c_attn)
        # sends oneDNN to a reference kernel hundreds of times slower than MKL.
        return False
    chosen = policy()
    if chosen == "torch" or not (torch.backends.mkldnn.enabled and _onednn_available()):
        return False
    if chosen == "onednn":
        return True
    rows = input.numel() // input.shape[-1]
    if rows * weight.numel() < _MIN_MULTIPLY_ADDS:
        return False
    return _decision(module, rows).kernel == "onednn"


def _weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer's (or Conv1D's) weight and bias, typed as tensors."""
    weight, bias = module.weight, module.bias
    assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
    return weight, bias


def _oriented(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight as ``[d_out, d_in]`` (Conv1D's ``[d_in, d_out]`` transposed in place) and bias."""
    weight, bias = _weight_and_bias(module)
    return (weight if type(module) is nn.Linear else weight.t()), bias


def _onednn_linear(
    input: Float[torch.Tensor, "rows d_in"],  # noqa: A002
    weight: Float[torch.Tensor, "d_out d_in"],
    bias: Float[torch.Tensor, " d_out"] | None,
) -> Float[torch.Tensor, "rows d_out"]:
    """``input @ weight.T + bias`` with oneDNN's matrix product (no post-op)."""
    return torch.ops.mkldnn._linear_pointwise(input, weight, bias, "none", [], "")


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


# --- "auto": one measurement per machine and shape bucket, remembered -----------------


@dataclass(frozen=True, order=True)
class _Bucket:
    """The products that share one decision: a layout, a weight shape, a bias, a range of rows."""

    layout: str  # "linear" (weight [d_out, d_in]) or "conv1d" (weight [d_in, d_out])
    d_in: int
    d_out: int
    bias: bool
    rows: int  # the bucket's upper bound, a power of two <= _MAX_PROBE_ROWS: the rows measured

    @classmethod
    def of(cls, module: nn.Module, rows: int) -> _Bucket:
        weight, bias = _oriented(module)
        top = min(1 << max(rows - 1, 0).bit_length(), _MAX_PROBE_ROWS)
        layout = "linear" if type(module) is nn.Linear else "conv1d"
        return cls(layout, int(weight.shape[1]), int(weight.shape[0]), bias is not None, top)

    def rows_label(self) -> str:
        """The bucket's rows as a range: ``"1"``, ``"2"``, ``"33-64"``, ``"257+"``."""
        if self.rows <= 2:
            return str(self.rows)
        low = self.rows // 2 + 1
        return f"{low}+" if self.rows == _MAX_PROBE_ROWS else f"{low}-{self.rows}"

    def file_name(self) -> str:
        bias = "bias" if self.bias else "nobias"
        return f"{self.layout}-{self.d_in}x{self.d_out}-{bias}-rows{self.rows_label()}.json"


@dataclass(frozen=True, order=True)
class _Machine:
    """What a decision is valid for: the CPU, how PyTorch uses it, and the threads."""

    cpu: str
    capability: str
    torch: str
    threads: int

    def directory(self) -> str:
        described = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(described.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class _Decision:
    """Which kernel a bucket runs on, the timings it rests on, and where it is kept."""

    machine: _Machine
    bucket: _Bucket
    kernel: str
    torch_s: float
    onednn_s: float
    runs: int
    measured: str  # "now" or "earlier"
    path: Path | None

    def row(self) -> dict[str, Any]:
        return {
            "layout": self.bucket.layout,
            "d_in": self.bucket.d_in,
            "d_out": self.bucket.d_out,
            "bias": self.bucket.bias,
            "rows": self.bucket.rows_label(),
            "kernel": self.kernel,
            "torch_ms": round(self.torch_s * 1e3, 4),
            "onednn_ms": round(self.onednn_s * 1e3, 4),
            "runs": self.runs,
            "measured": self.measured,
            "threads": self.machine.threads,
            "path": None if self.path is None else str(self.path),
        }


_decided: dict[tuple[_Machine, _Bucket], _Decision] = {}


def _decide(torch_s: float, onednn_s: float) -> str:
    """The rule: oneDNN only if its best time is below ``_MARGIN`` times PyTorch's."""
    return "onednn" if onednn_s < _MARGIN * torch_s else "torch"


def _decision(module: nn.Module, rows: int) -> _Decision:
    """This machine's decision for the module's bucket: remembered, read, or measured now."""
    key = (_machine(), _Bucket.of(module, rows))
    decision = _decided.get(key)
    if decision is None:
        decision = _decided[key] = _recall_or_measure(*key, module)
    return decision


def _machine() -> _Machine:
    return _Machine(_cpu_model(), _cpu_capability(), torch.__version__, torch.get_num_threads())


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, where ``platform`` has only the ISA)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@functools.cache
def _cpu_capability() -> str:
    """The instruction set PyTorch dispatches to (``AVX512``, ``AVX2``...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def _recall_or_measure(machine: _Machine, bucket: _Bucket, module: nn.Module) -> _Decision:
    """The decision kept in the cache, else a new measurement, kept if the cache allows."""
    folder = cache_root() / "kernels" / machine.directory()
    path = folder / bucket.file_name()
    kept = _read(path, machine, bucket)
    if kept is not None:
        return kept
    torch_s, onednn_s, runs = _measure(module, bucket.rows)
    kernel = _decide(torch_s, onednn_s)
    record = {
        "kernel": kernel,
        "torch_s": torch_s,
        "onednn_s": onednn_s,
        "runs": runs,
        "rule": f"onednn if onednn_s < {_MARGIN} * torch_s",
        "bucket": asdict(bucket),
        "machine": asdict(machine),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_once(folder / "machine.json", _json({"machine": asdict(machine)}))
        first = json.loads(write_once(path, _json(record)))
    except OSError as error:
        warnings.warn(
            f"grafting-lens could not keep its kernel decision in {folder} ({error}); it "
            f"holds for this process only, and another process may decide otherwise. Set "
            f"GRAFTING_LENS_CACHE to a writable directory, or pin a kernel with "
            f"kernels.use('torch') or {ENVIRONMENT_VARIABLE}=torch.",
            stacklevel=2,
        )
        return _Decision(machine, bucket, kernel, torch_s, onednn_s, runs, "now", None)
    decision = _parsed(first, path, machine, bucket, "now" if first == record else "earlier")
    _logger.info(
        "grafted %s %dx%d products of %s rows on %d threads run on %s (PyTorch %.3f ms, "
        "oneDNN %.3f ms, best of %d); kept in %s",
        bucket.layout,
        bucket.d_in,
        bucket.d_out,
        bucket.rows_label(),
        machine.threads,
        decision.kernel,
        decision.torch_s * 1e3,
        decision.onednn_s * 1e3,
        decision.runs,
        path,
    )
    return decision


def _json(record: dict[str, Any]) -> bytes:
    return json.dumps(record, indent=1, sort_keys=True).encode()


def _read(path: Path, machine: _Machine, bucket: _Bucket) -> _Decision | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None  # not decided yet (or no cache there: writing it will say so)
    except OSError as error:
        raise KernelError(
            f"The kernel decision {path} cannot be read ({error}). Delete it to measure "
            "again, or pin a kernel with kernels.use('torch')."
        ) from error
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise KernelError(
            f"The kernel decision {path} is not JSON ({error}). Delete it to measure again."
        ) from error
    return _parsed(record, path, machine, bucket, "earlier")


def _parsed(
    record: Any, path: Path, machine: _Machine, bucket: _Bucket, measured: str
) -> _Decision:
    try:
        kernel = record["kernel"]
        torch_s, onednn_s, runs = (
            float(record["torch_s"]),
            float(record["onednn_s"]),
            record["runs"],
        )
    except (TypeError, KeyError, ValueError) as error:
        raise KernelError(
            f"The kernel decision {path} lacks a field ({error!r}). Delete it to measure again."
        ) from error
    if kernel not in ("torch", "onednn") or not isinstance(runs, int):
        raise KernelError(
            f"The kernel decision {path} names kernel {kernel!r} with runs={runs!r}; expected "
            "'torch' or 'onednn' and a count. Delete it to measure again."
        )
    return _Decision(machine, bucket, kernel, torch_s, onednn_s, runs, measured, path)


def _measure(module: nn.Module, rows: int) -> tuple[float, float, int]:
    """Best times of PyTorch's kernel and oneDNN on ``rows`` random rows, and the runs of each.

    The two run interleaved, alternating which goes first, after one warm-up each
    (oneDNN builds its primitive on the first call), so a slow spell on a shared
    machine slows both. Noise only ever adds time, so the best run is the estimate.
    """
    weight, bias = _oriented(module)
    generator = torch.Generator().manual_seed(0)  # the caller's random stream is left alone
    input = torch.randn(rows, weight.shape[1], generator=generator)  # noqa: A001
    kernels = {
        "torch": lambda: module(input),
        "onednn": lambda: _onednn_linear(input, weight, bias),
    }
    best = {name: math.inf for name in kernels}
    with torch.no_grad():
        for run in kernels.values():
            run()
        start = time.perf_counter()
        runs = 0
        while runs < _PROBE_RUNS and (
            runs < _PROBE_MIN_RUNS or time.perf_counter() - start < _PROBE_BUDGET_S
        ):
            order = list(kernels) if runs % 2 == 0 else list(reversed(kernels))
            for name in order:
                began = time.perf_counter()
                kernels[name]()
                best[name] = min(best[name], time.perf_counter() - began)
            runs += 1
    return best["torch"], best["onednn"], runs
