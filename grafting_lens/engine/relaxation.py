"""The relaxed graft: components mixed per position between two checkpoints, differentiably.

Inside :func:`relaxing` every relaxed ``(component, layer)`` computes, at each position,
``lerp(current_out, source_out, weight[b, t])`` with the graft engine's layouts: weight 0
is the run as it stands, 1 the graft (``torch.lerp`` returns its ends to the last bit), and
one backward pass gives every cell's effect
(:func:`~grafting_lens.analysis.attribution.attribute_grafts`). A mixture-of-experts router
is relaxed as a mixture of the two routings; another output that is not floating point and
differs between the checkpoints is refused, named. Why: docs/concepts/attribution.md, "The
relaxation".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from transformer_lens.model_bridge import TransformerBridge

from grafting_lens.core.errors import AttributionError
from grafting_lens.engine import masks
from grafting_lens.engine.graft import check_declared
from grafting_lens.engine.masks import GraftMask, Key, checked_key
from grafting_lens.engine.routing import Dispatch, installed, position_shape
from grafting_lens.models.components import Slot
from grafting_lens.models.model_set import ModelSet, check_model_set

__all__ = ["check_source", "relaxing"]

_RELAXING = "_grafting_lens_relaxing"  # set on the base bridge while a relaxation is installed


class _MixDispatch(Dispatch):
    """Stands in for one slot: ``sources`` is ``(current, switch)``, what the slot held and the
    checkpoint's module it moves toward, both called on the whole input; every floating-point
    output is ``lerp(current_out, switch_out, weight)`` with each row's position's weight."""

    error = AttributionError
    verb = "relax"
    _weight: torch.Tensor

    def __init__(
        self,
        key: Key,
        path: str,
        sources: tuple[nn.Module, nn.Module],
        weight: torch.Tensor,
        pos_dim: int | None,
        norm: bool,
    ) -> None:
        super().__init__(key, path, sources, pos_dim, norm)
        self.__dict__["_weight"] = weight

    def window(self) -> tuple[int, int]:
        return int(self._weight.shape[0]), int(self._weight.shape[1])

    def forward(self, *args, **kwargs):
        current, switch = self.sources
        rest, other = current(*args, **kwargs), switch(*args, **kwargs)
        single = not isinstance(rest, tuple)
        rests, others = ((rest,), (other,)) if single else (rest, other)
        routing = _routing(rests) if self.key[0] == "router" else None
        if (
            single != isinstance(other, tuple)
            and len(rests) == len(others)
            and all(_mixable(a, b, routing is not None) for a, b in zip(rests, others))
        ):
            if routing is not None:
                return self._mix_routing(rests, others, *routing)
            mixed = [
                self._mix(a, b) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a, b in zip(rests, others)
            ]
            return mixed[0] if single else tuple(mixed)
        shown = [list(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in rests]
        self.refuse(
            f"outputs {shown} that differ between the two checkpoints and cannot be mixed "
            "(only floating-point tensors of one shape can)"
        )

    def _mix_routing(
        self, rests: tuple, others: tuple, logits_at: int, weights_at: int, indices_at: int
    ) -> tuple:
        """Mix two routings of a mixture of experts: each expert gets the mixed weight."""
        # The experts' output is sum_e weight_e * expert_e(x), linear in the weights: each
        # routing's top-k weights spread over every expert (zeros elsewhere) and mixed give
        # exactly one routing's output at 0 and 1. Every expert then computes every row.
        logits = rests[logits_at]
        experts = logits.shape[-1]
        dense = []
        for parts in (rests, others):
            indices, weights = parts[indices_at], parts[weights_at]
            spread = weights.new_zeros((*weights.shape[:-1], experts))
            dense.append(spread.scatter_add(-1, indices.long(), weights))
        mixed = list(rests)
        mixed[logits_at] = self._mix(logits, others[logits_at])
        mixed[weights_at] = self._mix(dense[0], dense[1])
        every = torch.arange(experts, device=logits.device, dtype=rests[indices_at].dtype)
        mixed[indices_at] = every.expand(*rests[indices_at].shape[:-1], experts)
        return tuple(mixed)

    def _mix(self, rest: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``lerp(rest, other, weight)``, the weight of each row's position broadcast over the rest."""
        layout = self.layout(rest)
        assert layout is not None  # required: refused otherwise
        first, second = layout.rows(rest), layout.rows(other)
        weight = self._weight.to(first.device).reshape(-1, *([1] * (first.dim() - 1)))
        if first.dtype in (torch.float32, torch.float64):
            mixed = torch.lerp(first, second, weight.to(first.dtype))
        else:
            # Half precision: mix in float32 (the ends stay exact), then cast back.
            mixed = torch.lerp(first.float(), second.float(), weight.float()).to(first.dtype)
        return layout.restore(mixed, grid=layout.pos_dim is not None)

    def per_position(self, name: str, value: torch.Tensor) -> torch.Tensor:
        other = getattr(self.sources[1], name, None)
        if not isinstance(other, torch.Tensor) or other.dim() == 0:
            return value
        if other.dim() > 1 and not self._reads_any_tensor:
            return value  # read for its dtype or shape only (see SourceDispatch)
        # A norm bridge applying its scale and bias itself is affine in them: mixing them
        # per position mixes the outputs.
        batch, length = self.window()
        layout = None if self._reading is None else self.layout(self._reading, required=False)
        shape = position_shape(layout, self._reading, other.shape, batch, length)
        lead = len(shape) - other.dim()
        weight = self._weight.to(other.device, other.dtype)
        return torch.lerp(value, other, weight.reshape(*shape[:lead], *([1] * other.dim())))


