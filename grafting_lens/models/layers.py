"""Layer ranges: which transformer blocks a graft or a patch touches (:func:`resolve_layers`),
named as fractions of the depth or as the released code's quarters (:data:`LAYER_ARITHMETICS`;
the table in docs/concepts/paper-code-library.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Union

from grafting_lens.core.arguments import is_integer, is_number
from grafting_lens.core.errors import ArgumentTypeError, SelectionError, did_you_mean

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
    """The named layer ranges of the paper's released code: a quarter is ``n_layers // 4``
    layers and the last takes the remainder (18 layers: 0-3, 4-7, 8-11, 12-17); a half is
    two quarters (``last_half`` of 18 is 8-17). Below four layers some are empty, as there."""
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
        spec: ``None`` or ``"all"``; an int (negative counts from the end); a list of ints
            (a tuple of ints too: ``(0, 2)`` is layers 0 and 2); a ``range`` or ``slice``;
            a name from :data:`LAYER_FRACTIONS`; or a pair of fractions ``(start, end)``
            with ``0 <= start < end <= 1``, selecting layers ``r(start * n) .. r(end * n) -
            1`` where ``r`` rounds halves up (the four quarters partition the layers; with
            an odd depth the first half is the larger).
        n_layers: Depth of the model.
        arithmetic: How a *name* becomes layers (see :data:`LAYER_ARITHMETICS`).

    Raises:
        ArgumentTypeError: ``spec``, a layer in it or ``n_layers`` of the wrong type.
        SelectionError: An unknown name or arithmetic, a layer outside the model, or a
            specification that selects no layer of this model.
    """
    if not is_integer(n_layers) or n_layers < 1:
        raise (SelectionError if is_integer(n_layers) else ArgumentTypeError)(
            f"n_layers must be a whole number >= 1, got {n_layers!r}."
        )
    n_layers = int(n_layers)
    if arithmetic not in LAYER_ARITHMETICS or (
        isinstance(spec, str) and spec not in LAYER_FRACTIONS
    ):
        what, given, known = (
            ("arithmetic", arithmetic, LAYER_ARITHMETICS)
            if arithmetic not in LAYER_ARITHMETICS
            else ("range", spec, tuple(LAYER_FRACTIONS))
        )
        raise (SelectionError if isinstance(given, (str, int)) else ArgumentTypeError)(
            f"Unknown layer {what} {given!r}.{did_you_mean(str(given), known)} "
            f"Known: {', '.join(known)}."
        )
    spec = "all" if spec is None else spec
    if isinstance(spec, str) and arithmetic == "quarters":
        chosen = quarter_ranges(n_layers)[spec]
        if not chosen:
            raise SelectionError(
                f"{spec!r} is empty in a {n_layers}-layer model under the code's quarters (a "
                f"quarter is {n_layers} // 4 = {n_layers // 4} layers); use the 'fractions' "
                "arithmetic or name the layers."
            )
        return tuple(chosen)
    spec = LAYER_FRACTIONS[spec] if isinstance(spec, str) else spec
    if (
        isinstance(spec, tuple)
        and len(spec) == 2
        and all(is_number(x) for x in spec)
        and any(not is_integer(x) for x in spec)
    ):
        start, end = float(spec[0]), float(spec[1])
        # Halves round up: round() sends them to the even neighbour, which would make
        # "last_half" of 3 layers one layer and of 5 layers three.
        chosen = range(0)
        if 0.0 <= start < end <= 1.0:
            chosen = range(math.floor(start * n_layers + 0.5), math.floor(end * n_layers + 0.5))
        if not chosen:
            raise SelectionError(
                f"The layer fraction {spec} selects no layer of a {n_layers}-layer model "
                "(fractions satisfy 0 <= start < end <= 1)."
            )
        return tuple(chosen)
    if isinstance(spec, slice):
        layers: list = list(range(n_layers)[spec])
    elif is_integer(spec):
        layers = [spec]
    elif isinstance(spec, Iterable):
        layers = list(spec)
    else:
        raise ArgumentTypeError(
            f"Cannot read layers from {spec!r}: give 'all', an int, a list or range of ints, a "
            "name such as 'last_half', or a pair of fractions such as (0.5, 1.0)."
        )
    # An index, not the item: the bad item may be None.
    at = next(
        (i for i, x in enumerate(layers) if not is_integer(x) or not -n_layers <= x < n_layers),
        None,
    )
    if at is not None:
        bad = layers[at]
        raise (SelectionError if is_integer(bad) else ArgumentTypeError)(
            f"Layer {bad} is outside the model, which has {n_layers} layers (0..{n_layers - 1}, "
            f"n_layers={n_layers})."
            if is_integer(bad)
            else f"Layers must be ints, got {bad!r}."
        )
    if not layers:
        raise SelectionError(f"The layer specification {spec!r} selects no layer.")
    return tuple(sorted({int(layer) % n_layers for layer in layers}))
