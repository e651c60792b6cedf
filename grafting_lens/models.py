"""Loading aligned checkpoints as one :class:`ModelSet`.

Grafting needs two or more checkpoints of one architecture: index 0 is the
*base* (usually the pretrained model), index 1 the *donor* (usually the
finetuned one), further indices any other checkpoint (the paper's hybrid
experiments use pretrained, task and relation models). Each becomes a
TransformerLens 4.x ``TransformerBridge`` loaded **without weight processing**:
no LayerNorm folding, centering or value-bias folding, because a graft swaps the
checkpoint's own parameters and processed weights are no longer those.

A donor need not be a whole model in memory (see :mod:`grafting_lens.sources`): a
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
:class:`~grafting_lens.AlignmentError` naming the first difference, instead of a
shape mismatch deep inside torch in the middle of a sweep, or a wrong number.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Union

import pandas as pd
import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError
from transformer_lens.model_bridge import TransformerBridge
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grafting_lens.adapters import (
    LoraAdapter,
    LoraSource,
    is_adapter_directory,
    is_peft_model,
    warn_if_other_base,
)
from grafting_lens.architectures import resolve_architecture, warn_if_unverified
from grafting_lens.compat import adapt_bridge
from grafting_lens.components import (
    ComponentLayout,
    Key,
    Slot,
    checkpoint_modules,
    checkpoint_parameters,
    component_layout,
    expand_components,
)
from grafting_lens.console import quiet_loading
from grafting_lens.errors import (
    AlignmentError,
    GraftingLensError,
    SelectionError,
    TokenError,
    unsafe_pickle,
)
from grafting_lens.layers import LayerSpec, resolve_layers
from grafting_lens.sources import (
    SHARD_INDEXES,
    CheckpointSource,
    LazySource,
    SafetensorsCheckpoint,
    Source,
    shard_files,
    tensor_bytes,
)

SourceSpec = Union[str, os.PathLike, PreTrainedModel, TransformerBridge, Any]
"""What :func:`load_models` takes as a source: a hub id, a ``save_pretrained`` directory
(a checkpoint, or a PEFT adapter directory), an HF model, a TransformerBridge, or a PEFT
model."""

IGNORED_CONFIG_FIELDS: frozenset[str] = frozenset(
    {
        # metadata; the architecture and dtypes are compared on the bridges and parameters
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "name_or_path",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "finetuning_task",
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        # special token ids: the tokenizers' vocabularies are compared instead
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        # what a forward call returns or keeps, not what it computes
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
        "chunk_size_feed_forward",  # chunks the MLP, same numbers
        # training only: initialisation and dropout (inactive in eval mode)
        "initializer_range",
        "initializer_factor",
        "gradient_checkpointing",
        "attention_dropout",
        "attn_pdrop",
        "embd_pdrop",
        "resid_pdrop",
        "hidden_dropout",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "classifier_dropout",
        "dropout",
        "activation_dropout",
        "summary_first_dropout",
        # GPT-2's sequence-summary head, which a causal LM does not run
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
    }
)
"""Hugging Face configuration fields :func:`load_models` does not compare between sources.

