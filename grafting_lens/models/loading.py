"""Loading aligned checkpoints as one :class:`~grafting_lens.models.model_set.ModelSet`: each a
``TransformerBridge`` **without weight processing** (a graft swaps the checkpoint's own
parameters), or a source a graft reads modules from (a LoRA adapter, a directory read lazily).
What the caller gives is never changed: the how-to "Load your own checkpoints".
"""

from __future__ import annotations

import copy
import os
import pickle
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import torch
from accelerate import init_empty_weights
from huggingface_hub.constants import is_offline_mode
from safetensors import SafetensorError
from transformer_lens.model_bridge import TransformerBridge
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grafting_lens.core.console import quiet_loading
from grafting_lens.core.errors import (
    AlignmentError,
    ArgumentTypeError,
    GraftingLensError,
    SelectionError,
    kind,
    unsafe_pickle,
)
from grafting_lens.models.adapters import (
    LoraAdapter,
    is_adapter_directory,
    is_peft_model,
    warn_if_other_base,
)
from grafting_lens.models.alignment import check_alignment, check_lazy_alignment, check_vocabulary
from grafting_lens.models.architectures import resolve_architecture, warn_if_unverified
from grafting_lens.models.checkpoint_files import SHARD_INDEXES, SafetensorsCheckpoint, shard_files
from grafting_lens.models.components import (
    ComponentLayout,
    Key,
    Slot,
    component_layout,
    expand_components,
)
from grafting_lens.models.gguf_checkpoint import (
    CHECKPOINT_FIX,
    checkpoint_problem,
    converted_checkpoint,
    is_gguf,
)
from grafting_lens.models.layers import LayerSpec, resolve_layers
from grafting_lens.models.lora_source import LoraSource
from grafting_lens.models.model_set import ModelSet, check_names
from grafting_lens.models.placement import (
    DeviceMap,
    check_placed,
    for_this_rank,
    realised_map,
    resolve_device_map,
    usable_device,
)
from grafting_lens.models.sources import (
    CheckpointSource,
    LazySource,
    Source,
    _boot_bridge,
    model_copy,
    shared_bridge,
)

SourceSpec = Union[str, os.PathLike, PreTrainedModel, TransformerBridge, Any]
"""A hub id, a ``save_pretrained`` directory (or a PEFT adapter's), a GGUF file, an HF, bridge or
PEFT model."""


