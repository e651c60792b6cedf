"""The model set: aligned checkpoints, index 0 the base, that grafts and patches run on.

Grafting needs two or more checkpoints of one architecture: index 0 is the
*base* (usually the pretrained model), index 1 the *donor* (usually the
finetuned one), further indices any other checkpoint (the paper's hybrid
experiments use pretrained, task and relation models). Each is a TransformerLens 4.x
``TransformerBridge`` loaded **without weight processing** (see
:mod:`grafting_lens.models.loading`), or a source a graft reads modules from (see
:mod:`grafting_lens.models.sources`): a LoRA adapter grafted as the base's weights plus
its factors, or a checkpoint directory read lazily, component by component.
:meth:`ModelSet.memory` says what each source holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pandas as pd
import torch
from transformer_lens.model_bridge import TransformerBridge

from grafting_lens.core.errors import (
    AlignmentError,
    GraftingLensError,
    TokenError,
)
from grafting_lens.models.alignment import _placement
from grafting_lens.models.components import (
    ComponentLayout,
    Key,
    Slot,
    component_layout,
)
from grafting_lens.models.sources import (
    CheckpointSource,
    LazySource,
    Source,
    tensor_bytes,
)


class ModelSet(Sequence[TransformerBridge]):
    """Aligned checkpoints, index 0 the base; a sequence of ``TransformerBridge``.

    Create one with :func:`load_models`. ``models[i]`` is source ``i`` as a model
    that runs alone; ``models.base`` is ``models[0]``, the model every grafted run
    goes through. ``models.sources[i]`` is the source itself (see
    :mod:`grafting_lens.models.sources`): a checkpoint in memory, a lazily loaded one or a
    LoRA adapter, which grafts ask for their modules. ``models[i]`` (and iterating)
    gives each source as a model that runs alone: a LoRA adapter's is built on first
    use over the base's tensors; iterating a set with a lazily loaded donor is refused
    (it would read the donor whole as a side effect); ``models[i]`` reads it whole, with a
    :class:`~grafting_lens.core.errors.LazyLoadWarning`, or refused if it was declared for some
    components only. Grafts never need it.

    Attributes:
        names: A label per source (directory name, hub id, or ``source{i}``).
        tokenizer: The shared tokenizer (the base's).
        allow_uncovered: Whether a graft may take every component around weights that
            no component covers (see :meth:`coverage`). False by default: such a
            graft raises :class:`~grafting_lens.core.errors.ComponentError`.
        graftable: The ``(component, layer)`` pairs donors may be grafted at, as
            declared to :func:`load_models` (``components=`` / ``layers=``), or None
            for every pair. A graft taking any other pair from a donor raises
            :class:`~grafting_lens.core.errors.GraftMaskError`.
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
                    "TransformerBridges or grafting_lens.models.sources.Source objects (use "
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
        # Walking the set must not read a lazily loaded donor whole as a side effect
        # (``list(models)``, ``for model in models``, ``model in models``): refuse, and
        # say how to ask for it on purpose.
        unread = [
            f"{index} ({self.names[index]})"
            for index, source in enumerate(self._sources)
            if isinstance(source, LazySource) and not source.is_whole
        ]
        if unread:
            raise GraftingLensError(
                f"Iterating this model set would read its lazily loaded source(s) "
                f"{', '.join(unread)} whole. Walk models.sources instead (each grafts what a "
                "graft takes, nothing more), or read one on purpose with models[i] (a "
                "LazyLoadWarning says so)."
            )
        return (source.bridge for source in self._sources)

    def __repr__(self) -> str:
        names = ", ".join(
            f"{i}={name}" + ("" if source.kind == "checkpoint" else f" ({source.kind})")
            for i, (name, source) in enumerate(zip(self.names, self._sources))
        )
        return f"ModelSet({self.architecture}, {self.n_layers} layers: {names})"

    @property
    def sources(self) -> tuple[Source, ...]:
        """Every source, index 0 the base (see :mod:`grafting_lens.models.sources`)."""
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
        """The components this architecture has (see :data:`~grafting_lens.models.components.COMPONENTS`)."""
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
        :class:`~grafting_lens.core.errors.ComponentError` unless :attr:`allow_uncovered`.

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


def _component_vector(source: Source, slots: Sequence[Slot]) -> torch.Tensor:
    params = [p.flatten().float() for slot in slots for p in source.weights(slot)]
    return torch.cat(params) if params else torch.zeros(0)
