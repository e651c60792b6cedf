"""Layer ranges: which transformer blocks a graft or a patch touches.

A layer specification names blocks the way people think of them, and
:func:`resolve_layers` turns it into sorted indices for one model: an index or a
list of them, a ``range`` or ``slice``, a name from :data:`LAYER_FRACTIONS`
(``"last_half"``, ``"third_quarter"``...) or a pair of fractions of the depth. Names
and fractions adapt to the depth, so one experiment runs on a 4-layer toy model and
a 32-layer Llama alike.

Names follow one of two *arithmetics* (:data:`LAYER_ARITHMETICS`). ``"fractions"``
(the default) rounds each fraction of the depth half up, so quarters are as equal
as the depth allows. ``"quarters"`` is the arithmetic of the paper's released code
(its ``get_layers_dict``): a quarter is ``n // 4`` layers and the last quarter takes
the remainder, and its "last half" is the third and fourth quarters together
(:func:`quarter_ranges`). The two agree whenever the depth is a multiple of four
(16, 32, 48 layers); for 18 layers (Gemma 2B) the fractions give 0-4 / 5-8 / 9-13 /
14-17 and the code's quarters 0-3 / 4-7 / 8-11 / 12-17. Grafts (:mod:`grafting_lens.engine.masks`), patches
(:mod:`grafting_lens.patching.patch`) and the experiments' configurations all select
layers here; a specification that selects nothing, or a layer the model lacks,
raises :class:`~grafting_lens.core.errors.SelectionError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Union

from grafting_lens.core.arguments import is_integer, is_number
from grafting_lens.core.errors import SelectionError, did_you_mean

__all__ = [
    "LAYER_ARITHMETICS",
    "LAYER_FRACTIONS",
    "LayerSpec",
    "quarter_ranges",
    "resolve_layers",
]

LayerSpec = Union[str, int, float, Sequence[int], range, slice, tuple[float, float], None]
"""Anything :func:`resolve_layers` accepts."""

LAYER_FRACTIONS: dict[str, tuple[float, float]] = {
    "all": (0.0, 1.0),
    "first_half": (0.0, 0.5),
    "last_half": (0.5, 1.0),
    "first_quarter": (0.0, 0.25),
    "second_quarter": (0.25, 0.5),
    "third_quarter": (0.5, 0.75),
    "last_quarter": (0.75, 1.0),
}
"""Named layer ranges as fractions of the depth ``[start, end)``."""

LAYER_ARITHMETICS: tuple[str, ...] = ("fractions", "quarters")
"""How :func:`resolve_layers` turns a name into layers: ``"fractions"`` (the names'
fractions of :data:`LAYER_FRACTIONS`, rounded half up) or ``"quarters"`` (the released
code's ``n // 4`` quarters, :func:`quarter_ranges`)."""


def quarter_ranges(n_layers: int) -> dict[str, range]:
    """The named layer ranges of the paper's released code for an ``n_layers``-deep model.

    A quarter is ``q = n_layers // 4`` layers: ``first_quarter`` is ``0..q-1``,
    ``second_quarter`` ``q..2q-1``, ``third_quarter`` ``2q..3q-1`` and ``last_quarter``
    ``3q..n-1``, so the last quarter takes the remainder (for 18 layers: 0-3, 4-7,
    8-11, 12-17). ``first_half`` and ``last_half`` are two quarters each, as the
    code's configurations name them (``[third_quarter, fourth_quarter]``), so for 18
    layers ``last_half`` is 8-17. Every name of :data:`LAYER_FRACTIONS` is here; below
    four layers some ranges are empty, as in the code.
    """
    q = n_layers // 4
    return {
        "all": range(n_layers),
        "first_half": range(0, 2 * q),
        "last_half": range(2 * q, n_layers),
        "first_quarter": range(0, q),
        "second_quarter": range(q, 2 * q),
        "third_quarter": range(2 * q, 3 * q),
        "last_quarter": range(3 * q, n_layers),
    }


def resolve_layers(
    spec: LayerSpec, n_layers: int, *, arithmetic: str = "fractions"
) -> tuple[int, ...]:
    """Turn a layer specification into sorted layer indices.

    Args:
        spec: ``None`` or ``"all"``; an int (negative counts from the end); a list
            of ints; a ``range`` or ``slice``; a name from :data:`LAYER_FRACTIONS`
            (``"last_half"``, ``"third_quarter"``...); or a pair of fractions
            ``(start, end)`` with ``0 <= start < end <= 1``. Fractions select
            layers ``r(start * n) .. r(end * n) - 1``, where ``r`` rounds halves
            up, so the four quarters of a model partition its layers and, with an
            odd depth, the first half is the larger one. A tuple of ints is a
            list of layers: ``(0, 2)`` is layers 0 and 2; write ``range(0, 3)``
            for 0, 1 and 2.
        n_layers: Depth of the model.
        arithmetic: How a *name* becomes layers (see :data:`LAYER_ARITHMETICS`):
            ``"fractions"`` (the default) or ``"quarters"``, the released code's
            (:func:`quarter_ranges`). Fractions, ints and ranges mean the same in both.

    Raises:
        SelectionError: A layer outside the model, an unknown name or arithmetic,
            or a fraction that selects no layer of this model.
    """
    if arithmetic not in LAYER_ARITHMETICS:
        raise SelectionError(
            f"Unknown layer arithmetic {arithmetic!r}; use one of {', '.join(LAYER_ARITHMETICS)}."
        )
    if spec is None:
        spec = "all"
    if isinstance(spec, str):
        if spec not in LAYER_FRACTIONS:
            raise SelectionError(
                f"Unknown layer range {spec!r}.{did_you_mean(spec, LAYER_FRACTIONS)} "
                f"Known: {', '.join(LAYER_FRACTIONS)}."
            )
        if arithmetic == "quarters":
            layers = tuple(quarter_ranges(n_layers)[spec])
            if not layers:
                raise SelectionError(
                    f"{spec!r} is empty in a {n_layers}-layer model under the code's quarters "
                    f"(a quarter is {n_layers} // 4 = {n_layers // 4} layers); use the "
                    "'fractions' arithmetic or name the layers."
                )
            return layers
        spec = LAYER_FRACTIONS[spec]
    if (
        isinstance(spec, tuple)
        and len(spec) == 2
        and all(is_number(x) for x in spec)
        and any(not is_integer(x) for x in spec)
    ):
        start, end = float(spec[0]), float(spec[1])
        if not 0.0 <= start < end <= 1.0:
            raise SelectionError(f"Layer fractions must satisfy 0 <= start < end <= 1, got {spec}.")
        layers = tuple(range(_round_half_up(start * n_layers), _round_half_up(end * n_layers)))
        if not layers:
            raise SelectionError(
                f"The layer fraction {spec} selects no layer of a {n_layers}-layer model."
            )
        return layers
    if isinstance(spec, slice):
        spec = range(n_layers)[spec]
    if is_integer(spec):
        spec = [int(spec)]
    if not isinstance(spec, Iterable):
        raise SelectionError(
            f"Cannot read layers from {spec!r}: give 'all', an int, a list or range of ints, a "
            f"name such as 'last_half', or a pair of fractions such as (0.5, 1.0)."
        )
    chosen: set[int] = set()
    for layer in spec:
        if not is_integer(layer):
            raise SelectionError(f"Layers must be ints, got {layer!r}.")
        layer = int(layer)
        if not -n_layers <= layer < n_layers:
            raise SelectionError(
                f"Layer {layer} is outside the model, which has {n_layers} layers "
                f"(0..{n_layers - 1})."
            )
        chosen.add(layer % n_layers)
    if not chosen:
        raise SelectionError("The layer specification selects no layer.")
    return tuple(sorted(chosen))


def _round_half_up(value: float) -> int:
    # Python's round() sends halves to the even neighbour, which would make
    # "last_half" of 3 layers one layer and of 5 layers three.
    return math.floor(value + 0.5)
