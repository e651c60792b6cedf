"""Loading aligned checkpoints as one :class:`ModelSet`.

Grafting needs two or more checkpoints of one architecture: index 0 is the
*base* (usually the pretrained model), index 1 the *donor* (usually the
finetuned one), further indices any other checkpoint (the paper's hybrid
experiments use pretrained, task and relation models). Each becomes a
TransformerLens 4.x ``TransformerBridge`` loaded **without weight processing**:
no LayerNorm folding, centering or value-bias folding, because a graft swaps the
checkpoint's own parameters and processed weights are no longer those.

Alignment is checked once, on load: the same architecture and configuration,
the same shape for every parameter, the same vocabulary. Anything else raises
:class:`~grafting_lens.AlignmentError` naming the first difference, instead of a
shape mismatch deep inside torch in the middle of a sweep.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Union

import pandas as pd
import torch
from transformer_lens.model_bridge import TransformerBridge
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grafting_lens.architectures import resolve_architecture, warn_if_unverified
from grafting_lens.components import ComponentLayout, Slot, component_layout
from grafting_lens.errors import AlignmentError, GraftingLensError

Source = Union[str, os.PathLike, PreTrainedModel, TransformerBridge]
"""A checkpoint: hub id, ``save_pretrained`` directory, HF model or TransformerBridge."""

# Configuration fields that change the computation without changing any shape.
_CONFIG_FIELDS = (
    "n_layers",
    "d_model",
    "n_heads",
    "d_head",
    "d_mlp",
    "d_vocab",
    "n_key_value_heads",
    "act_fn",
    "normalization_type",
    "positional_embedding_type",
    "rotary_dim",
    "rotary_base",
    "eps",
    "parallel_attn_mlp",
    "gated_mlp",
)


class ModelSet(Sequence[TransformerBridge]):
    """Aligned checkpoints, index 0 the base; a sequence of ``TransformerBridge``.

    Create one with :func:`load_models`. ``models[i]`` is source ``i``;
    ``models.base`` is ``models[0]``, the model every grafted run goes through.

    Attributes:
        names: A label per source (directory name, hub id, or ``source{i}``).
        tokenizer: The shared tokenizer (the base's).
        allow_uncovered: Whether a graft may take every component around weights that
            no component covers (see :meth:`coverage`). False by default: such a
            graft raises :class:`~grafting_lens.ComponentError`.
    """

    def __init__(
        self,
        bridges: Sequence[TransformerBridge],
        names: Sequence[str],
        allow_uncovered: bool = False,
    ) -> None:
        self._bridges = tuple(bridges)
        self.names = tuple(names)
        self.allow_uncovered = bool(allow_uncovered)
        self._layout = component_layout(self._bridges[0])

    def __getitem__(self, index):  # type: ignore[override]
        return self._bridges[index]

    def __len__(self) -> int:
        return len(self._bridges)

    def __iter__(self) -> Iterator[TransformerBridge]:
        return iter(self._bridges)

    def __repr__(self) -> str:
        names = ", ".join(f"{i}={name}" for i, name in enumerate(self.names))
        return f"ModelSet({self.architecture}, {self.n_layers} layers: {names})"

    @property
    def base(self) -> TransformerBridge:
        """Source 0, the model whose forward pass every graft runs through."""
        return self._bridges[0]

    @property
    def tokenizer(self) -> Any:
        """The base's tokenizer (every source shares its vocabulary)."""
        return self.base.tokenizer

    @property
    def architecture(self) -> str:
        """The HF architecture name, e.g. ``"LlamaForCausalLM"``."""
        return str(getattr(self.base.cfg, "architecture", type(self.base.original_model).__name__))

    @property
    def n_layers(self) -> int:
        """Number of transformer blocks."""
        return int(self.base.cfg.n_layers)

    @property
    def components(self) -> tuple[str, ...]:
        """The components this architecture has (see :data:`~grafting_lens.COMPONENTS`)."""
        return self._layout.components

    @property
    def pairs(self) -> tuple[tuple[str, int | None], ...]:
        """Every ``(component, layer)`` pair of the architecture, as masks address them.

        Usually every per-layer component at every layer; a stack that interleaves
        dense and mixture-of-experts blocks has ``mlp_in`` at some layers and
        ``experts`` at others.
        """
        return tuple(self._layout.slots)

    @property
    def layout(self) -> ComponentLayout:
        """Where each component lives in the bridge tree, and which parameters it holds."""
        return self._layout

    def slots(self, component: str, layer: int | None) -> tuple[Slot, ...]:
        """The places in the bridge tree that ``(component, layer)`` swaps (one, or several)."""
        return self._layout.slots[(component, layer)]

    def coverage(self) -> pd.DataFrame:
        """Every parameter of the checkpoint and the component that grafts it.

        Each parameter belongs to exactly one component, or to several that share it
        (tied embeddings: ``embed+unembed``; a fused QKV matrix, which the bridge
        splits: ``q+k+v``). A parameter no component covers is one a graft cannot
        take from a donor; a graft that takes every component around it (``all``,
        ``block``, ``attn`` or ``ffn`` at its layer) raises
        :class:`~grafting_lens.ComponentError` unless :attr:`allow_uncovered`.

        Returns:
            One row per checkpoint parameter, with columns ``parameter`` (its name in
            the checkpoint), ``component`` (``+``-joined components, empty when
            uncovered), ``layer`` (an integer column, ``<NA>`` outside the blocks),
            ``path`` (the bridge path that holds it), ``shape``, ``size`` (number of
            values) and ``covered``.
        """
        frame = pd.DataFrame(
            [
                {
                    "parameter": record.name,
                    "component": "+".join(record.components),
                    "layer": record.layer,
                    "path": record.path,
                    "shape": record.shape,
                    "size": int(torch.Size(record.shape).numel()),
                    "covered": record.covered,
                }
                for record in self._layout.parameters
            ],
            columns=["parameter", "component", "layer", "path", "shape", "size", "covered"],
        )
        frame["layer"] = frame["layer"].astype("Int64")  # <NA> outside the blocks
        return frame

    @property
    def device(self) -> torch.device:
        """Device of the base's parameters."""
        return next(self.base.original_model.parameters()).device

    def weight_diff(self) -> pd.DataFrame:
        """Relative change of every component in every source against the base.

        For source ``i`` and component ``c`` (at a layer), the figure is
        ``||theta_i - theta_0|| / ||theta_0||`` over all of ``c``'s parameters: a
        first look at what finetuning moved, and where a graft can matter.

        Returns:
            One row per source (1..n-1), component and layer, with columns
            ``source``, ``name``, ``component``, ``layer`` (an integer column;
            ``<NA>`` for global components), ``relative_change`` and ``base_norm``.
        """
        rows = []
        for source in range(1, len(self)):
            for component, layer in self.pairs:
                slots = self.slots(component, layer)
                base = _component_vector(self.base, slots)
                other = _component_vector(self[source], slots)
                base_norm = float(base.norm())
                change = float((other - base).norm())
                rows.append(
                    {
                        "source": source,
                        "name": self.names[source],
                        "component": component,
                        "layer": layer,
                        "relative_change": change / base_norm if base_norm else float("nan"),
                        "base_norm": base_norm,
                    }
                )
        frame = pd.DataFrame(rows)
        frame["layer"] = frame["layer"].astype("Int64")  # <NA> for global components
        return frame


def load_models(
    *sources: Source,
    tokenizer: Any = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    names: Sequence[str] | None = None,
    allow_uncovered: bool = False,
) -> ModelSet:
    """Load two or more checkpoints of one architecture as an aligned :class:`ModelSet`.

    Args:
        *sources: Base first, then donors. Each is an HF hub id, a local
            ``save_pretrained`` directory, an HF ``PreTrainedModel`` (wrapped in
            place by the bridge) or a ``TransformerBridge`` (used as is; it must
            not have processed weights).
        tokenizer: A tokenizer or a path/hub id to load one from. By default the
            base's own: its directory's tokenizer, or the bridge's.
        device: Where to put every model (default: where they are, CPU for paths).
        dtype: Cast every model to this dtype (default: keep the checkpoint's).
        names: A label per source, used in tables and figures.
        allow_uncovered: Let grafts take every component around parameters that no
            component covers (see :meth:`ModelSet.coverage`), leaving those at the
            base's values. Off by default: such a graft raises
            :class:`~grafting_lens.ComponentError`. Every architecture in the
            supported table is covered completely.

    Returns:
        The model set, index 0 the base.

    Raises:
        AlignmentError: Fewer than two sources, or sources that differ in
            architecture, configuration, parameter shapes or vocabulary.
        UnsupportedArchitectureError: A model TransformerLens cannot bridge (the
            message names the nearest supported architectures).
        ValueError: A path that is neither a directory nor loadable from the hub.

    Warns:
        UserWarning: An architecture TransformerLens bridges but grafting-lens has
            not verified (see the supported-architectures page).

    Examples:
        >>> models = load_models("out/pretrained", "out/finetuned")
        >>> models.weight_diff().sort_values("relative_change").tail()
    """
    if len(sources) < 2:
        raise AlignmentError(
            f"Grafting needs at least two checkpoints (a base and a donor), got {len(sources)}."
        )
    if names is not None and len(names) != len(sources):
        raise GraftingLensError(f"Got {len(names)} names for {len(sources)} sources.")
    seen: dict[int, int] = {}
    for index, source in enumerate(sources):
        if isinstance(source, (PreTrainedModel, TransformerBridge)):
            if id(source) in seen:
                raise AlignmentError(
                    f"Sources {seen[id(source)]} and {index} are the same model object; grafting "
                    "needs distinct models (pass copy.deepcopy(model) to graft a model into itself)."
                )
            seen[id(source)] = index
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(tokenizer), str(tokenizer))
    bridges: list[TransformerBridge] = []
    labels: list[str] = []
    fallback = tokenizer
    for index, source in enumerate(sources):
        # A directory brings its own tokenizer, so the vocabulary check compares
        # what each checkpoint was trained with; in-memory models borrow the base's.
        bridge, label = _to_bridge(source, index, tokenizer, fallback, device, dtype)
        fallback = fallback if fallback is not None else bridge.tokenizer
        bridges.append(bridge)
        labels.append(names[index] if names is not None else label)
    for index, bridge in enumerate(bridges[1:], start=1):
        _check_alignment(bridges[0], bridge, labels[0], labels[index], index)
    models = ModelSet(bridges, labels, allow_uncovered=allow_uncovered)
    warn_if_unverified(models.architecture)
    return models