def load_models(
    *sources: SourceSpec,
    tokenizer: Any = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    names: Sequence[str] | None = None,
    allow_uncovered: bool = False,
    lazy: bool | Literal["verify"] = False,
    components: str | Iterable[str] | None = None,
    layers: LayerSpec = None,
    device_map: DeviceMap | None = None,
    max_memory: Mapping[str | int, str | int] | None = None,
) -> ModelSet:
    """Load two or more checkpoints of one architecture as an aligned :class:`ModelSet`.

    Nothing given is changed: models, bridges and tokenizers passed in memory are copied
    (modules and config; the copies share your weight tensors, so an in-place edit of your
    model's weights shows in the set). See the how-to "Load your own checkpoints".

    Args:
        *sources: Base first, then donors: hub ids, ``save_pretrained`` directories, GGUF
            files (:func:`~grafting_lens.models.gguf_checkpoint.converted_checkpoint`), HF
            models or TransformerBridges (weights unprocessed), or a LoRA adapter of the base
            (a PEFT directory or model), grafted unmerged.
        tokenizer: A tokenizer, or where to load one. Default: each directory's own, the
            base's for in-memory donors.
        device: One device for every source. Default: where models are, the CPU for paths.
        device_map: What ``from_pretrained`` takes: a device, an accelerate strategy
            (``"auto"``...) or ``{module name: device}`` (for paths); donors follow the
            base's. Offloading maps are refused.
        max_memory: With a strategy, the budget per device (``{0: "70GiB"}``).
        dtype: Load every source in this floating dtype (or its name), as
            ``from_pretrained(dtype=...)`` does. Default: each checkpoint's.
        names: A label per source, for tables and figures.
        allow_uncovered: Let grafts take every component around parameters no component
            covers (see :meth:`ModelSet.coverage`).
        lazy: ``True`` opens donor directories of safetensors unread: a graft reads the
            components it takes. ``"verify"`` also hashes every tensor, checked at each read.
        components: Declare the components grafts take from donors (``"o+ffn"``).
        layers: Declare the layers, as :func:`~grafting_lens.resolve_layers` takes them.

    Raises:
        AlignmentError: Sources that cannot be grafted together (``AdapterError``: an
            adapter), or a source this cannot take.
        GraftingLensError: An argument or a checkpoint that cannot be used.
        ComponentError, SelectionError: A declaration of what the model lacks.
        UnsupportedArchitectureError: An architecture TransformerLens cannot bridge.

    Examples:
        >>> models = load_models("out/pretrained", "out/finetuned")
        >>> lora = load_models("meta-llama/Llama-3.1-8B", "out/my-lora-adapter")
        >>> big = load_models("base", "donor", lazy=True, components="o+ffn", layers="last_half")
    """
    if len(sources) < 2:
        raise AlignmentError(
            f"load_models needs at least two sources (a base and a donor), got {len(sources)}."
        )
    if names is not None:
        names = check_names(names, len(sources))
    if not (isinstance(lazy, bool) or (isinstance(lazy, str) and lazy == "verify")):
        raise kind(lazy, str, GraftingLensError)(
            f"lazy must be True, False or 'verify', got {lazy!r}."
        )
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        if not hasattr(tokenizer, "get_vocab"):
            raise ArgumentTypeError(
                "tokenizer must be a Hugging Face tokenizer or a path/hub id to load one from, "
                f"got {type(tokenizer).__name__}."
            )
    device, device_map = for_this_rank(*resolve_device_map(device, device_map, max_memory))
    dtype = resolve_placement(None, dtype)[1]
    _check_sources(sources, device_map, lazy)
    labels = list(names) if names is not None else [_label(s, i) for i, s in enumerate(sources)]
    # Two default labels alike (two directories named "model"): each its index too.
    labels = [
        label if names is not None or labels.count(label) == 1 else f"{label}#{i}"
        for i, label in enumerate(labels)
    ]
    # transformers would dequantize a GGUF on every load; it is converted once, and cached.
    sources = tuple(converted_checkpoint(s) if _is_gguf_path(s) else s for s in sources)
    # transformers draws a "Loading weights" bar per checkpoint; a model set is loaded often.
    with quiet_loading():
        given = copy.deepcopy(tokenizer)  # the bridge writes into it
        if isinstance(tokenizer, (str, os.PathLike)):
            given = _tokenizer_from(tokenizer)
        base = _to_bridge(sources[0], 0, given, None, device, dtype, device_map, max_memory)
        fallback = given if given is not None else base.tokenizer
        layout = component_layout(base)
        graftable = _declared_pairs(base, layout, components, layers)
        slots = [slot for key_slots in layout.slots.values() for slot in key_slots]
        declared = None
        if graftable is not None:
            declared = [slot for key in sorted(graftable, key=str) for slot in layout.slots[key]]
        # Every donor module goes where the base module it stands in for went.
        following = realised_map(base.original_model)
        loaded: list[Source] = [CheckpointSource(base, labels[0], _disk_bytes(sources[0]))]
        for index, source in enumerate(sources[1:], start=1):
            name, label = labels[index], f"source {index} ({labels[index]})"
            path = source if isinstance(source, (str, os.PathLike)) else None
            if is_peft_model(source) or (path is not None and is_adapter_directory(path)):
                if path is None:
                    adapter = LoraAdapter.from_peft_model(source)
                else:
                    adapter = LoraAdapter.from_directory(path)
                    if given is None:  # the adapter's own tokenizer, if it was saved with one
                        check_vocabulary(base.tokenizer, _load_tokenizer(path, fallback), label)
                warn_if_other_base(adapter, str(getattr(base.original_model, "name_or_path", "")))
                loaded.append(
                    LoraSource(name, adapter, base, slots, make_bridge=lambda: shared_bridge(base))
                )
            elif lazy and path is not None:
                loaded.append(
                    _lazy_source(path, index, name, base, slots, declared, given, fallback,
                                 dtype, verify=lazy == "verify")
                )  # fmt: skip
            else:
                where = (None, following) if path is not None else (device, None)
                bridge = _to_bridge(source, index, given, fallback, where[0], dtype, where[1])
                check_alignment(base, bridge, label)
                loaded.append(CheckpointSource(bridge, name, _disk_bytes(source)))
    models = ModelSet(loaded, labels, allow_uncovered=allow_uncovered, graftable=graftable)
    warn_if_unverified(models.architecture)
    return models


