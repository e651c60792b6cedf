"""A LoRA adapter as a source of weights: the base's modules plus the adapter's factors.

For a component the adapter touches, a module computing ``W x + B A x * scale`` from the
base's own weight (:class:`LoraLinear`, :class:`LoraEmbedding`); for any other, the base's
module itself. Nothing is merged. See the API page "Models", section "LoRA adapters".
"""

from __future__ import annotations

import abc
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.model_bridge import TransformerBridge
from transformers.pytorch_utils import Conv1D

from grafting_lens.core.errors import AdapterError
from grafting_lens.models.adapters import RESAVE, LoraAdapter
from grafting_lens.models.components import (
    FusedProjection,
    Slot,
    checkpoint_modules,
    checkpoint_parameters,
    fused_projections,
)
from grafting_lens.models.fingerprints import content_digest, parameters_state, weights_fingerprint
from grafting_lens.models.sources import CheckpointSource, Source, structural_copy


class _LoraLayer(nn.Module, abc.ABC):
    """A base layer and LoRA factors; attributes it lacks are read from the base layer."""

    def __init__(
        self, base_layer: nn.Module, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.Parameter(lora_A, requires_grad=False)
        self.lora_B = nn.Parameter(lora_B, requires_grad=False)
        self.scale = float(scale)

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:  # the base layer's, as PEFT's LoRA layers read it
            base = self.__dict__.get("_modules", {}).get("base_layer")
            if base is None:
                raise
            return getattr(base, name)

    @abc.abstractmethod
    def delta(self) -> torch.Tensor:
        """``B A * scale``, laid out like ``base_layer.weight``."""


class LoraLinear(_LoraLayer):
    """A linear layer with a LoRA update: ``base_layer(x) + B A x * scale``.

    ``base_layer`` is the base's own ``nn.Linear`` or ``Conv1D``, whose attributes this reads
    as PEFT's LoRA layers do. ``lora_A`` is ``[r, d_in]``, ``lora_B`` ``[d_out, r]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        # The order of PEFT's own forward: base output plus B(A(x)) * scale.
        return result + self.update(x).to(result.dtype)

    def update(self, x: torch.Tensor) -> torch.Tensor:
        """``B A x * scale``, what this layer adds to its base layer's output."""
        return F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B) * self.scale

    def delta(self) -> torch.Tensor:
        """``B A * scale``, laid out like ``base_layer.weight`` (transposed for ``Conv1D``)."""
        delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale
        return delta.t() if isinstance(self.base_layer, Conv1D) else delta


class LoraEmbedding(_LoraLayer):
    """An embedding with a LoRA update: ``base_layer(ids) + (B A)^T[ids] * scale``, scaled
    like the base's lookup where it has an ``embed_scale`` (Gemma), as PEFT does.
    ``lora_A`` is ``[r, vocab]``, ``lora_B`` ``[d_model, r]``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        base = self._modules["base_layer"]
        assert isinstance(base, nn.Embedding)
        result = base(ids)
        after_A = F.embedding(
            ids,
            self.lora_A.t(),
            padding_idx=base.padding_idx,
            max_norm=base.max_norm,
            norm_type=base.norm_type,
            scale_grad_by_freq=base.scale_grad_by_freq,
            sparse=base.sparse,
        )
        update = (after_A @ self.lora_B.t()) * self.scale
        embed_scale = getattr(base, "embed_scale", None)
        if embed_scale is not None:
            update = update * torch.as_tensor(embed_scale).to(update)
        return result + update.to(result.dtype)

    def delta(self) -> torch.Tensor:
        """``(B A)^T * scale``, laid out like the embedding's weight ``[vocab, d_model]``."""
        return ((self.lora_B.float() @ self.lora_A.float()) * self.scale).t()


@dataclass
class _Update:
    """What an adapter does to one module of the base: LoRA factors, and what they adapt."""

    name: str
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    embedding: bool = False


