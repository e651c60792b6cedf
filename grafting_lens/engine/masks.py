"""Graft masks: which checkpoint computes each component, layer and position.

A :class:`GraftMask` holds, for every ``(component, layer)`` pair (``layer=None`` for a
global component), a ``[batch, pos]`` integer tensor of *source indices* into a
:class:`~grafting_lens.ModelSet`: ``0`` the base, ``1`` the donor, ``2`` and on any further
checkpoint; an absent pair is source 0 everywhere. Each row is one configuration of one
prompt, so many configurations run as rows of one batch (:meth:`GraftMask.cat`). Build one
with :meth:`GraftMask.build` (positions, layers, components, source),
:meth:`GraftMask.from_dict` (``{("q", 3): tensor, ...}``) or :meth:`GraftMask.union` of
several grafts (the paper's hybrid graft).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Union

import pandas as pd
import torch
from jaxtyping import Int

from grafting_lens.core.arguments import is_integer
from grafting_lens.core.errors import (
    ArgumentTypeError,
    ComponentError,
    GraftingLensError,
    GraftMaskError,
    TokenError,
    did_you_mean,
    kind,
)
from grafting_lens.engine.positions import (
    PositionSpec,
    check_padding,
    row_lengths,
    selected_positions,
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
from grafting_lens.models.layers import LayerSpec, resolve_layers
from grafting_lens.models.model_set import check_model_set

if TYPE_CHECKING:
    from grafting_lens.models.model_set import ModelSet

Key = tuple[str, Union[int, None]]
"""A ``(component, layer)`` pair; ``layer`` is None for global components."""


class GraftMask:
    """Source indices for every ``(component, layer)`` pair and token position.

    Build one with :meth:`from_dict`, :meth:`build`, :meth:`union` or :meth:`cat` rather than
    the constructor, which trusts its arguments (it only moves the tensors to the CPU).

    Attributes:
        shape: ``(batch, pos)`` of the tokens the mask is for.
        n_sources: Number of checkpoints in the model set it was built for.
        lengths: ``[batch]``, each row's real tokens as the mask was built for them (from
            the attention mask given to :meth:`build` or :meth:`from_dict`; every row full
            when :meth:`build` got none), or ``None`` when unknown. A run with other lengths
            is refused, so "last" means the same token in the mask and in the run.
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
        # Only pairs that graft something are stored, on the CPU (masks combine on one
        # device); pairs that share a tensor keep sharing it.
        kept: dict[int, torch.Tensor | None] = {}
        self._entries: dict[Key, torch.Tensor] = {}
        for key, value in entries.items():
            if id(value) not in kept:
                kept[id(value)] = value.cpu() if bool(value.any()) else None
            stored = kept[id(value)]
            if stored is not None:
                self._entries[key] = stored

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
        """One row per grafted ``(component, layer)`` and source, with position counts: a
        quick check that a mask says what you meant (``layer`` is ``<NA>`` for a global one)."""
        rows = [
            {"component": component, "layer": layer, "source": source, "positions": count}
            for component, layer in self.keys()
            for source, count in enumerate(
                torch.bincount(self._entries[(component, layer)].flatten()).tolist()
            )
            if source and count
        ]
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
            entries: Per pair, an integer tensor of source indices (booleans with exactly
                two sources); missing pairs mean source 0; ``layer`` is None for globals.
            shape: ``(batch, pos)``; required when ``entries`` is empty.
            attention_mask: ``[batch, pos]`` right padding of the tokens the mask is for:
                the mask records each row's length (:attr:`lengths`) and refuses entries
                that graft a padding position.

        Raises:
            ComponentError: An unknown component, one the architecture lacks (at that
                layer), or a graft of every component around parameters no component
                covers (see :meth:`~grafting_lens.models.model_set.ModelSet.coverage`).
            GraftMaskError: A bad key or shape, a tensor that is not source indices of the
                model set, a pair given twice, or a graft at a padding position.
        """
        check_model_set(models)
        given = shape if shape is not None or not entries else next(iter(entries.values())).shape
        if given is None or len(given) != 2:
            raise GraftMaskError(
                f"A mask has shape (batch, pos): give shape=(batch, pos) (required for an "
                f"empty mask); got {None if given is None else tuple(given)}."
            )
        size = (int(given[0]), int(given[1]))
        checked: dict[Key, torch.Tensor] = {}
        for key, value in entries.items():
            key = checked_key(models, key)
            if key in checked:
                raise GraftMaskError(f"{key} is given twice (as {list(entries)}).")
            checked[key] = _source_indices(key, value, size, len(models))
        mask = cls(checked, size, len(models))
        check_leftovers(models, mask.keys())
        if attention_mask is not None:
            mask.lengths = mask.check_rows(attention_mask)
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
            layers: Which layers (see :func:`~grafting_lens.models.layers.resolve_layers`);
                global components (embed, pos_embed, ln_final, unembed) ignore it.
            components: Names, groups (``"attn"``, ``"ffn"``, ``"block"``, ``"all"``), the
                paper's labels (``"O"``, ``"FFN-up"``, ``"FFN-down"``, any case) or a
                ``+``-joined string such as ``"O+FFN"``. A group or label takes, at each
                layer, the members it has; a component named alone must be at every layer.
            source: Index of the checkpoint to take the weights from.
            attention_mask: ``[batch, pos]`` right padding, never grafted; the mask remembers
                each row's length (:attr:`lengths`) and a run with another one is refused.
                Without one every position is real (rows ending in the pad token refused).

        Raises:
            GraftMaskError: A bad source, layer or position, or padded tokens
                without their attention mask.
            TokenError: Tokens no run accepts (see
                :meth:`~grafting_lens.models.model_set.ModelSet.check_tokens`).
            SelectionError: Positions that select nothing, or of a form it cannot read.
            ComponentError: An unknown component, or one the architecture lacks.

        Examples:
            >>> mask = GraftMask.build(models, tokens, positions="last",
            ...                        layers="last_half", components="o+ffn")
        """
        check_model_set(models)
        if isinstance(tokens, torch.Tensor):
            # The check every run makes: a mask for tokens no run accepts fails here, first.
            shape = models.check_tokens(tokens)
            check_padding(tokens, attention_mask, models.tokenizer)
        elif (
            isinstance(tokens, tuple)
            and all(is_integer(n) and n >= 1 for n in tokens)
            and len(tokens) == 2
        ):
            shape = (int(tokens[0]), int(tokens[1]))
        else:
            raise kind(tokens, (tuple, list, torch.Size), TokenError)(
                f"tokens=(batch, pos) = {tokens!r} describes no token: give the [batch, pos] "
                "token ids (the tokenizer's, or models.base.to_tokens(...)) or their shape, a "
                "tuple of two ints >= 1."
            )
        check_source(models, source, allow_base=True, error=GraftMaskError)
        if not isinstance(components, (str, torch.Tensor)) and isinstance(components, Iterable):
            components = list(components)  # read twice below: an iterator only once
        lengths = row_lengths(shape, attention_mask)
        value = selected_positions(positions, lengths, shape[1]).long() * int(source)
        names = expand_components(components, models.components, models.architecture)
        layer_list = resolve_layers(layers, models.n_layers)
        named = components.split("+") if isinstance(components, str) else list(components)
        for name in map(canonical_component_name, named):
            if name not in COMPONENT_GROUPS and name not in COMPONENT_LABELS:
                check_component(models, name, layer_list if name in LAYER_COMPONENTS else (None,))
        entries = {
            (name, layer): value
            for name in names
            for layer in (layer_list if name in LAYER_COMPONENTS else (None,))
            if (name, layer) in models.layout.slots
        }
        mask = cls(entries, shape, len(models), lengths)
        check_leftovers(models, mask.keys())
        return mask

    @classmethod
    def union(cls, *masks: GraftMask, on_conflict: str = "error") -> GraftMask:
        """Combine grafts: each cell takes the non-base source any mask gives it.

        Args:
            masks: Masks of one shape for one model set, built for the same rows.
            on_conflict: Where two masks name different non-base sources for one cell:
                ``"error"`` (the default) or ``"last"`` (the later mask wins).

        Raises:
            GraftMaskError: Masks of different shapes, source counts or row lengths, or
                a conflict with ``on_conflict="error"``.
        """
        if len(masks) == 1 and isinstance(masks[0], (list, tuple)):
            masks = tuple(masks[0])
        _check_compatible(masks, "GraftMask.union", rows=True)
        if on_conflict not in ("error", "last"):
            raise GraftMaskError(f"on_conflict must be 'error' or 'last', got {on_conflict!r}.")
        combined: dict[Key, torch.Tensor] = {}
        for mask in masks:
            for key, value in mask._entries.items():
                current = combined.get(key)
                if current is None:
                    combined[key] = value
                    continue
                clash = (current != 0) & (value != 0) & (current != value)
                if on_conflict == "error" and bool(clash.any()):
                    row, position = (int(i) for i in clash.nonzero()[0])
                    raise GraftMaskError(
                        f"Grafts disagree at {key}, row {row}, position {position}: source "
                        f"{int(current[row, position])} vs {int(value[row, position])}.\n"
                        "Pass on_conflict='last' to let the later graft win."
                    )
                combined[key] = torch.where(value != 0, value, current)
        known = [mask.lengths for mask in masks if mask.lengths is not None]
        return cls(combined, masks[0].shape, masks[0].n_sources, known[0] if known else None)

    @classmethod
    def cat(cls, masks: Sequence[GraftMask]) -> GraftMask:
        """Stack masks along the batch: one block of rows per configuration (stack the tokens
        the same way, e.g. ``tokens.repeat(k, 1)`` for ``k`` configurations of the prompts)."""
        masks = list(masks)
        _check_compatible(masks, "GraftMask.cat", rows=False)
        keys = {key for mask in masks for key in mask._entries}
        entries = {key: torch.cat([mask[key] for mask in masks], dim=0) for key in keys}
        batch = sum(mask.shape[0] for mask in masks)
        known = [mask.lengths for mask in masks if mask.lengths is not None]
        lengths = torch.cat(known) if len(known) == len(masks) else None
        return cls(entries, (batch, masks[0].shape[1]), masks[0].n_sources, lengths)

    def extend(self, new_positions: int) -> GraftMask:
        """Append ``new_positions`` columns that repeat each row's last column.

        For tokens generated after a prompt: every ``(component, layer)`` keeps, in each row,
        the source it had at the last position. The mask must be for unpadded rows.
        """
        batch, positions = self.shape
        padded = self.lengths is not None and bool((self.lengths < positions).any())
        if padded or not is_integer(new_positions) or new_positions < 0:
            raise GraftMaskError(
                "extend continues each row after its last column, but this mask was built for "
                "padded rows.\nExtend a mask of unpadded tokens."
                if padded
                else f"new_positions must be an int >= 0, got {new_positions!r}."
            )
        entries = {
            key: torch.cat([value, value[:, -1:].expand(batch, int(new_positions))], dim=1)
            for key, value in self._entries.items()
        }
        lengths = None if self.lengths is None else self.lengths + int(new_positions)
        return GraftMask(entries, (batch, positions + int(new_positions)), self.n_sources, lengths)

    def check_rows(
        self,
        attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
        *,
        shape: tuple[int, ...] | None = None,
    ) -> Int[torch.Tensor, " batch"]:
        """Refuse running this mask on tokens of another ``shape`` (by default the mask's), or
        under an attention mask it was not built for (``None``: no padding): the rows'
        lengths must equal :attr:`lengths` when known, and no padding may be grafted.

        Returns:
            The run's row lengths.

        Raises:
            GraftMaskError: Another shape, lengths that disagree, or a graft at padding.
            SelectionError: An attention mask that is not ``[batch, pos]`` right padding.
        """
        shape = self.shape if shape is None else (int(shape[0]), int(shape[1]))
        lengths = None if shape != self.shape else row_lengths(shape, attention_mask)
        problem = (
            self._misfit(lengths)
            if lengths is not None
            else (f"it is for [batch, pos] = {list(self.shape)}, the tokens have {list(shape)}")
        )
        if problem:
            raise GraftMaskError(
                f"The mask does not fit this run: {problem}.\nBuild it from the run's tokens "
                "and attention mask: GraftMask.build(models, tokens, ..., attention_mask=...)."
            )
        assert lengths is not None
        return lengths

    def _misfit(self, lengths: torch.Tensor) -> str | None:
        """Why rows of ``lengths`` are not the ones this mask was built for, if they are not."""
        if self.lengths is not None and not torch.equal(lengths, self.lengths):
            row = int((lengths != self.lengths).nonzero()[0])
            return (
                f"row {row}: {int(self.lengths[row])} real tokens in the mask, "
                f"{int(lengths[row])} in the run"
            )
        padding = torch.arange(self.shape[1])[None, :] >= lengths[:, None]
        if bool(padding.any()):
            for key, value in {id(v): (k, v) for k, v in self._entries.items()}.values():
                grafted = (value != 0) & padding
                if bool(grafted.any()):
                    row, position = (int(i) for i in grafted.nonzero()[0])
                    return (
                        f"it grafts {key} at row {row}, position {position}, which the run's "
                        f"attention mask makes padding (the row has {int(lengths[row])} real tokens)"
                    )
        return None


