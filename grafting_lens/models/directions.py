"""Grafts below the matrix: part of a donor's change ``dW = W_donor - W_base`` to each weight
matrix (``rank=``: its top singular directions, or chosen ones), or a share of it
(``strength=``), each one value or one per ``(component, layer)``. :meth:`ModelSet.directions
<grafting_lens.models.model_set.ModelSet.directions>` adds a :class:`DirectionsSource` to a
model set as a donor. See ``docs/concepts/directions.md``.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Union

import torch
from torch import nn
from transformer_lens.model_bridge import TransformerBridge
from transformers.pytorch_utils import Conv1D

from grafting_lens.core.arguments import is_integer, is_number, shown
from grafting_lens.core.errors import ArgumentTypeError, SelectionError
from grafting_lens.models.components import (
    COMPONENTS,
    Slot,
    canonical_component_name,
    component_layout,
)
from grafting_lens.models.lora_source import LoraEmbedding, LoraLinear, LoraSource, _LoraLayer
from grafting_lens.models.sources import Source, structural_copy, tensor_bytes

Rank = Union[int, Sequence[int], None]
"""``None`` (every direction), ``k`` (the top k; 0 is the base) or a list of direction indices."""

PerCell = Union[Any, Mapping[tuple[str, Union[int, None]], Any]]
"""A setting, or one per ``(component, layer)``: a cell not named takes the default."""

MATRICES = (nn.Linear, Conv1D, nn.Embedding)
"""The modules whose weight has directions: ``[d_out, d_in]`` (Conv1D and embeddings
transposed to that: an embedding's input is a one-hot token)."""

Factors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]
"""``(values [n], U [d_out, n], V^T [n, d_in], ||dW||_F^2)`` of a slot's change, ``U`` and
``V`` of unit columns and rows, in float32."""

# SVDs by donor source, then by (base, slot path, state): shared by every DirectionsSource
# made from the same donor, dropped with it.
_SVDS: weakref.WeakKeyDictionary[Source, dict[tuple, tuple[tuple | None, Factors]]] = (
    weakref.WeakKeyDictionary()
)


def check_rank(rank: object) -> int | tuple[int, ...] | None:
    """``rank`` as ``None``, a count or distinct indices, refused when negative or a bool."""
    if rank is None:
        return None
    items = [rank] if is_integer(rank) else rank
    listed = isinstance(items, Iterable) and not isinstance(rank, (str, bytes))
    values = list(items) if isinstance(items, Iterable) and listed else []
    bad = [v for v in values if not is_integer(v)]
    if not listed or bad:
        what = (
            f"{shown(bad[0])} is not an integer" if bad else "give a count (4) or direction indices"
        )
        raise ArgumentTypeError(f"rank={shown(rank)}: {what}.")
    if not values or any(int(v) < 0 for v in values) or len(set(map(int, values))) < len(values):
        raise SelectionError(
            f"rank={shown(rank)}: a count or direction index is 0 or more, each index once "
            "(0: the base; [0, 2]: the first and third directions)."
            if values
            else "rank=[] names no direction: give rank=0 for the base."
        )
    return int(rank) if is_integer(rank) else tuple(int(v) for v in values)


def check_strength(strength: object) -> float:
    """``strength`` as a finite float (0: the base, 1: the graft; others extrapolate)."""
    if not (is_number(strength) and math.isfinite(float(strength))):
        raise (SelectionError if is_number(strength) else ArgumentTypeError)(
            f"strength={shown(strength)}: give a finite number, e.g. 0.5 (0 base, 1 donor)."
        )
    return float(strength)


