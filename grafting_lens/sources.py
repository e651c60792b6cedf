"""What a source of weights is: a checkpoint in memory, one read from disk on first use, or an adapter.

A :class:`~grafting_lens.ModelSet` holds *sources*: the base (index 0) and the
donors. A graft asks each source one question per slot of the bridge tree (see
:mod:`grafting_lens.components`): which module computes this slot for you? Anything
that can answer is a source, and the answer need not be a whole model in memory:

* :class:`CheckpointSource`: a checkpoint loaded whole, as a ``TransformerBridge``;
  its module for a slot is the one in its own tree. The base is always one.
* :class:`LazySource`: a checkpoint directory of safetensors files, opened without
  reading its weights. Its module for a slot is built on first use: a copy of the
  base's module (same class, same settings, buffers shared) holding the donor's
  tensors, memory-mapped from disk, read once and kept. A graft of the O projection
  and MLP in the last half of the layers reads those and nothing else.
* :class:`~grafting_lens.adapters.LoraSource` (in :mod:`grafting_lens.adapters`): a
  LoRA adapter on the base. Its module for an adapted slot computes
  ``W x + B A x * scale`` from the base's own weight and the adapter's factors; for
  every other slot it is the base's module. No merged copy of the donor exists.

Every source can also run alone, as :attr:`Source.bridge`: patching, scoring and
every TransformerLens tool run a donor that way. A checkpoint source is its bridge;
an adapter runs as a second bridge over the base's own tensors with the adapted
modules in place; a lazily loaded donor is loaded whole on first use, with a
:class:`~grafting_lens.LazyLoadWarning`, unless it was declared for some
components only, in which case running it alone is refused.

What each source holds is measured the same way for all of them
(:meth:`~grafting_lens.models.ModelSet.memory`): the bytes of the distinct tensors it keeps
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import safe_open
from torch import nn
from transformer_lens.model_bridge import TransformerBridge

from grafting_lens.components import (
    FusedProjection,
    Slot,
    checkpoint_modules,
    checkpoint_parameters,
    fused_projections,
)
from grafting_lens.errors import GraftingLensError, LazyLoadWarning

__all__ = [
    "CheckpointSource",
    "LazySource",
    "SafetensorsCheckpoint",
    "Source",
    "structural_copy",
    "tensor_bytes",
    "weights_fingerprint",
]


SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
"""The files in which a sharded checkpoint lists its shards."""


def shard_files(directory: Path, index_name: str) -> list[str]:
    """The shards a checkpoint's index lists, each a file of ``directory`` itself.

    An index is a file like any other in a directory that may come from anywhere: a
    shard named with a directory part, ``..`` or an absolute path, or resolving
    outside the checkpoint through a link, would read weights from outside it, and is
    refused.

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
    root = directory.resolve()
    for file in files:
        inside = Path(file).name == file and file not in ("", ".", "..") and "\\" not in file
        if not inside or (directory / file).resolve().parent != root:
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

    def declared_bytes(self) -> int | None:
        """Bytes this source loads at most under its declaration, or None when undeclared."""
        return None

    @property
    def disk_bytes(self) -> int | None:
        """Bytes of the weight files this source was read from, or None for an in-memory model."""
        return None

    def fingerprint(self) -> str:
        """A short hash of this source's weights (see :func:`weights_fingerprint`).

        Equal for the same checkpoint loaded whole or lazily; an adapter's combines
        the base's with its own factors and scales. Cheap: it reads 64 values of each
        tensor, not every value, so it tells checkpoints apart, not every edit.
        """
        raise NotImplementedError


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

    @property
    def disk_bytes(self) -> int | None:
        return self._disk_bytes

    def fingerprint(self) -> str:
        return weights_fingerprint(checkpoint_parameters(self._bridge.original_model))