def check_source(
    models: ModelSet,
    source: object,
    *,
    allow_base: bool,
    error: type[GraftingLensError] = GraftMaskError,
) -> None:
    """Refuse a checkpoint index the model set lacks (or the base, unless ``allow_base``)."""
    low = 0 if allow_base else 1
    if not is_integer(source) or not low <= source < len(models):
        raise (error if is_integer(source) or isinstance(source, float) else ArgumentTypeError)(
            f"source={source!r}, but the model set has {len(models)} sources: give an int "
            f"{low}..{len(models) - 1}" + ("" if allow_base else " (source 0 is the base)") + "."
        )


def checked_key(models: ModelSet, key: object) -> Key:
    """``key`` as the ``(component, layer)`` pair of ``models`` it names (a negative layer
    counts from the end); refused when malformed or naming what the architecture lacks."""
    component, layer = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
    if isinstance(component, str):
        check_component(models, component)
    if (
        not isinstance(component, str)
        or (layer is None) != (component in GLOBAL_COMPONENTS)
        or not (layer is None or is_integer(layer))
    ):
        raise GraftMaskError(
            "Mask keys are (component, layer) pairs: ('q', 3) for a per-layer component, "
            f"('embed', None) for a global component; got {key!r}."
        )
    if layer is None:
        return (component, None)
    layer = resolve_layers(int(layer), models.n_layers)[0]
    check_component(models, component, (layer,))
    return (component, layer)