@dataclass
class _Replacement:
    """A parameter of the base that the adapter holds whole, with its new value.

    ``owner``: the ``modules_to_save`` module, the only one computing with the new value even
    where the base ties the parameter; ``None``: a value loaded into the base's parameter
    itself (an embedding layer saved beside an embedding adapter), for every module sharing it.
    """

    name: str
    parameter: nn.Parameter
    value: nn.Parameter
    owner: nn.Module | None


class LoraSource(Source):
    """A LoRA adapter on the base, as a donor: the base's modules plus the adapter's factors.

    Its module for an adapted slot is a :class:`LoraLinear` or :class:`LoraEmbedding` around
    the base's own module (or a copy holding a ``modules_to_save`` replacement); for any other
    slot, the base's module itself.

    Args:
        name: The source's label.
        adapter: The adapter.
        base: The base's bridge.
        slots: Every slot of the architecture.
        make_bridge: Builds a bridge over the base's own tensors (for :attr:`bridge`).

    Raises:
        AdapterError: An adapter made for another base, or one no component computes.
    """

    kind = "lora"

    def __init__(
        self,
        name: str,
        adapter: LoraAdapter,
        base: TransformerBridge,
        slots: Iterable[Slot],
        *,
        make_bridge: Callable[[], TransformerBridge],
    ) -> None:
        super().__init__(name)
        self.adapter = adapter
        self._base = base
        self._slots = {slot.path: slot for slot in slots}
        self._templates = {path: slot.module(base) for path, slot in self._slots.items()}
        self._make_bridge = make_bridge
        self._bridge: TransformerBridge | None = None
        self._modules = _AdaptedModules(adapter, base, self._templates).build()

    @property
    def adapted(self) -> tuple[str, ...]:
        """The slots the adapter changes, by bridge path."""
        return tuple(self._modules)

    @property
    def bridge(self) -> TransformerBridge:
        """The base with the adapter: a second bridge over the base's own tensors (moving or
        casting it moves the base too)."""
        if self._bridge is None:
            bridge = self._make_bridge()
            for path, module in self._modules.items():
                self._slots[path].replace(bridge, module)
            self._bridge = bridge
        return self._bridge

    def module(self, slot: Slot) -> nn.Module:
        module = self._modules.get(slot.path)
        return module if module is not None else self._templates[slot.path]

    def weights(self, slot: Slot) -> list[torch.Tensor]:
        return _merged_parameters(self.module(slot))

    def resident_tensors(self) -> list[torch.Tensor]:
        tensors = [p.detach() for m in self._modules.values() for p in m.parameters()]
        if self._bridge is not None:
            tensors += [p.detach() for p in self._bridge.parameters()]
            tensors += list(self._bridge.buffers())
        return tensors

    def full_bytes(self) -> int:
        return CheckpointSource(self._base, self.name).full_bytes()  # the merged model's

    def _parameters_of(self) -> Iterable[nn.Parameter]:
        # The factors are cast to the base weight's dtype where they are applied.
        return self._base.original_model.parameters()

    def _weights_state(self) -> tuple | None:
        return parameters_state(self._base.original_model)  # the factors are read-only

    def _fingerprint(self) -> str:
        base = weights_fingerprint(checkpoint_parameters(self._base.original_model))
        return self._digest(base)[:16]

    def content_digest(self) -> str:
        return self._digest(content_digest(checkpoint_parameters(self._base.original_model)))[:32]

    def _digest(self, base: str) -> str:
        """The base's hash with every value of the factors (small: sampling could miss a
        change) and the settings that scale them."""
        factors = content_digest(sorted(self.adapter.tensors.items()))
        settings = {
            k: self.adapter.config.get(k) for k in ("lora_alpha", "alpha_pattern", "use_rslora")
        }
        text = f"{base}{factors}{json.dumps(settings, sort_keys=True, default=str)}"
        return hashlib.sha256(text.encode()).hexdigest()


