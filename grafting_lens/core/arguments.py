"""What counts as a number, a list of texts or a table where a user passes one: numpy, pandas
and torch values pass, and a ``bool`` never counts as a number. The forms each takes: the docs
page "Errors", section "A user's numbers".
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

import numpy as np

from grafting_lens.core.errors import ArgumentTypeError, GraftingLensError, SelectionError

__all__ = [
    "as_list",
    "as_table",
    "as_texts",
    "check_table",
    "is_integer",
    "is_number",
    "plain",
    "shown",
]


def is_integer(value: object) -> TypeGuard[int]:
    """An ``int``, a numpy integer or a 0-d torch integer tensor, but not a ``bool``
    (``numpy.bool_`` and torch's ``bool`` included)."""
    if _torch_scalar(value):
        return not (value.dtype.is_floating_point or value.dtype.is_complex)  # type: ignore[attr-defined]
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_number(value: object) -> TypeGuard[float]:
    """A real number (``int``, ``float``, numpy's integers and floats, a 0-d torch tensor of
    them), but not a ``bool``."""
    if _torch_scalar(value):
        return not value.dtype.is_complex  # type: ignore[attr-defined]
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def plain(value: Any) -> Any:
    """A numpy or torch scalar as the Python number it holds (to keep in JSON or a table);
    anything else as it is."""
    return value.item() if isinstance(value, np.generic) or _torch_scalar(value) else value


def _torch_scalar(value: object) -> bool:
    """A 0-d torch tensor that is not a ``bool``, asked without importing torch (the command
    line starts faster without it)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return False
    return value.dim() == 0 and value.dtype != torch.bool


def shown(value: Any) -> str:
    """A user's value as a message quotes it: its ``repr``, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def as_list(
    value: Any, name: str, forms: str, error: type[GraftingLensError] = SelectionError
) -> list[Any]:
    """``value`` as a non-empty list: a str is one item; a list, array, Series, generator its items.

    Raises:
        ArgumentTypeError: A mapping, bytes or something not iterable, naming ``name=`` and
            the ``forms`` it takes.
        error: Nothing.
    """
    if isinstance(value, str):
        return [value]
    scalar = getattr(value, "ndim", 1) == 0  # a 0-d tensor or array: Iterable, but no items
    if isinstance(value, (Mapping, bytes)) or not isinstance(value, Iterable) or scalar:
        raise ArgumentTypeError(f"{name}={shown(value)} cannot be read; give {forms}.")
    items = list(value)
    if not items:
        raise error(f"{name}={shown(value)} holds nothing; give {forms}.")
    return items


def as_texts(
    value: Any, name: str, forms: str, error: type[GraftingLensError] = SelectionError
) -> list[str]:
    """``value`` as a list of non-empty strings (see :func:`as_list`); the first bad item is
    named by its index, since the bad item may be ``None``: an :class:`ArgumentTypeError` if it
    is not a string, else ``error``."""
    items = as_list(value, name, forms, error)
    bad = [i for i, item in enumerate(items) if not (isinstance(item, str) and item.strip())]
    if bad:
        kind = error if isinstance(items[bad[0]], str) else ArgumentTypeError
        raise kind(f"{name}[{bad[0]}] is {shown(items[bad[0]])}: each is a non-empty string.")
    return [str(item) for item in items]


def as_table(value: Any) -> Any:
    """Records (a list or tuple of dicts) or a Hugging Face ``datasets.Dataset`` as a DataFrame
    of their columns; anything else as it is. Asked without importing ``datasets``: a value
    can only be one once it is imported."""
    datasets = sys.modules.get("datasets")
    if datasets is not None and isinstance(value, datasets.Dataset):
        return value.to_pandas()
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
        import pandas as pd  # records come from a user who has it; the CLI starts without it

        return pd.DataFrame(list(value))
    return value


def check_table(
    table: Any, name: str, forms: str, error: type[GraftingLensError] = GraftingLensError
) -> None:
    """Refuse what is not a DataFrame, and one that names a column twice (as
    ``pd.concat(axis=1)`` makes, whose ``table["text"]`` is a table).

    Raises:
        ArgumentTypeError: Not a DataFrame, naming ``name=`` and the ``forms`` it takes.
        error: A column named twice, by its name.
    """
    pandas = sys.modules.get("pandas")
    if pandas is None or not isinstance(table, pandas.DataFrame):
        raise ArgumentTypeError(f"{name}= takes {forms}; got {type(table).__name__}.")
    twice = table.columns[table.columns.duplicated()]
    if len(twice):
        raise error(
            f"{name}= has two columns named {twice[0]!r} (as pd.concat(axis=1) makes): keep "
            f"one, e.g. {name}.loc[:, ~{name}.columns.duplicated()]."
        )