def check_component(
    models: ModelSet, component: str, layers: Iterable[int | None] | None = None
) -> None:
    """Refuse a component the architecture lacks, anywhere or (given ``layers``) at one of them
    (a mixture-of-experts stack has ``experts`` at some layers, ``mlp_in`` at others)."""
    missing = [layer for layer in layers or () if (component, layer) not in models.layout.slots]
    if component in models.components and not missing:
        return
    if component not in COMPONENTS:
        problem = f"Unknown component {component!r}.{did_you_mean(component, COMPONENTS)}"
        fix = f"Known components: {', '.join(COMPONENTS)}."
    elif component not in models.components:
        problem = f"{models.architecture} has no {component!r} component."
        fix = f"Its components are: {', '.join(models.components)}."
    else:
        at = ", ".join(str(layer) for name, layer in models.pairs if name == component)
        problem = f"{models.architecture} has no {component!r} at layer {missing[0]}; it has one at layers {at}."
        fix = "Name those layers, or use a group (ffn, block), which takes what each layer has."
    raise ComponentError(f"{problem}\n{fix}")


def check_leftovers(models: ModelSet, keys: Iterable[Key]) -> None:
    """Refuse a graft that takes every component around parameters no component covers (they
    would stay the base's: a partial graft nobody asked for); ``models.allow_uncovered``
    turns the check off."""
    left = [] if models.allow_uncovered else leftover_parameters(models.layout, keys)
    if left:
        shown = ", ".join(f"{r.name} (at {r.path or 'no bridge component'})" for r in left[:4])
        more = f" and {len(left) - 4} more" if len(left) > 4 else ""
        raise ComponentError(
            f"This graft takes every component around {len(left)} parameter(s) of "
            f"{models.architecture} that no component covers ({shown}{more}), which would keep "
            "the base's values: graft named components, or load with allow_uncovered=True.\n"
            "models.coverage() lists every parameter; register_component_paths(...) names "
            "the missing weights as components."
        )


