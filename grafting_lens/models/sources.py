"""What a source of weights is: a checkpoint in memory, one read from disk on first use, or an adapter.

A graft asks each source of a :class:`~grafting_lens.ModelSet` which module computes a slot:
a :class:`CheckpointSource` (the base is one) answers with its own bridge's module, a
:class:`LazySource` with a copy of the base's holding tensors read on first use, a
:class:`~grafting_lens.models.lora_source.LoraSource` with the base's module plus its factors.
Each also runs alone, as :attr:`Source.bridge`.
"""

from __future__ import annotations

import abc
import copy
import hashlib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.model_bridge.generalized_components.base import GeneralizedComponent

from grafting_lens.core.compat import adapt_bridge
from grafting_lens.core.errors import GraftingLensError, LazyLoadWarning
from grafting_lens.models.checkpoint_files import SafetensorsCheckpoint
from grafting_lens.models.components import (
    FusedProjection,
    Slot,
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
from grafting_lens.models.placement import embedding_device


class Source(abc.ABC):
    """One checkpoint of a model set, as a graft and a run see it.

    Attributes:
        kind: ``"checkpoint"``, ``"lazy"``, ``"lora"`` or ``"directions"``.
        name: The source's label in the model set.
    """

    kind: ClassVar[str] = ""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @property
    @abc.abstractmethod
    def bridge(self) -> TransformerBridge:
        """A model that runs this source alone (``models[i]``)."""

    @abc.abstractmethod
    def module(self, slot: Slot) -> nn.Module:
        """The module that computes ``slot`` for this source (read from disk on first use)."""

    @abc.abstractmethod
    def weights(self, slot: Slot) -> list[torch.Tensor]:
        """The values of ``slot``'s parameters as the base module orders and shapes them (an
        adapter's merged ``W + B A * scale``; a lazy donor's read, not kept)."""

    @abc.abstractmethod
    def resident_tensors(self) -> list[torch.Tensor]:
        """The tensors this source holds in memory now (those it shares included)."""

    @abc.abstractmethod
    def full_bytes(self) -> int:
        """Bytes of this checkpoint held whole in memory (for an adapter: the merged model)."""

    @abc.abstractmethod
    def content_digest(self) -> str:
        """A hash of every value of this source's weights (whole or lazily loaded alike), which a
        run directory compares before it reuses stored results."""

    @abc.abstractmethod
    def _fingerprint(self) -> str: ...

    def floating_dtypes(self) -> set[torch.dtype]:
        """The dtypes this source computes its weights in, without loading any."""
        return {p.dtype for p in self._parameters_of() if p.is_floating_point()}

    def declared_bytes(self) -> int | None:
        """Bytes this source loads at most under its declaration, or None when undeclared."""
        return None

    @property
    def disk_bytes(self) -> int | None:
        """Bytes of the weight files this source was read from, or None for an in-memory model."""
        return None

    def fingerprint(self) -> str:
        """A short hash of 64 values of each weight tensor (see
        :mod:`~grafting_lens.models.fingerprints`), kept until a parameter changes."""
        state = self._weights_state()
        known = self.__dict__.get("_fingerprinted")
        if known is None or state is None or known[0] != state:
            known = (state, self._fingerprint())
            self.__dict__["_fingerprinted"] = known
        return known[1]

    def _weights_state(self) -> tuple | None:
        """What, changed, changes the fingerprint (``None``: unknown, so never kept)."""
        return ()

    def _parameters_of(self) -> Iterable[nn.Parameter]:
        """The base's or this checkpoint's parameters, whose dtypes this source computes in."""
        return self.bridge.original_model.parameters()


class CheckpointSource(Source):
    """A checkpoint loaded whole, as a ``TransformerBridge``; the base is always one."""

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
        return [p.detach() for p in self.module(slot).parameters()]

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

    def _fingerprint(self) -> str:
        return weights_fingerprint(checkpoint_parameters(self._bridge.original_model))

    def content_digest(self) -> str:
        return content_digest(checkpoint_parameters(self._bridge.original_model))

    def _weights_state(self) -> tuple | None:
        return parameters_state(self._bridge.original_model)


class LazySource(Source):
    """A donor read from safetensors files a component at a time, on first use.

    Its module for a slot is a copy of the base's holding the donor's tensors, read once onto
    the base's devices and dtypes (a fused matrix cut by the bridge's own split); every use
    first checks the files are those opened at load. ``declared`` are the slots a graft may
    take (None: every one); ``load_whole`` loads it whole, for :attr:`bridge`.
    """

    kind = "lazy"

    def __init__(
        self,
        name: str,
        files: SafetensorsCheckpoint,
        base: TransformerBridge,
        slots: Iterable[Slot],
        *,
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
        self._declared = None if declared is None else tuple(declared)
        self._load_whole = load_whole
        self._tensors: dict[str, torch.Tensor] = {}
        self._modules: dict[str, nn.Module] = {}
        self._slot_files: dict[str, set[str]] = {}
        self._whole: TransformerBridge | None = None
        derived = [
            path
            for path in self._slots
            if any(id(p) not in self._names for p in self._template(path).parameters())
        ]
        if derived:
            raise GraftingLensError(
                f"{name}: the bridge computes {derived[0]} with a parameter it derives at load "
                "time, not one the checkpoint holds, so the donor cannot be read lazily. Load "
                "it whole (lazy=False), and please report the architecture."
            )

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
            GraftingLensError: The donor was declared for some components only, or its files
                changed.
        """
        self._files.check()  # the checkpoint read whole, or used, is the one opened lazily
        if self._whole is None:
            if self._declared is not None:
                raise GraftingLensError(
                    f"{self.name} was loaded lazily for some components only (components= / "
                    "layers= of load_models), so it cannot run alone, as patching and scoring "
                    "run it: load the model set without the declaration, or with lazy=False."
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
        files = self._slot_files.get(slot.path)
        if files is None:
            files = self._slot_files[slot.path] = self._files.files(self._slot_names([slot]))
        self._files.check(files)  # what was read is used only while its files are unchanged
        if self._whole is not None:
            return slot.module(self._whole)
        module = self._modules.get(slot.path)
        if module is None:
            module = self._modules[slot.path] = self._build(slot, self._tensor)
        return module

    def weights(self, slot: Slot) -> list[torch.Tensor]:
        kept = self._whole is not None or slot.path in self._modules
        module = self.module(slot) if kept else self._build(slot, self._read)  # read, not kept
        return [p.detach() for p in module.parameters()]

    def resident_tensors(self) -> list[torch.Tensor]:
        if self._whole is not None:
            return CheckpointSource(self._whole, self.name).resident_tensors()
        held = [p.detach() for m in self._modules.values() for p in m.parameters()]
        return [*self._tensors.values(), *held]

    def full_bytes(self) -> int:
        return self._bytes_of(None)

    def declared_bytes(self) -> int | None:
        return None if self._declared is None else self._bytes_of(self._slot_names(self._declared))

    @property
    def disk_bytes(self) -> int | None:
        return self._files.disk_bytes

    def _parameters_of(self) -> Iterable[nn.Parameter]:
        return self._base.original_model.parameters()  # cast to the base's dtypes as read

    def _fingerprint(self) -> str:
        # 64 values of each tensor are read from its file, then cast: none is read whole.
        digest = hashlib.sha256()
        for name, parameter in checkpoint_parameters(self._base.original_model):
            sample = self._files.sample(name, sample_indices(parameter.numel()))
            digest_sample(digest, name, self._files.shapes[name], sample, parameter.dtype)
        return digest.hexdigest()[:16]

    def content_digest(self) -> str:
        return content_digest(
            (name, self._files.tensor(name).to(parameter.dtype))
            for name, parameter in checkpoint_parameters(self._base.original_model)
        )

    def _bytes_of(self, names: set[str] | None) -> int:
        """Bytes of the named tensors (every one for None) once read: the base's, per tensor."""
        return sum(
            p.numel() * p.element_size()
            for name, p in checkpoint_parameters(self._base.original_model)
            if names is None or name in names
        )

    def _template(self, path: str) -> nn.Module:
        fused = self._fused.get(path)
        return fused.fused(self._base) if fused is not None else self._templates[path]

    def _read(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return self._files.tensor(name).to(device=like.device, dtype=like.dtype)

    def _tensor(self, name: str, like: torch.Tensor) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            tensor = self._tensors[name] = self._read(name, like)
        return tensor

    def _slot_names(self, slots: Iterable[Slot]) -> set[str]:
        """The checkpoint tensors that computing ``slots`` reads."""
        return {
            self._names[id(p)] for slot in slots for p in self._template(slot.path).parameters()
        }

    def _build(self, slot: Slot, read: Callable[[str, torch.Tensor], torch.Tensor]) -> nn.Module:
        template = self._template(slot.path)
        # Each parameter beside the base's it stands in for: on a layer-split base
        # (device_map) each layer's modules are on their own device.
        donor = structural_copy(
            template,
            {
                id(p): nn.Parameter(read(self._names[id(p)], p), requires_grad=p.requires_grad)
                for p in template.parameters()
            },
        )
        fused = self._fused.get(slot.path)
        if fused is None:
            return donor
        return fused.split(self._base, donor)[slot.path.rpartition(".")[2]]


def structural_copy(
    module: nn.Module,
    parameters: Mapping[int, nn.Parameter],
    modules: Mapping[int, nn.Module] | None = None,
) -> nn.Module:
    """A copy of ``module``'s tree of modules, with some parameters and submodules replaced:
    new objects of the same class and attributes (settings, buffers and untouched parameters
    shared, not copied), computing what ``module`` computes with the replacements in place.

    Args:
        module: The template (e.g. the base's ``q_proj``).
        parameters: Replacements by ``id`` of the template's parameter.
        modules: Replacements by ``id`` of a submodule (taken as they are).

    Raises:
        GraftingLensError: A module keeps a replaced parameter in a plain attribute too (a
            cached transpose), which the copy would leave pointing at the template's values.
    """
    modules = modules or {}
    if id(module) in modules:
        return modules[id(module)]
    clone = copy.copy(module)
    replaced = {
        p.untyped_storage().data_ptr()
        for p in module._parameters.values()
        if p is not None and id(p) in parameters
    }
    for key, value in vars(module).items():
        if isinstance(value, dict):  # parameters, buffers, submodules and the hook tables
            clone.__dict__[key] = copy.copy(value)
        elif isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in replaced:
            raise GraftingLensError(
                f"{type(module).__name__} keeps a parameter in its attribute {key!r} too, so a "
                "copy with other weights would compute with both: load the checkpoint whole."
            )
    for name, parameter in module._parameters.items():
        if parameter is not None and id(parameter) in parameters:
            clone._parameters[name] = parameters[id(parameter)]
    for name, child in module._modules.items():
        if child is not None:
            clone._modules[name] = structural_copy(child, parameters, modules)
    return clone


def tensor_bytes(tensors: Iterable[torch.Tensor], counted: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one count once), skipping and
    adding to ``counted`` (data pointers), so that sources sharing tensors count them once."""
    counted = set() if counted is None else counted
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage() if tensor.device.type != "meta" else None
        if storage is not None and storage.data_ptr() not in counted and storage.nbytes():
            counted.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_copy(model: nn.Module, share_parameters: bool = False) -> Any:
    """A copy of ``model``'s modules and config over the same weight tensors, unwrapped from
    any bridge: new ``Parameter`` objects over the same storage (the same objects with
    ``share_parameters``), so that casting or moving the copy leaves ``model`` as it was."""
    memo: dict[int, Any] = {id(tensor): tensor for tensor in model.buffers()}
    for p in model.parameters():
        memo[id(p)] = (
            p if share_parameters else nn.Parameter(p.detach(), requires_grad=p.requires_grad)
        )
    # A bridge wraps modules in place: each wrapper stands for the module it wraps.
    for module in reversed(list(model.modules())):
        if isinstance(module, GeneralizedComponent) and module.original_component is not None:
            memo[id(module)] = copy.deepcopy(module.original_component, memo)
    return copy.deepcopy(model, memo)


def shared_bridge(base: TransformerBridge) -> TransformerBridge:
    """A second bridge over the base's own parameters and buffers (an adapter runs alone in
    it): it costs the modules, not the weights, and moves with the base."""
    model = model_copy(base.original_model, share_parameters=True)
    name = str(getattr(base.cfg, "model_name", "") or "base")
    return _boot_bridge(model, name, base.tokenizer)


def _boot_bridge(model: nn.Module, name: str, tokenizer: Any) -> TransformerBridge:
    """A bridge over ``model`` itself in eval mode, weights unprocessed; a dispatched model is
    taken as is (the bridge reads its ``hf_device_map``), token ids go to its embedding."""
    model.eval()
    bridge = TransformerBridge.boot_transformers(
        name,
        hf_model=model,
        tokenizer=tokenizer,
        device=str(embedding_device(model)),
        dtype=next(model.parameters()).dtype,
    )
    return adapt_bridge(bridge)