def resolve_placement(
    device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
) -> tuple[torch.device | None, torch.dtype | None]:
    """``device`` and ``dtype`` (or its name) as torch objects, checked before anything loads.

    Raises:
        GraftingLensError: A device this machine cannot use, or not a floating torch dtype.
    """
    if dtype is not None:
        found = (
            getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
        )
        if not (isinstance(found, torch.dtype) and found.is_floating_point):
            raise kind(dtype, (str, torch.dtype), GraftingLensError)(
                f"dtype={dtype!r} is not a floating torch dtype: use torch.float32, "
                "torch.bfloat16 or torch.float16 (or a name such as 'bfloat16')."
            )
        dtype = found
    return (None if device is None else usable_device(device)), dtype


def _check_sources(sources: Sequence[SourceSpec], device_map: object, lazy: object) -> None:
    """Refuse, before anything loads, a source :func:`load_models` cannot take."""
    for index, source in enumerate(sources):
        path = isinstance(source, (str, os.PathLike))
        adapter = is_peft_model(source) or (
            isinstance(source, (str, os.PathLike)) and is_adapter_directory(source)
        )
        if path and not adapter and not _is_gguf_path(source):
            place = Path(source).expanduser()  # type: ignore[arg-type]  # a path here
            _checkpoint_target(str(source), place, index, lazy=bool(lazy) and index > 0)
        if not (path or adapter or isinstance(source, (PreTrainedModel, TransformerBridge))):
            raise ArgumentTypeError(
                f"sources[{index}] is a {type(source).__name__}; expected a hub id, a directory, "
                "a transformers PreTrainedModel, a TransformerBridge or (a donor) a PEFT model."
            )
        problem = None
        if index == 0 and adapter:
            problem = "a LoRA adapter, but source 0 is the base: pass the model it adapts first"
        elif device_map is not None and not path:
            problem = (
                f"an in-memory {type(source).__name__}, and device_map= splits checkpoints given "
                "as paths: pass device=, or dispatch it yourself (from_pretrained(device_map=))"
            )
        elif getattr(source, "_weights_processed", False):
            problem = (
                "a TransformerBridge with processed weights: boot it without process_weights()"
            )
        elif isinstance(source, PreTrainedModel) and any(
            type(module).__module__.startswith("peft.") for module in source.modules()
        ):
            problem = (
                "a model holding PEFT layers (get_peft_model adds them in place): pass it without "
                "them (peft_model.unload()) and the adapter as a donor"
            )
        if problem:
            raise AlignmentError(f"Source {index} is {problem}.")


