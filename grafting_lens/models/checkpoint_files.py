"""The weight files of a checkpoint directory, read a tensor at a time and checked before each read.

Each file's identity is checked before and after every read, no file stays memory-mapped,
and ``verify=True`` also hashes every tensor: the how-to "Graft a LoRA adapter, or a donor
too big to load".
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from grafting_lens.core.errors import GraftingLensError
from grafting_lens.models.components import checkpoint_modules

SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
"""The files in which a sharded checkpoint lists its shards."""

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def shard_files(directory: Path, index_name: str) -> list[str]:
    """The shards a checkpoint's index lists, each an entry of ``directory`` itself (a link is
    taken, as the Hugging Face cache keeps them; a path elsewhere is refused).

    Raises:
        GraftingLensError: The index is not JSON with a ``weight_map`` of the directory's files.
    """
    index = directory / index_name
    try:
        files = sorted({str(file) for file in json.loads(index.read_text())["weight_map"].values()})
        outside = [f for f in files if Path(f).name != f or f in ("", ".", "..") or "\\" in f]
        problem = f"it lists the shard {outside[0]!r}, outside {directory}" if outside else None
        if not files:
            problem = "its weight_map is empty"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        problem = f"{type(error).__name__}: {error}"
    if problem:
        raise GraftingLensError(
            f"{index} cannot be used as a shard index ({problem}); save_pretrained writes JSON "
            "whose 'weight_map' names shard files beside it. Save the checkpoint again."
        )
    return files


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lies in its file, as the file's header says."""

    file: str
    stored: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int


class SafetensorsCheckpoint:
    """The safetensors files of a checkpoint directory, opened without reading a tensor.

    Tensors are named as ``model`` names them after transformers' renamings on load (NeoX's
    ``embed_out`` is ``lm_head``); those it *converts* (experts stored apart) are left out.
    ``verify`` hashes every tensor now and checks the hash at every read.

    Raises:
        GraftingLensError: A file missing, damaged, or holding a dtype read whole only.
    """

    def __init__(
        self, directory: str | os.PathLike, model: nn.Module | None = None, verify: bool = False
    ) -> None:
        self.directory = Path(directory)
        index = self.directory / SHARD_INDEXES[0]
        files = ["model.safetensors"]
        if index.is_file() or index.is_symlink():
            files = shard_files(self.directory, index.name)
        self._identities: dict[str, os.stat_result] = {}
        entries: list[_Entry] = []
        for file in files:
            path = self.directory / file
            found = sorted(p.name for p in self.directory.glob("*.bin"))
            problem = (
                None if path.is_file() else "it is missing" + (f" (only {found})" if found else "")
            )
            if path.is_symlink() and not path.exists():
                problem = f"it is a link to {os.readlink(path)!r}, which does not exist"
            try:
                if problem is None:
                    with safe_open(str(path), framework="pt"):  # safetensors checks the header
                        pass
                    with open(path, "rb") as handle:
                        self._identities[file] = os.fstat(handle.fileno())
                        entries += _header(handle, file)
            except (SafetensorError, OSError, ValueError) as error:
                problem = f"it is not a whole safetensors file ({error})"
            if problem is None:
                unreadable = [e for e in entries if e.dtype is None]
                if unreadable:
                    problem = f"it stores {unreadable[0].stored} in a dtype read whole only"
            if problem is not None:
                raise GraftingLensError(
                    f"{path}: {problem}. Lazy loading reads whole safetensors files: save or "
                    "download the checkpoint again, or load it whole (lazy=False)."
                )
        renamed = _loading_names([entry.stored for entry in entries], model)
        # By the model's name; a tensor converted on load (not renamed) is not the model's.
        self._where = {renamed[e.stored]: e for e in entries if e.stored in renamed}
        self.shapes: dict[str, tuple[int, ...]] = {n: e.shape for n, e in self._where.items()}
        self.dtypes: dict[str, torch.dtype] = {n: e.dtype for n, e in self._where.items()}
        self.disk_bytes = sum(status.st_size for status in self._identities.values())
        self._digests = {n: hashlib.sha256(self._bytes(n)).digest() for n in self._where if verify}

    def names(self) -> list[str]:
        """Every tensor name, as the model names it (converted tensors excluded)."""
        return list(self.shapes)

    def files(self, names: Iterable[str]) -> set[str]:
        """The files holding the named tensors."""
        return {self._where[name].file for name in names}

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from its file into memory of its own (refused if the file changed)."""
        entry = self._where[name]
        data = self._bytes(name)
        if self._digests and hashlib.sha256(data).digest() != self._digests[name]:
            self.check([entry.file], edited=name)
        return _as_tensor(data, entry.dtype).reshape(entry.shape)

    def sample(self, name: str, indices: Sequence[int]) -> torch.Tensor:
        """Values of one tensor at flat ``indices``, read one by one (the tensor whole when
        verifying, to check its hash)."""
        if self._digests:
            return self.tensor(name).reshape(-1)[list(indices)]
        entry = self._where[name]
        size = entry.dtype.itemsize
        return _as_tensor(
            self._bytes(name, [entry.begin + i * size for i in indices], size), entry.dtype
        )

    def check(self, files: Iterable[str] | None = None, *, edited: str | None = None) -> None:
        """Refuse when a weight file (every one by default) changed since it was opened;
        ``edited`` names a tensor whose bytes are not those hashed then."""
        for file in self._identities if files is None else files:
            try:
                what = _difference(self._identities[file], os.stat(self.directory / file), edited)
            except OSError as error:
                what = f"it cannot be opened ({error.strerror})"
            if what is not None:
                raise GraftingLensError(
                    f"{self.directory / file} changed after load_models opened it: {what}. A "
                    "graft reads the checkpoint that was loaded: load the model set again, and "
                    "keep a checkpoint's files unchanged while a model set reads them lazily."
                )

    def _bytes(self, name: str, starts: Sequence[int] | None = None, size: int = 0) -> bytearray:
        """``size`` bytes at each of ``starts`` in a tensor's file (default: all), checked."""
        entry = self._where[name]
        if starts is None:
            starts, size = [entry.begin], entry.end - entry.begin
        data = bytearray(len(starts) * size)
        done = 0
        self.check([entry.file])
        with open(self.directory / entry.file, "rb", buffering=0) as handle:
            for start in starts:
                handle.seek(start)
                end = done + size
                while done < end and (count := handle.readinto(memoryview(data)[done:end])):
                    done += count
        self.check([entry.file])  # a write while the bytes were read changes the identity
        if done < len(data):  # cut short with its identity restored: damaged all the same
            self.check([entry.file], edited=name)
        return data