def _source_indices(key: Key, value: object, size: tuple[int, int], n_sources: int) -> torch.Tensor:
    """``value`` as a ``[batch, pos]`` long tensor of source indices on the CPU; refused otherwise."""
    tensor = torch.as_tensor(value) if not isinstance(value, torch.Tensor) else value
    if tensor.dtype == torch.bool and n_sources == 2:
        tensor = tensor.long()
    fits = (
        tuple(tensor.shape) == size
        and tensor.device.type != "meta"
        and not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)
    )
    if fits:
        tensor = tensor.to(device="cpu", dtype=torch.long)
        fits = not tensor.numel() or (int(tensor.min()) >= 0 and int(tensor.max()) < n_sources)
    if not fits:
        readable = tensor.device.type == "cpu" and tensor.numel() and not tensor.is_complex()
        held = f" holding {int(tensor.min())}..{int(tensor.max())}" if readable else ""
        raise GraftMaskError(
            f"The mask for {key} must be a {size} [batch, pos] tensor of source indices "
            f"0..{n_sources - 1} (booleans with two sources), not on the meta device; got "
            f"{tensor.dtype} of shape {tuple(tensor.shape)} on {tensor.device}{held}."
        )
    return tensor


def _check_compatible(masks: Sequence[object], what: str, rows: bool) -> None:
    """Refuse masks that cannot be combined: none, not masks, or of other positions or sources
    (and, with ``rows``, other rows or row lengths)."""
    kinds = {
        (m.n_sources, m.shape if rows else m.shape[1]) if isinstance(m, GraftMask) else None
        for m in masks
    }
    lengths = [m.lengths for m in masks if isinstance(m, GraftMask) and m.lengths is not None]
    differ = rows and any(not torch.equal(known, lengths[0]) for known in lengths)
    if len(kinds) != 1 or None in kinds or differ:
        shown = [
            m
            if not isinstance(m, GraftMask)
            else (m.shape, m.n_sources, None if m.lengths is None else m.lengths.tolist())
            for m in masks
        ]
        raise GraftMaskError(
            f"{what} needs one or more masks of one {'shape' if rows else 'length'} and source "
            f"count{', built for the same rows' if rows else ''}; got (shape, sources, row "
            f"lengths) {shown}.\nBuild every mask from the same tokens and attention mask, for "
            "one model set."
        )


def _key_order(key: Key) -> tuple[int, int]:
    """Order pairs as the residual stream meets them: embeddings, layers, final norm."""
    component, layer = key
    index = COMPONENTS.index(component)
    if layer is None:
        layer = -1 if index < COMPONENTS.index(LAYER_COMPONENTS[0]) else 10**9
    return (layer, index)