def _label(source: SourceSpec, index: int) -> str:
    """A source's default label: a directory's or file's name, a hub id, or ``source{index}``."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        return path.name if path.exists() else str(source)
    return f"source{index}"


def _is_gguf_path(source: SourceSpec) -> bool:
    return isinstance(source, (str, os.PathLike)) and is_gguf(source)


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
    chosen = set(expand_components(components or "all", layout.components, architecture))
    at = set(resolve_layers(layers, int(base.cfg.n_layers)))
    pairs = frozenset(
        (component, layer)
        for component, layer in layout.slots
        if component in chosen and (layer is None or layer in at)
    )
    if not pairs:  # a component only some layers have (interleaved experts), not those
        raise SelectionError(
            f"components={components!r} at layers={layers!r} declares nothing this "
            f"{architecture} has; declare components it has at those layers."
        )
    return pairs


def _lazy_source(
    source: str | os.PathLike,
    index: int,
    name: str,
    base: TransformerBridge,
    slots: list[Slot],
    declared: list[Slot] | None,
    given: Any,
    fallback: Any,
    dtype: torch.dtype | None,
    verify: bool,
) -> LazySource:
    """Open a checkpoint directory without reading its weights, checked against the base."""
    path = Path(source).expanduser()
    label = f"source {index} ({name})"
    _checkpoint_target(str(source), path, index, lazy=True)
    files = SafetensorsCheckpoint(path, base.original_model, verify=verify)
    check_lazy_alignment(base, files, AutoConfig.from_pretrained(str(path)), label, dtype)
    if given is None:  # a directory's own tokenizer, as for a donor loaded whole
        check_vocabulary(base.tokenizer, _load_tokenizer(path, fallback), label)

    def load_whole() -> TransformerBridge:
        following = realised_map(base.original_model)
        bridge = _to_bridge(source, index, given, fallback, None, dtype, following)
        check_alignment(base, bridge, label)
        return bridge

    return LazySource(name, files, base, slots, declared=declared, load_whole=load_whole)


def _to_bridge(
    source: SourceSpec,
    index: int,
    tokenizer: Any,
    fallback: Any,
    device: torch.device | None,
    dtype: torch.dtype | None,
    device_map: Any = None,
    max_memory: Any = None,
) -> TransformerBridge:
    """A bridge over a checkpoint loaded from a path, or over a copy of an in-memory model."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if device is not None:
            device_map = {"": device}
        model = _load_checkpoint(str(source), path, index, dtype, device_map, max_memory)
        if tokenizer is None:
            tokenizer = _load_tokenizer(path if path.is_dir() else str(source), fallback)
        label = str(source)
    else:
        if isinstance(source, TransformerBridge):  # it keeps its own tokenizer
            tokenizer = copy.deepcopy(source.tokenizer)
            source = source.original_model
        model = model_copy(source)
        if dtype is not None:
            _cast_as_loaded(model, dtype)
        if device is not None:
            model.to(device)
        tokenizer = tokenizer if tokenizer is not None else fallback
        label = f"an in-memory {type(model).__name__}"
    if tokenizer is None:
        raise GraftingLensError(
            f"Source {index} ({label}) has no tokenizer, and none was given: pass tokenizer=... "
            "to load_models (a tokenizer, or where the checkpoint's was saved)."
        )
    resolve_architecture(model, index)
    check_placed(model, f"source {index}")
    name = str(model.config._name_or_path or f"source{index}")
    return _boot_bridge(model, name, _prepare_tokenizer(tokenizer, name))


def _cast_as_loaded(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Cast as ``from_pretrained(dtype=dtype)`` would load it: parameters to ``dtype``, and
    each buffer to the dtype HF's own initialisation gives it under ``dtype``."""
    with init_empty_weights():  # parameters on meta; buffers made as HF makes them
        made = type(model)._from_config(model.config, dtype=dtype)
    kept = {name: buffer.dtype for name, buffer in made.named_buffers()}
    for parameter in model.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)
    for prefix, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[key] = buffer.to(kept.get(f"{prefix}.{key}".lstrip("."), dtype))


def _checkpoint_target(label: str, path: Path, index: int, lazy: bool = False) -> str:
    """What ``from_pretrained`` loads a source path from: its directory, or a hub id."""
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    hub_id = not path.exists() and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", label) is not None
    if hub_id and not lazy:
        return label
    if hub_id:
        problem = "a hub id, and lazy=True reads checkpoint directories: download it first "
        problem += "(huggingface_hub.snapshot_download), or load it whole (lazy=False)"
    else:
        problem = checkpoint_problem(path) or "not a directory (no such path)"
    fix = "" if hub_id else f" {CHECKPOINT_FIX}"
    raise GraftingLensError(f"Source {index} ({label!r}) is {problem}.{fix}")


def _load_checkpoint(
    label: str, path: Path, index: int, dtype: torch.dtype | None, device_map: Any, max_memory: Any
) -> PreTrainedModel:
    """An HF causal LM loaded from a directory or hub id, or an error naming what is wrong."""
    target = _checkpoint_target(label, path, index)
    for index_name in SHARD_INDEXES:
        if (path / index_name).is_file():
            shard_files(path, index_name)  # every shard inside the checkpoint
    given = {"dtype": dtype, "device_map": device_map, "max_memory": max_memory}
    options = {key: value for key, value in given.items() if value is not None}
    try:
        # The loading report is read here, not logged: TransformerLens sets transformers'
        # logger to ERROR, which hides it; mismatched shapes are reported in it too.
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            target, output_loading_info=True, ignore_mismatched_sizes=True, **options
        )
    except (OSError, ValueError, SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError) as error:  # fmt: skip
        raise GraftingLensError(_unloadable(label, path, index, error)) from error
    model, info = loaded
    _check_loading_info(info, label, index)
    return model


