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
    """A component name is unknown, or the architecture does not have that component."""


class GraftMaskError(GraftingLensError):
    """A graft mask does not fit the model set or the tokens it is used with."""


class GraftingError(GraftingLensError):
    """A grafted run was asked for something the single pass cannot do."""


class NonFiniteLogitsError(GraftingLensError):
    """Logits to be scored hold NaN or infinite values.

    A NaN compares false with everything, so a rank counted as "tokens scoring
    higher than the target" would be 0, a perfect answer. Scoring refuses such
    rows instead; the message names them and the usual causes (a NaN or infinite
    weight in a checkpoint, float16 overflow).
    """


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A " Did you mean 'x'?" suffix naming the closest choice, or an empty string."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""