def _merged_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The parameters ``module`` computes with, LoRA updates merged, in the base's order."""
    if isinstance(module, _LoraLayer):
        base = module._modules["base_layer"]
        assert base is not None
        merged = _merged_parameters(base)
        # The weight comes first among its parameters (nn.Linear, Conv1D, nn.Embedding).
        merged[0] = merged[0] + module.delta().to(merged[0])
        return merged
    values: list[torch.Tensor] = [p.detach() for p in module._parameters.values() if p is not None]
    return values + [
        p
        for child in module._modules.values()
        if child is not None
        for p in _merged_parameters(child)
    ]


_LORA_KEYS = {  # suffix: (the factor, whether it adapts an embedding)
    ".lora_A.weight": ("lora_A", False),
    ".lora_B.weight": ("lora_B", False),
    ".lora_embedding_A": ("lora_A", True),
    ".lora_embedding_B": ("lora_B", True),
}

_MERGE_IT = "Merge it into a full checkpoint (merge_and_unload) and load that."


class _AdaptedModules:
    """Builds, for every slot an adapter changes, the module that computes it."""

    def __init__(
        self, adapter: LoraAdapter, base: TransformerBridge, templates: Mapping[str, nn.Module]
    ) -> None:
        self.adapter = adapter
        self.base = base
        self.templates = templates
        self.architecture = type(base.original_model).__name__
        original = base.original_model
        assert isinstance(original, nn.Module)
        self.named = {prefix[:-1]: m for prefix, m in checkpoint_modules(original) if prefix}
        self.parameters = {
            prefix + name: p
            for prefix, m in checkpoint_modules(original)
            for name, p in m._parameters.items()
            if p is not None
        }
        self.slot_of = {id(m): path for path, m in templates.items()}
        self.inside: dict[int, str] = {}
        for path, template in templates.items():
            for sub in template.modules():
                self.inside.setdefault(id(sub), path)
        self.fused: dict[int, FusedProjection] = {
            id(f.fused(base)): f for f in fused_projections(base)
        }
        self.replacements: list[_Replacement] = []

    def _another_base(self, what: str) -> str:
        named = self.adapter.base_name
        made_for = f" (its config names the base {named!r})" if named else ""
        return (
            f"The adapter {self.adapter.label}{made_for} {what}: it was made for another model "
            f"than this base ({self.architecture}). Load it on the base it was trained on."
        )

    def build(self) -> dict[str, nn.Module]:
        updates, self.replacements = self._read()
        modules = [*self.templates.values(), *(f.fused(self.base) for f in self.fused.values())]
        computed = self.inside.keys() | self.fused.keys()  # by id of the base's module
        orphans = [
            f"replaces {r.name}, which no component grafts"
            for r in self.replacements
            if not any(id(r.parameter) in self._replacing(m) for m in modules)
        ] + [
            f"adapts {name}, which no component computes"
            for name in updates
            if id(self.named[name]) not in computed
        ]
        if orphans:
            raise AdapterError(
                f"The adapter {self.adapter.label} {orphans[0]} (see ModelSet.coverage()). "
                + _MERGE_IT
            )
        donors: dict[str, nn.Module] = {}
        # Replaced parameters (modules_to_save, saved embedding layers) first: the
        # LoRA updates then apply to the replaced modules, as in PEFT.
        for path, template in self.templates.items():
            replacing = self._replacing(template)
            if replacing:
                donors[path] = structural_copy(template, replacing)
        for fused in self.fused.values():
            template = fused.fused(self.base)
            replacing = self._replacing(template)
            if replacing:
                parts = fused.split(self.base, structural_copy(template, replacing))
                for child, module in parts.items():
                    donors[f"{fused.node}.{child}"] = module
        nested: dict[str, dict[int, nn.Module]] = {}
        for update in updates.values():
            module = self.named[update.name]
            slot_path = self.slot_of.get(id(module))
            if slot_path is not None:
                donors[slot_path] = self._wrap(donors.get(slot_path, module), update)
            elif id(module) in self.fused:
                fused = self.fused[id(module)]
                rows = self._rows(fused, update)
                for child, index in rows.items():
                    child_path = f"{fused.node}.{child}"
                    inner = donors.get(child_path, self.templates[child_path])
                    assert update.lora_B is not None
                    part = _Update(update.name, update.lora_A, update.lora_B[index])
                    donors[child_path] = self._wrap(inner, part)
            else:  # inside a slot's module
                path = self.inside[id(module)]
                inner = structural_copy(module, self._replacing(module))
                nested.setdefault(path, {})[id(module)] = self._wrap(inner, update)
        for path, inner_modules in nested.items():
            template = self.templates[path]
            donors[path] = structural_copy(template, self._replacing(template), inner_modules)
        return donors

    def _replacing(self, module: nn.Module) -> dict[int, nn.Parameter]:
        """The replacements that apply inside ``module``, by ``id`` of the base's parameter: a
        ``modules_to_save`` copy inside its own module, a loaded value wherever its parameter is."""
        inside = {id(sub) for sub in module.modules()}
        held = {id(p) for _, p in module.named_parameters(remove_duplicate=False)}
        return {
            id(r.parameter): r.value
            for r in self.replacements
            if id(r.parameter) in held and (r.owner is None or id(r.owner) in inside)
        }

    def _read(self) -> tuple[dict[str, _Update], list[_Replacement]]:
        """The adapter's LoRA updates by module, and the base parameters it replaces."""
        updates: dict[str, _Update] = {}
        replacements: list[_Replacement] = []
        problem = None
        for key, tensor in self.adapter.tensors.items():
            suffix = next((end for end in _LORA_KEYS if key.endswith(end)), None)
            name = key[: -len(suffix)] if suffix else key
            if suffix is not None and name in self.named:
                part, embedding = _LORA_KEYS[suffix]
                setattr(updates.setdefault(name, _Update(name, embedding=embedding)), part, tensor)
                continue
            if suffix is not None:
                problem = self._another_base(f"adapts {name}, which the base lacks")
                break
            if ".lora_" in key:
                kind = "DoRA's magnitude vector" if "magnitude" in key else "not plain LoRA A or B"
                problem = (
                    f"The adapter {self.adapter.label} holds {key}, a LoRA tensor of a kind "
                    f"grafting-lens does not compute ({kind}). {_MERGE_IT}"
                )
                break
            # A whole parameter: modules_to_save, the embedding layers PEFT saves beside
            # embedding adapters (as base_layer.weight), or PEFT's copy of the base's own
            # module beside a modules_to_save (original_module), which must be the base's.
            name = key.replace(".base_layer.", ".").replace(".original_module.", ".")
            parameter = self.parameters.get(name)
            if parameter is None or tuple(tensor.shape) != tuple(parameter.shape):
                where = "lacks" if parameter is None else f"holds as {tuple(parameter.shape)}"
                problem = self._another_base(
                    f"holds {key} {tuple(tensor.shape)}, which the base {where}"
                )
                break
            value = tensor.to(device=parameter.device, dtype=parameter.dtype)
            if torch.equal(value, parameter.detach()):
                continue
            if ".original_module." in key:
                problem = self._another_base(
                    f"holds {key}, a copy of the base's {name} with other values"
                )
                break
            module_name = name.rpartition(".")[0]
            owner = (
                self.named.get(module_name)
                if ".base_layer." not in key and self.adapter.saved_whole(module_name)
                else None
            )
            replacements.append(
                _Replacement(name, parameter, nn.Parameter(value, requires_grad=False), owner)
            )
        for update in updates.values():
            problem = problem or self._problem(update)
        if problem is not None:
            raise AdapterError(problem)
        return updates, replacements

    def _problem(self, update: _Update) -> str | None:
        """Why ``update`` is not LoRA of its base module, or None (its factors then cast to it)."""
        module = self.named[update.name]
        label, name = self.adapter.label, update.name
        lora_A, lora_B = update.lora_A, update.lora_B
        if lora_A is None or lora_B is None:
            missing = "A" if lora_A is None else "B"
            return f"The adapter {label} holds no {missing} for {name}: its file is incomplete. {RESAVE}"
        if update.embedding and isinstance(module, nn.Embedding):
            d_in, d_out = module.num_embeddings, module.embedding_dim
        elif not update.embedding and isinstance(module, nn.Linear):
            d_in, d_out = module.in_features, module.out_features
        elif not update.embedding and isinstance(module, Conv1D):
            d_in, d_out = module.weight.shape[0], module.weight.shape[1]
        else:
            return self._another_base(
                f"adapts {name} as {'an embedding' if update.embedding else 'a linear layer'}, "
                f"which in the base is a {type(module).__name__}"
            )
        rank = lora_A.shape[0] if lora_A.dim() == 2 else -1
        if tuple(lora_A.shape) != (rank, d_in) or tuple(lora_B.shape) != (d_out, rank):
            return self._another_base(
                f"adapts {name} with A {tuple(lora_A.shape)} and B {tuple(lora_B.shape)}, but the "
                f"base's {name} maps {d_in} to {d_out} features (A must be [r, {d_in}], B "
                f"[{d_out}, r])"
            )
        if rank != self.adapter.rank(name):
            return (
                f"The adapter {label} adapts {name} with factors of rank {rank}, but its config "
                f"gives that module rank {self.adapter.rank(name)} (r or rank_pattern), and "
                f"scales by lora_alpha / rank: the config is not these weights'. {RESAVE}"
            )
        update.lora_A = lora_A.to(device=module.weight.device, dtype=module.weight.dtype)
        update.lora_B = lora_B.to(device=module.weight.device, dtype=module.weight.dtype)
        return None

    def _wrap(self, module: nn.Module, update: _Update) -> nn.Module:
        assert update.lora_A is not None and update.lora_B is not None
        scale = self.adapter.scale(update.name, int(update.lora_A.shape[0]))
        kind = LoraEmbedding if update.embedding else LoraLinear
        return kind(module, update.lora_A, update.lora_B, scale)

    def _rows(self, fused: FusedProjection, update: _Update) -> dict[str, torch.Tensor]:
        """Which rows of ``B`` each split module computes: the bridge's split function run on a
        weight holding each output's row number, checked against the base's own split."""
        template = fused.fused(self.base)
        weight = template.weight
        bias = getattr(template, "bias", None)
        assert isinstance(weight, torch.Tensor) and update.lora_B is not None
        d_out = update.lora_B.shape[0]
        numbers = torch.arange(d_out, dtype=torch.float32)
        by_rows = weight.shape[0] == d_out and not isinstance(template, Conv1D)
        probe = (numbers[:, None] if by_rows else numbers[None, :]).expand(weight.shape)
        replacements = {id(weight): nn.Parameter(probe.contiguous(), requires_grad=False)}
        if bias is not None:
            replacements[id(bias)] = nn.Parameter(numbers.clone(), requires_grad=False)
        parts = fused.split(self.base, structural_copy(template, replacements))
        matrix = weight.detach() if by_rows else weight.detach().t()  # [d_out, d_in]
        rows = {}
        for child, module in parts.items():
            split = getattr(module, "weight", None)
            base_child = self.templates[f"{fused.node}.{child}"]
            index = None
            if isinstance(module, nn.Linear) and isinstance(split, torch.Tensor):
                first = split[:, 0]
                if torch.equal(split, first[:, None].expand_as(split)) and torch.equal(
                    first, first.round()
                ):
                    index = first.long()
            if (
                index is None
                or not isinstance(base_child, nn.Linear)
                or not torch.equal(base_child.weight.detach(), matrix[index.to(matrix.device)])
            ):
                raise AdapterError(
                    f"The adapter {self.adapter.label} adapts {update.name}, which the bridge "
                    f"splits into {', '.join(fused.children)} other than by output rows: its B "
                    f"cannot be split alike. {_MERGE_IT}"
                )
            rows[child] = index.to(update.lora_B.device)
        return rows