def _mixable(a: object, b: object, routing: bool) -> bool:
    """Whether two checkpoints' outputs can be mixed (floating-point tensors of one shape) or are
    the same (a router's expert indices may differ: the two routings are mixed)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
        return a.is_floating_point() or routing or torch.equal(a, b)
    return a is b


@contextmanager
def relaxing(
    models: ModelSet, weights: Mapping[Key, torch.Tensor], *, source: int = 1
) -> Iterator[TransformerBridge]:
    """Run the base with components mixed, per position, toward another checkpoint's.

    Inside the block, every ``(component, layer)`` of ``weights`` computes, at each position
    ``[b, t]``, ``lerp(out, source_out, weights[key][b, t])``: ``out`` what it computes now
    (the base's module, or an enclosing :func:`grafting` block's graft), ``source_out`` what
    checkpoint ``source``'s module computes from the same input. A weight of 0 is the run as
    it is, 1 exactly the graft; the metric's gradient with respect to the weights is the
    attribution of :func:`attribute_grafts`. Hooks work as usual; the base is restored on
    exit, also when the body raises.

    Args:
        models: The aligned checkpoints.
        weights: ``{(component, layer): [batch, pos] floating-point weights}``, one
            shape for every key, on any device (moved to the model's, differentiably).
        source: The checkpoint mixed in (inside a :func:`grafting` block, 0 mixes the
            base's own module back in).

    Raises:
        ComponentError: A component the architecture lacks (at that layer).
        GraftMaskError: A malformed key, or a component a lazily loaded donor was
            declared not to give (``components=`` / ``layers=`` of ``load_models``).
        AttributionError: Weights that are not floating-point ``[batch, pos]`` tensors
            of one shape, a bad ``source``, a nested block, or a run on tokens of
            another shape.

    Examples:
        >>> alpha = torch.zeros(tokens.shape, requires_grad=True)
        >>> with relaxing(models, {("mlp_out", 2): alpha}) as model:
        ...     logits = model(tokens)
        >>> logits[:, -1, answer].sum().backward()  # alpha.grad: [batch, pos]
    """
    check_model_set(models)
    check_source(models, source, allow_base=True)
    checked, shape = _check_weights(models, weights, source)
    if getattr(models.base, _RELAXING, False):
        raise AttributionError(
            "This model set is already inside a relaxing(...) block; relaxations do not "
            "nest.\nPut every component in one weights mapping."
        )

    def dispatch(key: Key, slot: Slot, current: nn.Module, pos_dim: int | None, norm: bool):
        if source == 0:
            # Inside a graft the slot holds its dispatcher, whose source 0 is the base's module.
            switch = current.sources[0] if isinstance(current, Dispatch) else current
        else:
            # As a graft asks for it: a lazily loaded donor reads this slot only, an
            # adapter adds its factors to the base's module; no whole donor is built.
            switch = models.sources[source].module(slot)
        return _MixDispatch(key, slot.path, (current, switch), checked[key], pos_dim, norm)

    with installed(models, list(checked), dispatch, lambda: shape, AttributionError, _RELAXING):
        yield models.base


def _routing(parts: tuple) -> tuple[int, int, int] | None:
    """Where a router's output holds its logits, top-k weights and top-k experts, if it is one:
    the only integer tensor is the experts, the float of its shape their weights."""
    tensors = [(i, part) for i, part in enumerate(parts) if isinstance(part, torch.Tensor)]
    integer = [i for i, part in tensors if not part.is_floating_point()]
    if len(tensors) != 3 or len(integer) != 1:
        return None
    indices_at = integer[0]
    shape = parts[indices_at].shape
    paired = [i for i, part in tensors if i != indices_at and part.shape == shape]
    rest = [i for i, _ in tensors if i != indices_at and i not in paired]
    if len(paired) != 1 or len(rest) != 1 or parts[rest[0]].shape[:-1] != shape[:-1]:
        return None
    return rest[0], paired[0], indices_at


def _check_weights(
    models: ModelSet, weights: object, source: int
) -> tuple[dict[Key, torch.Tensor], tuple[int, int]]:
    """The weights by checked key, and their one ``[batch, pos]``."""
    given = list(weights.items()) if isinstance(weights, Mapping) else []
    shapes = {
        tuple(w.shape)
        if isinstance(w, torch.Tensor) and w.is_floating_point() and w.dim() == 2
        else None
        for _, w in given
    }
    if not given or None in shapes or len(shapes) != 1:
        got = (
            f"several shapes {sorted(map(str, shapes))}"
            if None not in shapes and len(shapes) > 1
            else ", ".join(f"{k}: {_described(w)}" for k, w in given) or f"{weights!r:.80}"
        )
        raise AttributionError(
            "weights must be a non-empty mapping {(component, layer): floating-point "
            f"[batch, pos] tensor}}, one shape for every key; got {got}."
        )
    shape = shapes.pop()
    assert shape is not None
    # The mask builder's checks: known components, present at these layers, each given
    # once, no graft around uncovered parameters (weights of 1 everywhere are that graft).
    everywhere = torch.full(shape, source or 1, dtype=torch.long)
    mask = GraftMask.from_dict(models, {key: everywhere for key, _ in given})
    if source:
        check_declared(models, mask)  # a donor declared for some components only
    return {checked_key(models, k): w for k, w in given}, (int(shape[0]), int(shape[1]))


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {list(value.shape)}"
    return type(value).__name__


def check_source(models: ModelSet, source: object, *, allow_base: bool) -> None:
    """Refuse a checkpoint index the model set lacks (or the base, unless ``allow_base``).

    Raises:
        AttributionError: Not an int, or out of range.
    """
    masks.check_source(models, source, allow_base=allow_base, error=AttributionError)