def _to_bridge(
    source: Source,
    index: int,
    tokenizer: Any,
    fallback: Any,
    device: Any,
    dtype: torch.dtype | None,
) -> tuple[TransformerBridge, str]:
    if isinstance(source, TransformerBridge):
        if getattr(source, "_weights_processed", False):
            raise AlignmentError(
                f"Source {index} is a TransformerBridge with processed weights (folded LayerNorm, "
                "centered weights): a graft must swap the checkpoint's own parameters. Load it "
                "again without calling process_weights() or enable_compatibility_mode()."
            )
        if device is not None or dtype is not None:
            source.to(device=device, dtype=dtype)
        return source, f"source{index}"
    if isinstance(source, PreTrainedModel):
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
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path) if path.is_dir() else label)
        except OSError as error:
            where = "directory" if path.is_dir() else "hub id or directory"
            raise GraftingLensError(
                f"Could not load source {index} ({label!r}) as a {where}: {error}. A local "
                "checkpoint is a directory written by save_pretrained; a hub id needs a network "
                "connection or a filled HF cache (HF_HUB_OFFLINE=1 forbids downloads)."
            ) from error
        if path.is_dir():
            label = path.name
        if tokenizer is None:
            tokenizer = _load_tokenizer(str(path) if path.is_dir() else model_name, fallback)
    else:
        raise TypeError(
            f"Source {index} is a {type(source).__name__}; expected a hub id, a directory, a "
            "transformers PreTrainedModel or a TransformerBridge."
        )
    tokenizer = tokenizer if tokenizer is not None else fallback
    if tokenizer is None:
        raise GraftingLensError(
            f"Source {index} is an in-memory model without a tokenizer: pass tokenizer=... to "
            "load_models."
        )
    resolve_architecture(model, index)
    model.eval()
    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)
    parameter = next(model.parameters())
    bridge = TransformerBridge.boot_transformers(
        model_name,
        hf_model=model,
        tokenizer=_prepare_tokenizer(tokenizer, model_name),
        device=str(parameter.device),
        dtype=parameter.dtype,
    )
    return bridge, label


