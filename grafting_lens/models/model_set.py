"""The model set: aligned checkpoints, index 0 the base, that grafts and patches run on; each
a source (:mod:`grafting_lens.models.sources`) loaded by :mod:`grafting_lens.models.loading`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pandas as pd
import torch
from transformer_lens.model_bridge import TransformerBridge

from grafting_lens.core.arguments import as_texts, is_integer, shown
from grafting_lens.core.errors import (
    AlignmentError,
    ArgumentTypeError,
    GraftingLensError,
    SelectionError,
    TokenError,
    kind,
    refuse_first,
)
from grafting_lens.models.alignment import check_placement
from grafting_lens.models.components import ComponentLayout, Key, Slot, component_layout
from grafting_lens.models.sources import (
    CheckpointSource,
    LazySource,
    Source,
    shared_bridge,
    tensor_bytes,
)


class ModelSet(Sequence[TransformerBridge]):
    """Aligned checkpoints, index 0 the base; a sequence of ``TransformerBridge``.

    Create one with :func:`load_models`. ``models.base`` (``models[0]``) is the model every
    grafted run goes through; ``models.sources[i]`` is source ``i`` as grafts see it,
    ``models[i]`` as a model that runs alone (a lazily loaded donor read whole, with a
    :class:`~grafting_lens.core.errors.LazyLoadWarning`). Iterating a set whose lazy donors
    are unread is refused: it would read them whole as a side effect.

    Attributes:
        names: A label per source (directory name, hub id, or ``source{i}``).
        allow_uncovered: Whether a graft may take every component around weights that no
            component covers (see :meth:`coverage`).
        graftable: The ``(component, layer)`` pairs donors may be grafted at, as declared
            to :func:`load_models` (``components=`` / ``layers=``), or None for every pair.
    """

    def __init__(
        self,
        sources: Sequence[TransformerBridge | Source],
        names: Sequence[str],
        allow_uncovered: bool = False,
        graftable: Iterable[Key] | None = None,
    ) -> None:
        names = check_names(names, len(sources))
        wrapped = [
            CheckpointSource(source, names[i]) if isinstance(source, TransformerBridge) else source
            for i, source in enumerate(sources)
        ]
        bad = next((i for i, source in enumerate(wrapped) if not isinstance(source, Source)), None)
        typed = isinstance(allow_uncovered, bool) and isinstance(graftable, (Iterable, type(None)))
        if bad is not None or not typed:
            raise ArgumentTypeError(
                f"allow_uncovered={shown(allow_uncovered)} (True or False), graftable="
                f"{shown(graftable):.60} (None or (component, layer) pairs): of another type."
                if bad is None
                else f"Source {bad} is a {type(wrapped[bad]).__name__}; a ModelSet holds "
                "TransformerBridges or grafting_lens.models.sources.Source objects (use "
                "load_models to load checkpoints)."
            )
        if not wrapped or not isinstance(wrapped[0], CheckpointSource):
            raise AlignmentError(
                "The base (source 0) must be a checkpoint loaded whole: every grafted run "
                "goes through its forward pass. Adapters and lazily loaded checkpoints are donors."
            )
        self._sources: tuple[Source, ...] = tuple(wrapped)
        self.names = names
        self.allow_uncovered = allow_uncovered
        self._layout = component_layout(wrapped[0].bridge)
        self.graftable = None if graftable is None else frozenset(graftable)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(source.bridge for source in self._sources[index])
        return self._sources[index].bridge

    def __len__(self) -> int:
        return len(self._sources)

    def __iter__(self) -> Iterator[TransformerBridge]:
        # ``list(models)``, ``model in models``: never read a lazy donor whole on the side.
        unread = [
            f"{index} ({self.names[index]})"
            for index, source in enumerate(self._sources)
            if isinstance(source, LazySource) and not source.is_whole
        ]
        if unread:
            raise GraftingLensError(
                f"Iterating this model set would read its lazily loaded source(s) "
                f"{', '.join(unread)} whole: walk models.sources instead, or read one on "
                "purpose with models[i]."
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

        Returns:
            One row per source: ``source``, ``name``, ``kind``, ``resident_bytes`` (held now;
            a tensor shared with an earlier source counts once), ``declared_bytes`` (a lazy
            donor's declared components, once read), ``full_bytes`` (whole in memory; an
            adapter's merged model) and ``disk_bytes`` (its weight files).
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
        """Every ``(component, layer)`` pair of the architecture, as masks address them."""
        return tuple(self._layout.slots)

    @property
    def layout(self) -> ComponentLayout:
        """Where each component lives in the bridge tree, and which parameters it holds."""
        return self._layout

    def slots(self, component: str, layer: int | None) -> tuple[Slot, ...]:
        """The places in the bridge tree that ``(component, layer)`` swaps (one, or several)."""
        return self._layout.slots[(component, layer)]

    def coverage(self) -> pd.DataFrame:
        """Every parameter of the checkpoint and the component that grafts it. A graft that
        takes every component around one no component covers is refused (``ComponentError``)
        unless :attr:`allow_uncovered`.

        Returns:
            One row per checkpoint parameter: ``parameter``, ``component`` (``+``-joined when
            shared: ``embed+unembed``, ``q+k+v``; empty when uncovered), ``layer``
            (``<NA>`` outside the blocks), ``path``, ``shape``, ``size`` and ``covered``.
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
        """How many positions the model embeds, for learned position embeddings (GPT-2);
        ``None`` for models without a ``pos_embed`` component (rotary models)."""
        return int(self.base.cfg.n_ctx) if "pos_embed" in self.components else None

    @property
    def device(self) -> torch.device:
        """Device of the base's parameters."""
        return next(self.base.original_model.parameters()).device

    def check_tokens(self, tokens: object, name: str = "tokens") -> tuple[int, int]:
        """Check that ``tokens`` is a ``[batch, pos]`` tensor of ids this model set can run: the
        one token check of the package. Any integer dtype is accepted (:func:`token_ids`).

        Args:
            tokens: The candidate token ids.
            name: What to call them in the message (``"patch_tokens"``...).

        Returns:
            ``(batch, pos)``.

        Raises:
            TokenError: Not a two-dimensional tensor of integer ids with values, empty, an
                id outside the vocabulary, or more positions than :attr:`max_positions`.
        """
        message = None
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            got = (
                f"shape {list(tokens.shape)}"
                if isinstance(tokens, torch.Tensor)
                else type(tokens).__name__
            )
            message = (
                f"{name} must be a [batch, pos] tensor of token ids (models.base.to_tokens(...) "
                f"or the tokenizer), got {got}."
            )
        elif tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            message = f"{name} must hold integer token ids, got {tokens.dtype}."
        elif tokens.numel() == 0:
            message = (
                f"{name} is empty (shape {list(tokens.shape)}): a run needs at least one row of "
                "at least one token. Check the tokenization (an empty prompt?)."
            )
        elif tokens.device.type == "meta":
            message = f"{name} is on the meta device, which holds no values: make it on the CPU."
        else:
            vocab, limit = int(self.base.cfg.d_vocab), self.max_positions
            ids = token_ids(tokens)  # torch has no min/max for wide unsigned types
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= vocab:
                message = (
                    f"Token ids in {name} must lie in 0..{vocab - 1}, the model's vocabulary; "
                    f"got {low}..{high}."
                )
            elif limit is not None and tokens.shape[1] > limit:
                message = (
                    f"The tokens have {tokens.shape[1]} positions, but {self.architecture} "
                    f"learned position embeddings for {limit}: truncate or split the prompts."
                )
        if message is not None:
            raise (TokenError if isinstance(tokens, torch.Tensor) else ArgumentTypeError)(message)
        assert isinstance(tokens, torch.Tensor)
        return (int(tokens.shape[0]), int(tokens.shape[1]))

    def check_placement(
        self, sources: Iterable[int], what: str = "This run", *, pairs: Iterable[Key] | None = None
    ) -> None:
        """Refuse sources cast or moved since :func:`~grafting_lens.load_models` placed them: the
        one placement check (:func:`~grafting_lens.models.alignment.check_placement`).

        Args:
            sources: The sources a run uses (the base, 0, is the reference).
            what: What runs them, for the message.
            pairs: The ``(component, layer)`` pairs a graft takes from them: only their
                modules are compared, and no source is read whole. ``None``: each source's
                whole model, as a run of it alone uses it.

        Raises:
            AlignmentError: A tensor of another dtype or on another device than the base's.
        """
        for index in sorted(set(sources) - {0}):
            label = f"{what}: source {index} ({self.names[index]})"
            if pairs is None:
                check_placement(self.base, self[index], label)
                continue
            for component, layer in pairs:
                where = component if layer is None else f"{component} at layer {layer}"
                for slot in self.slots(component, layer):
                    source = self._sources[index].module(slot)
                    check_placement(slot.module(self.base), source, f"{label}'s {where}")

    def weight_diff(self) -> pd.DataFrame:
        """Relative change ``||theta_i - theta_0|| / ||theta_0||`` of every component of every
        donor: a first look at what finetuning moved, and where a graft can matter.

        Returns:
            One row per donor, component and layer: ``source``, ``name``, ``component``,
            ``layer`` (``<NA>`` for global components), ``relative_change``, ``base_norm``.
        """
        rows = []
        for source in range(1, len(self)):
            for component, layer in self.pairs:
                slots = self.slots(component, layer)
                base = _component_vector(self._sources[0], slots)
                norm = float(base.norm())
                change = float((_component_vector(self._sources[source], slots) - base).norm())
                relative = change / norm if norm else float("nan")
                rows.append((source, self.names[source], component, layer, relative, norm))
        columns = ["source", "name", "component", "layer", "relative_change", "base_norm"]
        frame = pd.DataFrame(rows, columns=columns)
        frame["layer"] = frame["layer"].astype("Int64")  # <NA> for global components
        return frame

    def directions(
        self,
        donor: int | str = 1,
        *,
        rank: Any = None,
        strength: Any = 1.0,
        name: str | None = None,
    ) -> ModelSet:
        """This model set with one more donor, last: ``donor``'s change to each weight matrix
        cut to ``rank`` directions and times ``strength``, each one value or one per cell
        ``{(component, layer): value}`` (:mod:`~grafting_lens.models.directions`).

        Raises:
            SelectionError: An unknown donor, one equal to the base, a negative rank, a
                strength not finite.
        """
        from grafting_lens.models.directions import DirectionsSource

        index = self.names.index(donor) if isinstance(donor, str) and donor in self.names else donor
        if not (is_integer(index) and 1 <= int(index) < len(self)):
            raise kind(donor, (int, str), SelectionError)(
                f"donor={shown(donor)} is not a donor of this model set: give an index "
                f"1..{len(self) - 1} or a name of {list(self.names[1:])}."
            )
        shown_rank, shown_strength = (
            "per cell" if isinstance(v, Mapping) else v for v in (rank, strength)
        )
        settings = "" if rank is None else f"rank={shown_rank}"
        settings += "" if strength == 1 else f"{',' if settings else ''}strength={shown_strength}"
        label = name or f"{self.names[int(index)]}[{settings or 'all'}]"
        source = DirectionsSource(
            label,
            self._sources[0],
            self._sources[int(index)],
            rank=rank,
            strength=strength,
            make_bridge=lambda: shared_bridge(self.base),
        )
        return ModelSet(
            [*self._sources, source],
            [*self.names, label],
            allow_uncovered=self.allow_uncovered,
            graftable=self.graftable,
        )