def _unloadable(label: str, path: Path, index: int, error: BaseException) -> str:
    """Why ``from_pretrained`` could not load a source, and the fix."""
    what = f"Could not load source {index} ({label!r})"
    if isinstance(error, pickle.UnpicklingError) and "weights only" in str(error).lower():
        return unsafe_pickle(f"A weight file of source {index} ({label!r})")
    if not path.is_dir():
        if is_offline_mode():
            return (
                f"{what}: the hub id is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 "
                f"forbids downloading it. Download it once with a connection, or pass its directory."
            )
        return f"{what} as a hub id: {' '.join(str(error).split())[:300]}"
    if isinstance(error, (OSError, ValueError)):
        return f"{what} as a directory: {' '.join(str(error).split())[:300]}"
    # A damaged weight file (an interrupted download or save) fails inside safetensors or
    # torch with a message that names no file.
    files = sorted(p.name for p in path.glob("*") if p.suffix in (".safetensors", ".bin"))
    return (
        f"{what}: its weights ({', '.join(files)}) cannot be read ({type(error).__name__}: "
        f"{str(error)[:200]}). A file is truncated or damaged: save or download it again."
    )


def _check_loading_info(info: Any, label: str, index: int) -> None:
    """Refuse a checkpoint whose weights are not its config's model: transformers fills them
    randomly, and reports it in a log TransformerLens silences."""

    def entries(name: str) -> list[str]:  # a dict in transformers 5, an object's fields before
        found = info.get(name) if isinstance(info, dict) else getattr(info, name, None)
        return sorted(str(entry[0] if isinstance(entry, tuple) else entry) for entry in found or ())

    problems = [
        f"{len(found)} weight(s) {what} ({', '.join(found[:3])}{' ...' if len(found) > 3 else ''})"
        for key, what in (
            ("missing_keys", "missing, which transformers filled with random values"),
            ("mismatched_keys", "of another shape than the model's, filled with random values"),
            ("unexpected_keys", "the model does not have"),
        )
        if (found := entries(key))
    ]
    if problems:
        raise GraftingLensError(
            f"Source {index} ({label!r}) does not hold the weights of the model its config "
            f"describes: {'; '.join(problems)}. It is incomplete or its config.json is another "
            "model's: save or download it again."
        )


def _load_tokenizer(name: str | os.PathLike, fallback: Any) -> Any:
    """The tokenizer saved with a checkpoint, or ``fallback`` when it has none."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name))
    except (OSError, ValueError):
        return fallback
    return fallback if _only_special_tokens(tokenizer) else tokenizer


def _tokenizer_from(name: str | os.PathLike) -> Any:
    """The tokenizer ``tokenizer=`` names (a directory or a hub id), or an error saying why not."""
    path = Path(name).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else str(name))
        # transformers builds a tokenizer from a config.json alone, knowing nothing but its
        # special tokens: every text would tokenize to unknown or nothing.
        problem = (
            "only special tokens: no vocabulary files" if _only_special_tokens(tokenizer) else None
        )
    except (OSError, ValueError) as error:
        problem = " ".join(str(error).split())[:200]
    if problem:
        raise GraftingLensError(
            f"tokenizer={str(name)!r} holds no usable tokenizer ({problem}). Give the directory "
            "tokenizer.save_pretrained wrote, or a hub id such as 'gpt2' (in the local HF cache "
            "when HF_HUB_OFFLINE=1)."
        )
    return tokenizer


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
    """Fill in the ``init_kwargs`` TransformerLens 4.3's bridge reads of a tokenizer (this
    library's copy), without which it fails or looks the tokenizer up on the hub."""
    init_kwargs = getattr(tokenizer, "init_kwargs", None)
    if init_kwargs is not None:
        if not init_kwargs.get("name_or_path"):
            init_kwargs["name_or_path"] = getattr(tokenizer, "name_or_path", "") or name
        init_kwargs.setdefault("add_bos_token", True)
    return tokenizer