class DirectionsSource(Source):
    """A donor's change cut to some directions of each weight matrix, or scaled.

    Its module for a linear slot is a :class:`~grafting_lens.models.lora_source.LoraLinear`,
    the base's own module plus ``B A x * strength`` (``B = U_k S_k``, ``A = V_k^T``); under
    ``rank=None`` a copy holding ``W_base + strength * dW``. SVDs are computed on first use in
    float64 and kept per donor in float32 (:meth:`svd_bytes`).

    Raises:
        SelectionError: The donor equals the base; at a slot, a rank past its directions.
    """

    kind = "directions"

    def __init__(
        self,
        name: str,
        base: Source,
        donor: Source,
        *,
        rank: PerCell = None,
        strength: PerCell = 1.0,
        make_bridge: Callable[[], TransformerBridge],
    ) -> None:
        super().__init__(name)
        self.base, self.donor = base, donor
        self._keys: dict[str, tuple] = {}  # slot path -> (component, layer), for per-cell settings
        self.rank = self._per_cell(rank, check_rank)
        self.strength = self._per_cell(strength, check_strength)
        self._make_bridge = make_bridge
        self._bridge: TransformerBridge | None = None
        self._modules: dict[str, nn.Module] = {}
        tensors = donor.adapter.tensors if isinstance(donor, LoraSource) else None
        unchanged = (  # an adapter of zero B factors and nothing else, or the base's fingerprint
            all("lora_" in k and ("_B" not in k or not t.any()) for k, t in tensors.items())
            if tensors is not None
            else donor.fingerprint() == base.fingerprint()
        )
        if unchanged:
            raise SelectionError(
                f"The donor {donor.name} holds the base's weights (dW = 0): its directions "
                "would graft nothing. Load the finetuned checkpoint as the donor."
            )

    def __repr__(self) -> str:
        return f"DirectionsSource({self.name!r}, rank={self.rank}, strength={self.strength})"

    def _per_cell(self, value: Any, check: Callable[[Any], Any]) -> Any:
        """``check(value)``, or ``{(component, layer): check(v)}`` of known cells."""
        if not isinstance(value, Mapping):
            return check(value)
        if not self._keys:
            layout = component_layout(self.base.bridge).slots
            self._keys = {s.path: key for key, slots in layout.items() for s in slots}
        known = set(self._keys.values())
        checked = {}
        for key, setting in value.items():
            pair = isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)
            cell = (canonical_component_name(key[0]), key[1]) if pair else None
            if cell not in known:
                raise (SelectionError if pair else ArgumentTypeError)(
                    f"{shown(key)}: key a per-cell setting by a (component, layer) of this "
                    "model (models.pairs), e.g. {('mlp_out', 3): 0.5}."
                )
            checked[cell] = check(setting)
        return checked

    def setting(self, slot: Slot) -> tuple[int | tuple[int, ...] | None, float]:
        """``(rank, strength)`` at ``slot`` (a cell a mapping leaves out: every direction, 1)."""
        key = self._keys.get(slot.path)
        rank = self.rank.get(key) if isinstance(self.rank, dict) else self.rank
        strength = self.strength.get(key, 1.0) if isinstance(self.strength, dict) else self.strength
        return rank, strength

    @property
    def bridge(self) -> TransformerBridge:
        """The base with this source's module in every slot (a second bridge over its tensors)."""
        if self._bridge is None:
            bridge = self._make_bridge()
            layout = component_layout(self.base.bridge)
            for slot in (slot for slots in layout.slots.values() for slot in slots):
                module = self.module(slot)
                if module is not slot.module(self.base.bridge):
                    slot.replace(bridge, module)
            self._bridge = bridge
        return self._bridge

    def module(self, slot: Slot) -> nn.Module:
        module = self._modules.get(slot.path)
        if module is None:
            module = self._modules[slot.path] = self._build(slot)
        return module

    def _build(self, slot: Slot) -> nn.Module:
        base = self.base.module(slot)
        rank, strength = self.setting(slot)
        if rank == 0 or strength == 0:
            return base
        donor = self.donor.module(slot)
        if donor is base:  # a slot a LoRA donor leaves alone
            return base
        if isinstance(donor, _LoraLayer) and donor._modules["base_layer"] is base:
            picked = self._picked(slot, rank, int(donor.lora_A.shape[0]))
            return type(donor)(
                base, donor.lora_A[picked], donor.lora_B[:, picked], donor.scale * strength
            )
        if rank is None:
            if strength == 1:
                return donor
            pairs = zip(base.parameters(), self.donor.weights(slot))
            return structural_copy(
                base,
                {
                    id(p): nn.Parameter(
                        (p.float() + strength * (d.float() - p.float())).to(p.dtype),
                        requires_grad=False,
                    )
                    for p, d in pairs
                },
            )
        factors = self.factors(slot)
        if factors is None or not factors[3]:  # no matrix, or one the donor did not change
            return base
        values, U, Vh, _ = factors
        picked = self._picked(slot, rank, len(values))
        weight = base.weight
        assert isinstance(weight, torch.Tensor)
        B = (U[:, picked] * values[picked]).to(weight)
        kind = LoraEmbedding if isinstance(base, nn.Embedding) else LoraLinear
        return kind(base, Vh[picked].to(weight), B, strength)

    def _picked(self, slot: Slot, rank: Any, count: int) -> list[int]:
        wanted = range(rank) if isinstance(rank, int) else rank or range(count)
        if max(wanted, default=-1) >= count:
            raise SelectionError(
                f"rank={shown(rank)}: {slot.path}'s change has {count} directions "
                f"(indices 0..{count - 1}): give at most that, or leave this component out."
            )
        return list(wanted)

    def factors(self, slot: Slot) -> Factors | None:
        """The directions of ``slot``'s change, largest first (a LoRA donor's: its rank
        components, in the adapter's order), or None for a slot with no weight matrix."""
        base = self.base.module(slot)
        if not isinstance(base, MATRICES):
            return None
        donor = self.donor.module(slot)
        if isinstance(donor, _LoraLayer) and donor._modules["base_layer"] is base:
            A, B = donor.lora_A.float(), donor.lora_B.float() * donor.scale
            a, b = A.norm(dim=1), B.norm(dim=0)
            norm2 = float(donor.delta().float().norm() ** 2)
            return a * b, B / b.clamp_min(1e-30), A / a[:, None].clamp_min(1e-30), norm2
        cache = _SVDS.setdefault(self.donor, {})
        key, state = (id(self.base), slot.path), self._weights_state()
        if state is None or cache.get(key, (None,))[0] != state:  # new, or weights changed
            delta = self.donor.weights(slot)[0].double() - base.weight.detach().double()
            if not isinstance(base, nn.Linear):  # Conv1D [in, out], embedding [vocab, d]
                delta = delta.t()
            U, values, Vh = torch.linalg.svd(delta, full_matrices=False)
            cache[key] = (
                state,
                (values.float(), U.float(), Vh.float(), float(values.detach().square().sum())),
            )
        return cache[key][1]

    def svd_bytes(self) -> int:
        """Bytes of the SVDs held for this source's donor (shared by its other sources)."""
        return tensor_bytes(t for _, f in _SVDS.get(self.donor, {}).values() for t in f[:3])

    def weights(self, slot: Slot) -> list[torch.Tensor]:
        module = self.module(slot)
        if isinstance(module, _LoraLayer):
            merged = [p.detach() for p in module._modules["base_layer"].parameters()]  # type: ignore[union-attr]
            return [merged[0] + module.delta().to(merged[0]), *merged[1:]]
        return [p.detach() for p in module.parameters()]

    def resident_tensors(self) -> list[torch.Tensor]:
        tensors = [p.detach() for m in self._modules.values() for p in m.parameters()]
        tensors += [t for _, f in _SVDS.get(self.donor, {}).values() for t in f[:3]]
        if self._bridge is not None:
            tensors += [p.detach() for p in self._bridge.parameters()]
        return tensors

    def full_bytes(self) -> int:
        return self.base.full_bytes()

    def _parameters_of(self) -> Iterable[nn.Parameter]:
        return self.base.bridge.original_model.parameters()

    def _weights_state(self) -> tuple | None:
        states = (self.base._weights_state(), self.donor._weights_state())
        return None if None in states else states

    def _settings(self, base: str, donor: str) -> str:
        text = f"{base}{donor}{self.rank}{self.strength}"
        return hashlib.sha256(text.encode()).hexdigest()

    def _fingerprint(self) -> str:
        return self._settings(self.base.fingerprint(), self.donor.fingerprint())[:16]

    def content_digest(self) -> str:
        return self._settings(self.base.content_digest(), self.donor.content_digest())[:32]


def check_matrix_components(models: Any, components: str | Sequence[str]) -> None:
    """Refuse, under ``rank=``, a component named alone that holds no weight matrix (a norm's
    scale): a group (``"all"``, ``"ffn"``) takes its members' matrices, the rest stays the base's.

    Raises:
        SelectionError: Naming the component and the fix.
    """
    names = components.split("+") if isinstance(components, str) else list(components)
    for name in map(canonical_component_name, names):
        if name in COMPONENTS and name in models.components:
            modules = [
                slot.module(models.base)
                for (component, _), slots in models.layout.slots.items()
                if component == name
                for slot in slots
            ]
            if not any(isinstance(m, MATRICES) for m in modules):
                raise SelectionError(
                    f"rank= grafts directions of weight matrices, and {name} holds none "
                    f"({type(modules[0]).__name__}): drop it from components=, or graft it "
                    "whole without rank= (strength= scales every parameter)."
                )
