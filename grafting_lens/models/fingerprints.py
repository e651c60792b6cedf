"""Fingerprints: a short hash of a checkpoint's weights that never reads one whole, and an
exact one for what must not be mistaken.

Names, shapes, dtypes and 64 evenly spaced values of every tensor: the same values for
a checkpoint in memory and for one read lazily from its files
(:meth:`~grafting_lens.models.sources.SafetensorsCheckpoint.sample`), so both get one
fingerprint. :meth:`Source.fingerprint <grafting_lens.models.sources.Source.fingerprint>`
is built on it, and keeps it until a parameter changes (:func:`parameters_state`).

A fingerprint tells checkpoints apart (a finetune moves every sampled value), not every
edit of one weight: an ablation that zeroes one neuron between the sampled values, or a
change written through ``.data`` (which no version counter sees), keeps it. What decides
whether stored results are reused, a run directory's weights, uses :func:`content_digest`
instead: every value of every tensor, read one tensor at a time, never kept.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn

__all__ = [
    "content_digest",
    "digest_sample",
    "parameters_state",
    "sample_indices",
    "weights_fingerprint",
]

_SAMPLES = 64


def weights_fingerprint(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> str:
    """A short hash of named tensors: names, shapes, dtypes and 64 evenly spaced values of each.

    A lazily loaded checkpoint reads the same 64 values of each tensor from its files
    (:meth:`~grafting_lens.models.sources.SafetensorsCheckpoint.sample`), so it is
    fingerprinted without being read.

    Args:
        tensors: ``(name, tensor)`` pairs, in a fixed order.
        dtype: The dtype the tensors are used in, when they are stored in another
            (the sampled values are cast to it first, as a model cast whole would be).

    Returns:
        16 hexadecimal digits.
    """
    digest = hashlib.sha256()
    for name, tensor in tensors:
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES)
        sample = flat[::step][:_SAMPLES]
        digest_sample(digest, name, tuple(tensor.shape), sample, dtype or tensor.dtype)
    return digest.hexdigest()[:16]


def parameters_state(model: nn.Module) -> tuple | None:
    """Which tensors hold a model's parameters, and how often each was changed in place.

    ``None`` when that cannot be told (tensors made in inference mode keep no count).
    """
    try:
        return tuple(
            (name, p.data_ptr(), p._version, p.dtype, tuple(p.shape), str(p.device))
            for name, p in model.named_parameters()
        )
    except RuntimeError:
        return None


def sample_indices(numel: int) -> range:
    """The flat indices :func:`weights_fingerprint` samples: ``flat[::step][:64]``."""
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


def content_digest(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> str:
    """A hash of every value of named tensors: their names, shapes, dtypes and bytes.

    Args:
        tensors: ``(name, tensor)`` pairs, in a fixed order; an iterator is read one
            tensor at a time (a lazily loaded checkpoint is never held whole).
        dtype: The dtype the floating tensors are used in, when they are stored in
            another (each is cast first, as a model cast whole would be, so a checkpoint
            read lazily and the same one loaded whole get one digest).

    Returns:
        32 hexadecimal digits.
    """
    digest = hashlib.sha256()
    for name, tensor in tensors:
        value = tensor.detach()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        digest.update(f"{name}{tuple(value.shape)}{value.dtype}".encode())
        digest.update(value.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()[:32]