def _load_tokenizer(name: str, fallback: Any) -> Any:
    """The tokenizer saved with a checkpoint, or ``fallback`` when it has none."""
    try:
        return _prepare_tokenizer(AutoTokenizer.from_pretrained(name), name)
    except (OSError, ValueError):
        if fallback is None:
            raise GraftingLensError(
                f"{name!r} has no tokenizer and none was given: pass tokenizer=... to load_models."
            ) from None
        return fallback


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


def _check_alignment(
    base: TransformerBridge, other: TransformerBridge, base_name: str, name: str, index: int
) -> None:
    label = f"source {index} ({name})"
    base_arch = getattr(base.cfg, "architecture", None)
    other_arch = getattr(other.cfg, "architecture", None)
    if base_arch != other_arch:
        raise AlignmentError(f"{label} is a {other_arch}, the base ({base_name}) is a {base_arch}.")
    if base.cfg.n_layers != other.cfg.n_layers:
        raise AlignmentError(
            f"{label} has {other.cfg.n_layers} layers, the base has {base.cfg.n_layers}."
        )
    for field in _CONFIG_FIELDS:
        mine, theirs = getattr(base.cfg, field, None), getattr(other.cfg, field, None)
        if mine != theirs:
            raise AlignmentError(f"{label} has {field}={theirs!r}, the base has {field}={mine!r}.")
    base_params, other_params = _checkpoint_parameters(base), _checkpoint_parameters(other)
    for param_name, param in base_params.items():
        if param_name not in other_params:
            raise AlignmentError(f"{label} has no parameter {param_name!r}, which the base has.")
        if other_params[param_name].shape != param.shape:
            raise AlignmentError(
                f"{label}'s {param_name!r} has shape {tuple(other_params[param_name].shape)}, "
                f"the base's has {tuple(param.shape)}."
            )
    extra = sorted(set(other_params) - set(base_params))
    if extra:
        raise AlignmentError(f"{label} has a parameter the base lacks: {extra[0]!r}.")
    _check_vocabulary(base.tokenizer, other.tokenizer, label)


