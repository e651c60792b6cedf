"""What the fuzzer generates, and the one property every call must keep.

The property (:func:`door`): a call either returns a result (checked by the caller against
an independent computation where there is one) or raises a
:class:`~grafting_lens.GraftingLensError` whose message names an argument it was given, by
name (``at=``, ``layers``) or by the user's value; any other exception is a bug.
"""

from __future__ import annotations

import contextlib
import os
import re
import unicodedata
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pandas as pd
import torch
from hypothesis import settings
from hypothesis import strategies as st

from grafting_lens.core.errors import GraftingLensError

LONG = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "long"


def budget(examples: int) -> settings:
    """``examples`` per test in CI, twenty times as many under the long profile."""
    return settings(max_examples=examples * 20 if LONG else examples)


def _mentions(message: str, name: str, value: Any) -> bool:
    """Whether ``message`` names the argument ``name`` or shows (part of) its ``value``."""
    if len(name) >= 4:  # a word such as "layers" or "prompts", in any case
        if re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message, re.IGNORECASE):
            return True
    elif re.search(rf"(?<![\w-]){re.escape(name)}\s*(=|\[|\{{)", message):  # at=, k=
        return True
    shown = [value]
    if isinstance(value, Mapping):
        shown += [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, pd.Series, np.ndarray)) or (
        isinstance(value, torch.Tensor) and value.dim() > 0
    ):
        shown += list(value)[:20]
    for item in shown:
        if isinstance(item, (torch.nn.Module, pd.DataFrame)):
            continue
        if isinstance(item, str) and repr(item) in message:  # quoted: '' and ' ' count
            return True
        for text in {repr(item), str(item)}:
            text = text.strip()
            # A short number ("0", "1") is in most messages: only its repr beside a name counts.
            if (len(text) >= 3 or (len(text) == 2 and not text.isdigit())) and text in message:
                return True
            if len(text) >= 3 and text[:40] in message:
                return True
            if len(text) >= 3 and unicodedata.normalize("NFC", text[:40]) in message:
                return True
    return False


def door(call: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call ``call``; return its result, or ``None`` when it refused the input by name.

    A :class:`GraftingLensError` must name one of the arguments (a keyword's name or value,
    a positional argument's value, or "source <i>" for the ``i``-th positional one); every
    other exception propagates and fails the example.
    """
    try:
        return call(*args, **kwargs)
    except GraftingLensError as error:
        message = str(error)
        given = [*kwargs.items(), *((f"source {i}", value) for i, value in enumerate(args))]
        given += [("sources", args)]  # the positional arguments, named together
        assert any(_mentions(message, name, value) for name, value in given), (
            f"{getattr(call, '__name__', call)} refused {sorted(kwargs)} with a message "
            f"naming none of them: {message!r}"
        )
        return None


# Values that are wrong for nearly every argument: the wrong type, empty, blank, NaN, zero,
# negative, huge, and numbers as numpy and torch give them.
HOSTILE = st.sampled_from(
    [
        None,
        "",
        "   ",
        "\u200b",
        "🎬",
        "nan",
        0,
        -1,
        10**9,
        1.5,
        float("nan"),
        float("inf"),
        True,
        np.int64(-1),
        np.float64("nan"),
        torch.tensor(0),
        torch.tensor([1, 2]),
        [],
        {},
        [None],
        (),
        b"bytes",
        object,
    ]
)


def integers(low: int, high: int) -> st.SearchStrategy[Any]:
    """Integers in ``[low, high]`` as Python, numpy and torch give them."""
    return st.integers(low, high).flatmap(
        lambda i: st.sampled_from(
            [i, np.int64(i), torch.tensor(i)] + ([np.int32(i)] if abs(i) < 2**31 else [])
        )
    )


# For a count whose large values are valid and cost time or memory in proportion (a depth,
# resamples, steps): the hostile values but the huge one.
CHEAP = HOSTILE.filter(lambda value: not (isinstance(value, int) and value > 10**6))


def arg(
    *valid: Any,
    extra: st.SearchStrategy[Any] | None = None,
    hostile: st.SearchStrategy[Any] = HOSTILE,
) -> st.SearchStrategy[Any]:
    """An argument: one of its ``valid`` values, a ``hostile`` one, or one of ``extra``."""
    options = [st.sampled_from(valid)] if valid else []
    options += [hostile] + ([extra] if extra is not None else [])
    return st.one_of(*options)


def text(max_size: int = 60) -> st.SearchStrategy[str]:
    """Any text: Unicode of every category (emoji, combining marks, blanks), NFC or NFD."""
    raw = st.text(st.characters(exclude_categories=["Cs"]), max_size=max_size)
    return st.one_of(
        raw,
        raw.map(lambda t: unicodedata.normalize("NFD", t)),
        st.sampled_from(["Café", unicodedata.normalize("NFD", "Café"), "東京", "🎬🎬", " \t\n"]),
    )


CONTAINERS: dict[str, Callable[[list[Any]], Any]] = {
    "list": list,
    "tuple": tuple,
    "array": lambda items: np.array(items, dtype=object),
    "series": pd.Series,
    "generator": lambda items: (item for item in items),
    "set": lambda items: set(items) if all(isinstance(i, str) for i in items) else list(items),
    "dict": lambda items: dict.fromkeys(map(str, items)),
}


def container(items: st.SearchStrategy[list[Any]]) -> st.SearchStrategy[tuple[str, list[Any]]]:
    """``(kind, items)``: build the value with ``CONTAINERS[kind](items)`` in the test (a
    generator is used once) and keep ``items`` to check the result against."""
    return st.tuples(st.sampled_from(sorted(CONTAINERS)), items)


@contextlib.contextmanager
def threads_kept() -> Iterator[None]:
    """Restore torch's thread count after a call that may set it (``threads=``, ``--threads``)."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
