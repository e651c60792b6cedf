"""Placement: where each checkpoint's modules sit, on one device or split across several.

A donor module runs where the base module it stands in for sits: the base is loaded with
``device_map=``, every donor with the map the base *realised* (:func:`realised_map`).
Offloading is refused: accelerate fills such modules at call time, and a donor module run in
their place would not be filled. See the how-to "Run on a GPU".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Union

import torch
from torch import nn

from grafting_lens.core import ranks
from grafting_lens.core.errors import AlignmentError, GraftingLensError, kind

Device = Union[str, int, torch.device]
DeviceMap = Union[Device, Mapping[str, Device]]
"""What ``device_map=`` takes: a device, an accelerate strategy or ``{module name: device}``."""

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""The strategies accelerate computes a map with."""

OFFLOADED = ("disk", "meta")
"""Where a module's weights are not in memory."""


def usable_device(device: object, what: str = "device") -> torch.device:
    """``device`` as a torch device this machine can use, or an error saying why not.

    Raises:
        GraftingLensError: torch does not know the device, or has no backend for it here.
    """
    try:
        found = torch.device(device)  # type: ignore[call-overload]
        torch.empty(0, device=found)  # fails here, not halfway through loading
    except (RuntimeError, TypeError, AssertionError) as error:
        strategies = f" nor a strategy ({', '.join(STRATEGIES)})" if what == "device_map" else ""
        raise kind(device, (str, int, torch.device), GraftingLensError)(
            f"{what}={device!r} cannot be used: it is not a device torch can use here"
            f"{strategies} ({str(error).splitlines()[0]}). Use 'cpu', or 'cuda:0' / 'mps' where "
            "torch has that backend (torch.cuda.is_available())."
        ) from None
    return found


def resolve_device_map(
    device: object, device_map: object, max_memory: object
) -> tuple[torch.device | None, str | dict[str, Device] | None]:
    """``device=`` and ``device_map=`` as loading uses them: one device (a map naming one, such
    as ``{"": "cuda:0"}``, included), or a map.

    Returns:
        ``(device, None)``, ``(None, strategy or {module name: device})`` or ``(None, None)``.

    Raises:
        GraftingLensError: Both given, ``max_memory`` without a strategy or not a dict, a
            device this machine cannot use, or a map that offloads.
    """
    problem = None
    if device is not None and device_map is not None:
        problem = "device= and device_map= both say where the models go: pass one"
    elif max_memory is not None and not (
        isinstance(max_memory, Mapping) and isinstance(device_map, str)
    ):
        problem = (
            "max_memory= is a dict {device: budget} such as {0: '70GiB'} that bounds what a "
            "device_map strategy puts on each device: pass it with device_map='auto'"
        )
    if problem:
        raise kind(max_memory, (Mapping, type(None)), GraftingLensError)(f"{problem}.")
    if isinstance(device_map, Mapping) and list(device_map) == [""]:
        device_map = device_map[""]  # the whole model on one device
    if isinstance(device_map, str) and device_map in STRATEGIES:
        return None, device_map
    if isinstance(device_map, (str, int, torch.device)):
        if _kind(device_map) not in OFFLOADED:
            return usable_device(device_map, "device_map"), None
        device_map = {"": device_map}  # refused below
    if device is not None:
        return usable_device(device), None
    if device_map is None:
        return None, None
    if (
        not isinstance(device_map, Mapping)
        or not device_map
        or not all(isinstance(name, str) for name in device_map)
    ):
        raise kind(device_map, Mapping, GraftingLensError)(
            f"device_map must be a device, a strategy ({', '.join(STRATEGIES)}) or a "
            f"non-empty dict {{module name: device}}, got {device_map!r:.80}."
        )
    check_offload(device_map.values(), "device_map")
    for target in {str(target): target for target in device_map.values()}.values():
        usable_device(target, "device_map")
    return None, dict(device_map)


def for_this_rank(
    device: torch.device | None, device_map: str | dict[str, Device] | None
) -> tuple[torch.device | None, str | dict[str, Device] | None]:
    """Under a launcher (:func:`grafting_lens.core.ranks.launched`), where this rank's pair
    goes: its own GPU (``cuda:<local rank>``) unless ``device=`` names one with an index.

    Raises:
        GraftingLensError: A ``device_map=``, which would spread every rank's pair over the
            GPUs the other ranks use.
    """
    share = ranks.launched()
    if share is None:
        return device, device_map
    if device_map is not None:
        raise GraftingLensError(
            f"device_map={device_map!r:.60} splits one pair over several devices, but this "
            f"process is rank {share.rank} of {share.world}, each holding its own pair on its "
            "own GPU: leave device_map out (each rank takes cuda:LOCAL_RANK), or split a pair "
            "too large for one GPU in a single process, without torchrun."
        )
    unindexed = share.device.type == "cuda" if device is None else device == torch.device("cuda")
    return (share.device if unindexed else device), None


def check_offload(targets: Iterable[Any], where: str) -> None:
    """Refuse placements that leave weights out of memory: disk, meta, or CPU beside an accelerator.

    Raises:
        AlignmentError: Naming the offloaded targets and the fix.
    """
    kinds = {_kind(target) for target in targets}
    offloaded = [kind for kind in OFFLOADED if kind in kinds]
    if "cpu" in kinds and kinds - {"cpu", "disk", "meta"}:
        # Beside an accelerator, accelerate runs "cpu" modules there, weights fetched per call.
        offloaded.insert(0, "cpu")
    if offloaded:
        raise AlignmentError(
            f"The {where} offloads modules to {' and '.join(offloaded)}, whose weights a graft "
            "would not fetch. Give every module an accelerator with enough max_memory, load the "
            "donor lazily (lazy=True, components=...), or put everything on the CPU."
        )


def _kind(target: object) -> str:
    """``"disk"``, or the type of the device ``target`` names, there or not (an index: cuda)."""
    if isinstance(target, int) and not isinstance(target, bool):
        return "cuda"
    if isinstance(target, torch.device):
        return target.type
    if str(target).lower() == "disk":
        return "disk"
    try:
        return torch.device(str(target)).type
    except RuntimeError:
        return usable_device(target, "device_map").type  # raises, naming it


def realised_map(model: nn.Module) -> dict[str, Device]:
    """Where a loaded model's modules are: its ``hf_device_map``, or ``{"": its one device}``."""
    placed = getattr(model, "hf_device_map", None)
    return dict(placed) if placed else {"": next(model.parameters()).device}


def check_placed(model: nn.Module, label: str) -> None:
    """Refuse a loaded model whose modules are offloaded, or hold meta tensors.

    Raises:
        AlignmentError: As :func:`check_offload`.
    """
    placed = list((getattr(model, "hf_device_map", None) or {}).values())
    check_offload(placed + [p.device for p in model.parameters()], f"placement of {label}")


def embedding_device(model: nn.Module) -> torch.device:
    """The device token ids go to: the input embedding's (the first parameter's otherwise)."""
    embeddings = getattr(model, "get_input_embeddings", None)
    weight = getattr(embeddings() if callable(embeddings) else None, "weight", None)
    return weight.device if isinstance(weight, torch.Tensor) else next(model.parameters()).device
