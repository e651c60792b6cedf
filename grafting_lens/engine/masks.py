"""Graft masks: which checkpoint computes each component, layer and position.

A :class:`GraftMask` holds, for every ``(component, layer)`` pair, a
``[batch, pos]`` integer tensor of *source indices* into a
:class:`~grafting_lens.ModelSet`: ``0`` is the base, ``1`` the donor, ``2`` and on
any further checkpoint. A pair that is absent means "source 0 everywhere", so a
mask only stores what it changes. Global components use ``layer=None``.

Each row of a mask is one configuration of one prompt. Because rows are
independent, many configurations of the same prompt (PRE, FE, LT, FE+LT...) run
as rows of a single batch: build one mask per configuration and join them with
:meth:`GraftMask.cat`.

Three ways to build one:

* :meth:`GraftMask.from_dict`, the raw form, ``{("q", 3): tensor, ...}``;
* :meth:`GraftMask.build` for people: positions (see :mod:`grafting_lens.engine.positions`),
  layers (see :func:`~grafting_lens.models.layers.resolve_layers`), components (names or groups, see
  :mod:`grafting_lens.models.components`) and the source to take them from;
* :meth:`GraftMask.union` of several grafts, e.g. the paper's hybrid graft (task
  model's attention at FE and LT, relation model's O and FFN at LT).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Union

import pandas as pd
import torch
from jaxtyping import Int

from grafting_lens.core.arguments import is_integer
from grafting_lens.core.errors import ComponentError, GraftMaskError, did_you_mean
from grafting_lens.engine.positions import (
    PositionSpec,
    check_padding,
    resolve_positions,
    row_lengths,
)
from grafting_lens.models.components import (
    COMPONENT_GROUPS,
    COMPONENT_LABELS,
    COMPONENTS,
    GLOBAL_COMPONENTS,
    LAYER_COMPONENTS,
    canonical_component_name,
    expand_components,
    leftover_parameters,
)
from grafting_lens.models.layers import LAYER_FRACTIONS, LayerSpec, resolve_layers  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from grafting_lens.models.model_set import ModelSet

Key = tuple[str, Union[int, None]]
"""A ``(component, layer)`` pair; ``layer`` is None for global components."""

# LAYER_FRACTIONS, LayerSpec and resolve_layers live in grafting_lens.models.layers; they stay
# importable from here because masks were their first home.


class GraftMask:
    """Source indices for every ``(component, layer)`` pair and token position.

    Build one with :meth:`from_dict`, :meth:`build`, :meth:`union` or :meth:`cat`
    rather than the constructor, which trusts its arguments (it only moves the tensors
    to the CPU, where masks are kept whatever device the models are on).

    Attributes:
        shape: ``(batch, pos)`` of the tokens the mask is for.
        n_sources: Number of checkpoints in the model set it was built for.
        lengths: ``[batch]``, the number of real tokens of each row the mask was
            built for: from the attention mask given to :meth:`build` or
            :meth:`from_dict` (every row full when :meth:`build` got none), or
            ``None`` when unknown. A grafted run whose attention mask gives other
            lengths is refused, so "last" means the same token in the mask and
            in the run.
    """

    def __init__(
        self,
        entries: Mapping[Key, Int[torch.Tensor, "batch pos"]],
        shape: tuple[int, int],
        n_sources: int,
        lengths: Int[torch.Tensor, " batch"] | None = None,
    ) -> None:
        self.shape = (int(shape[0]), int(shape[1]))
        self.n_sources = int(n_sources)
        self.lengths = None if lengths is None else torch.as_tensor(lengths, dtype=torch.long).cpu()
        if self.lengths is not None and tuple(self.lengths.shape) != (self.shape[0],):
            raise GraftMaskError(
                f"lengths has shape {tuple(self.lengths.shape)}, expected one length per row "
                f"({self.shape[0]},)."
            )
        # Only pairs that graft something are stored: an all-zero pair is the base. On the
        # CPU, as from_dict keeps them: masks combine (union, cat, check_rows) on one device,
        # and a grafted run moves them to the models'. Pairs that share a tensor keep sharing.
        on_cpu: dict[int, torch.Tensor] = {}
        self._entries: dict[Key, torch.Tensor] = {}
        for key, value in entries.items():
            value = on_cpu.setdefault(id(value), value.cpu())
            if bool(value.any()):
                self._entries[key] = value

    # ----------------------------------------------------------------- access
    def keys(self) -> list[Key]:
        """The ``(component, layer)`` pairs that graft at least one position."""
        return sorted(self._entries, key=_key_order)

    def __getitem__(self, key: Key) -> Int[torch.Tensor, "batch pos"]:
        """Source indices of one pair (zeros, the base, if the pair grafts nothing)."""
        if key in self._entries:
            return self._entries[key]
        return torch.zeros(self.shape, dtype=torch.long)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return self.shape[0]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GraftMask):
            return NotImplemented
        return (
            self.shape == other.shape
            and self.n_sources == other.n_sources
            and self._entries.keys() == other._entries.keys()
            and all(torch.equal(v, other._entries[k]) for k, v in self._entries.items())
        )

    def __repr__(self) -> str:
        return (
            f"GraftMask(batch={self.shape[0]}, pos={self.shape[1]}, sources={self.n_sources}, "
            f"grafted pairs={len(self._entries)})"
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per grafted ``(component, layer)`` and source, with position counts.

        A quick way to check a mask says what you meant before running it. The
        ``layer`` column is an integer column, ``<NA>`` for global components.
        """
        rows = []
        for component, layer in self.keys():
            values = self._entries[(component, layer)]
            for source in range(1, self.n_sources):
                count = int((values == source).sum())
                if count:
                    rows.append(
                        {
                            "component": component,
                            "layer": layer,
                            "source": source,
                            "positions": count,
                        }
                    )
        frame = pd.DataFrame(rows, columns=["component", "layer", "source", "positions"])
        frame["layer"] = frame["layer"].astype("Int64")  # <NA> for global components
        return frame

    # --------------------------------------------------------------- builders
    @classmethod
    def from_dict(
        cls,
        models: ModelSet,
        entries: Mapping[Key, torch.Tensor],
        shape: tuple[int, int] | None = None,
        *,
        attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    ) -> GraftMask:
        """The raw form: ``{(component, layer): [batch, pos] source indices}``.

        Args:
            models: The model set the mask will run on.
            entries: Per pair, an integer tensor of source indices (booleans are
                accepted when there are exactly two sources). Missing pairs mean
                source 0. ``layer`` is None for global components.
            shape: ``(batch, pos)``; required when ``entries`` is empty.
            attention_mask: ``[batch, pos]`` right padding of the tokens the mask
                is for. Given, the mask records each row's length (see
                :attr:`lengths`) and refuses entries that graft a padding position.

        Raises:
            ComponentError: An unknown component, one the architecture lacks (at
                that layer), or a graft of every component around parameters no
                component covers (see :meth:`~grafting_lens.models.model_set.ModelSet.coverage`).
            GraftMaskError: A bad layer, a tensor of another shape or dtype, a
                source index out of range, or a graft at a padding position.
        """
        if shape is None:
            if not entries:
                raise GraftMaskError("An empty mask needs an explicit shape=(batch, pos).")
            given: tuple[int, ...] = tuple(torch.as_tensor(next(iter(entries.values()))).shape)
        else:
            given = tuple(shape)
        if len(given) != 2:
            raise GraftMaskError(f"A mask has shape (batch, pos), got {given}.")
        size = (int(given[0]), int(given[1]))
        n_sources = len(models)
        checked: dict[Key, torch.Tensor] = {}
        for key, value in entries.items():
            key = _check_key(key, models)
            value = torch.as_tensor(value)
            if tuple(value.shape) != size:
                raise GraftMaskError(
                    f"The mask for {key} has shape {tuple(value.shape)}, expected {size} "
                    "(batch, pos) like the tokens."
                )
            if value.dtype == torch.bool:
                if n_sources != 2:
                    raise GraftMaskError(
                        f"A boolean mask is ambiguous with {n_sources} sources: give integer "
                        "source indices."
                    )
                value = value.long()
            elif value.is_floating_point() or value.is_complex():
                raise GraftMaskError(
                    f"The mask for {key} must hold integer source indices, got {value.dtype}."
                )
            value = value.to(device="cpu", dtype=torch.long)
            if value.numel() and (int(value.min()) < 0 or int(value.max()) >= n_sources):
                bad = int(value.max()) if int(value.max()) >= n_sources else int(value.min())
                raise GraftMaskError(
                    f"The mask for {key} names source {bad}, but the model set has "
                    f"{n_sources} sources (0..{n_sources - 1})."
                )
            if key in checked:
                raise GraftMaskError(f"{key} is given twice.")
            checked[key] = value
        mask = cls(checked, size, n_sources)
        check_leftovers(models, mask.keys())
        if attention_mask is not None:
            mask.lengths = row_lengths(mask.shape, attention_mask)
            mask.check_rows(attention_mask)
        return mask

    @classmethod
    def build(
        cls,
        models: ModelSet,
        tokens: torch.Tensor | tuple[int, int],
        *,
        positions: PositionSpec = "all",
        layers: LayerSpec = "all",
        components: str | Iterable[str] = "all",
        source: int = 1,
        attention_mask: torch.Tensor | None = None,
    ) -> GraftMask:
        """One graft: take ``components`` at ``layers`` and ``positions`` from ``source``.

        Args:
            models: The model set the mask will run on.
            tokens: The ``[batch, pos]`` tokens, or just their shape.
            positions: Where to graft (see :func:`~grafting_lens.engine.positions.resolve_positions`):
                ``"all"``, ``"last"``, indices, per-row lists or a boolean tensor.
            layers: Which layers (see :func:`resolve_layers`); global components
                (embed, pos_embed, ln_final, unembed) ignore it.
            components: Names, groups (``"attn"``, ``"ffn"``, ``"block"``, ``"all"``),
                the paper's labels (``"O"``, ``"FFN-up"``, ``"FFN-down"``, any case) or
                a ``+``-joined string such as ``"O+FFN"``. A group or label takes, at
                each layer, the members that layer has; a component named alone must
                exist at every selected layer.
            source: Index of the checkpoint to take the weights from.
            attention_mask: ``[batch, pos]`` right padding; padding is never grafted.
                The mask remembers each row's length (:attr:`lengths`) and a run
                with another attention mask is refused. Without one every position
                is real, and tokens whose rows end in the pad token are refused
                (pass the attention mask of a padded batch).

        Raises:
            GraftMaskError: A bad source, layer or position, or padded tokens
                without their attention mask.
            TokenError: Tokens no run accepts (see
                :meth:`~grafting_lens.models.model_set.ModelSet.check_tokens`): empty, not integer
                ids, ids outside the vocabulary.
            SelectionError: Positions that select nothing, or a selector of a type it
                cannot read.
            ComponentError: An unknown component, or one the architecture lacks.

        Examples:
            >>> mask = GraftMask.build(models, tokens, positions="last",
            ...                        layers="last_half", components="o+ffn")
        """
        shape = _tokens_shape(tokens)
        if not isinstance(components, str) and isinstance(components, Iterable):
            components = list(components)  # read twice below: an iterator only once
        if not is_integer(source) or not 0 <= source < len(models):
            raise GraftMaskError(
                f"source={source!r}, but the model set has {len(models)} sources: give an int "
                f"0..{len(models) - 1}."
            )
        source = int(source)
        if isinstance(tokens, torch.Tensor):
            # The check every run makes: a mask for tokens no run accepts fails here, first.
            models.check_tokens(tokens)
            check_padding(tokens, attention_mask, models.tokenizer)
        elif min(shape) < 1:
            raise GraftMaskError(
                f"tokens=(batch, pos) = {shape} describes no token: a mask needs at least one "
                "row of at least one position. Pass the tokens themselves, or their shape."
            )
        selected = resolve_positions(positions, shape, attention_mask)
        names = expand_components(components, models.components, models.architecture)
        layer_list = resolve_layers(layers, models.n_layers)
        value = selected.long() * source
        present = set(models.pairs)
        entries: dict[Key, torch.Tensor] = {}
        for name in names:
            for layer in layer_list if name in LAYER_COMPONENTS else (None,):
                if (name, layer) in present:
                    entries[(name, layer)] = value
        named = components.split("+") if isinstance(components, str) else list(components)
        for name in (canonical_component_name(part) for part in named):
            if name not in COMPONENT_GROUPS and name not in COMPONENT_LABELS:
                for layer in layer_list if name in LAYER_COMPONENTS else (None,):
                    _check_present(models, name, layer)
        mask = cls.from_dict(models, entries, shape)
        mask.lengths = row_lengths(mask.shape, attention_mask)
        return mask

    @classmethod
    def union(cls, *masks: GraftMask, on_conflict: str = "error") -> GraftMask:
        """Combine grafts: each cell takes the non-base source any mask gives it.

        Args:
            masks: Masks of one shape for one model set.
            on_conflict: What to do where two masks name different non-base
                sources for the same cell: ``"error"`` (the default) or ``"last"``
                (the later mask wins, like painting over).

        Raises:
            GraftMaskError: Masks of different shapes or source counts, or a
                conflict with ``on_conflict="error"``.
        """
        if on_conflict not in ("error", "last"):
            raise GraftMaskError(f"on_conflict must be 'error' or 'last', got {on_conflict!r}.")
        if len(masks) == 1 and isinstance(masks[0], (list, tuple)):
            masks = tuple(masks[0])
        first = _check_compatible(masks)
        combined: dict[Key, torch.Tensor] = {}
        for mask in masks:
            for key, value in mask._entries.items():
                if key not in combined:
                    combined[key] = value.clone()
                    continue
                current = combined[key]
                clash = (current != 0) & (value != 0) & (current != value)
                if clash.any() and on_conflict == "error":
                    row, position = (int(i) for i in clash.nonzero()[0])
                    raise GraftMaskError(
                        f"Grafts disagree at {key}, row {row}, position {position}: source "
                        f"{int(current[row, position])} vs {int(value[row, position])}. Pass "
                        "on_conflict='last' to let the later graft win."
                    )
                combined[key] = torch.where(value != 0, value, current)
        known = [mask.lengths for mask in masks if mask.lengths is not None]
        for lengths in known[1:]:
            if not torch.equal(lengths, known[0]):
                raise GraftMaskError(
                    "The masks were built for rows of different lengths (different attention "
                    "masks); build every graft of a union from the same tokens and attention mask."
                )
        return cls(combined, first.shape, first.n_sources, known[0] if known else None)

    @classmethod
    def cat(cls, masks: Sequence[GraftMask]) -> GraftMask:
        """Stack masks along the batch: one block of rows per configuration.

        The tokens must be stacked the same way (e.g. ``tokens.repeat(k, 1)`` for
        ``k`` configurations of the same prompts).
        """
        masks = list(masks)
        if not masks:
            raise GraftMaskError("GraftMask.cat needs at least one mask.")
        n_sources = masks[0].n_sources
        positions = masks[0].shape[1]
        for mask in masks:
            if mask.n_sources != n_sources or mask.shape[1] != positions:
                raise GraftMaskError(
                    "GraftMask.cat needs masks with the same number of positions and sources, "
                    f"got {masks[0].shape}/{n_sources} and {mask.shape}/{mask.n_sources}."
                )
        keys = {key for mask in masks for key in mask._entries}
        entries = {key: torch.cat([mask[key] for mask in masks], dim=0) for key in keys}
        batch = sum(mask.shape[0] for mask in masks)
        known = [mask.lengths for mask in masks if mask.lengths is not None]
        lengths = torch.cat(known) if len(known) == len(masks) else None
        return cls(entries, (batch, positions), n_sources, lengths)

    def extend(self, new_positions: int) -> GraftMask:
        """Append ``new_positions`` columns that repeat each row's last column.

        Used for tokens generated after a prompt: every ``(component, layer)`` keeps,
        in each row, the source it had at the row's last position.
        """
        if not is_integer(new_positions) or new_positions < 0:
            raise GraftMaskError(f"new_positions must be an int >= 0, got {new_positions!r}.")
        new_positions = int(new_positions)
        batch, positions = self.shape
        if self.lengths is not None and bool((self.lengths < positions).any()):
            raise GraftMaskError(
                "extend continues each row after its last column, but this mask was built for "
                "padded rows, whose last column is padding. Extend a mask of unpadded tokens."
            )
        entries = {
            key: torch.cat([value, value[:, -1:].expand(batch, new_positions)], dim=1)
            for key, value in self._entries.items()
        }
        lengths = None if self.lengths is None else self.lengths + new_positions
        return GraftMask(entries, (batch, positions + new_positions), self.n_sources, lengths)

    def check_rows(self, attention_mask: Int[torch.Tensor, "batch pos"] | None) -> None:
        """Refuse running this mask under an attention mask it was not built for.

        A grafted run calls this with its own attention mask (``None``: no
        padding). The rows' lengths must equal :attr:`lengths` when the mask
        knows them, and no position the run treats as padding may be grafted:
        either would mean the mask's "last token" is not the run's.

        Raises:
            GraftMaskError: Lengths that disagree, or a graft at a padding position.
        """
        lengths = row_lengths(self.shape, attention_mask)
        if self.lengths is not None and not torch.equal(lengths, self.lengths):
            row = int((lengths != self.lengths).nonzero()[0])
            raise GraftMaskError(
                f"The mask was built for rows of other lengths than this run's attention mask "
                f"gives (row {row}: {int(self.lengths[row])} real tokens in the mask, "
                f"{int(lengths[row])} in the run), so its positions ('last', spans) are not "
                "the run's. Build the mask with the run's attention mask: "
                "GraftMask.build(..., attention_mask=attention_mask)."
            )
        padding = torch.arange(self.shape[1])[None, :] >= lengths[:, None]
        if not bool(padding.any()):
            return
        checked: set[int] = set()
        for key, value in self._entries.items():
            if id(value) in checked:  # pairs often share one tensor
                continue
            checked.add(id(value))
            grafted = (value != 0) & padding
            if bool(grafted.any()):
                row, position = (int(i) for i in grafted.nonzero()[0])
                raise GraftMaskError(
                    f"The mask grafts {key} at row {row}, position {position}, which this run's "
                    f"attention mask makes padding (the row has {int(lengths[row])} real "
                    "tokens): the mask was built for other rows. Build it with the run's "
                    "attention mask (GraftMask.build(..., attention_mask=...), or "
                    "from_dict(..., attention_mask=...))."
                )


