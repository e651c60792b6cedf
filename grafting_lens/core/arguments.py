"""What counts as a number where a user passes one: Python's, and numpy's scalars too.

A count or a fraction often comes out of numpy or pandas, and ``isinstance(np.float32(0.9),
float)`` is false: a check written with ``isinstance`` would refuse it, naming its range.
Every check of a user's number asks these functions instead. ``bool`` is refused by both:
``True`` where a count belongs is a mistake, not a 1.
"""

from __future__ import annotations

import numbers
from typing import Any, TypeGuard

import numpy as np

__all__ = ["is_integer", "is_number", "plain"]


def is_integer(value: object) -> TypeGuard[int]:
    """An ``int`` or a numpy integer, but not a ``bool`` (``numpy.bool_`` included)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_number(value: object) -> TypeGuard[float]:
    """A real number (``int``, ``float``, numpy's integers and floats), but not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds (to keep in JSON or a table); anything else
    as it is."""
    return value.item() if isinstance(value, np.generic) else value
