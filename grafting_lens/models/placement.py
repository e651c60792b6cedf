"""Placement: where each checkpoint's modules sit, on one device or split across several.

A graft runs a donor's module inside the base's forward pass, on the activation the
base's layer received, so **every donor module must sit where the base module it
stands in for sits**. On one device that is ``load_models(..., device=...)``. A pair
that outgrows one device is split by layers with accelerate's ``device_map``, which
:func:`~grafting_lens.load_models` takes for checkpoints given as paths: the base is
loaded with the map asked for (``"auto"``, ``"balanced"``, a dict, with an optional
``max_memory``), and every donor with the map the base *realised*
(:func:`realised_map`), module for module, so that base and donor modules of one
layer share a device. A lazily loaded donor builds each module on its template's
device, a LoRA donor puts its factors beside the base's weight. The routing of a
graft puts its indices on each activation's device (see
:mod:`grafting_lens.engine.routing`).

Offloading is refused: a map that sends modules to ``"disk"``, or to ``"cpu"`` beside
an accelerator, leaves meta placeholders in the model and loads their weights inside
accelerate's hook at call time; a donor module run in their place would have to do
the same, which nothing here does. A map that puts everything on the CPU places, it
does not offload, and is accepted (that is how the split is tested without GPUs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import torch
from torch import nn

from grafting_lens.core.errors import AlignmentError, GraftingLensError

DeviceMap = Union[str, Mapping[str, Union[str, int, torch.device]]]
"""What ``device_map=`` takes: an accelerate strategy name or ``{module name: device}``."""

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""The strategies accelerate computes a map with."""

_OFFLOAD_FIX = (
    "Give every module an accelerator (cuda:0, cuda:1...) with enough max_memory for the "
    "pair, load a lazily read donor (lazy=True, components=...) to halve the memory, or "
    "put everything on the CPU ({'': 'cpu'})."
)


def check_device_map(device_map: object, max_memory: object, device: object) -> DeviceMap | None:
    """``device_map`` checked before anything loads (an offloading map refused).

    Args:
        device_map: ``None``, an accelerate strategy (:data:`STRATEGIES`) or a dict
            ``{module name: device}`` (``""`` names the whole model).
        max_memory: ``None`` or ``{device: budget}`` for a strategy (``{0: "70GiB"}``).
        device: ``load_models``' ``device=``, which ``device_map`` excludes.

    Returns:
        The map, as given.

    Raises:
        GraftingLensError: A map and a device both given, ``max_memory`` without a
            map or not a dict, a strategy accelerate does not have, a map that is not
            a dict of module names to devices, or one that offloads (``"disk"``, or
            ``"cpu"`` beside an accelerator).
    """
    if max_memory is not None and not isinstance(max_memory, Mapping):
        raise GraftingLensError(
            f"max_memory must be a dict {{device: budget}} such as {{0: '70GiB', 1: '70GiB'}}, "
            f"got {type(max_memory).__name__}."
        )
    if device_map is None:
        if max_memory is not None:
            raise GraftingLensError(
                "max_memory= bounds what device_map= puts on each device, but no device_map "
                "was given. Pass device_map='auto' (or 'balanced') with it."
            )
        return None
    if device is not None:
        raise GraftingLensError(
            f"device={device!r} and device_map= both say where to put the models; pass one "
            "(device= for one device, device_map= to split the layers across several)."
        )
    if isinstance(device_map, str):
        if device_map not in STRATEGIES:
            raise GraftingLensError(
                f"device_map={device_map!r} is not a strategy accelerate has; use one of "
                f"{', '.join(STRATEGIES)}, or a dict {{module name: device}}."
            )
        return device_map
    if not isinstance(device_map, Mapping) or not device_map:
        raise GraftingLensError(
            f"device_map must be a strategy ({', '.join(STRATEGIES)}) or a non-empty dict "
            f"{{module name: device}}, got {device_map!r:.80}."
        )
    for name, target in device_map.items():
        if not isinstance(name, str) or not isinstance(target, (str, int, torch.device)):
            raise GraftingLensError(
                f"device_map entry {name!r}: {target!r} is not a module name mapped to a device "
                "(a name such as 'model.layers.0' to 'cuda:0', 0 or 'cpu')."
            )
    check_offload(device_map.values(), "device_map")
    return device_map


def check_offload(targets: Any, where: str) -> None:
    """Refuse placements that offload: ``"disk"``, or ``"cpu"`` beside an accelerator.

    Raises:
        AlignmentError: Naming the offloaded targets and the fix.
    """
    kinds = {_kind(target) for target in targets}
    offloaded: list[str] = [kind for kind in ("disk", "meta") if kind in kinds]
    if "cpu" in kinds and kinds - {"cpu", "disk", "meta"}:
        # Beside an accelerator, accelerate runs "cpu" modules there, weights fetched per call.
        offloaded.insert(0, "cpu")
    if offloaded:
        raise AlignmentError(
            f"The {where} offloads modules to {' and '.join(offloaded)}: accelerate keeps their "
            "weights there and loads them at call time, and a graft would run donor modules in "
            f"their place without doing so. {_OFFLOAD_FIX}"
        )


def _kind(target: object) -> str:
    """``"cpu"``, ``"disk"``, ``"meta"`` or an accelerator's type (an int is a GPU index)."""
    if isinstance(target, int):
        return "cuda"
    if isinstance(target, torch.device):
        return target.type
    text = str(target).lower()
    if text in ("cpu", "disk", "meta"):
        return text
    try:
        return torch.device(text).type
    except RuntimeError:
        raise GraftingLensError(
            f"{target!r} is not a device; a device_map maps module names to devices such as "
            "'cuda:0', 0 (a GPU index) or 'cpu'."
        ) from None


def realised_map(model: nn.Module) -> dict[str, str | int | torch.device]:
    """Where a loaded model's modules are: its ``hf_device_map``, or its one device.

    transformers records ``hf_device_map`` only when it dispatched a model across
    devices; a model on one device is ``{"": device}``.
    """
    placed = getattr(model, "hf_device_map", None)
    if placed:
        return dict(placed)
    return {"": next(model.parameters()).device}


def check_placed(model: nn.Module, label: str) -> None:
    """Refuse a loaded model whose modules are offloaded (see :func:`check_offload`).

    A model dispatched before :func:`~grafting_lens.load_models` (taken as is) is
    checked here, as is the map a strategy realised.

    Raises:
        AlignmentError: Naming the model, the offloaded targets and the fix.
    """
    placed = getattr(model, "hf_device_map", None)
    if placed:
        check_offload(placed.values(), f"placement of {label}")
    devices = {parameter.device.type for parameter in model.parameters()}
    if "meta" in devices and len(devices) > 1:
        # All on meta is a model moved there, refused with the other sources' devices.
        name = next(name for name, p in model.named_parameters() if p.device.type == "meta")
        raise AlignmentError(
            f"{label}'s {name} has no weights (a meta tensor): the model was offloaded or "
            f"initialised empty, and a graft needs every weight in memory. {_OFFLOAD_FIX}"
        )


def embedding_device(model: nn.Module) -> torch.device:
    """The device token ids go to: the input embedding's (the first parameter's otherwise)."""
    embeddings = getattr(model, "get_input_embeddings", None)
    module = embeddings() if callable(embeddings) else None
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    return next(model.parameters()).device
