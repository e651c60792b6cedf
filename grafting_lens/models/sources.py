"""What a source of weights is: a checkpoint in memory, one read from disk on first use, or an adapter.

A :class:`~grafting_lens.ModelSet` holds *sources*: the base (index 0) and the
donors. A graft asks each source one question per slot of the bridge tree (see
:mod:`grafting_lens.models.components`): which module computes this slot for you? Anything
that can answer is a source, and the answer need not be a whole model in memory:

* :class:`CheckpointSource`: a checkpoint loaded whole, as a ``TransformerBridge``;
  its module for a slot is the one in its own tree. The base is always one.
* :class:`LazySource`: a checkpoint directory of safetensors files, opened without
  reading its weights. Its module for a slot is built on first use: a copy of the
  base's module (same class, same settings, buffers shared) holding the donor's
  tensors, read from disk once and kept. A graft of the O projection and MLP in the
  last half of the layers reads those and nothing else. Each read first checks that
  the file is still the one opened at load time, and refuses if it changed.
* :class:`~grafting_lens.models.lora_source.LoraSource` (in :mod:`grafting_lens.models.lora_source`): a
  LoRA adapter on the base. Its module for an adapted slot computes
  ``W x + B A x * scale`` from the base's own weight and the adapter's factors; for
  every other slot it is the base's module. No merged copy of the donor exists.

Every source can also run alone, as :attr:`Source.bridge`: patching, scoring and
every TransformerLens tool run a donor that way. A checkpoint source is its bridge;
an adapter runs as a second bridge over the base's own tensors with the adapted
modules in place; a lazily loaded donor is loaded whole on first use, with a
:class:`~grafting_lens.core.errors.LazyLoadWarning`, unless it was declared for some
components only, in which case running it alone is refused.

What each source holds is measured the same way for all of them
(:meth:`~grafting_lens.models.model_set.ModelSet.memory`): the bytes of the distinct tensors it keeps
in memory, where tensors the base holds too (an adapter's shared weights) count once,
for the base. :meth:`Source.fingerprint` summarises a source's weights in a short
hash, equal for the same checkpoint however it was loaded.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ClassVar

import torch
from torch import nn
from transformer_lens.model_bridge import TransformerBridge

from grafting_lens.core.errors import GraftingLensError, LazyLoadWarning
from grafting_lens.models.components import (
    FusedProjection,
    Slot,
    checkpoint_modules,
    checkpoint_parameters,
    fused_projections,
)
from grafting_lens.models.fingerprints import (
    content_digest,
    digest_sample,
    parameters_state,
    sample_indices,
    weights_fingerprint,
)

__all__ = [
    "CheckpointSource",
    "LazySource",
    "SafetensorsCheckpoint",
    "Source",
    "structural_copy",
    "tensor_bytes",
    "weights_fingerprint",  # re-exported from grafting_lens.models.fingerprints
]


SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
"""The files in which a sharded checkpoint lists its shards."""


def shard_files(directory: Path, index_name: str) -> list[str]:
    """The shards a checkpoint's index lists, each an entry of ``directory`` itself.

    An index is a file like any other in a directory that may come from anywhere: a
    shard named with a directory part, ``..`` or an absolute path would read weights
    from wherever the index says, and is refused. An entry of the directory that is a
    link is taken, as any file of it is: the Hugging Face cache keeps every file of a
    snapshot as a link into its ``blobs/``, and a link is made by whoever made the
    directory, not named by the index.

    Raises:
        GraftingLensError: The index is not JSON with a ``weight_map`` of file names,
            or names a shard outside the checkpoint directory.
    """
    index = directory / index_name
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise TypeError("weight_map is not a non-empty mapping")
        files = sorted({str(file) for file in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise GraftingLensError(
            f"{index} cannot be read as a shard index ({type(error).__name__}: {error}); it "
            "must be JSON with a 'weight_map' of tensor names to shard files, as save_pretrained "
            "writes it. Save the checkpoint again."
        ) from None
    for file in files:
        if Path(file).name != file or file in ("", ".", "..") or "\\" in file:
            raise GraftingLensError(
                f"{index} lists the shard {file!r}, which is not a file of {directory} itself; "
                "grafting-lens reads no weights from outside a checkpoint's directory. Save the "
                "checkpoint again, or put its shards beside the index."
            )
    return files


class Source:
    """One checkpoint of a model set, as a graft and a run see it.

    Subclasses answer four questions: the module that computes a slot
    (:meth:`module`), the values of its parameters (:meth:`weights`), a model that
    runs the source alone (:attr:`bridge`), and what it holds in memory
    (:meth:`resident_tensors`).

    Attributes:
        kind: ``"checkpoint"``, ``"lazy"`` or ``"lora"``.
        name: The source's label in the model set.
    """

    kind: ClassVar[str] = ""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @property
    def bridge(self) -> TransformerBridge:
        """A model that runs this source alone (``models[i]``)."""
        raise NotImplementedError

    def module(self, slot: Slot) -> nn.Module:
        """The module that computes ``slot`` for this source (read from disk on first use)."""
        raise NotImplementedError

    def weights(self, slot: Slot) -> list[torch.Tensor]:
        """The values of ``slot``'s parameters for this source.

        In the order of the base module's parameters, each the shape of the base's:
        an adapter's merged weight ``W + B A * scale``, for one slot at a time. A
        lazily loaded donor reads the slot's tensors without keeping them.
        """
        raise NotImplementedError

    def resident_tensors(self) -> list[torch.Tensor]:
        """The tensors this source holds in memory now (those it shares included)."""
        raise NotImplementedError

    def full_bytes(self) -> int:
        """Bytes of this checkpoint held whole in memory (for an adapter: the merged model)."""
        raise NotImplementedError

    def floating_dtypes(self) -> set[torch.dtype]:
        """The dtypes this source computes its weights in, without loading any."""
        raise NotImplementedError

    def declared_bytes(self) -> int | None:
        """Bytes this source loads at most under its declaration, or None when undeclared."""
        return None

    @property
    def disk_bytes(self) -> int | None:
        """Bytes of the weight files this source was read from, or None for an in-memory model."""
        return None

    def fingerprint(self) -> str:
        """A short hash of this source's weights (see :func:`weights_fingerprint`).

        The one hash of a source's weights grafting-lens keeps (a run directory's
        fingerprint is made of it). Equal for the same checkpoint loaded whole or
        lazily, and lazy-safe: a lazily loaded donor is sampled from its files, never
        read whole. An adapter's combines the base's with its own factors and scales.
        Cheap: it reads 64 values of each tensor, not every value, so it tells
        checkpoints apart (a finetune moves every sampled value of what it trains), not
        every edit of one weight. Kept until a parameter is replaced or changed in place.
        """
        state = self._weights_state()
        known = self.__dict__.get("_fingerprinted")
        if known is None or state is None or known[0] != state:
            known = (state, self._fingerprint())
            self.__dict__["_fingerprinted"] = known
        return known[1]

    def _fingerprint(self) -> str:
        raise NotImplementedError

    def content_digest(self) -> str:
        """A hash of every value of this source's weights (see :func:`content_digest`).

        Exact where :meth:`fingerprint` samples: what a run directory compares before it
        reuses stored results, so that an edit of one weight is a different run. Reads
        every tensor once, one at a time; a lazily loaded donor's are read from its
        files and dropped, never kept. Equal for the same checkpoint loaded whole or
        lazily.
        """
        raise NotImplementedError

    def _weights_state(self) -> tuple | None:
        """What, changed, changes the fingerprint (``None``: unknown, so never kept)."""
        return ()


class CheckpointSource(Source):
    """A checkpoint loaded whole, as a ``TransformerBridge``; the base is always one.

    Args:
        bridge: The loaded model (unprocessed weights).
        name: Its label.
        disk_bytes: Bytes of the weight files it was read from, if known.
    """

    kind = "checkpoint"

    def __init__(self, bridge: TransformerBridge, name: str, disk_bytes: int | None = None) -> None:
        super().__init__(name)
        self._bridge = bridge
        self._disk_bytes = disk_bytes

    @property
    def bridge(self) -> TransformerBridge:
        return self._bridge

    def module(self, slot: Slot) -> nn.Module:
        return slot.module(self._bridge)

    def weights(self, slot: Slot) -> list[torch.Tensor]:
        return [p.detach() for p in slot.module(self._bridge).parameters()]

    def resident_tensors(self) -> list[torch.Tensor]:
        # The bridge's own tensors too: a split the bridge copies (NeoX's Q, K, V).
        tensors = [p.detach() for p in self._bridge.parameters()]
        tensors += [p.detach() for _, p in checkpoint_parameters(self._bridge.original_model)]
        return tensors + [b for b in self._bridge.buffers()]

    def full_bytes(self) -> int:
        return tensor_bytes(self.resident_tensors())

    def floating_dtypes(self) -> set[torch.dtype]:
        parameters = self._bridge.original_model.parameters()
        return {p.dtype for p in parameters if p.is_floating_point()}

    @property
    def disk_bytes(self) -> int | None:
        return self._disk_bytes

    def _fingerprint(self) -> str:
        return weights_fingerprint(checkpoint_parameters(self._bridge.original_model))

    def content_digest(self) -> str:
        return content_digest(checkpoint_parameters(self._bridge.original_model))

    def _weights_state(self) -> tuple | None:
        return parameters_state(self._bridge.original_model)


@dataclass(frozen=True)
class _FileIdentity:
    """What tells a file apart from the one opened earlier at its path."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, status: os.stat_result) -> _FileIdentity:
        return cls(status.st_size, status.st_mtime_ns, status.st_ino, status.st_dev)


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lies in its file, as the file's header says."""

    file: str
    stored: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int