Every other field, nested ones included (``rope_parameters.rope_theta``), must be
equal; fields starting with ``_`` (private metadata such as ``_name_or_path``) are
ignored too. A field listed here cannot change the logits of a causal LM in eval
mode. When a compared field differs in a way you know is
immaterial, set the donor's ``config`` field (or its ``config.json``) to the base's.
"""

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

    Create one with :func:`load_models`. ``models[i]`` is source ``i`` as a model
    that runs alone; ``models.base`` is ``models[0]``, the model every grafted run
    goes through. ``models.sources[i]`` is the source itself (see
    :mod:`grafting_lens.sources`): a checkpoint in memory, a lazily loaded one or a
    LoRA adapter, which grafts ask for their modules. ``models[i]`` (and iterating)
    gives each source as a model that runs alone: a LoRA adapter's is built on first
    use over the base's tensors; a lazily loaded donor is then read whole, with a
    :class:`~grafting_lens.LazyLoadWarning`, or refused if it was declared for some
    components only. Grafts never need it.

    Attributes:
        names: A label per source (directory name, hub id, or ``source{i}``).
        tokenizer: The shared tokenizer (the base's).
        allow_uncovered: Whether a graft may take every component around weights that
            no component covers (see :meth:`coverage`). False by default: such a
            graft raises :class:`~grafting_lens.ComponentError`.
        graftable: The ``(component, layer)`` pairs donors may be grafted at, as
            declared to :func:`load_models` (``components=`` / ``layers=``), or None
            for every pair. A graft taking any other pair from a donor raises
            :class:`~grafting_lens.GraftMaskError`.
    """

    def __init__(
        self,
        sources: Sequence[TransformerBridge | Source],
        names: Sequence[str],
        allow_uncovered: bool = False,
        graftable: Iterable[Key] | None = None,
    ) -> None:
        if len(names) != len(sources):
            raise GraftingLensError(f"Got {len(names)} names for {len(sources)} sources.")
        wrapped: list[Source] = []
        for index, source in enumerate(sources):
            if isinstance(source, TransformerBridge):
                source = CheckpointSource(source, str(names[index]))
            if not isinstance(source, Source):
                raise TypeError(
                    f"Source {index} is a {type(source).__name__}; a ModelSet holds "
                    "TransformerBridges or grafting_lens.sources.Source objects (use "
                    "load_models to load checkpoints)."
                )
            wrapped.append(source)
        if not wrapped or not isinstance(wrapped[0], CheckpointSource):
            raise AlignmentError(
                "The base (source 0) must be a checkpoint loaded whole: every grafted run "
                "goes through its forward pass. Adapters and lazily loaded checkpoints are donors."
            )
        self._sources = tuple(wrapped)
        self.names = tuple(names)
        self.allow_uncovered = bool(allow_uncovered)
        self._layout = component_layout(wrapped[0].bridge)
        self.graftable = None if graftable is None else frozenset(graftable)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(source.bridge for source in self._sources[index])
        return self._sources[index].bridge

    def __len__(self) -> int:
        return len(self._sources)

    def __iter__(self) -> Iterator[TransformerBridge]:
        return (source.bridge for source in self._sources)

    def __repr__(self) -> str:
        names = ", ".join(
            f"{i}={name}" + ("" if source.kind == "checkpoint" else f" ({source.kind})")
            for i, (name, source) in enumerate(zip(self.names, self._sources))
        )
        return f"ModelSet({self.architecture}, {self.n_layers} layers: {names})"

    @property
    def sources(self) -> tuple[Source, ...]:
        """Every source, index 0 the base (see :mod:`grafting_lens.sources`)."""
        return self._sources

    @property
    def base(self) -> TransformerBridge:
        """Source 0, the model whose forward pass every graft runs through."""
        return self._sources[0].bridge

    def memory(self) -> pd.DataFrame:
        """What each source holds in memory, against what it would hold whole and on disk.

        Tensors several sources share (a LoRA donor computes with the base's weights)
        count once, for the first source that holds them; views of one tensor (the
        bridge's Q, K and V cut out of GPT-2's fused matrix) count once.

        Returns:
            One row per source, with columns ``source``, ``name``, ``kind``
            (``checkpoint``, ``lazy`` or ``lora``), ``resident_bytes`` (held now, not
            counted for an earlier source), ``declared_bytes`` (a lazily loaded donor
            declared for some components: what those take once read; ``<NA>``
            otherwise), ``full_bytes`` (the checkpoint whole in memory; for an
            adapter, the merged model) and ``disk_bytes`` (its weight files, ``<NA>``
            for an in-memory model).
        """
        counted: set[int] = set()
        rows = [
            {
                "source": index,
                "name": self.names[index],
                "kind": source.kind,
                "resident_bytes": tensor_bytes(source.resident_tensors(), counted),
                "declared_bytes": source.declared_bytes(),
                "full_bytes": source.full_bytes(),
                "disk_bytes": source.disk_bytes,
            }
            for index, source in enumerate(self._sources)
        ]
        frame = pd.DataFrame(rows)
        for column in ("declared_bytes", "disk_bytes"):
            frame[column] = frame[column].astype("Int64")
        return frame

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
    def max_positions(self) -> int | None:
        """How many positions the model can embed, for learned position embeddings (GPT-2).

        ``None`` for models without a ``pos_embed`` component (rotary models), which
        have no hard limit.
        """
        if "pos_embed" not in self.components:
            return None
        return int(self.base.cfg.n_ctx)

    def check_length(self, length: int) -> None:
        """Refuse sequences longer than the learned position embeddings.

        Raises:
            TokenError: ``length`` exceeds :attr:`max_positions`.
        """
        limit = self.max_positions
        if limit is not None and length > limit:
            raise TokenError(
                f"The tokens have {length} positions, but {self.architecture} learned position "
                f"embeddings for {limit}: truncate or split the prompts to at most {limit} tokens."
            )

    @property
    def device(self) -> torch.device:
        """Device of the base's parameters."""
        return next(self.base.original_model.parameters()).device

    def check_tokens(self, tokens: object, name: str = "tokens") -> tuple[int, int]:
        """Check that ``tokens`` is a ``[batch, pos]`` tensor of ids this model set can run.

        The one token check of the package: grafts, patches, comparisons and the
        experiment runner all call it, so a bad tensor reads the same everywhere.

        Args:
            tokens: The candidate token ids.
            name: What to call them in the message (``"patch_tokens"``...).

        Returns:
            ``(batch, pos)``.

        Any integer dtype is accepted (``uint8`` and ``int16`` ids included); the
        functions that run tokens widen them with :func:`token_ids`, since torch's
        embedding takes ``int64`` and ``int32`` only.

        Raises:
            TokenError: Not a two-dimensional tensor, not integer ids, empty, an id
                outside the vocabulary, or more positions than the model learned
                position embeddings for (:meth:`check_length`).
        """
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            got = (
                f"shape {list(tokens.shape)}"
                if isinstance(tokens, torch.Tensor)
                else type(tokens).__name__
            )
            raise TokenError(
                f"{name} must be a [batch, pos] tensor of token ids (models.base.to_tokens(...) "
                f"or the tokenizer), got {got}."
            )
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TokenError(f"{name} must hold integer token ids, got {tokens.dtype}.")
        if tokens.numel() == 0:
            raise TokenError(
                f"{name} is empty (shape {list(tokens.shape)}): a run needs at least one row "
                "of at least one token. Check the tokenization (an empty prompt, or a slice "
                "past the end)."
            )
        vocab = int(self.base.cfg.d_vocab)
        # torch has no min/max for its unsigned types wider than 8 bits: compare as int64.
        ids = token_ids(tokens)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise TokenError(
                f"Token ids in {name} must lie in 0..{vocab - 1}, the model's vocabulary; got "
                f"{low}..{high}."
            )
        self.check_length(int(tokens.shape[1]))
        return (int(tokens.shape[0]), int(tokens.shape[1]))

    def check_placement(self, indices: Iterable[int], what: str = "This run") -> None:
        """Refuse sources cast or moved since :func:`load_models` placed them alike.

        Load time checks that every parameter shares the base's dtype and device; a
        model cast or moved afterwards (``models.base.half()``, ``models[1].to("cuda")``)
        would fail inside torch naming neither, or run on in another precision. Each
        source's set of (dtype, device) over its floating parameters must be the base's.
        Grafts check the modules they take instead, without building any source's model.

        Args:
            indices: The sources a run uses (each runs alone, as a model).
            what: What runs them, for the message.

        Raises:
            AlignmentError: A source whose parameters are of another dtype or on another
                device than the base's.
        """
        placements = {0: _placement(self.base)}
        for index in indices:
            if index not in placements:
                placements[index] = _placement(self[index])
            if placements[index] != placements[0]:
                found = ", ".join(f"{dtype} on {device}" for dtype, device in placements[index])
                base = ", ".join(f"{dtype} on {device}" for dtype, device in placements[0])
                raise AlignmentError(
                    f"{what} runs source {index} ({self.names[index]}), whose weights are "
                    f"{found}, and the base's are {base}: the sources of a model set must share "
                    "a dtype and a device, and one was cast or moved after load_models "
                    "(models.base.half(), models[1].to('cuda')...). Load the model set with "
                    "load_models(..., dtype=..., device=...), which places every source alike, "
                    "or cast and move every source the same way."
                )

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
                base = _component_vector(self._sources[0], slots)
                other = _component_vector(self._sources[source], slots)
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


