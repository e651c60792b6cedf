"""Routing: which source computes each position of the window, and where positions sit.

A grafted slot of the base computes each position with the source the mask names for it.
This room holds what every grafted module shares for that: the window of positions being
computed (all of them in one pass, one at a time in generation), each mask's split of the
window into the positions of each source (:class:`Plan`, made once per mask tensor and
window, and kept), and the layout of a tensor a module receives (:class:`Layout`: positions
on an axis of a grid, or flattened rows), so that the rows of one source can be taken out,
computed and put back. The graft dispatcher (:mod:`grafting_lens.engine.graft`) and the
relaxed graft (:mod:`grafting_lens.engine.relaxation`) both route through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from jaxtyping import Int
from torch import nn

from grafting_lens.engine.kernels import run_module
from grafting_lens.engine.masks import GraftMask, Key


@dataclass
class Plan:
    """How one (component, layer) splits the positions of the current window.

    Made on the host from the mask (kept on the CPU), so making it never waits for
    an accelerator. A layer-split model (accelerate's ``device_map``) runs each layer
    on its own device; every index is asked for on the device of the activation it
    indexes (:meth:`parts_on`, :meth:`window_on`), copied there once and kept.
    """

    window: Int[torch.Tensor, "batch pos"]
    single: int | None
    parts: list[tuple[int, Int[torch.Tensor, " n"]]] = field(default_factory=list)
    _placed: dict[torch.device, list[tuple[int, torch.Tensor]]] = field(
        default_factory=dict, repr=False
    )
    _windows: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

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


class GraftState:
    """The mask of one grafted run and the window of positions being computed.

    A full pass computes positions ``0..pos-1`` at once; generation computes one
    new position per step. Every dispatcher reads the same window. The masks stay on
    the host and the full window's plans are made here, before the forward: a plan
    made from a device tensor mid-forward (``bincount().tolist()``, ``nonzero()``)
    would wait for the device once per mask per window.
    """

    def __init__(self, mask: GraftMask) -> None:
        self.shape = mask.shape
        self.n_sources = mask.n_sources
        self.window = (0, mask.shape[1])
        # Many pairs share one tensor (GraftMask.build); keep the sharing so each
        # distinct tensor is split into index lists once.
        moved: dict[int, torch.Tensor] = {}
        self.masks = {key: moved.setdefault(id(mask[key]), mask[key].cpu()) for key in mask.keys()}
        self._plans: dict[tuple[int, int, int], Plan] = {}
        for key in self.masks:
            self.plan(key)

    def plan(self, key: Key) -> Plan:
        """The plan of ``key`` for the current window (made once per mask tensor and window)."""
        values = self.masks[key]
        offset, length = self.window
        cache_key = (id(values), offset, length)
        plan = self._plans.get(cache_key)
        if plan is None:
            window = values[:, offset : offset + length]
            flat = window.reshape(-1)
            counts = torch.bincount(flat, minlength=self.n_sources).tolist()
            used = [source for source, count in enumerate(counts) if count]
            if len(used) == 1:
                plan = Plan(window, used[0])
            else:
                parts = [(source, (flat == source).nonzero().squeeze(1)) for source in used]
                plan = Plan(window, None, parts)
            self._plans[cache_key] = plan
        return plan


# Components whose input describes positions rather than rows of the batch: a
# position embedding reads position ids, a padding mask to count (OPT) or a cache
# offset. Every source used in the window embeds every position, and each position
# takes its own source's row; a lookup costs next to nothing.
PICKED = frozenset({"pos_embed"})


@dataclass(frozen=True)
class Layout:
    """Where the positions of the window sit in a tensor a grafted module receives.

    Either on a grid, ``[batch, ..., pos, ...]`` with the positions on ``pos_dim``
    (``[1, ...]`` when shared by every row, as GPT-2's position ids), or flattened,
    ``[batch * pos, ...]``, as a mixture-of-experts block and OPT's decoder layer
    hand their rows to the modules inside.
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

    def take(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The rows ``index`` of ``x``, laid out as the module expects (a batch of one on a grid)."""
        picked = self.rows(x).index_select(0, index)
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


def input_shape(args: tuple, kwargs: dict) -> torch.Size | None:
    """The shape of a module call's first tensor argument, or None if it has none."""
    primary = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
    return None if primary is None else primary.shape


def declared_layout(
    shape: torch.Size,
    batch: int,
    length: int,
    pos_dim: int | None,
    refusal: Callable[[str], Exception],
) -> Layout | None:
    """Where a slot's tensor carries the window's positions: on ``pos_dim`` where the bridge
    declares it, else on dimension 1; raises ``refusal(cause)`` where that is ambiguous."""
    if pos_dim is None and len(shape) >= 4 and shape[1] == shape[2] == length:
        # [batch, heads, pos, d_head] with as many heads as positions looks like
        # [batch, pos, heads, d_head]; only a declared position axis tells them apart.
        raise refusal(
            f"an input of shape {list(shape)} whose position axis is ambiguous (dimension 1 "
            "or 2) and not declared by the bridge"
        )
    return Layout.of(shape, batch, length, pos_dim or 1)


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


def call_module(module: nn.Module, args: tuple, kwargs: dict):
    if args:
        return run_module(module, *args, **kwargs)
    return module(**kwargs)


def take_rows(layout: Layout, x: object, index: torch.Tensor) -> object:
    if isinstance(x, torch.Tensor) and x.dim():
        return layout.take(x, index)
    return x