class SafetensorsCheckpoint:
    """The weight files of a checkpoint directory, opened without reading a tensor.

    ``model.safetensors``, or the shards a ``model.safetensors.index.json`` lists.
    Names, shapes and dtypes come from the files' headers; :meth:`tensor` maps one
    tensor from disk (``safetensors`` memory-maps the file, so only what is read
    becomes resident, and stays so while the tensor lives).

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
            ``pytorch_model.bin``, which cannot be read a tensor at a time).
    """

    def __init__(self, directory: str | os.PathLike, model: nn.Module | None = None) -> None:
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        if index.is_file():
            files = shard_files(self.directory, index.name)
        elif single.is_file():
            files = [single.name]
        else:
            found = sorted(p.name for p in self.directory.glob("*.bin"))
            raise GraftingLensError(
                f"{str(self.directory)!r} holds no safetensors weights"
                + (f" (only {', '.join(found)})" if found else "")
                + ", so it cannot be loaded lazily: lazy loading maps tensors from "
                "safetensors files. Save it again with save_pretrained (safetensors is the "
                "default), or load it whole (lazy=False)."
            )
        self._where: dict[str, tuple[str, str]] = {}  # model name: (file, name as stored)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.converted: list[str] = []
        headers: dict[tuple[str, str], tuple[tuple[int, ...], str]] = {}
        for file in files:
            with safe_open(str(self.directory / file), framework="pt") as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    headers[(file, name)] = (
                        tuple(int(n) for n in view.get_shape()),
                        view.get_dtype(),
                    )
        renamed = _loading_names([name for _, name in headers], model)
        for (file, name), (shape, dtype) in headers.items():
            model_name = renamed.get(name)
            if model_name is None:
                self.converted.append(name)
                continue
            self._where[model_name] = (file, name)
            self.shapes[model_name] = shape
            self.dtypes[model_name] = _DTYPES.get(dtype, torch.uint8)
        self.disk_bytes = sum((self.directory / file).stat().st_size for file in files)

    def names(self) -> list[str]:
        """Every tensor name, as the model names it (converted tensors excluded)."""
        return list(self.shapes)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor by the model's name for it, memory-mapped from its file.

        Each read opens the file anew: the tensor keeps its own mapping alive, and
        pages read through a handle kept open would stay resident after a copy (a
        cast to another dtype) no longer needs them.
        """
        file, stored = self._where[name]
        with safe_open(str(self.directory / file), framework="pt") as handle:
            return handle.get_tensor(stored)

    def nbytes(self, name: str, dtype: torch.dtype | None = None) -> int:
        """Bytes of one tensor in memory, in ``dtype`` (default: its dtype on disk)."""
        numel = 1
        for size in self.shapes[name]:
            numel *= size
        return numel * (dtype or self.dtypes[name]).itemsize


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
}


class LazySource(Source):
    """A donor read from safetensors files a component at a time, on first use.

    Its module for a slot is a copy of the base's module (same class and settings,
    the base's buffers) whose parameters are the donor's tensors, memory-mapped from
    disk, cast and moved where the base's are, read once and kept. A slot the bridge
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
        self._device = next(base.original_model.parameters()).device
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
    def bridge(self) -> TransformerBridge:
        """The donor loaded whole, on first use, with a :class:`~grafting_lens.LazyLoadWarning`.

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

    def declared_bytes(self) -> int | None:
        if self._declared is None:
            return None
        return sum(self._nbytes(name) for name in self._slot_names(self._declared))

    @property
    def disk_bytes(self) -> int | None:
        return self._files.disk_bytes

    def fingerprint(self) -> str:
        # Sampled where the file is mapped, then cast: 64 values of each tensor are
        # read, none is copied whole (to the GPU, or to another dtype).
        names = [name for name, _ in checkpoint_parameters(self._base.original_model)]
        return weights_fingerprint(((n, self._files.tensor(n)) for n in names), self._dtype)

    # ------------------------------------------------------------------ internals

    def _nbytes(self, name: str) -> int:
        return self._files.nbytes(name, self._dtype)

    def _read(self, name: str) -> torch.Tensor:
        tensor = self._files.tensor(name)
        return tensor.to(device=self._device, dtype=self._dtype or tensor.dtype)

    def _tensor(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            tensor = self._tensors[name] = self._read(name)
        return tensor

    def _slot_names(self, slots: Iterable[Slot]) -> set[str]:
        """The checkpoint tensors that computing ``slots`` reads."""
        names: set[str] = set()
        for slot in slots:
            fused = self._fused.get(slot.path)
            template = fused.fused(self._base) if fused is not None else self._templates[slot.path]
            names.update(self._names[id(p)] for p in template.parameters() if id(p) in self._names)
        return names

    def _build(self, slot: Slot, read: Callable[[str], torch.Tensor]) -> nn.Module:
        fused = self._fused.get(slot.path)
        if fused is not None:
            template = fused.fused(self._base)
            donor = structural_copy(template, self._parameters(template, slot, read))
            return fused.split(self._base, donor)[slot.path.rpartition(".")[2]]
        template = self._templates[slot.path]
        return structural_copy(template, self._parameters(template, slot, read))

    def _parameters(
        self, template: nn.Module, slot: Slot, read: Callable[[str], torch.Tensor]
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
            replacements[id(parameter)] = nn.Parameter(
                read(name), requires_grad=parameter.requires_grad
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


_SAMPLES = 64


def weights_fingerprint(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> str:
    """A short hash of named tensors: names, shapes, dtypes and 64 evenly spaced values of each.

    Reading 64 values of a memory-mapped tensor touches 64 pages of its file, so a
    lazily loaded checkpoint is fingerprinted without being read.

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
        sample = flat[::step][:_SAMPLES].to(dtype or tensor.dtype)
        digest.update(f"{name}{tuple(tensor.shape)}{dtype or tensor.dtype}".encode())
        digest.update(sample.float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
