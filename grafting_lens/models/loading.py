"""Loading aligned checkpoints as one :class:`~grafting_lens.models.model_set.ModelSet`.

Grafting needs two or more checkpoints of one architecture: index 0 is the
*base* (usually the pretrained model), index 1 the *donor* (usually the
finetuned one), further indices any other checkpoint (the paper's hybrid
experiments use pretrained, task and relation models). Each becomes a
TransformerLens 4.x ``TransformerBridge`` loaded **without weight processing**:
no LayerNorm folding, centering or value-bias folding, because a graft swaps the
checkpoint's own parameters and processed weights are no longer those.

A donor need not be a whole model in memory (see :mod:`grafting_lens.models.sources`): a
LoRA adapter (a PEFT directory or model) is grafted as the base's weights plus its
factors, and with ``lazy=True`` a checkpoint directory is opened without reading its
weights, each component read from disk when a graft first needs it.
:meth:`ModelSet.memory` says what each source holds.

Alignment is checked once, on load: the same architecture, the same shape,
dtype and device for every parameter, the same vocabulary, and the same
configuration of what the models *compute*. A graft runs the donor's modules
inside the base's forward pass, and whatever lives outside the grafted modules
comes from the base: rotary frequencies (``rope_theta``, ``rope_scaling``, the
rotary fraction), attention scaling and softcapping, sliding windows, norm
epsilons, activations. A donor that differs there would be grafted silently
wrong, so the Hugging Face configurations are compared field by field, except
fields that cannot change the forward pass of a causal LM in eval mode
(:data:`IGNORED_CONFIG_FIELDS`: metadata, special token ids, dropout rates,
initialisation, output flags). The buffers the models derive from their
configuration (rotary ``inv_freq``...) must be equal too. Anything else raises
:class:`~grafting_lens.core.errors.AlignmentError` naming the first difference, instead of a
shape mismatch deep inside torch in the middle of a sweep, or a wrong number.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError
from transformer_lens.model_bridge import TransformerBridge
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grafting_lens.core.compat import adapt_bridge
from grafting_lens.core.console import quiet_loading
from grafting_lens.core.errors import (
    AlignmentError,
    GraftingLensError,
    SelectionError,
    unsafe_pickle,
)
from grafting_lens.models.adapters import (
    LoraAdapter,
    is_adapter_directory,
    is_peft_model,
    warn_if_other_base,
)
from grafting_lens.models.alignment import (
    _check_alignment,
    _check_lazy_alignment,
    _check_vocabulary,
)
from grafting_lens.models.architectures import resolve_architecture, warn_if_unverified
from grafting_lens.models.components import (
    ComponentLayout,
    Key,
    Slot,
    checkpoint_modules,
    component_layout,
    expand_components,
)
from grafting_lens.models.layers import LayerSpec, resolve_layers
from grafting_lens.models.lora_source import LoraSource
from grafting_lens.models.model_set import ModelSet
from grafting_lens.models.placement import (
    DeviceMap,
    check_device_map,
    check_placed,
    embedding_device,
    realised_map,
)
from grafting_lens.models.sources import (
    SHARD_INDEXES,
    CheckpointSource,
    LazySource,
    SafetensorsCheckpoint,
    Source,
    shard_files,
)

SourceSpec = Union[str, os.PathLike, PreTrainedModel, TransformerBridge, Any]
"""What :func:`load_models` takes as a source: a hub id, a ``save_pretrained`` directory
(a checkpoint, or a PEFT adapter directory), an HF model, a TransformerBridge, or a PEFT
model."""


def load_models(
    *sources: SourceSpec,
    tokenizer: Any = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    names: Sequence[str] | None = None,
    allow_uncovered: bool = False,
    lazy: bool = False,
    components: str | Iterable[str] | None = None,
    layers: LayerSpec = None,
    device_map: DeviceMap | None = None,
    max_memory: Mapping[str | int, str | int] | None = None,
) -> ModelSet:
    """Load two or more checkpoints of one architecture as an aligned :class:`ModelSet`.

    Args:
        *sources: Base first, then donors. Each is an HF hub id, a local
            ``save_pretrained`` directory, an HF ``PreTrainedModel`` (wrapped in
            place by the bridge) or a ``TransformerBridge`` (used as is; it must
            not have processed weights). A donor may also be a LoRA adapter of the
            base: a PEFT adapter directory (``adapter_config.json`` beside
            ``adapter_model.safetensors``) or a PEFT model object; it is grafted as
            the base's weights plus the adapter's factors, never merged (see
            :mod:`grafting_lens.models.adapters`).
        tokenizer: A tokenizer or a path/hub id to load one from. By default the
            base's own: its directory's tokenizer, or the bridge's.
        device: Where to put every model (default: where they are, CPU for paths).
        device_map: Split checkpoints given as paths across devices by layers with
            accelerate (see :mod:`grafting_lens.models.placement`): a strategy
            (``"auto"``, ``"balanced"``...) or ``{module name: device}``. The base is
            loaded with it, every donor with the map the base realised, so base and
            donor modules of one layer share a device. Maps that offload (``"disk"``,
            or ``"cpu"`` beside an accelerator) are refused. In-memory models are
            taken as placed (dispatch them first, e.g. ``from_pretrained(...,
            device_map=...)``), so they cannot be given with it.
        max_memory: With a strategy, the budget per device (``{0: "70GiB", 1:
            "70GiB"}``), as accelerate takes it; leave room for the donors' share.
        dtype: Cast every model to this floating dtype, a ``torch.dtype`` or its
            name (``"float32"``, ``"bfloat16"``, ``"torch.float16"``); default:
            keep the checkpoint's.
        names: A label per source, used in tables and figures.
        allow_uncovered: Let grafts take every component around parameters that no
            component covers (see :meth:`ModelSet.coverage`), leaving those at the
            base's values. Off by default: such a graft raises
            :class:`~grafting_lens.core.errors.ComponentError`. Every architecture in the
            supported table is covered completely.
        lazy: Open donors given as checkpoint directories (safetensors) without
            reading their weights: a graft reads, memory-mapped, the components its
            mask takes from them, once (see :class:`~grafting_lens.models.sources.LazySource`).
            A lazily loaded donor that runs alone (patching, scoring) is read whole,
            with a :class:`~grafting_lens.core.errors.LazyLoadWarning`. The base is always
            loaded whole.
        components: Declare which components grafts will take from donors: a
            component, a group or a ``+``-joined list (``"o+ffn"``), as masks name
            them. A graft taking another component from a donor raises
            :class:`~grafting_lens.core.errors.GraftMaskError`; a lazily loaded donor then never
            reads more than the declaration (:meth:`ModelSet.memory` says how much),
            and cannot run alone. Default: every component.
        layers: Declare at which layers (any layer specification of
            :func:`~grafting_lens.resolve_layers`, e.g. ``"last_half"``); global
            components (``embed``, ``unembed``...) are not limited by it. Default:
            every layer.

    Returns:
        The model set, index 0 the base.

    Raises:
        AlignmentError: Fewer than two sources, or sources that differ in
            architecture, configuration (any field that changes the forward
            pass, see :data:`IGNORED_CONFIG_FIELDS`), parameter shapes, dtypes or
            devices, buffers or vocabulary; a base that is an adapter or holds PEFT
            layers.
        AdapterError: An adapter made for another base (a module the base lacks, a
            shape that differs), of a kind grafting-lens does not compute (other
            methods, LoRA variants, initialisations that rewrite the base's weights),
            or whose files cannot be read or disagree (each named, with the fix).
        GraftingLensError: A path that is neither a checkpoint directory nor
            loadable from the hub, an unreadable checkpoint file, a ``tokenizer=``
            path that does not exist or holds no tokenizer, a base without a
            tokenizer of its own when none is given, weights missing, extra or of another
            shape than the config's model, a device or
            dtype torch does not have, or ``lazy=True`` for a donor that is not a
            directory of safetensors files.
        ComponentError: ``components`` names a component the architecture lacks.
        SelectionError: ``layers`` selects no layer of the model.
        UnsupportedArchitectureError: A model TransformerLens cannot bridge (the
            message names the nearest supported architectures).

    Warns:
        UserWarning: An architecture TransformerLens bridges but grafting-lens has
            not verified (see the supported-architectures page); an adapter whose
            config names another base than this one (its shapes match).

    Loading is quiet: transformers' per-checkpoint loading bars and info messages are
    held back (see :func:`grafting_lens.core.console.quiet_loading`). Its warnings do not
    show either (TransformerLens sets transformers' logger to ERROR on import), so the
    one that matters is checked here: a checkpoint directory or hub id whose weights
    are missing, extra or of another shape than its config's model raises
    :class:`~grafting_lens.GraftingLensError` instead of loading with random values.

    Examples:
        >>> models = load_models("out/pretrained", "out/finetuned")
        >>> models.weight_diff().sort_values("relative_change").tail()
        >>> lora = load_models("meta-llama/Llama-3.1-8B", "out/my-lora-adapter")
        >>> big = load_models("base_dir", "donor_dir", lazy=True, components="o+ffn",
        ...                   layers="last_half")
        >>> big.memory()
    """
    if len(sources) < 2:
        raise AlignmentError(
            f"Grafting needs at least two checkpoints (a base and a donor), got {len(sources)}."
        )
    if names is not None and len(names) != len(sources):
        raise GraftingLensError(f"Got {len(names)} names for {len(sources)} sources.")
    if not isinstance(lazy, bool):
        raise TypeError(f"lazy must be True or False, got {type(lazy).__name__}.")
    device, dtype = resolve_placement(device, dtype)
    device_map = check_device_map(device_map, max_memory, device)
    if device_map is not None:
        for index, source in enumerate(sources):
            if not isinstance(source, (str, os.PathLike)):
                raise GraftingLensError(
                    f"device_map= places checkpoints given as paths, but source {index} is an "
                    f"in-memory {type(source).__name__}, which load_models takes as placed. "
                    "Give every source as a path, or dispatch the models yourself "
                    "(AutoModelForCausalLM.from_pretrained(..., device_map=...)) and pass "
                    "them without device_map=."
                )
    seen: dict[int, int] = {}
    for index, source in enumerate(sources):
        if isinstance(source, (PreTrainedModel, TransformerBridge)) or is_peft_model(source):
            if id(source) in seen:
                raise AlignmentError(
                    f"Sources {seen[id(source)]} and {index} are the same model object; grafting "
                    "needs distinct models (pass copy.deepcopy(model) to graft a model into itself)."
                )
            seen[id(source)] = index
    if is_peft_model(sources[0]) or (
        isinstance(sources[0], (str, os.PathLike)) and is_adapter_directory(sources[0])
    ):
        raise AlignmentError(
            "Source 0 is a LoRA adapter, but source 0 is the base: every grafted run goes "
            "through its forward pass. Pass the model the adapter was trained on first, "
            "then the adapter: load_models(base, adapter)."
        )
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        if not hasattr(tokenizer, "get_vocab"):
            raise TypeError(
                f"tokenizer must be a Hugging Face tokenizer or a path/hub id to load one from, "
                f"got {type(tokenizer).__name__}."
            )
    # transformers draws a "Loading weights" bar per checkpoint; a model set is loaded often.
    with quiet_loading():
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = _tokenizer_from(tokenizer)
        placing = None if device_map is None else (device_map, max_memory)
        base, base_label = _to_bridge(
            sources[0], 0, tokenizer, tokenizer, device, dtype, placing=placing
        )
        # Every donor module goes where the base module it stands in for went.
        donor_placing = None if device_map is None else (realised_map(base.original_model), None)
        labels = [names[0] if names is not None else base_label]
        base_name = str(getattr(base.original_model.config, "_name_or_path", "") or "")
        layout = component_layout(base)
        graftable = _declared_pairs(base, layout, components, layers)
        declared = (
            None
            if graftable is None
            else [slot for key in sorted(graftable, key=str) for slot in layout.slots[key]]
        )
        slots = [slot for key_slots in layout.slots.values() for slot in key_slots]
        loaded: list[Source] = [CheckpointSource(base, labels[0], _disk_bytes(sources[0]))]
        fallback = tokenizer if tokenizer is not None else base.tokenizer
        for index, source in enumerate(sources[1:], start=1):
            label = _label(source, index)
            name = names[index] if names is not None else label
            if is_peft_model(source) or (
                isinstance(source, (str, os.PathLike)) and is_adapter_directory(source)
            ):
                if is_peft_model(source):
                    adapter = LoraAdapter.from_peft_model(source)
                else:
                    path = Path(source).expanduser()  # type: ignore[arg-type]
                    adapter = LoraAdapter.from_directory(path)
                    if tokenizer is None:
                        _check_vocabulary(
                            base.tokenizer, _load_tokenizer(str(path), fallback), name
                        )
                warn_if_other_base(adapter, base_name)
                loaded.append(
                    LoraSource(name, adapter, base, slots, make_bridge=lambda: _shared_bridge(base))
                )
            elif lazy and not isinstance(source, (PreTrainedModel, TransformerBridge)):
                loaded.append(
                    _lazy_source(
                        source,
                        index,
                        name,
                        base,
                        labels[0],
                        slots,
                        declared,
                        tokenizer,
                        fallback,
                        dtype,
                    )
                )
            else:
                # A directory brings its own tokenizer, so the vocabulary check compares
                # what each checkpoint was trained with; in-memory models borrow the base's.
                bridge, _ = _to_bridge(
                    source, index, tokenizer, fallback, device, dtype, placing=donor_placing
                )
                _check_alignment(base, bridge, labels[0], name, index)
                loaded.append(CheckpointSource(bridge, name, _disk_bytes(source)))
            labels.append(name)
    models = ModelSet(loaded, labels, allow_uncovered=allow_uncovered, graftable=graftable)
    warn_if_unverified(models.architecture)
    return models


def _label(source: SourceSpec, index: int) -> str:
    """A source's default label: a directory's name, a hub id, or ``source{index}``."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        return path.name if path.is_dir() else str(source)
    return f"source{index}"


def _disk_bytes(source: SourceSpec) -> int | None:
    """Bytes of the weight files of a checkpoint directory (None for anything else)."""
    if not isinstance(source, (str, os.PathLike)) or not Path(source).expanduser().is_dir():
        return None
    files = Path(source).expanduser().glob("*")
    return sum(f.stat().st_size for f in files if f.suffix in (".safetensors", ".bin"))


def _declared_pairs(
    base: TransformerBridge,
    layout: ComponentLayout,
    components: str | Iterable[str] | None,
    layers: LayerSpec,
) -> frozenset[Key] | None:
    """The pairs ``components=`` / ``layers=`` declare, or None when neither is given."""
    if components is None and layers is None:
        return None
    architecture = str(getattr(base.cfg, "architecture", type(base.original_model).__name__))
    chosen = set(
        expand_components(
            "all" if components is None else components, layout.components, architecture
        )
    )
    at = set(resolve_layers(layers, int(base.cfg.n_layers)))
    pairs = frozenset(
        (component, layer)
        for component, layer in layout.slots
        if component in chosen and (layer is None or layer in at)
    )
    if not pairs:
        raise SelectionError(
            f"components={components!r} at layers={layers!r} declares nothing this "
            f"{architecture} has; declare components it has at those layers."
        )
    return pairs


def _lazy_source(
    source: SourceSpec,
    index: int,
    name: str,
    base: TransformerBridge,
    base_name: str,
    slots: list[Slot],
    declared: list[Slot] | None,
    tokenizer: Any,
    fallback: Any,
    dtype: torch.dtype | None,
) -> LazySource:
    """Open a checkpoint directory without reading its weights, checked against the base."""
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"Source {index} is a {type(source).__name__}; expected a hub id, a directory, a "
            "transformers PreTrainedModel, a TransformerBridge or a PEFT model."
        )
    path = Path(source).expanduser()
    if not path.is_dir():
        raise GraftingLensError(
            f"lazy=True reads donors from checkpoint directories, but source {index} "
            f"({str(source)!r}) is not a directory. Download it first "
            "(huggingface_hub.snapshot_download(repo_id) returns the directory), or load "
            "it whole (lazy=False)."
        )
    if not (path / "config.json").is_file():
        _load_checkpoint(str(source), path, index)  # raises, naming what the directory holds
    files = SafetensorsCheckpoint(path, base.original_model)
    config = AutoConfig.from_pretrained(str(path))
    label = f"source {index} ({name})"
    _check_lazy_alignment(base, files, config, label, dtype)
    if tokenizer is None:  # a directory's own tokenizer, as for a donor loaded whole
        _check_vocabulary(base.tokenizer, _load_tokenizer(str(path), fallback), label)
    # Read whole (to run alone), the donor goes where the base is, module for module.
    split = getattr(base.original_model, "hf_device_map", None)
    placing = (realised_map(base.original_model), None) if split else None
    device = None if split else next(base.original_model.parameters()).device

    def load_whole() -> TransformerBridge:
        bridge, _ = _to_bridge(source, index, tokenizer, fallback, device, dtype, placing=placing)
        _check_alignment(base, bridge, base_name, name, index)
        return bridge

    return LazySource(
        name, files, base, slots, dtype=dtype, declared=declared, load_whole=load_whole
    )


def _shared_bridge(base: TransformerBridge) -> TransformerBridge:
    """A second bridge over the base's own tensors (an adapter runs alone in it).

    A skeleton of the base's class is built without allocating weights, then holds
    the base's parameters and buffers themselves, so it costs the modules, not the
    weights.
    """
    original = base.original_model
    assert isinstance(original, PreTrainedModel)
    with init_empty_weights():
        skeleton = type(original)._from_config(original.config)
    tensors = {
        prefix + name: tensor
        for prefix, module in checkpoint_modules(original)
        for table in (module._parameters, module._buffers)
        for name, tensor in table.items()
        if tensor is not None
    }
    for table in ("_parameters", "_buffers"):
        named = (
            skeleton.named_parameters(remove_duplicate=False)
            if table == "_parameters"
            else skeleton.named_buffers(remove_duplicate=False)
        )
        for name, _ in list(named):
            owner, _, attribute = name.rpartition(".")
            if name not in tensors:
                raise GraftingLensError(
                    f"Cannot run the adapter alone: the base has no {name!r} to share. Merge "
                    "the adapter into a full checkpoint to run it alone."
                )
            getattr(skeleton.get_submodule(owner), table)[attribute] = tensors[name]
    skeleton.eval()
    _mirror_dispatch(original, skeleton)
    parameter = next(original.parameters())
    return adapt_bridge(
        TransformerBridge.boot_transformers(
            str(getattr(base.cfg, "model_name", "") or "base"),
            hf_model=skeleton,
            tokenizer=base.tokenizer,
            device=str(embedding_device(skeleton)),
            dtype=parameter.dtype,
        )
    )


def _mirror_dispatch(original: PreTrainedModel, skeleton: PreTrainedModel) -> None:
    """Give the skeleton the base's accelerate hooks, module for module.

    A base dispatched across devices (``device_map``) moves each block's inputs to the
    block's device with accelerate's hooks; the skeleton holds the same tensors, so it
    needs the same moves, or an adapter running alone on a layer-split base would meet
    activations on another device than its weights. A base on one device has none.
    """
    from accelerate.hooks import add_hook_to_module

    for prefix, module in checkpoint_modules(original):  # the HF modules the bridge wraps
        hook = getattr(module, "_hf_hook", None)
        if hook is not None:  # a copy: a hook keeps per-call state (the input's device)
            add_hook_to_module(skeleton.get_submodule(prefix.rstrip(".")), copy.copy(hook))
    placed = getattr(original, "hf_device_map", None)
    if placed:
        skeleton.__dict__["hf_device_map"] = dict(placed)  # what the bridge reads


def _to_bridge(
    source: SourceSpec,
    index: int,
    tokenizer: Any,
    fallback: Any,
    device: Any,
    dtype: torch.dtype | None,
    *,
    placing: tuple[DeviceMap, Any] | None = None,
) -> tuple[TransformerBridge, str]:
    if isinstance(source, TransformerBridge):
        if getattr(source, "_weights_processed", False):
            raise AlignmentError(
                f"Source {index} is a TransformerBridge with processed weights (folded LayerNorm, "
                "centered weights): a graft must swap the checkpoint's own parameters. Load it "
                "again without calling process_weights() or enable_compatibility_mode()."
            )
        check_placed(source.original_model, f"source {index}")
        if device is not None or dtype is not None:
            source.to(device=device, dtype=dtype, print_details=False)  # TransformerLens prints
        return adapt_bridge(source), f"source{index}"
    if isinstance(source, PreTrainedModel):
        if any(type(module).__module__.startswith("peft.") for module in source.modules()):
            raise AlignmentError(
                f"Source {index} holds PEFT layers (get_peft_model and PeftModel.from_pretrained "
                "add them to the model in place), so it does not compute the checkpoint alone. "
                "Pass the model without them (a fresh load, or peft_model.unload()), and the "
                "adapter as a donor: load_models(base, adapter_dir_or_peft_model)."
            )
        if any("_original_component" in name for name, _ in source.named_modules()):
            raise GraftingLensError(
                f"Source {index} is a model that a TransformerBridge already wraps (load_models "
                "wraps in-memory models in place). Pass the bridge from the earlier ModelSet "
                "(models[i]) instead, or a fresh copy of the model (copy.deepcopy before the "
                "first load_models)."
            )
        model, label = source, f"source{index}"
        model_name = getattr(model.config, "_name_or_path", "") or label
    elif isinstance(source, (str, os.PathLike)):
        label = str(source)
        model_name = label
        path = Path(source).expanduser()
        model = _load_checkpoint(label, path, index, placing=placing, dtype=dtype)
        if path.is_dir():
            label = path.name
        if tokenizer is None:
            tokenizer = _load_tokenizer(str(path) if path.is_dir() else model_name, fallback)
    else:
        raise TypeError(
            f"Source {index} is a {type(source).__name__}; expected a hub id, a directory, a "
            "transformers PreTrainedModel, a TransformerBridge or (for a donor) a PEFT model."
        )
    tokenizer = tokenizer if tokenizer is not None else fallback
    if tokenizer is None:
        raise GraftingLensError(
            f"Source {index} is an in-memory model without a tokenizer: pass tokenizer=... to "
            "load_models."
        )
    resolve_architecture(model, index)
    check_placed(model, f"source {index} ({label})")
    model.eval()
    if placing is None and (device is not None or dtype is not None):
        # transformers wraps PreTrainedModel.to in a decorator mypy reads as unbound.
        model.to(device=device, dtype=dtype)  # type: ignore[call-arg]
    parameter = next(model.parameters())
    # A dispatched model is taken as is: the bridge reads its hf_device_map, and token
    # ids go to the embedding's device.
    bridge = TransformerBridge.boot_transformers(
        model_name,
        hf_model=model,
        tokenizer=_prepare_tokenizer(tokenizer, model_name),
        device=str(embedding_device(model)),
        dtype=parameter.dtype,
    )
    return adapt_bridge(bridge), label


def _accelerate_map(device_map: DeviceMap) -> Any:
    """A map as accelerate takes it: a strategy, or devices as strings or GPU indices."""
    if isinstance(device_map, str):
        return device_map
    return {
        name: str(target) if isinstance(target, torch.device) else target
        for name, target in device_map.items()
    }


def resolve_placement(
    device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
) -> tuple[torch.device | None, torch.dtype | None]:
    """``device`` and ``dtype`` as torch objects, checked before anything is loaded.

    :func:`load_models` calls it; a command line calls it first so that a typo
    fails before minutes of loading or building.

    Args:
        device: A device torch can use here (``"cpu"``, ``"cuda:0"``...), or ``None``.
        dtype: A floating ``torch.dtype`` or its name (``"bfloat16"``,
            ``"torch.float16"``), or ``None``.

    Raises:
        GraftingLensError: A device torch does not know or has no backend for
            here, or a dtype that is not a floating torch dtype.
        TypeError: A dtype that is neither a torch dtype nor a string.
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        candidate = getattr(torch, name, None)
        if not isinstance(candidate, torch.dtype):
            raise GraftingLensError(
                f"dtype={dtype!r} is not a torch dtype; use torch.float32, torch.bfloat16 or "
                "torch.float16 (or their names, e.g. 'bfloat16')."
            )
        dtype = candidate
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or its name, got {type(dtype).__name__}.")
        if not dtype.is_floating_point:
            raise GraftingLensError(
                f"dtype={dtype} is not a floating dtype; model weights need torch.float32, "
                "torch.bfloat16 or torch.float16."
            )
    if device is not None:
        try:
            device = torch.device(device)
            torch.empty(0, device=device)  # fails here, not halfway through loading
        except (RuntimeError, TypeError, AssertionError) as error:
            raise GraftingLensError(
                f"device={device!r} cannot be used: {str(error).splitlines()[0]} Use 'cpu', or "
                "'cuda' / 'cuda:0' / 'mps' where torch has that backend (torch.cuda.is_available())."
            ) from None
    return device, dtype


def _load_checkpoint(
    label: str,
    path: Path,
    index: int,
    *,
    placing: tuple[DeviceMap, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """An HF causal LM from a directory or hub id, or an error naming what is wrong.

    With ``placing`` (a device map and a memory budget) accelerate dispatches it as it
    loads, in ``dtype``; without, it loads on the CPU in the checkpoint's dtype.
    """
    if path.is_dir():
        if not (path / "config.json").is_file():
            contents = sorted(child.name for child in path.iterdir())[:8]
            raise GraftingLensError(
                f"Source {index} ({label!r}) is a directory without a config.json, so it is not "
                f"a checkpoint (it holds {contents or 'nothing'}). Point to the directory "
                "save_pretrained wrote (config.json next to the weights)."
            )
        for index_name in SHARD_INDEXES:
            if (path / index_name).is_file():
                shard_files(path, index_name)  # every shard inside the checkpoint
        target = str(path)
    else:
        hub_id_form = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", label) is not None
        if path.exists() or not hub_id_form:
            raise GraftingLensError(
                f"Source {index} ({label!r}) is not a directory"
                + (" (it is a file)" if path.exists() else " (no such path)")
                + ". Give the directory save_pretrained wrote, or a hub id such as "
                "'EleutherAI/pythia-160m'."
            )
        target = label
    try:
        # The loading report is read here, not logged: TransformerLens sets transformers'
        # logger to ERROR on import, which hides it. Mismatched shapes are reported in it
        # too, instead of a RuntimeError that points at the hidden report.
        # With output_loading_info, transformers returns (model, info); its stubs say a model.
        options: dict[str, Any] = {}
        if placing is not None:
            options["device_map"] = _accelerate_map(placing[0])
            if placing[1] is not None:
                options["max_memory"] = dict(placing[1])
            if dtype is not None:
                options["dtype"] = dtype
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            target, output_loading_info=True, ignore_mismatched_sizes=True, **options
        )
        model, info = loaded
    except (OSError, ValueError) as error:
        where = "directory" if path.is_dir() else "hub id"
        raise GraftingLensError(
            f"Could not load source {index} ({label!r}) as a {where}: {str(error).rstrip('.')}. A local "
            "checkpoint is a directory written by save_pretrained; a hub id needs a network "
            "connection or a filled HF cache (HF_HUB_OFFLINE=1 forbids downloads)."
        ) from error
    except (SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        if isinstance(error, pickle.UnpicklingError) and "weights only" in str(error).lower():
            raise GraftingLensError(
                unsafe_pickle(f"A weight file of source {index} ({label!r})")
            ) from None
        # A damaged weight file (truncated download, interrupted save) fails inside
        # safetensors or torch with a message that names no file.
        files = (
            sorted(
                child.name for child in path.glob("*") if child.suffix in (".safetensors", ".bin")
            )
            if path.is_dir()
            else []
        )
        raise GraftingLensError(
            f"Could not read the weights of source {index} ({label!r}"
            + (f": {', '.join(files)}" if files else "")
            + f"): {type(error).__name__}: {error}. The file is probably truncated or damaged "
            "(an interrupted download or save): save or download the checkpoint again."
        ) from error
    _check_loading_info(info, label, index)
    assert isinstance(model, PreTrainedModel)
    return model


def _check_loading_info(info: Any, label: str, index: int) -> None:
    """Refuse a checkpoint whose weights are not the model's: missing, extra, other shapes.

    transformers fills a weight the checkpoint lacks (or holds in another shape) with
    random values and reports it in a log that TransformerLens silences; a graft from
    such a model would be silently wrong. Weights transformers ties (the unembedding of
    GPT-2 or Gemma) and those its model classes expect to lack or ignore (old buffers)
    are not in the report.

    Raises:
        GraftingLensError: Naming the weights and the fix.
    """

    def first(names: list[str]) -> str:
        shown = ", ".join(names[:3])
        return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    def entries(name: str) -> Any:  # a dict in transformers 5, fields of an object in others
        found = info.get(name) if isinstance(info, dict) else getattr(info, name, None)
        return found or ()

    missing = sorted(str(key) for key in entries("missing_keys"))
    unexpected = sorted(str(key) for key in entries("unexpected_keys"))
    mismatched = sorted(
        (
            f"{entry[0]} ({tuple(entry[1])} in the checkpoint, {tuple(entry[2])} in the model)"
            if isinstance(entry, tuple) and len(entry) == 3
            else str(entry)
        )
        for entry in entries("mismatched_keys")
    )
    problems = []
    if missing:
        problems.append(
            f"it lacks {len(missing)} weight(s) of the model ({first(missing)}), which "
            "transformers filled with random values"
        )
    if mismatched:
        problems.append(
            f"it holds {len(mismatched)} weight(s) in another shape than the model's "
            f"({first(mismatched)}), which transformers filled with random values"
        )
    if unexpected:
        problems.append(
            f"it holds {len(unexpected)} weight(s) the model does not have ({first(unexpected)})"
        )
    if problems:
        raise GraftingLensError(
            f"Source {index} ({label!r}) does not hold the weights of the model its config "
            f"describes: {'; '.join(problems)}. A model loaded from it would not be the "
            "checkpoint, and every graft from it would be wrong. The checkpoint is incomplete "
            "(an interrupted save or download) or its config.json belongs to another model: "
            "save or download it again, or load it with the config it was saved with."
        )


def _load_tokenizer(name: str, fallback: Any) -> Any:
    """The tokenizer saved with a checkpoint, or ``fallback`` when it has none."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):
        tokenizer = None
    if tokenizer is None or _only_special_tokens(tokenizer):
        if fallback is None:
            raise GraftingLensError(
                f"{name!r} has no tokenizer and none was given: pass tokenizer=... to load_models "
                "(a tokenizer, or the directory or hub id of the one the checkpoint was "
                "trained with)."
            )
        return fallback
    return _prepare_tokenizer(tokenizer, name)


def _tokenizer_from(name: str | os.PathLike) -> Any:
    """The tokenizer ``tokenizer=`` names (a directory or a hub id), or an error saying why not."""
    label = str(name)
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir():
        raise GraftingLensError(
            f"tokenizer={label!r} is a file; give the directory a tokenizer was saved in "
            "(tokenizer.save_pretrained(directory) writes tokenizer.json and its config there), "
            "or a hub id such as 'gpt2'."
        )
    if not path.exists() and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", label) is None:
        raise GraftingLensError(
            f"tokenizer={label!r} does not exist (no such path, and not a hub id). Give the "
            "directory a tokenizer was saved in, or a hub id such as 'gpt2'."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else label)
    except (OSError, ValueError) as error:
        where = "the directory" if path.is_dir() else "the hub id"
        reason = " ".join(str(error).split())[:200]
        raise GraftingLensError(
            f"tokenizer={label!r}: no tokenizer could be loaded from {where} ({reason}). Give "
            "the directory tokenizer.save_pretrained wrote (tokenizer.json and its config), or "
            "a hub id that is reachable (HF_HUB_OFFLINE=1 needs it in the local HF cache)."
        ) from None
    if _only_special_tokens(tokenizer):
        # transformers builds a tokenizer from a config.json alone, with nothing but its
        # special tokens: every text would tokenize to unknown or nothing.
        raise GraftingLensError(
            f"tokenizer={label!r} holds no tokenizer: no vocabulary files were found there, "
            f"so the tokenizer transformers made knows only its {len(tokenizer.get_vocab())} "
            "special token(s). Give the directory tokenizer.save_pretrained wrote (tokenizer.json "
            "and its config), or a hub id such as 'gpt2'."
        )
    return _prepare_tokenizer(tokenizer, label)


def _only_special_tokens(tokenizer: Any) -> bool:
    """Whether a tokenizer's vocabulary is its special and added tokens alone (an empty one)."""
    try:
        vocabulary = set(tokenizer.get_vocab())
    except (AttributeError, NotImplementedError, TypeError):
        return False  # cannot tell: leave it to the vocabulary check against the base
    special = set(getattr(tokenizer, "all_special_tokens", None) or ())
    added = set(getattr(tokenizer, "added_tokens_encoder", None) or ())
    return not vocabulary - special - added


def _prepare_tokenizer(tokenizer: Any, name: str) -> Any:
    """Work around TransformerLens 4.3's handling of in-memory tokenizers.

    The bridge reads ``init_kwargs["name_or_path"]`` and ``init_kwargs["add_bos_token"]``;
    without them it fails, or looks the tokenizer up on the hub.
    """
    init_kwargs = getattr(tokenizer, "init_kwargs", None)
    if init_kwargs is not None:
        if not init_kwargs.get("name_or_path"):
            init_kwargs["name_or_path"] = getattr(tokenizer, "name_or_path", "") or name
        init_kwargs.setdefault("add_bos_token", True)
    return tokenizer