class SafetensorsCheckpoint:
    """The weight files of a checkpoint directory, opened without reading a tensor.

    ``model.safetensors``, or the shards a ``model.safetensors.index.json`` lists.
    Names, shapes and dtypes come from the files' headers; :meth:`tensor` reads one
    tensor from disk into memory of its own.

    Each file's identity (size, modification time, inode and device) is recorded when
    it is opened, and checked before and after every read: a file replaced, rewritten
    or truncated since would give later reads another checkpoint than the one loaded,
    and is refused with an error naming it. No file stays memory-mapped, so a file
    truncated under a tensor already read cannot kill the process (a memory-mapped
    page past a file's end raises SIGBUS), and tensors already read keep the values
    the checkpoint had when it was loaded.

    Tensors are named as the model names its parameters: transformers renames some
    when it loads a checkpoint (NeoX's ``embed_out`` is the model's ``lm_head``), and
    :class:`SafetensorsCheckpoint` applies the same renamings, taken from
    transformers itself, when given the model class. Tensors transformers *converts*
    on load (experts stored apart and fused in the model) are listed in
    :attr:`converted`; they cannot be read as they are stored.

    Args:
        directory: A directory written by ``save_pretrained`` with safetensors weights.
        model: A model of the checkpoint's class (the base), whose loading renamings
            apply; None reads the names as stored.

    Attributes:
        shapes: Shape of every tensor, by the model's name for it.
        dtypes: Dtype of every tensor as stored, by the model's name for it.
        converted: Names (as stored) of tensors transformers converts on load.
        disk_bytes: Total size of the weight files.

    Raises:
        GraftingLensError: The directory holds no safetensors weights (only
            ``pytorch_model.bin``, which cannot be read a tensor at a time), its
            weights file or a shard is missing or a link to nothing, its index cannot
            be read, or a file is not a whole safetensors file (truncated, damaged).
    """

    def __init__(self, directory: str | os.PathLike, model: nn.Module | None = None) -> None:
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        for path in (index, single):
            if path.is_symlink() and not path.exists():
                raise GraftingLensError(
                    f"{path} is a link to {os.readlink(path)!r}, which does not exist (a "
                    "download cleaned up half-way, or a cache whose files were deleted). "
                    "Download or save the checkpoint again."
                )
        if index.is_file():
            files = shard_files(self.directory, index.name)
        elif single.is_file():
            files = [single.name]
        else:
            found = sorted(p.name for p in self.directory.glob("*.bin"))
            raise GraftingLensError(
                f"{str(self.directory)!r} holds no safetensors weights"
                + (f" (only {', '.join(found)})" if found else "")
                + ", so it cannot be loaded lazily: lazy loading reads tensors from "
                "safetensors files. Save it again with save_pretrained (safetensors is the "
                "default), or load it whole (lazy=False)."
            )
        self._identities: dict[str, _FileIdentity] = {}
        entries: list[_Entry] = []
        for file in files:
            path = self.directory / file
            if not path.is_file():
                raise GraftingLensError(
                    f"{index} lists the shard {file!r}, which {self.directory} does not hold"
                    + (" (it is a link to a file that does not exist)" if path.is_symlink() else "")
                    + ". Download or save the checkpoint again, with all its shards."
                )
            with open(path, "rb") as handle:
                identity = _FileIdentity.of(os.fstat(handle.fileno()))
                entries += _read_header(handle, path, file, identity.size)
            self._identities[file] = identity
        self._where: dict[str, _Entry] = {}  # by the model's name
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.converted: list[str] = []
        renamed = _loading_names([entry.stored for entry in entries], model)
        for entry in entries:
            model_name = renamed.get(entry.stored)
            if model_name is None:
                self.converted.append(entry.stored)
                continue
            self._where[model_name] = entry
            self.shapes[model_name] = entry.shape
            self.dtypes[model_name] = _DTYPES.get(entry.dtype, torch.uint8)
        self.disk_bytes = sum(identity.size for identity in self._identities.values())

    def names(self) -> list[str]:
        """Every tensor name, as the model names it (converted tensors excluded)."""
        return list(self.shapes)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor by the model's name for it, read from its file into memory of its own.

        Raises:
            GraftingLensError: Its file changed since the checkpoint was opened, or is
                not the whole file it was (naming the file and the fix).
        """
        entry = self._where[name]
        dtype = self._dtype(entry)
        data = bytearray(entry.end - entry.begin)
        with self._open(entry.file) as handle:
            self._read_into(handle, entry, entry.begin, memoryview(data))
        return _as_tensor(data, dtype).reshape(entry.shape)

    def sample(self, name: str, indices: Sequence[int]) -> torch.Tensor:
        """Values of one tensor at flat ``indices``, read one by one (no tensor is read whole).

        Raises:
            GraftingLensError: As :meth:`tensor`.
        """
        entry = self._where[name]
        dtype = self._dtype(entry)
        size = dtype.itemsize
        data = bytearray(len(indices) * size)
        view = memoryview(data)
        with self._open(entry.file) as handle:
            for at, index in enumerate(indices):
                offset = entry.begin + index * size
                self._read_into(handle, entry, offset, view[at * size : (at + 1) * size])
        return _as_tensor(data, dtype)

    def check(self) -> None:
        """Refuse when a weight file changed since the checkpoint was opened.

        Raises:
            GraftingLensError: Naming the file, what changed, and the fix.
        """
        for file in self._identities:
            try:
                status = os.stat(self.directory / file)
            except OSError as error:
                raise self._changed(file, f"it cannot be opened ({error.strerror})") from None
            self._check_identity(file, status)

    def nbytes(self, name: str, dtype: torch.dtype | None = None) -> int:
        """Bytes of one tensor in memory, in ``dtype`` (default: its dtype on disk)."""
        numel = 1
        for size in self.shapes[name]:
            numel *= size
        return numel * (dtype or self.dtypes[name]).itemsize

    # ------------------------------------------------------------------ internals

    @contextmanager
    def _open(self, file: str) -> Iterator[BinaryIO]:
        """The file, opened unbuffered, checked against its identity when opened."""
        try:
            handle = open(self.directory / file, "rb", buffering=0)  # noqa: SIM115
        except OSError as error:
            raise self._changed(file, f"it cannot be opened ({error.strerror})") from None
        with handle:
            self._check_identity(file, os.fstat(handle.fileno()))
            yield handle
            # A write while the bytes were read changes the file's identity too.
            self._check_identity(file, os.fstat(handle.fileno()))

    def _read_into(self, handle: BinaryIO, entry: _Entry, offset: int, target: memoryview) -> None:
        handle.seek(offset)
        done = 0
        while done < len(target):
            count = handle.readinto(target[done:])  # type: ignore[attr-defined]
            if not count:
                raise self._changed(
                    entry.file,
                    f"it ends before the bytes of {entry.stored} (it was truncated)",
                )
            done += count

    def _dtype(self, entry: _Entry) -> torch.dtype:
        dtype = _DTYPES.get(entry.dtype)
        if dtype is None:
            raise GraftingLensError(
                f"{self.directory / entry.file} stores {entry.stored} as {entry.dtype}, a dtype "
                "grafting-lens cannot read a tensor at a time. Load the checkpoint whole "
                "(lazy=False)."
            )
        return dtype

    def _check_identity(self, file: str, status: os.stat_result) -> None:
        recorded = self._identities[file]
        now = _FileIdentity.of(status)
        if now == recorded:
            return
        if (now.inode, now.device) != (recorded.inode, recorded.device):
            what = "another file now has its name (it was replaced)"
        elif now.size != recorded.size:
            what = f"its size went from {recorded.size} to {now.size} bytes"
        else:
            what = "it was written to (its modification time changed)"
        raise self._changed(file, what)

    def _changed(self, file: str, what: str) -> GraftingLensError:
        return GraftingLensError(
            f"{self.directory / file} changed after load_models opened it: {what}. A graft "
            "reads the checkpoint that was loaded, and that file no longer holds it, so "
            "nothing more is read from it. Load the model set again with load_models (and "
            "keep a checkpoint's files unchanged while a model set reads them lazily)."
        )


def _as_tensor(data: bytearray, dtype: torch.dtype) -> torch.Tensor:
    """``data`` (little-endian, as safetensors stores it) as a flat tensor that owns it."""
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype)


def _read_header(handle: BinaryIO, path: Path, file: str, size: int) -> list[_Entry]:
    """The tensors a safetensors file's header lists, checked against the file's size.

    The format: 8 bytes (little-endian) giving the header's length, the header (JSON:
    each tensor's dtype, shape and data offsets, counted from the header's end), then
    the data.
    """

    def damaged(reason: str) -> GraftingLensError:
        return GraftingLensError(
            f"{path} is not a whole safetensors file ({reason}): it is truncated or damaged "
            "(an interrupted download or save). Download or save the checkpoint again."
        )

    start = handle.read(8)
    if len(start) < 8:
        raise damaged(f"{size} bytes, fewer than a header needs")
    length = int.from_bytes(start, "little")
    if 8 + length > size:
        raise damaged(f"its header claims {length} bytes, the file has {size}")
    try:
        header = json.loads(handle.read(length))
    except ValueError as error:
        raise damaged(f"its header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise damaged("its header is not a JSON object")
    entries = []
    for stored, fields in header.items():
        if stored == "__metadata__":
            continue
        try:
            dtype = str(fields["dtype"])
            shape = tuple(int(n) for n in fields["shape"])
            begin, end = (int(n) for n in fields["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise damaged(f"its header describes {stored!r} as {fields!r}") from None
        numel = 1
        for n in shape:
            numel *= n
        known = _DTYPES.get(dtype)
        if (
            min(shape, default=0) < 0
            or not 0 <= begin <= end
            or 8 + length + end > size
            or (known is not None and end - begin != numel * known.itemsize)
        ):
            raise damaged(
                f"{stored!r} ({dtype} {list(shape)}) at bytes {begin}..{end} of the data, "
                f"which does not fit it or the file's {size} bytes"
            )
        entries.append(_Entry(file, stored, dtype, shape, 8 + length + begin, 8 + length + end))
    return entries


def _loading_names(stored: list[str], model: nn.Module | None) -> dict[str, str]:
    """The model's name for each stored tensor name, as transformers renames them on load.

    transformers keeps the renamings of each architecture (and legacy ones such as
    LayerNorm's ``gamma``) in ``conversion_mapping``; they are applied here with its
    own ``rename_source_key``. A name that a *converter* (an operation on values, not
    only a new name) claims is left out of the result.
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


class LazySource(Source):
    """A donor read from safetensors files a component at a time, on first use.

    Its module for a slot is a copy of the base's module (same class and settings,
    the base's buffers) whose parameters are the donor's tensors, read from disk,
    cast and put on the device of the base module it stands in for (on a layer-split
    base each layer's own), read once and kept. A file that changed since load time
    is refused before anything more is read from it (see
    :class:`SafetensorsCheckpoint`). A slot the bridge
    cuts out of a fused matrix (GPT-2's Q, K and V out of ``c_attn``) is cut from the
    donor's fused matrix by the bridge's own split function, so the fused matrix is
    read whole. Created by :func:`~grafting_lens.load_models` with ``lazy=True``,
    which has checked the directory against the base (configuration, every tensor's
    name, shape and dtype, vocabulary).

    Args:
        name: The source's label.
        files: The checkpoint's weight files.
        base: The base's bridge (its modules are the templates).
        slots: Every slot of the architecture.
        dtype: The dtype every tensor is cast to (the base's).
        declared: The slots a graft may take from this source, or None for every one.
        load_whole: Loads the checkpoint whole as a bridge (for :attr:`bridge`).
    """

    kind = "lazy"

    def __init__(
        self,
        name: str,
        files: SafetensorsCheckpoint,
        base: TransformerBridge,
        slots: Iterable[Slot],
        *,
        dtype: torch.dtype | None,
        declared: Sequence[Slot] | None,
        load_whole: Callable[[], TransformerBridge],
    ) -> None:
        super().__init__(name)
        self._files = files
        self._base = base
        self._slots = {slot.path: slot for slot in slots}
        # The base's modules now, before any graft puts dispatchers in their place.
        self._templates = {path: slot.module(base) for path, slot in self._slots.items()}
        self._names = {id(p): name for name, p in checkpoint_parameters(base.original_model)}
        self._fused: dict[str, FusedProjection] = {
            f"{fused.node}.{child}": fused
            for fused in fused_projections(base)
            for child in fused.children
        }
        self._dtype = dtype
        self._declared = None if declared is None else tuple(declared)
        self._load_whole = load_whole
        self._tensors: dict[str, torch.Tensor] = {}
        self._modules: dict[str, nn.Module] = {}
        self._whole: TransformerBridge | None = None

    @property
    def loaded(self) -> tuple[str, ...]:
        """The slots read so far, by bridge path."""
        return tuple(self._modules)

    @property
    def is_whole(self) -> bool:
        """Whether the donor was read whole already (:attr:`bridge` was asked for)."""
        return self._whole is not None

    @property
    def bridge(self) -> TransformerBridge:
        """The donor loaded whole, on first use, with a :class:`~grafting_lens.core.errors.LazyLoadWarning`.

        Raises:
            GraftingLensError: The donor was declared for some components only
                (``components=`` / ``layers=`` of :func:`~grafting_lens.load_models`).
        """
        if self._whole is None:
            if self._declared is not None:
                raise GraftingLensError(
                    f"{self.name} was loaded lazily for some components only (components= / "
                    "layers= of load_models), so it cannot run alone: that needs every weight. "
                    "Patching and scoring run each checkpoint alone; load the model set "
                    "without the declaration (the donor is then read whole when it runs "
                    "alone), or with lazy=False."
                )
            warnings.warn(
                f"Running {self.name} alone loads it whole ({self.full_bytes() / 2**30:.2f} GiB): "
                "it was opened lazily, for grafts. Load the model set with lazy=False to "
                "load it whole up front.",
                LazyLoadWarning,
                stacklevel=3,
            )
            self._files.check()  # the checkpoint read whole is the one opened lazily
            self._whole = self._load_whole()
            # The whole model's modules serve grafts from now on.
            self._modules.clear()
            self._tensors.clear()
        return self._whole

    def module(self, slot: Slot) -> nn.Module:
        if self._whole is not None:
            return slot.module(self._whole)
        module = self._modules.get(slot.path)
        if module is None:
            module = self._modules[slot.path] = self._build(slot, self._tensor)
        return module

    def weights(self, slot: Slot) -> list[torch.Tensor]:
        if self._whole is not None or slot.path in self._modules:
            module = self.module(slot)
        else:  # read, not kept
            module = self._build(slot, self._read)
        return [p.detach() for p in module.parameters()]

    def resident_tensors(self) -> list[torch.Tensor]:
        if self._whole is not None:
            return CheckpointSource(self._whole, self.name).resident_tensors()
        tensors = list(self._tensors.values())
        return tensors + [p.detach() for m in self._modules.values() for p in m.parameters()]

    def full_bytes(self) -> int:
        return sum(self._nbytes(name) for name in set(self._names.values()))

    def floating_dtypes(self) -> set[torch.dtype]:
        if self._dtype is not None:
            return {self._dtype}  # every tensor is cast to it as it is read
        stored = {self._files.dtypes[name] for name in set(self._names.values())}
        return {dtype for dtype in stored if dtype.is_floating_point}

    def declared_bytes(self) -> int | None:
        if self._declared is None:
            return None
        return sum(self._nbytes(name) for name in self._slot_names(self._declared))

    @property
    def disk_bytes(self) -> int | None:
        return self._files.disk_bytes

    def _fingerprint(self) -> str:
        # 64 values of each tensor are read from its file, then cast: none is read
        # whole (nor copied to the GPU, or to another dtype).
        digest = hashlib.sha256()
        for name, _ in checkpoint_parameters(self._base.original_model):
            numel = 1
            for size in self._files.shapes[name]:
                numel *= size
            sample = self._files.sample(name, sample_indices(numel))
            dtype = self._dtype or self._files.dtypes[name]
            digest_sample(digest, name, self._files.shapes[name], sample, dtype)
        return digest.hexdigest()[:16]

    def content_digest(self) -> str:
        names = (name for name, _ in checkpoint_parameters(self._base.original_model))
        return content_digest(((name, self._files.tensor(name)) for name in names), self._dtype)

    # ------------------------------------------------------------------ internals

    def _nbytes(self, name: str) -> int:
        return self._files.nbytes(name, self._dtype)

    def _read(self, name: str, device: torch.device) -> torch.Tensor:
        tensor = self._files.tensor(name)
        return tensor.to(device=device, dtype=self._dtype or tensor.dtype)

    def _tensor(self, name: str, device: torch.device) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            tensor = self._tensors[name] = self._read(name, device)
        return tensor

    def _slot_names(self, slots: Iterable[Slot]) -> set[str]:
        """The checkpoint tensors that computing ``slots`` reads."""
        names: set[str] = set()
        for slot in slots:
            fused = self._fused.get(slot.path)
            template = fused.fused(self._base) if fused is not None else self._templates[slot.path]
            names.update(self._names[id(p)] for p in template.parameters() if id(p) in self._names)
        return names

    def _build(self, slot: Slot, read: Callable[[str, torch.device], torch.Tensor]) -> nn.Module:
        fused = self._fused.get(slot.path)
        if fused is not None:
            template = fused.fused(self._base)
            donor = structural_copy(template, self._parameters(template, slot, read))
            return fused.split(self._base, donor)[slot.path.rpartition(".")[2]]
        template = self._templates[slot.path]
        return structural_copy(template, self._parameters(template, slot, read))

    def _parameters(
        self, template: nn.Module, slot: Slot, read: Callable[[str, torch.device], torch.Tensor]
    ) -> dict[int, nn.Parameter]:
        replacements = {}
        for local, parameter in template.named_parameters():
            name = self._names.get(id(parameter))
            if name is None:
                raise GraftingLensError(
                    f"{self.name}: the bridge computes {slot.path} with a parameter "
                    f"({local!r}) that it derives from the checkpoint at load time, not one "
                    "the checkpoint holds, so this donor cannot be read lazily. Load it whole "
                    "(lazy=False) and please report the architecture."
                )
            # Beside the base's module it stands in for: on a layer-split base
            # (device_map) each layer's modules are on their own device.
            replacements[id(parameter)] = nn.Parameter(
                read(name, parameter.device), requires_grad=parameter.requires_grad
            )
        return replacements


def structural_copy(
    module: nn.Module,
    parameters: Mapping[int, nn.Parameter],
    modules: Mapping[int, nn.Module] | None = None,
) -> nn.Module:
    """A copy of ``module``'s tree of modules, with some parameters and submodules replaced.

    Every module in the tree is a new object of the same class with the same
    attributes (settings, buffers and untouched parameters are shared, not copied),
    so the copy computes what ``module`` computes with the replacements in place.

    Args:
        module: The template (e.g. the base's ``q_proj``).
        parameters: Replacements by ``id`` of the template's parameter.
        modules: Replacements by ``id`` of a submodule of the template (taken as
            they are, not copied).

    Raises:
        GraftingLensError: A module of the template keeps a replaced parameter in a
            plain attribute too (a cached transpose), which the copy would leave
            pointing at the template's values.
    """
    modules = modules or {}
    if id(module) in modules:
        return modules[id(module)]
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, dict):  # parameters, buffers, submodules and the hook tables
            clone.__dict__[key] = copy.copy(value)
        elif isinstance(value, torch.Tensor) and any(
            value.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
            for p in module._parameters.values()
            if p is not None and id(p) in parameters
        ):
            raise GraftingLensError(
                f"{type(module).__name__} keeps a parameter in its attribute {key!r} too, so a "
                "copy with other weights would compute with both; this module cannot be "
                "loaded lazily or adapted. Load the checkpoint whole."
            )
    for name, parameter in module._parameters.items():
        if parameter is not None and id(parameter) in parameters:
            clone._parameters[name] = parameters[id(parameter)]
    for name, child in module._modules.items():
        if child is not None:
            clone._modules[name] = structural_copy(child, parameters, modules)
    return clone


def tensor_bytes(tensors: Iterable[torch.Tensor], counted: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once).

    Args:
        tensors: Any tensors.
        counted: Storages already counted elsewhere (by data pointer), skipped and
            updated in place, so that several sources sharing tensors count them once.
    """
    counted = set() if counted is None else counted
    total = 0
    for tensor in tensors:
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in counted or storage.nbytes() == 0:
            continue
        counted.add(pointer)
        total += storage.nbytes()
    return total