def token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Token ids as torch's embedding takes them: ``int64``, or ``int32`` left as it is.

    :meth:`ModelSet.check_tokens` accepts ids of any integer dtype; every function that
    runs them passes them through this first, so that ``uint8`` or ``int16`` ids (a
    compact dataset on disk) run as the same ids instead of failing inside the
    embedding.
    """
    if tokens.dtype in (torch.int64, torch.int32):
        return tokens
    return tokens.to(torch.int64)


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
            :mod:`grafting_lens.adapters`).
        tokenizer: A tokenizer or a path/hub id to load one from. By default the
            base's own: its directory's tokenizer, or the bridge's.
        device: Where to put every model (default: where they are, CPU for paths).
        dtype: Cast every model to this floating dtype, a ``torch.dtype`` or its
            name (``"float32"``, ``"bfloat16"``, ``"torch.float16"``); default:
            keep the checkpoint's.
        names: A label per source, used in tables and figures.
        allow_uncovered: Let grafts take every component around parameters that no
            component covers (see :meth:`ModelSet.coverage`), leaving those at the
            base's values. Off by default: such a graft raises
            :class:`~grafting_lens.ComponentError`. Every architecture in the
            supported table is covered completely.
        lazy: Open donors given as checkpoint directories (safetensors) without
            reading their weights: a graft reads, memory-mapped, the components its
            mask takes from them, once (see :class:`~grafting_lens.sources.LazySource`).
            A lazily loaded donor that runs alone (patching, scoring) is read whole,
            with a :class:`~grafting_lens.LazyLoadWarning`. The base is always
            loaded whole.
        components: Declare which components grafts will take from donors: a
            component, a group or a ``+``-joined list (``"o+ffn"``), as masks name
            them. A graft taking another component from a donor raises
            :class:`~grafting_lens.GraftMaskError`; a lazily loaded donor then never
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
    held back (see :func:`grafting_lens.console.quiet_loading`). Its warnings do not
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
        base, base_label = _to_bridge(sources[0], 0, tokenizer, tokenizer, device, dtype)
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
                bridge, _ = _to_bridge(source, index, tokenizer, fallback, device, dtype)
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
    device = next(base.original_model.parameters()).device

    def load_whole() -> TransformerBridge:
        bridge, _ = _to_bridge(source, index, tokenizer, fallback, device, dtype)
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
    parameter = next(original.parameters())
    return adapt_bridge(
        TransformerBridge.boot_transformers(
            str(getattr(base.cfg, "model_name", "") or "base"),
            hf_model=skeleton,
            tokenizer=base.tokenizer,
            device=str(parameter.device),
            dtype=parameter.dtype,
        )
    )


def _to_bridge(
    source: SourceSpec,
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
        model = _load_checkpoint(label, path, index)
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
    model.eval()
    if device is not None or dtype is not None:
        # transformers wraps PreTrainedModel.to in a decorator mypy reads as unbound.
        model.to(device=device, dtype=dtype)  # type: ignore[call-arg]
    parameter = next(model.parameters())
    bridge = TransformerBridge.boot_transformers(
        model_name,
        hf_model=model,
        tokenizer=_prepare_tokenizer(tokenizer, model_name),
        device=str(parameter.device),
        dtype=parameter.dtype,
    )
    return adapt_bridge(bridge), label


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


def _load_checkpoint(label: str, path: Path, index: int) -> PreTrainedModel:
    """An HF causal LM from a directory or hub id, or an error naming what is wrong."""
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
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            target, output_loading_info=True, ignore_mismatched_sizes=True
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
    base_params = dict(checkpoint_parameters(base.original_model))
    other_params = dict(checkpoint_parameters(other.original_model))
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
    _check_same_placement(base_params, other_params, label)
    _check_hf_config(base.original_model.config, other.original_model.config, label)
    _check_buffers(base, other, label)
    _check_vocabulary(base.tokenizer, other.tokenizer, label)


def _check_lazy_alignment(
    base: TransformerBridge,
    files: SafetensorsCheckpoint,
    config: Any,
    label: str,
    dtype: torch.dtype | None,
) -> None:
    """:func:`_check_alignment` for a checkpoint on disk: its config and its files' headers.

    The architecture and every configuration field that changes the forward pass
    (which also fixes the buffers a model derives from its configuration), every
    tensor's name and shape, and its dtype after the cast to ``dtype``.
    """
    base_architecture = getattr(base.cfg, "architecture", None)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if architecture != base_architecture:
        raise AlignmentError(f"{label} is a {architecture}, the base is a {base_architecture}.")
    _check_hf_config(base.original_model.config, config, label)
    if files.converted:
        raise AlignmentError(
            f"transformers converts {label}'s {files.converted[0]!r} when it loads the "
            "checkpoint (an operation on values, such as fusing experts stored apart), so the "
            "donor cannot be read lazily, tensor by tensor: load it whole (lazy=False)."
        )
    original = base.original_model
    assert isinstance(original, torch.nn.Module)
    known = {
        prefix + name
        for prefix, module in checkpoint_modules(original)
        for table in (module._parameters, module._buffers)
        for name in table
    }
    for name, parameter in checkpoint_parameters(original):
        if name not in files.shapes:
            raise AlignmentError(
                f"{label}'s weight files hold no {name!r}, which the base has. If the files "
                "use other names that transformers converts when loading (some architectures' "
                "experts, checkpoints saved from another model class), the donor cannot be "
                "read lazily: load it whole (lazy=False)."
            )
        if files.shapes[name] != tuple(parameter.shape):
            raise AlignmentError(
                f"{label}'s {name!r} has shape {files.shapes[name]}, the base's has "
                f"{tuple(parameter.shape)}."
            )
        stored = dtype or files.dtypes[name]
        if stored != parameter.dtype:
            raise AlignmentError(
                f"{label}'s {name!r} is {stored}, the base's is {parameter.dtype}: a graft "
                "mixes the sources' outputs in one forward pass, so they must share a dtype. "
                "Pass dtype=... to load_models to cast every source."
            )
    extra = sorted(set(files.names()) - known)
    if extra:
        raise AlignmentError(f"{label} has a tensor the base lacks: {extra[0]!r}.")


def _check_same_placement(
    base_params: dict[str, torch.nn.Parameter],
    other_params: dict[str, torch.nn.Parameter],
    label: str,
) -> None:
    """Same dtype and device for every parameter: a graft mixes their outputs in one pass."""
    for param_name, param in base_params.items():
        other = other_params[param_name]
        if other.dtype != param.dtype:
            raise AlignmentError(
                f"{label}'s {param_name!r} is {other.dtype}, the base's is {param.dtype}: a graft "
                "mixes the sources' outputs in one forward pass, so they must share a dtype. "
                "Pass dtype=... to load_models to cast every source."
            )
        if other.device != param.device:
            raise AlignmentError(
                f"{label}'s {param_name!r} is on {other.device}, the base's on {param.device}: a "
                "graft runs every source on the base's activations, so they must share a "
                "device. Pass device=... to load_models to move every source."
            )


def _check_hf_config(base_config: Any, other_config: Any, label: str) -> None:
    """Every configuration field that can change the forward pass must be equal.

    TransformerLens's bridge config does not carry every such field (under
    TransformerLens 4.3 it reports ``rotary_base=10000`` whatever ``rope_theta``
    is), so the Hugging Face configurations are compared instead.
    """
    mine = _forward_config(base_config)
    theirs = _forward_config(other_config)
    for field in sorted(set(mine) | set(theirs)):
        a, b = mine.get(field), theirs.get(field)
        if a != b:
            raise AlignmentError(
                f"{label}'s configuration has {field}={b!r}, the base's has {field}={a!r}. "
                "It changes what the model computes without changing a parameter's shape, and "
                "a graft computes it the base's way for every source, so the result would be "
                "neither model. Graft checkpoints of one configuration; if you know this "
                f"difference is immaterial, set the donor's config.{field} to the base's value."
            )


def _forward_config(config: Any) -> dict[str, Any]:
    """The configuration's fields, nested ones as ``a.b``, without the ignored ones."""
    flat: dict[str, Any] = {}

    def walk(values: dict[str, Any], prefix: str) -> None:
        for key, value in values.items():
            if key.startswith("_") or key in IGNORED_CONFIG_FIELDS:
                continue
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif value is not None:  # a missing field and None mean the same default
                flat[prefix + key] = _plain(value)

    walk(config.to_dict(), "")
    return flat