def token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """Token ids as torch's embedding takes them: ``int64``, or ``int32`` left as it is, so
    that ``uint8`` or ``int16`` ids (a compact dataset) run as the same ids."""
    return tokens if tokens.dtype in (torch.int64, torch.int32) else tokens.to(torch.int64)


def _component_vector(source: Source, slots: Sequence[Slot]) -> torch.Tensor:
    params = [p.flatten().float() for slot in slots for p in source.weights(slot)]
    return torch.cat(params) if params else torch.zeros(0)


def check_names(names: object, count: int) -> tuple[str, ...]:
    """``names`` as ``count`` distinct labels, one per source, for tables and figures.

    Raises:
        GraftingLensError: Not a list of non-empty strings, another count, or a label twice.
    """
    labels = as_texts(names, "names", "one label per source", GraftingLensError)
    twice = min((label for label in labels if labels.count(label) > 1), default=None)
    refuse_first(
        GraftingLensError,
        [
            (len(labels) != count, f"Got {len(labels)} names for {count} sources."),
            (twice, f"names={labels!r} gives {twice!r} twice: each source needs its own label."),
        ],
    )
    return tuple(labels)


def check_model_set(models: object) -> None:
    """Refuse anything but a :class:`~grafting_lens.ModelSet` (a ``TypeError``)."""
    if not isinstance(models, ModelSet):
        raise ArgumentTypeError(
            f"models must be a ModelSet, got {type(models).__name__}. Load the checkpoints with "
            "grafting_lens.load_models(base, donor, ...)."
        )