def _tokens_shape(tokens: object) -> tuple[int, int]:
    if isinstance(tokens, torch.Tensor):
        shape = tuple(tokens.shape)
    elif isinstance(tokens, tuple) and all(is_integer(n) for n in tokens):
        shape = tokens
    else:
        raise TypeError(
            f"tokens must be a [batch, pos] tensor of token ids or a (batch, pos) tuple, got "
            f"{type(tokens).__name__}. Tokenize with the tokenizer or models.base.to_tokens(...)."
        )
    if len(shape) != 2:
        raise GraftMaskError(f"tokens must be [batch, pos], got shape {shape}.")
    return (int(shape[0]), int(shape[1]))


def _check_key(key: object, models: ModelSet) -> Key:
    if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)):
        raise GraftMaskError(
            f"Mask keys are (component, layer) pairs such as ('q', 3) or ('embed', None), got {key!r}."
        )
    component, layer = key
    if component not in COMPONENTS:
        raise ComponentError(
            f"Unknown component {component!r}.{did_you_mean(component, COMPONENTS)} "
            f"Known components: {', '.join(COMPONENTS)}."
        )
    if component not in models.components:
        raise ComponentError(
            f"{models.architecture} has no {component!r} component. Its components are: "
            f"{', '.join(models.components)}."
        )
    if component in GLOBAL_COMPONENTS:
        if layer is not None:
            raise GraftMaskError(
                f"{component!r} is a global component: use ({component!r}, None), not layer {layer}."
            )
        return (component, None)
    if not is_integer(layer):
        raise GraftMaskError(f"{component!r} exists per layer: give an int layer, got {layer!r}.")
    layer = resolve_layers(int(layer), models.n_layers)[0]
    _check_present(models, component, layer)
    return (component, layer)


