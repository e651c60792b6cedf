"""The exceptions grafting-lens raises on purpose.

Every error a user can meet names the problem and the fix. An argument of a
usable type but an unusable value raises a subclass of :class:`GraftingLensError`,
which is also a :class:`ValueError`, so ``except ValueError`` keeps working for code
that does not care which. An argument of the wrong type altogether (a number where
a checkpoint is expected, a slow tokenizer where offsets are needed) raises
:class:`TypeError`, as Python's own functions do.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class GraftingLensError(ValueError):
    """Base class of every error raised on purpose by grafting-lens."""


class AlignmentError(GraftingLensError):
    """The checkpoints of a :class:`~grafting_lens.ModelSet` cannot be grafted together.

    Grafting swaps one checkpoint's weights for another's at the same place in the
    network, so every source must share the architecture, the shape of every
    parameter and the vocabulary of the base. The message names the first difference.
    """


class ComponentError(GraftingLensError):
    """A component name is unknown, the architecture does not have that component, or a
    graft would take every component around weights that no component covers."""


class UnsupportedArchitectureError(GraftingLensError):
    """A model whose architecture TransformerLens cannot bridge, so it cannot be grafted.

    The message names the model's class and ``model_type``, the nearest supported
    architectures, and what to do.
    """


class UnverifiedArchitectureWarning(UserWarning):
    """A model TransformerLens bridges, of an architecture grafting-lens has not verified."""


class GraftMaskError(GraftingLensError):
    """A graft mask does not fit the model set or the tokens it is used with."""


class GraftingError(GraftingLensError):
    """A grafted run was asked for something the single pass cannot do."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A " Did you mean 'x'?" suffix naming the closest choice, or an empty string."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""
