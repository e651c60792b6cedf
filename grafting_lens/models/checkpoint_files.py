"""The weight files of a checkpoint directory, read a tensor at a time and checked before each read.

A lazily loaded donor (:class:`~grafting_lens.models.sources.LazySource`) reads its
tensors from here when a graft first needs them, minutes or hours after
:func:`~grafting_lens.load_models` opened the checkpoint. Each file's identity (size,
modification time, inode, device) is recorded when it is opened and checked before and
after every read and before every use of what was read: a file replaced, rewritten or
truncated since is refused. No file stays memory-mapped, so a file truncated under a
tensor cannot kill the process (a memory-mapped page past a file's end raises SIGBUS).

The identity cannot see a file edited in place with its size kept and its modification
time restored. ``verify=True`` (``load_models(..., lazy="verify")``) sees that too: every
tensor's bytes are hashed when the checkpoint is opened (the files are read once, a
tensor at a time) and hashed again when read.
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
    """The shards a checkpoint's index lists, each an entry of ``directory`` itself.

    A shard named with a directory part, ``..`` or an absolute path would read weights
    from wherever the index says, and is refused. An entry that is a link is taken: the
    Hugging Face cache keeps every file of a snapshot as a link into its ``blobs/``.

    Raises:
        GraftingLensError: The index is not JSON with a ``weight_map`` of file names of
            the directory.
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
class _Identity:
    """What tells a file apart from the one opened earlier at its path."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, status: os.stat_result) -> _Identity:
        return cls(status.st_size, status.st_mtime_ns, status.st_ino, status.st_dev)


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

    Tensors are named as the model names its parameters: transformers renames some on load
    (NeoX's ``embed_out`` is the model's ``lm_head``), and the same renamings, taken from
    transformers, are applied here given the model. Tensors transformers *converts* on load
    (experts stored apart, fused in the model) are listed in :attr:`converted`.

    Args:
        directory: A directory written by ``save_pretrained`` with safetensors weights.
        model: A model of the checkpoint's class (the base), whose renamings apply.
        verify: Hash every tensor now and check the hash at every read (see the module
            docstring).

    Attributes:
        shapes: Shape of every tensor, by the model's name for it.
        dtypes: Dtype of every tensor as stored, by the model's name for it.
        converted: Names (as stored) of the tensors transformers converts on load.
        disk_bytes: Total size of the weight files.

    Raises:
        GraftingLensError: No safetensors weights, a file missing, damaged, or holding a
            dtype that cannot be read a tensor at a time.
    """

    def __init__(
        self, directory: str | os.PathLike, model: nn.Module | None = None, verify: bool = False
    ) -> None:
        self.directory = Path(directory)
        index = self.directory / SHARD_INDEXES[0]
        if index.is_file() or index.is_symlink():
            files = shard_files(self.directory, index.name)
        elif (self.directory / "model.safetensors").is_symlink() or (
            self.directory / "model.safetensors"
        ).exists():
            files = ["model.safetensors"]
        else:
            found = sorted(p.name for p in self.directory.glob("*.bin"))
            raise GraftingLensError(
                f"{str(self.directory)!r} holds no safetensors weights"
                + (f" (only {', '.join(found)})" if found else "")
                + ", which lazy loading reads. Save it again with save_pretrained (safetensors "
                "is the default), or load it whole (lazy=False)."
            )
        self._identities: dict[str, _Identity] = {}
        entries: list[_Entry] = []
        for file in files:
            path = self.directory / file
            problem = None if path.is_file() else "it is missing"
            if path.is_symlink() and not path.exists():
                problem = f"it is a link to {os.readlink(path)!r}, which does not exist"
            try:
                if problem is None:
                    with safe_open(str(path), framework="pt"):  # safetensors checks the header
                        pass
                    with open(path, "rb") as handle:
                        self._identities[file] = _Identity.of(os.fstat(handle.fileno()))
                        entries += _header(handle, file)
            except (SafetensorError, OSError, ValueError) as error:
                problem = f"it is not a whole safetensors file ({error})"
            if problem is None:
                unreadable = [e for e in entries if e.dtype is None]
                if unreadable:
                    problem = f"it stores {unreadable[0].stored} in a dtype read whole only"
            if problem is not None:
                raise GraftingLensError(
                    f"{path}: {problem}. Download or save the checkpoint again (an interrupted "
                    "download or save), or load it whole (lazy=False)."
                )
        self._where: dict[str, _Entry] = {}  # by the model's name
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.converted: list[str] = []
        renamed = _loading_names([entry.stored for entry in entries], model)
        for entry in entries:
            name = renamed.get(entry.stored)
            if name is None:
                self.converted.append(entry.stored)
                continue
            self._where[name] = entry
            self.shapes[name] = entry.shape
            self.dtypes[name] = entry.dtype
        self.disk_bytes = sum(identity.size for identity in self._identities.values())
        self._digests: dict[str, bytes] = {}
        if verify:
            for name in self._where:
                self._digests[name] = hashlib.sha256(self._bytes(name)).digest()

    def names(self) -> list[str]:
        """Every tensor name, as the model names it (converted tensors excluded)."""
        return list(self.shapes)

    def files(self, names: Iterable[str]) -> set[str]:
        """The files holding the named tensors."""
        return {self._where[name].file for name in names}

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from its file into memory of its own.

        Raises:
            GraftingLensError: Its file changed since the checkpoint was opened.
        """
        entry = self._where[name]
        data = self._bytes(name)
        if self._digests and hashlib.sha256(data).digest() != self._digests[name]:
            self.check([entry.file], edited=name)
        if not data:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return torch.frombuffer(data, dtype=entry.dtype).reshape(entry.shape)

    def sample(self, name: str, indices: Sequence[int]) -> torch.Tensor:
        """Values of one tensor at flat ``indices``, read one by one (the tensor whole when
        verifying, to check its hash)."""
        if self._digests:
            return self.tensor(name).reshape(-1)[list(indices)]
        entry = self._where[name]
        size = entry.dtype.itemsize
        data = bytearray()
        for index in indices:
            begin = entry.begin + index * size
            data += self._bytes(name, begin, begin + size)
        return (
            torch.frombuffer(data, dtype=entry.dtype) if data else torch.empty(0, dtype=entry.dtype)
        )

    def check(self, files: Iterable[str] | None = None, *, edited: str | None = None) -> None:
        """Refuse when a weight file (every one by default) changed since it was opened.

        Raises:
            GraftingLensError: Naming the file, what changed, and the fix.
        """
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

    def _bytes(self, name: str, begin: int | None = None, end: int | None = None) -> bytearray:
        """Bytes ``begin..end`` of a file (default: the tensor's), checked before and after."""
        entry = self._where[name]
        begin = entry.begin if begin is None else begin
        end = entry.end if end is None else end
        data = bytearray(end - begin)
        self.check([entry.file])
        with open(self.directory / entry.file, "rb", buffering=0) as handle:
            handle.seek(begin)
            done = 0
            while done < len(data):
                count = handle.readinto(memoryview(data)[done:])
                if not count:
                    break
                done += count
        self.check([entry.file])  # a write while the bytes were read changes the identity
        if done < len(data):  # cut short with its identity restored: damaged all the same
            self.check([entry.file], edited=name)
        return data


def _difference(recorded: _Identity, status: os.stat_result, edited: str | None) -> str | None:
    """What changed in a file since ``recorded``, or None."""
    now = _Identity.of(status)
    if (now.inode, now.device) != (recorded.inode, recorded.device):
        return "another file now has its name (it was replaced)"
    if now.size != recorded.size:
        return f"its size went from {recorded.size} to {now.size} bytes"
    if now != recorded:
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
    """The model's name for each stored tensor name, as transformers renames them on load.

    transformers keeps each architecture's renamings in ``conversion_mapping``; they are
    applied with its own ``rename_source_key``. A name a *converter* (an operation on values)
    claims is left out.
    """
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
