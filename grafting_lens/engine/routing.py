"""Routing: which source computes each position of the window, and where positions sit.

What every grafted slot shares: the window of positions being computed (all at once in a
pass, one at a time in generation), each mask's split of it by source (:class:`Plan`, made
once per mask tensor and window), where a tensor carries the positions (:class:`Layout`),
and :class:`Dispatch`, the module standing in for a slot (the graft's and the relaxed
graft's dispatchers are both one).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, NoReturn
from weakref import WeakKeyDictionary

import torch
from jaxtyping import Int
from torch import nn
from transformer_lens.model_bridge.generalized_components import NormalizationBridge
from transformer_lens.model_bridge.generalized_components.base import GeneralizedComponent

from grafting_lens.core.errors import GraftingLensError
from grafting_lens.engine.masks import GraftMask, Key
from grafting_lens.models.components import Slot
from grafting_lens.models.model_set import ModelSet

# Taking and putting back rows by slices costs Python per run, by index a second copy of
# every row: slices measured as fast or faster down to runs of 4 rows on average (GPT-2-small
# shapes at batch 8 and 32, one thread), so shorter runs go by index.
MIN_RUN_ROWS = 4


@dataclass
class Plan:
    """How one (component, layer) splits the positions of the current window.

    Made on the host from the mask (kept on the CPU), so making it never waits for an
    accelerator; each index is copied once to the device of the activation it indexes
    (:meth:`parts_on`, :meth:`window_on`: a layer-split model runs each layer on its own).

    Each source's rows are taken out of a ``[batch * pos, ...]`` tensor and put back
    (:meth:`take`, :meth:`put`) one of two ways, named by :attr:`path`, with identical
    results: ``"slices"`` where the sources form runs of consecutive positions of
    :data:`MIN_RUN_ROWS` rows or more on average, the same runs in every row (``grid`` is
    ``(batch, pos)``) or along the flattened rows (``grid`` is ``(1, batch * pos)``); else
    ``"gather"``, by index (``index_select`` out, then one more to reorder the results).
    """

    window: Int[torch.Tensor, "batch pos"]
    single: int | None
    parts: list[tuple[int, Int[torch.Tensor, " n"]]] = field(default_factory=list)
    # (part, start, stop) over the positions of a row of ``grid``, in order; None: gather.
    runs: list[tuple[int, int, int]] | None = None
    grid: tuple[int, int] = (1, 0)
    _placed: dict[torch.device, list[tuple[int, torch.Tensor]]] = field(
        default_factory=dict, repr=False
    )
    _windows: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    _orders: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, window: Int[torch.Tensor, "batch pos"], n_sources: int) -> Plan:
        """The plan of a window of source indices (on the host)."""
        flat = window.reshape(-1)
        counts = torch.bincount(flat, minlength=n_sources).tolist()
        used = [source for source, count in enumerate(counts) if count]
        if len(used) == 1:
            return cls(window, used[0])
        parts = [(source, (flat == source).nonzero().squeeze(1)) for source in used]
        batch, length = window.shape
        shared = batch > 1 and bool((window == window[:1]).all())
        grid = (batch, length) if shared else (1, batch * length)
        runs = _runs(window[0] if shared else flat, batch * length // MIN_RUN_ROWS)
        if runs is not None:
            part = {source: at for at, source in enumerate(used)}
            runs = [(part[source], start, stop) for source, start, stop in runs]
        return cls(window, None, parts, runs, grid)

    @property
    def path(self) -> str:
        """``"single"`` (one source computes the whole window), ``"slices"`` or ``"gather"``."""
        if self.single is not None:
            return "single"
        return "gather" if self.runs is None else "slices"

    def parts_on(self, device: torch.device) -> list[tuple[int, Int[torch.Tensor, " n"]]]:
        """``parts`` with each source's flat row indices on ``device``."""
        placed = self._placed.get(device)
        if placed is None:
            placed = self._placed[device] = [
                (source, index.to(device)) for source, index in self.parts
            ]
        return placed

    def window_on(self, device: torch.device) -> Int[torch.Tensor, "batch pos"]:
        """The window's source indices on ``device``."""
        window = self._windows.get(device)
        if window is None:
            window = self._windows[device] = self.window.to(device)
        return window

    def sources(self) -> frozenset[int]:
        """The sources some position of the window takes."""
        return frozenset([self.single] if self.single is not None else [s for s, _ in self.parts])

    def take(self, rows: torch.Tensor, part: int) -> torch.Tensor:
        """The rows of ``parts[part]``'s source out of ``rows`` (``[batch * pos, ...]``)."""
        if self.runs is not None and self.grid[0] == 1:
            spans = [(start, stop) for at, start, stop in self.runs if at == part]
            if len(spans) == 1:  # one stretch of rows: a view, nothing copied
                start, stop = spans[0]
                return rows.narrow(0, start, stop - start)
        return rows.index_select(0, self.parts_on(rows.device)[part][1])

    def put(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """``[batch * pos, ...]`` rows made of each part's ``[count, ...]`` rows, each in its place."""
        if self.runs is None:
            order = self._orders.get(pieces[0].device)
            if order is None:
                index = torch.cat([index for _, index in self.parts])
                order = self._orders[pieces[0].device] = index.argsort().to(pieces[0].device)
            return torch.cat(pieces).index_select(0, order)
        rows, length = self.grid
        grids = [piece.reshape(rows, -1, *piece.shape[1:]) for piece in pieces]
        taken = [0] * len(pieces)
        slices = []
        for part, start, stop in self.runs:
            slices.append(grids[part][:, taken[part] : taken[part] + stop - start])
            taken[part] += stop - start
        return torch.cat(slices, dim=1).reshape(rows * length, *pieces[0].shape[1:])


def _runs(values: Int[torch.Tensor, " n"], most: int) -> list[tuple[int, int, int]] | None:
    """``values`` as runs ``(value, start, stop)`` of equal values, or None past ``most`` runs."""
    starts = (values[1:] != values[:-1]).nonzero().squeeze(1) + 1
    if len(starts) >= most:
        return None
    bounds = [0, *starts.tolist(), len(values)]
    firsts = values[bounds[:-1]].tolist()
    return [(value, start, stop) for value, start, stop in zip(firsts, bounds[:-1], bounds[1:])]


class GraftState:
    """The mask of one grafted run and the window of positions being computed.

    A pass computes positions ``0..pos-1`` at once, generation one per step. The masks stay
    on the host and the full window's plans are made before the forward (one made from a
    device tensor mid-forward would wait for the device). ``last``, when set, holds the
    positions in the window (``[batch]`` or ``[batch, k]``) the unembedding runs on alone.
    """

    def __init__(self, mask: GraftMask, last: torch.Tensor | None = None) -> None:
        self.shape = mask.shape
        self.n_sources = mask.n_sources
        self.window = (0, mask.shape[1])
        self.last = last
        # Many pairs share one tensor (GraftMask.build): each distinct one is planned once.
        self.masks = {key: mask[key] for key in mask.keys()}
        self._plans: dict[tuple, Plan] = {}
        self.used = {key: self.plan(key).sources() for key in self.masks}

    def plan(self, key: Key) -> Plan:
        """The plan of ``key`` for the current window (made once per mask tensor and window)."""
        values = self.masks[key]
        offset, length = self.window
        last = self.last if key[0] == "unembed" else None
        cache_key = (id(values), offset, length, None if last is None else id(last))
        plan = self._plans.get(cache_key)
        if plan is None:
            window = values[:, offset : offset + length]
            if last is not None:
                window = window.gather(1, as_columns(last))
            plan = self._plans[cache_key] = Plan.of(window, self.n_sources)
        return plan


def as_columns(positions: torch.Tensor) -> torch.Tensor:
    """``[batch]`` positions as ``[batch, 1]``; ``[batch, k]`` as they are."""
    return positions if positions.dim() == 2 else positions[:, None]


# Components whose input describes positions (position ids, OPT's padding mask, a cache
# offset), not rows: every used source embeds every position, each position takes its own.
PICKED = frozenset({"pos_embed"})


@dataclass(frozen=True)
class Layout:
    """Where the positions of the window sit in a tensor a grafted module receives.

    On a grid, ``[batch, ..., pos, ...]`` with the positions on ``pos_dim`` (``[1, ...]`` when
    shared by every row, as GPT-2's position ids), or flattened, ``[batch * pos, ...]``, as a
    mixture-of-experts block and OPT's decoder layer hand rows to the modules inside.
    """

    batch: int
    length: int
    pos_dim: int | None  # None: flattened rows

    @classmethod
    def of(cls, shape: torch.Size, batch: int, length: int, pos_dim: int) -> Layout | None:
        """The layout of a tensor of ``shape``, or None if it carries no positions of the window."""
        grid = cls(batch, length, pos_dim)
        if grid.fits(shape):
            return grid
        rows = cls(batch, length, None)
        return rows if rows.fits(shape) else None

    def fits(self, shape: torch.Size) -> bool:
        """Whether a tensor of ``shape`` is laid out this way."""
        if self.pos_dim is None:
            return len(shape) >= 1 and shape[0] == self.batch * self.length
        return (
            len(shape) > self.pos_dim
            and shape[self.pos_dim] == self.length
            and shape[0] in (self.batch, 1)
        )

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``[batch * pos, ...]``, one row per position of the window."""
        if self.pos_dim is None:
            return x
        x = x.expand(self.batch, *x.shape[1:]).movedim(self.pos_dim, 1)
        return x.reshape(self.batch * self.length, *x.shape[2:])

    def take(self, x: object, plan: Plan, part: int) -> object:
        """The rows of ``plan.parts[part]`` in a tensor ``x``, laid out as the module expects
        (a batch of one on a grid); anything else as it is."""
        if not isinstance(x, torch.Tensor) or not x.dim():
            return x
        picked = plan.take(self.rows(x), part)
        if self.pos_dim is None:
            return picked
        return picked.unsqueeze(0).movedim(1, self.pos_dim)

    def untake(self, y: torch.Tensor, count: int) -> tuple[torch.Tensor, bool] | None:
        """A module's output for ``count`` taken rows, as ``[count, ...]`` rows, and whether on a grid."""
        if self.pos_dim is not None and y.dim() > self.pos_dim and y.shape[0] == 1:
            if y.shape[self.pos_dim] == count:
                return y.movedim(self.pos_dim, 1)[0], True
        if y.dim() >= 1 and y.shape[0] == count:
            return y, False
        return None

    def restore(self, rows: torch.Tensor, grid: bool) -> torch.Tensor:
        """``[batch * pos, ...]`` rows back in the layout: on the grid, or flattened."""
        if not grid or self.pos_dim is None:
            return rows
        return rows.reshape(self.batch, self.length, *rows.shape[1:]).movedim(1, self.pos_dim)


def position_shape(
    layout: Layout | None, reading: torch.Size | None, value: torch.Size, batch: int, length: int
) -> list[int]:
    """The shape of per-position copies of a parameter of shape ``value``, as a bridge reads it.

    ``[batch, pos, *value]`` by default; against an input (``reading``) such as
    ``[batch, heads, pos, d_head]``, ones where the input has other axes and the value on
    its last axes, so that it broadcasts against the input laid out as ``layout``.
    """
    shape = [batch, length, *value]
    trailing = len(reading) - len(value) if reading is not None else 0
    if layout is not None and trailing >= 1:
        shape = [1] * trailing + list(value)
        if layout.pos_dim is None:
            shape[0] = batch * length
        elif layout.pos_dim < trailing:
            shape[0], shape[layout.pos_dim] = batch, length
        else:
            shape = [batch, length, *value]
    return shape


class Dispatch(nn.Module):
    """Stands in for one slot of the base, computing each position from its own source(s).

    ``sources[0]`` is what the slot held when this was installed (the base's module, or an
    enclosing graft's dispatcher). The sources are held in a tuple, not registered as
    submodules, so no donor parameter joins the base's module tree (while installed,
    ``models.base.parameters()`` lacks the slot's). A tensor that carries the window's
    positions nowhere (:meth:`layout`) is refused with the module named. A norm bridge that
    applies its scale and bias itself reads each position's own (:meth:`per_position`).
    """

    error: ClassVar[type[GraftingLensError]]
    verb: ClassVar[str]  # "graft", "relax": what the refusal says cannot be done
    key: Key
    path: str
    sources: tuple[nn.Module, ...]
    _pos_dim: int | None
    _reads_any_tensor: bool
    _reading: torch.Size | None

    def __init__(
        self, key: Key, path: str, sources: tuple[nn.Module, ...], pos_dim: int | None, norm: bool
    ) -> None:
        super().__init__()
        # Plain attributes, set past nn.Module's __setattr__ (which checks each value for
        # a parameter or a module): a graft makes a dispatcher per slot on every call.
        self.__dict__.update(
            key=key,
            path=path,
            sources=sources,
            # None: nobody declared where positions are; dimension 1, with a check.
            _pos_dim=pos_dim,
            # A norm bridge computes with its scale and bias whatever their rank (Cohere's
            # [heads, d_head]); others read vectors, and matrices only for dtype and shape.
            _reads_any_tensor=norm,
            _reading=None,
        )

    @abstractmethod
    def window(self) -> tuple[int, int]:
        """``(batch, pos)`` of the positions the current call computes."""

    @abstractmethod
    def per_position(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The tensor a bridge reads as ``name`` (``value`` is the first source's)."""

    def layout(
        self, value: object, required: bool = True, like: Layout | None = None
    ) -> Layout | None:
        """Where ``value`` (a tensor, or a shape) carries the window's positions: as ``like``
        (the input's layout, for a further argument), else on the bridge's declared axis, on
        dimension 1 or in flattened rows. Refused where it carries none (unless not
        ``required``) or where that is ambiguous."""
        batch, length = self.window()
        shape = value.shape if isinstance(value, torch.Tensor) else value
        found, cause = None, f"a {type(value).__name__} where a tensor was expected"
        if isinstance(shape, torch.Size) and like is not None:
            found = like if like.fits(shape) else None
            cause = f"an argument of shape {list(shape)} laid out unlike the input"
        elif isinstance(shape, torch.Size):
            # [batch, heads, pos, d_head] with as many heads as positions looks like
            # [batch, pos, heads, d_head]; only a declared position axis tells them apart.
            if self._pos_dim is None and len(shape) >= 4 and shape[1] == shape[2] == length:
                cause = f"shape {list(shape)}, whose position axis (1 or 2) is not declared"
                required = True
            else:
                found = Layout.of(shape, batch, length, self._pos_dim or 1)
                cause = f"shape {list(shape)}, which does not carry the window's positions"
        if found is None and required:
            self.refuse(cause)
        return found

    def refuse(self, cause: str) -> NoReturn:
        """Refuse what the slot's module was given or gave, named with the window."""
        component, layer = self.key
        where = component if layer is None else f"{component} at layer {layer}"
        batch, length = self.window()
        raise self.error(
            f"Cannot {self.verb} {where} through {self.path} ({type(self.sources[-1]).__name__}): "
            f"it gave {cause} (the window is [batch={batch}, pos={length}]).\n"
            f"{self.verb.capitalize()} the components around it; if no hook of yours reshaped "
            "its tensors, please report the architecture."
        )

    def record_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook on the bridge: remember its input's shape for scale reads."""
        primary = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
        self.__dict__["_reading"] = None if primary is None else primary.shape

    def __getattr__(self, name: str):
        # Only reached for what the dispatcher lacks: it registers no parameter, buffer or
        # submodule, so nn.Module's lookup is needed only before __init__ set the sources.
        sources = self.__dict__.get("sources")
        if sources is None:
            return super().__getattr__(name)
        value = getattr(sources[0], name)
        if not isinstance(value, torch.Tensor):
            return value  # configuration (eps, in_features...), shared by aligned sources
        return self.per_position(name, value)


@contextmanager
def installed(
    models: ModelSet,
    keys: list[Key],
    dispatch: Callable[[Key, Slot, nn.Module, int | None, bool], Dispatch],
    shape: Callable[[], tuple[int, int]],
    error: type[GraftingLensError],
    flag: str,
) -> Iterator[None]:
    """Put ``dispatch(key, slot, current, pos_dim, norm)`` in every slot of ``keys``; restore on exit.
    Token ids run inside must have the ``[batch, pos]`` of ``shape()``; ``flag`` is set on the
    base bridge meanwhile (the doors refuse nesting by it)."""
    swapped: list[tuple[Slot, GeneralizedComponent | None, nn.Module]] = []
    embed = models.slots("embed", None)[0].holder(models.base)

    def check_tokens(module: nn.Module, args: tuple) -> None:
        tokens = args[0] if args else None
        if isinstance(tokens, torch.Tensor) and not tokens.is_floating_point():
            if tuple(tokens.shape[:2]) != shape():
                raise error(
                    f"The model was run on tokens of shape {list(tokens.shape)} inside a block "
                    f"for [batch, pos] = {list(shape())}.\nRun it on the tokens the block was "
                    "made for (every position at once), or make a block for these tokens."
                )

    handles = [embed.register_forward_pre_hook(check_tokens)]
    holders = _HOLDERS.setdefault(models.base, {})
    setattr(models.base, flag, True)
    try:
        for key in keys:
            for slot in models.slots(*key):
                if slot.path not in holders:
                    holders[slot.path] = (
                        slot.holder(models.base) if slot.attribute is None else None
                    )
                holder = holders[slot.path]
                current = slot.module(models.base) if holder is None else holder.original_component
                assert current is not None  # every bridge component of a loaded model wraps one
                # TransformerLens marks the position axis of a per-head norm; plain
                # modules inside a block get rows.
                pos_dim = None if holder is None else getattr(holder.hook_in, "pos_dim", None)
                module = dispatch(
                    key, slot, current, pos_dim, isinstance(holder, NormalizationBridge)
                )
                _put(models, slot, holder, module)
                swapped.append((slot, holder, current))
                if holder is not None:
                    handles.append(
                        holder.register_forward_pre_hook(module.record_input, with_kwargs=True)
                    )
        yield
    finally:
        for slot, holder, current in reversed(swapped):
            _put(models, slot, holder, current)
        for handle in handles:
            handle.remove()
        setattr(models.base, flag, False)


# The bridge component holding each slot of a base bridge (None for a module inside one),
# found once: a graft installs every grafted slot on every call, and a lookup walks the tree.
_HOLDERS: WeakKeyDictionary[nn.Module, dict[str, GeneralizedComponent | None]] = WeakKeyDictionary()


def _put(models: ModelSet, slot: Slot, holder: GeneralizedComponent | None, module: nn.Module):
    """Put ``module`` in ``slot``, through the bridge's public API where the slot is its component."""
    if holder is None:
        slot.replace(models.base, module)
    else:
        holder.set_original_component(module)
