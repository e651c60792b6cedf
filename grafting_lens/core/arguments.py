"""What counts as a number where a user passes one: Python's, and numpy's scalars too.

A count or a fraction often comes out of numpy or pandas (``np.float32(0.9)`` from a
table, ``np.int64(3)`` from ``argmax``), and those are not ``float`` or ``int``:
``isinstance(np.float32(0.9), float)`` is false. A check written with ``isinstance``
then refuses a value it would accept from Python, with a message about its range
that is not the reason. Every check of a user's number asks these two functions
instead. ``bool`` is refused by both, although Python counts it an ``int``: ``True``
where a count or a fraction belongs is a mistake, not a 1.
"""

from __future__ import annotations

import numbers
from typing import Any, TypeGuard

import numpy as np

__all__ = ["is_integer", "is_number", "plain"]


def is_integer(value: object) -> TypeGuard[int]:
    """An ``int`` or a numpy integer, but not a ``bool`` (``numpy.bool_`` included).

    To a type checker, an ``int`` from here on: a numpy integer behaves as one.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_number(value: object) -> TypeGuard[float]:
    """A real number (``int``, ``float``, numpy's integers and floats), but not a ``bool``.

    To a type checker, a ``float`` from here on: a numpy number behaves as one.
    """
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds; anything else as it is.

    Called on a number once it is accepted, so that what is kept (in a run's description,
    a JSON file, a table) is a plain ``int`` or ``float`` whichever way it came.
    """
    return value.item() if isinstance(value, np.generic) else value