def _check_present(models: ModelSet, component: str, layer: int | None) -> None:
    """Refuse a component at a layer that lacks it (dense layers of a mixture-of-experts stack)."""
    if (component, layer) in models.layout.slots:
        return
    layers = [str(at) for name, at in models.pairs if name == component]
    raise ComponentError(
        f"{models.architecture} has no {component!r} at layer {layer}; it has one at layers "
        f"{', '.join(layers)}. Name those layers, or use a group (ffn, block), which takes "
        "what each layer has."
    )


def check_leftovers(models: ModelSet, keys: Iterable[Key]) -> None:
    """Refuse a graft that takes every component around parameters no component covers.

    Such a graft would run the donor's weights everywhere there except those
    parameters, which stay the base's: a partial graft nobody asked for.
    ``models.allow_uncovered`` turns the check off.

    Raises:
        ComponentError: The parameters left behind, and what to do.
    """
    if models.allow_uncovered:
        return
    left = leftover_parameters(models.layout, keys)
    if not left:
        return
    shown = ", ".join(
        f"{record.name} (at {record.path or 'no bridge component'})" for record in left[:4]
    )
    more = f" and {len(left) - 4} more" if len(left) > 4 else ""
    raise ComponentError(
        f"This graft takes every component around {len(left)} parameter(s) of "
        f"{models.architecture} that no component covers: {shown}{more}. Those would keep the "
        "base's values while everything around them is grafted. models.coverage() lists every "
        "parameter and its component. Graft only named components, name the missing weights "
        "with register_component_paths(...), or pass allow_uncovered=True to load_models to "
        "graft what the components cover."
    )


def _check_compatible(masks: Sequence[GraftMask]) -> GraftMask:
    if not masks:
        raise GraftMaskError("Need at least one mask.")
    first = masks[0]
    for mask in masks[1:]:
        if mask.shape != first.shape or mask.n_sources != first.n_sources:
            raise GraftMaskError(
                f"Masks differ: shape {first.shape} with {first.n_sources} sources vs "
                f"{mask.shape} with {mask.n_sources}."
            )
    return first


def _key_order(key: Key) -> tuple[int, int]:
    """Order pairs as the residual stream meets them: embeddings, layers, final norm."""
    component, layer = key
    if layer is None:
        depth = -1 if COMPONENTS.index(component) < COMPONENTS.index(LAYER_COMPONENTS[0]) else 10**9
    else:
        depth = layer
    return (depth, COMPONENTS.index(component))
