"""Fingerprints: a short hash of a checkpoint's weights that never reads one whole, and an
exact one for what must not be mistaken.

:func:`weights_fingerprint` samples 64 values of every tensor, the same in memory and read
lazily: it tells checkpoints apart, not every edit of one weight (one neuron ablated between
the samples, a write through ``.data``). Reusing stored results uses :func:`content_digest`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn

_SAMPLES = 64


def weights_fingerprint(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A short hash (16 hex digits) of named tensors: names, shapes, dtypes and 64 values of each."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLES)][:_SAMPLES]  # sample_indices'
        digest_sample(digest, name, tuple(tensor.shape), sample, tensor.dtype)
    return digest.hexdigest()[:16]


def parameters_state(model: nn.Module) -> tuple | None:
    """Which tensors hold a model's parameters, and how often each was changed in place
    (``None``: cannot be told, as for tensors made in inference mode)."""
    try:
        return tuple(
            (name, p.data_ptr(), p._version, p.dtype, tuple(p.shape), str(p.device))
            for name, p in model.named_parameters()
        )
    except RuntimeError:
        return None


def sample_indices(numel: int) -> range:
    """The flat indices :func:`weights_fingerprint` samples: 64, evenly spaced."""
    return range(0, numel, max(1, numel // _SAMPLES))[:_SAMPLES]


def digest_sample(
    digest: hashlib._Hash,
    name: str,
    shape: tuple[int, ...],
    sample: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """Add one tensor's name, shape, dtype and sampled values (cast to ``dtype``) to ``digest``."""
    digest.update(f"{name}{tuple(shape)}{dtype}".encode())
    digest.update(sample.to(dtype).float().cpu().contiguous().numpy().tobytes())


def content_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A hash (32 hex digits) of every value of named tensors: names, shapes, dtypes and bytes,
    read one tensor at a time (a lazily loaded checkpoint is never held whole)."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        value = tensor.detach()
        digest.update(f"{name}{tuple(value.shape)}{value.dtype}".encode())
        digest.update(value.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()[:32]