def _as_tensor(data: bytearray, dtype: torch.dtype) -> torch.Tensor:
    """``data`` (little-endian, as safetensors stores it) as a flat tensor that owns it."""
    return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)


def _difference(was: os.stat_result, now: os.stat_result, edited: str | None) -> str | None:
    """What changed in a file since ``was`` (its identity, or a tensor ``edited`` in place)."""
    if (now.st_ino, now.st_dev) != (was.st_ino, was.st_dev):
        return "another file now has its name (it was replaced)"
    if now.st_size != was.st_size:
        return f"its size went from {was.st_size} to {now.st_size} bytes"
    if now.st_mtime_ns != was.st_mtime_ns:
        return "it was written to (its modification time changed)"
    if edited is not None:
        return f"the bytes of {edited} differ from those it held (edited in place)"
    return None


def _header(handle: Any, file: str) -> list[_Entry]:
    """The tensors a safetensors file's header lists (checked by safetensors already)."""
    length = int.from_bytes(handle.read(8), "little")
    header = json.loads(handle.read(length))
    return [
        _Entry(
            file,
            stored,
            _DTYPES.get(fields["dtype"]),  # type: ignore[arg-type]
            tuple(fields["shape"]),
            8 + length + fields["data_offsets"][0],
            8 + length + fields["data_offsets"][1],
        )
        for stored, fields in header.items()
        if stored != "__metadata__"
    ]


def _loading_names(stored: list[str], model: nn.Module | None) -> dict[str, str]:
    """The model's name for each stored tensor name, renamed by transformers' own
    ``rename_source_key``; a name a *converter* (an operation on values) claims is left out."""
    if model is None:
        return {name: name for name in stored}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # another transformers: names as stored
        return {name: name for name in stored}
    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    known = {
        prefix + name: True
        for prefix, module in checkpoint_modules(model)
        for table in (module._parameters, module._buffers)
        for name in table
    }
    prefix = getattr(model, "base_model_prefix", None)
    names = {}
    for name in stored:
        renamed, converter = rename_source_key(name, renamings, converters, prefix, known)
        if renamed not in known and name in known:
            # As transformers does: a name that should not have been renamed.
            renamed, converter = rename_source_key(name, [], [], prefix, known)
        if converter is None:
            names[name] = renamed
    return names