def _plain(value: Any) -> Any:
    """Tuples as lists, so that equal settings read from JSON or Python compare equal."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _check_buffers(base: TransformerBridge, other: TransformerBridge, label: str) -> None:
    """Buffers (rotary frequencies, causal masks) derive from the configuration: equal or refused."""
    base_buffers, other_buffers = _checkpoint_buffers(base), _checkpoint_buffers(other)
    for name in sorted(set(base_buffers) | set(other_buffers)):
        a, b = base_buffers.get(name), other_buffers.get(name)
        if a is None or b is None:
            which = "the base" if a is None else label
            raise AlignmentError(f"{which} lacks the buffer {name!r} that the other source has.")
        if a.shape != b.shape or a.device != b.device or not _close(a, b):
            raise AlignmentError(
                f"{label}'s buffer {name!r} differs from the base's by more than rounding (a "
                "buffer derived from the configuration, e.g. rotary frequencies): the sources "
                "do not compute the same function, and a graft would use the base's buffer for "
                "every source."
            )


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or for floating buffers equal to bfloat16 rounding.

    A model cast to bfloat16 and back keeps rounded rotary frequencies; that is
    not another configuration. Another ``rope_theta`` or scaling factor moves
    them by far more than 1%.
    """
    if a.is_floating_point() and b.is_floating_point():
        return torch.allclose(a.float(), b.float(), rtol=1e-2, atol=0.0)
    return a.dtype == b.dtype and torch.equal(a, b)


def _checkpoint_buffers(bridge: TransformerBridge) -> dict[str, torch.Tensor]:
    return {
        name.replace("._original_component", ""): buffer
        for name, buffer in bridge.original_model.named_buffers()
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


def _placement(bridge: TransformerBridge) -> frozenset[tuple[torch.dtype, torch.device]]:
    """The (dtype, device) pairs of a model's floating parameters (a model kept partly in
    float32, its norms say, has two)."""
    return frozenset(
        (parameter.dtype, parameter.device)
        for parameter in bridge.parameters()
        if parameter.is_floating_point()
    )


def _component_vector(source: Source, slots: Sequence[Slot]) -> torch.Tensor:
    params = [p.flatten().float() for slot in slots for p in source.weights(slot)]
    return torch.cat(params) if params else torch.zeros(0)
