"""The relaxed graft: components mixed per position between two checkpoints, differentiably.

A graft switches a component at a position from one checkpoint to another: its output
is either the base's module's or the donor's. The *relaxation* puts a continuous weight
between the two. Inside :func:`relaxing`, every relaxed ``(component, layer)``
computes, at each position ``[b, t]``,

    out = lerp(current_out, source_out, weight[b, t])
        = current_out + weight[b, t] * (source_out - current_out)

where ``current_out`` is what the slot computes in the run as it stands (the base's
module, or the graft of an enclosing :func:`~grafting_lens.engine.graft.grafting` block) and
``source_out`` what the other checkpoint's module computes from the same input.
``torch.lerp`` returns its start at a weight of 0 and its end at 1 to the last bit, so
a weight of 0 is the run as it stands and a weight of 1 is the graft, exactly (up to
the kernel a grafted product runs on: the graft engine computes the donor's rows
alone, here every row). The weights may require gradients: that is how
:func:`~grafting_lens.analysis.attribution.attribute_grafts` gets every cell's effect from one
backward pass.

For a component whose output is affine in its weights (every linear layer, every
norm's scale and bias, an embedding) mixing the outputs is the same as running the
component with interpolated weights, ``W_base + weight * (W_donor - W_base)``; the
tests use that to check the gradient against finite differences of exact grafts of
interpolated checkpoints. A component made of several slots (a mixture-of-experts
shared expert) is mixed slot by slot with one weight, which agrees with the graft at
0 and 1. A mixture-of-experts router chooses experts, which cannot be interpolated; it
is relaxed as a mixture of the two *routings*: every expert gets the mixed weight of
the two routers' top-k weights (zero where a router did not choose it), so the experts'
output is ``lerp(output under one routing, output under the other, weight)``, exact at
0 and 1 (every expert then computes every row where a router is relaxed). Any other
output that is not floating point and differs between the checkpoints is refused with
the module named.

How it is done
--------------
Each slot of each relaxed component (see :mod:`grafting_lens.models.components`) is given a
mixing module through the same public ``set_original_component`` the graft engine
uses. It calls what the slot held (so a relaxation sits on top of a graft) and the
other checkpoint's module on the slot's whole input, finds the positions in each
output with the graft engine's own layouts (``[batch, pos, ...]``, per-head
``[batch, heads, pos, d_head]`` where the bridge declares it, flattened rows), and
mixes. Norm bridges that apply their scale and bias themselves read a mixed scale per
position: a norm's output is affine in them, so that is the same mixture. The
bridge's hooks fire as usual, so ``run_with_cache`` and ``run_with_hooks`` see the
relaxed run, and a hook that edits it changes the gradient. On exit (also after an
exception) the slots are restored.

Examples:
    >>> alpha = torch.zeros(tokens.shape, requires_grad=True)
    >>> with relaxing(models, {("mlp_out", 2): alpha}) as model:
    ...     logits = model(tokens)
    >>> logits[:, -1, answer].sum().backward()  # alpha.grad: [batch, pos]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.model_bridge.generalized_components import NormalizationBridge

from grafting_lens.core.arguments import is_integer
from grafting_lens.core.errors import AttributionError

# The graft engine's own machinery: where positions sit in a module's tensors, how a
# bridge reads per-position parameters, and how a source's module is called.
from grafting_lens.engine.graft import SourceDispatch, check_declared
from grafting_lens.engine.masks import GraftMask, Key
from grafting_lens.engine.routing import (
    Layout,
    call_module,
    declared_layout,
    input_shape,
    position_shape,
)
from grafting_lens.models.model_set import ModelSet

__all__ = ["check_source", "relaxing"]

_RELAXING = "_grafting_lens_relaxing"  # set on the base bridge while a relaxation is installed


class _MixDispatch(nn.Module):
    """Stands in for one slot: what computes it now, mixed per position with another module.

    ``current`` is what the slot held when the relaxation was installed (the base's
    module, or an enclosing graft's dispatcher); ``switch`` is the checkpoint's module
    the relaxation moves toward. Both are called on the slot's whole input, and every
    floating-point output is mixed as ``lerp(current_out, switch_out, weight)`` with the
    weight of each output row's position. Both modules are held in a tuple, not
    registered as submodules, so no donor parameter joins the base's module tree.
    """

    def __init__(
        self,
        key: Key,
        path: str,
        current: nn.Module,
        switch: nn.Module,
        weight: torch.Tensor,
        pos_dim: int | None,
        reads_any_tensor: bool,
    ) -> None:
        super().__init__()
        self._key = key
        self._path = path
        self._pair = (current, switch)
        self._weight = weight
        self._pos_dim = pos_dim
        self._reads_any_tensor = reads_any_tensor
        self._reading: torch.Size | None = None

    def forward(self, *args, **kwargs):
        current, switch = self._pair
        rest = call_module(current, args, kwargs)
        other = call_module(switch, args, kwargs)
        single = not isinstance(rest, tuple)
        rests, others = ((rest,), (other,)) if single else (rest, other)
        if single == isinstance(other, tuple) or len(rests) != len(others):
            raise self._refusal("outputs of different structure from the two checkpoints")
        routing = _routing(rests) if self._key[0] == "router" else None
        if routing is not None:
            return self._mix_routing(rests, others, *routing)
        mixed = []
        for index, (first, second) in enumerate(zip(rests, others)):
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                mixed.append(self._mix(first, second))
            elif first is second or (
                isinstance(first, torch.Tensor)
                and isinstance(second, torch.Tensor)
                and first.shape == second.shape
                and torch.equal(first, second)
            ):
                mixed.append(first)
            else:
                raise self._refusal(
                    f"outputs whose element {index} ({type(first).__name__}) differs between "
                    "the two checkpoints and is not a floating-point tensor, so it cannot be "
                    "mixed"
                )
        return mixed[0] if single else tuple(mixed)

    def _mix_routing(
        self, rests: tuple, others: tuple, logits_at: int, weights_at: int, indices_at: int
    ) -> tuple:
        """Mix two routings of a mixture of experts: each expert gets the mixed weight.

        A router returns ``(logits, top-k weights, top-k experts)``; the experts' output
        is ``sum_e weight_e * expert_e(x)``, linear in the weights. Spreading each
        routing's top-k weights over every expert (zeros elsewhere) and mixing those
        gives ``lerp(experts under one routing, experts under the other, w)``: at 0 and 1
        exactly one routing's output (the other experts add exact zeros), in between a
        mixture of the two, differentiable in ``w``. Every expert then computes every
        row, which costs more than top-k but only where a router is relaxed.
        """
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

    def _mix(self, rest: torch.Tensor, other: object) -> torch.Tensor:
        """``lerp(rest, other, weight)``, the weight of each row's position broadcast over the rest."""
        if not isinstance(other, torch.Tensor) or other.shape != rest.shape:
            raise self._refusal(
                f"an output of shape {list(rest.shape)} from one checkpoint and "
                f"{list(getattr(other, 'shape', []))} from the other"
            )
        batch, length = self._weight.shape
        layout = self._layout(rest.shape, batch, length)
        if layout is None:
            raise self._refusal(
                f"an output of shape {list(rest.shape)} without one row per position of "
                f"[batch={batch}, pos={length}]"
            )
        first, second = layout.rows(rest), layout.rows(other)
        weight = self._weight.to(first.device).reshape(-1, *([1] * (first.dim() - 1)))
        if first.dtype in (torch.float32, torch.float64):
            mixed = torch.lerp(first, second, weight.to(first.dtype))
        else:
            # Half precision: mix in float32 (the ends stay exact), then cast back.
            mixed = torch.lerp(first.float(), second.float(), weight.float()).to(first.dtype)
        return layout.restore(mixed, grid=layout.pos_dim is not None)

    def _refusal(self, cause: str) -> AttributionError:
        component, layer = self._key
        where = component if layer is None else f"{component} at layer {layer}"
        module = type(self._pair[1]).__name__
        return AttributionError(
            f"Cannot relax {where}: {self._path} ({module}) gave {cause}. Attribute the "
            "components around this one instead, and if no hook of yours reshaped its "
            "tensors, please report the architecture."
        )

    def _layout(self, shape: torch.Size, batch: int, length: int) -> Layout | None:
        """Where a tensor's positions are, by the graft engine's rule."""
        return declared_layout(shape, batch, length, self._pos_dim, self._refusal)

    def record_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook on the bridge: remember its input's shape for scale reads."""
        self._reading = input_shape(args, kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        current, switch = self.__dict__["_pair"]
        value = getattr(current, name)
        other = getattr(switch, name, None)
        if not isinstance(value, torch.Tensor) or not isinstance(other, torch.Tensor):
            return value  # configuration (eps, in_features...), shared by aligned sources
        if other.dim() == 0 or (other.dim() > 1 and not self.__dict__["_reads_any_tensor"]):
            return value  # read for its dtype or shape only (see SourceDispatch)
        # A norm bridge applying its scale and bias itself (x * weight + bias): its
        # output is affine in them, so mixing them per position mixes the outputs.
        weight = self.__dict__["_weight"]
        batch, length = weight.shape
        reading = self.__dict__["_reading"]
        layout = None if reading is None else self._layout(reading, batch, length)
        shape = position_shape(layout, reading, other.shape, batch, length)
        lead = len(shape) - other.dim()
        mixing = weight.to(other.device, other.dtype).reshape(*shape[:lead], *([1] * other.dim()))
        return torch.lerp(value, other, mixing)


@contextmanager
def relaxing(
    models: ModelSet, weights: Mapping[Key, torch.Tensor], *, source: int = 1
) -> Iterator[TransformerBridge]:
    """Run the base with components mixed, per position, toward another checkpoint's.

    Inside the block, every ``(component, layer)`` of ``weights`` computes, at each
    position ``[b, t]``, ``lerp(out, source_out, weights[key][b, t])``: ``out`` is what
    it computes now (the base's module, or the graft of an enclosing :func:`grafting`
    block, which this block may sit inside), ``source_out`` what checkpoint ``source``'s
    module computes from the same input. A weight of 0 leaves the run exactly as it
    is, 1 is exactly the graft of ``source`` there. The weights may require gradients:
    the metric's gradient with respect to them is the attribution of
    :func:`attribute_grafts`. Hooks, ``run_with_cache`` and ``run_with_hooks`` work as
    usual. The base is restored on exit, also when the body raises.

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
    if not isinstance(models, ModelSet):
        raise TypeError(
            f"Expected a ModelSet, got {type(models).__name__}. Load the checkpoints with "
            "grafting_lens.load_models(base, donor, ...)."
        )
    check_source(models, source, allow_base=True)
    shape = _check_weights(models, weights, source)
    if getattr(models.base, _RELAXING, False):
        raise AttributionError(
            "This model set is already inside a relaxing(...) block; relaxations do not "
            "nest. Put every component in one weights mapping."
        )
    swapped: list[tuple[Any, nn.Module]] = []
    embed = models.slots("embed", None)[0].holder(models.base)
    handles = [embed.register_forward_pre_hook(lambda module, args: _check_run(shape, args))]
    setattr(models.base, _RELAXING, True)
    try:
        for key, weight in weights.items():
            for slot in models.slots(*key):
                current = slot.module(models.base)
                if source == 0:
                    # Inside a graft the slot holds its dispatcher; the base's module is
                    # the dispatcher's source 0.
                    switch = current._sources[0] if isinstance(current, SourceDispatch) else current
                else:
                    # The source's module for this slot, as a graft asks for it: a lazily
                    # loaded donor reads this slot only, an adapter adds its factors to
                    # the base's module; no whole donor model is built.
                    switch = models.sources[source].module(slot)
                holder = slot.holder(models.base)
                bridged = slot.attribute is None
                pos_dim = getattr(holder.hook_in, "pos_dim", None) if bridged else None
                norm = bridged and isinstance(holder, NormalizationBridge)
                mix = _MixDispatch(key, slot.path, current, switch, weight, pos_dim, norm)
                slot.replace(models.base, mix)
                swapped.append((slot, current))
                if bridged:
                    handles.append(
                        holder.register_forward_pre_hook(mix.record_input, with_kwargs=True)
                    )
        yield models.base
    finally:
        for slot, current in reversed(swapped):
            slot.replace(models.base, current)
        for handle in handles:
            handle.remove()
        setattr(models.base, _RELAXING, False)


def _routing(parts: tuple) -> tuple[int, int, int] | None:
    """Where a router's output holds its logits, top-k weights and top-k experts, if it is one.

    ``(logits [..., experts], weights [..., k], indices [..., k])`` in any order: the only
    integer tensor is the experts, the floating-point tensor of its shape their weights,
    the remaining floating-point tensor the logits.
    """
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


def _check_run(shape: tuple[int, int], args: tuple) -> None:
    """Refuse token ids whose shape is not the weights' ``[batch, pos]``."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].is_floating_point():
        return
    if tuple(args[0].shape[:2]) != shape:
        raise AttributionError(
            f"The relaxed model was run on tokens of shape {list(args[0].shape)}, but the "
            f"weights are [batch, pos] = {list(shape)}. Run it on the tokens the weights "
            "were made for (no generation with a cache: every position at once)."
        )


def _check_weights(models: ModelSet, weights: object, source: int) -> tuple[int, int]:
    if not isinstance(weights, Mapping) or not weights:
        raise AttributionError(
            "weights must be a non-empty mapping {(component, layer): [batch, pos] tensor}, "
            f"got {weights!r:.80}."
        )
    shapes = set()
    for key, weight in weights.items():
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            given = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise AttributionError(
                f"The weights of {key} must be a floating-point [batch, pos] tensor, got {given}."
            )
        if weight.dim() != 2:
            raise AttributionError(
                f"The weights of {key} have shape {list(weight.shape)}; expected [batch, pos]."
            )
        shapes.add(tuple(weight.shape))
    if len(shapes) > 1:
        raise AttributionError(f"The weights have several shapes {sorted(shapes)}; give one.")
    shape = shapes.pop()
    # The mask builder's checks: known components, present at these layers, no graft
    # around uncovered parameters (weights of 1 everywhere are that graft).
    GraftMask.from_dict(models, {key: torch.ones(shape, dtype=torch.long) for key in weights})
    if source:
        # A donor declared to load_models for some components only has no others.
        everywhere = torch.full(shape, source, dtype=torch.long)
        check_declared(models, GraftMask.from_dict(models, dict.fromkeys(weights, everywhere)))
    return (int(shape[0]), int(shape[1]))


def check_source(models: ModelSet, source: object, *, allow_base: bool) -> None:
    """Refuse a checkpoint index the model set lacks (or the base, unless ``allow_base``).

    Raises:
        AttributionError: Not an int, or out of range.
    """
    low = 0 if allow_base else 1
    if not is_integer(source) or not low <= source < len(models):
        raise AttributionError(
            f"source={source!r}, but the donor must be a checkpoint index {low}.."
            f"{len(models) - 1} of the model set"
            + ("" if allow_base else " (source 0 is the base itself)")
            + "."
        )