def _checkpoint_parameters(bridge: TransformerBridge) -> dict[str, torch.nn.Parameter]:
    """Parameters named as in the checkpoint (the bridge's wrappers add "._original_component")."""
    return {
        name.replace("._original_component", ""): param
        for name, param in bridge.original_model.named_parameters()
    }


def _check_vocabulary(base_tokenizer: Any, other_tokenizer: Any, label: str) -> None:
    if base_tokenizer is None or other_tokenizer is None or base_tokenizer is other_tokenizer:
        return
    base_vocab, other_vocab = base_tokenizer.get_vocab(), other_tokenizer.get_vocab()
    if base_vocab == other_vocab:
        return
    if len(base_vocab) != len(other_vocab):
        raise AlignmentError(
            f"{label}'s tokenizer has {len(other_vocab)} tokens, the base's has {len(base_vocab)}."
        )
    for token, token_id in sorted(base_vocab.items(), key=lambda item: item[1]):
        if other_vocab.get(token) != token_id:
            raise AlignmentError(
                f"{label}'s vocabulary differs from the base's: token {token!r} is id "
                f"{token_id} in the base and {other_vocab.get(token)} in {label}."
            )


def _component_vector(bridge: TransformerBridge, slots: Sequence[Slot]) -> torch.Tensor:
    params = [
        p.detach().flatten().float() for slot in slots for p in slot.module(bridge).parameters()
    ]
    return torch.cat(params) if params else torch.zeros(0)
