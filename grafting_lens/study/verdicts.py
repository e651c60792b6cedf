"""A target's verdict from its 95% interval, never its point estimate: 0.83 [0.57, 1.00]
against ">= 0.70" is neither a pass nor a failure.

* **met**: every value of the interval meets the target (touching the threshold counts);
* **not met**: no value of it does;
* **undecided**: the interval holds values on both sides, or there is no interval (NaN).
"""

from __future__ import annotations

import math

from grafting_lens.core.errors import GraftingLensError

__all__ = ["MET", "NOT_MET", "UNDECIDED", "VERDICTS", "verdict"]

MET = "met"
NOT_MET = "not met"
UNDECIDED = "undecided"
VERDICTS = (MET, NOT_MET, UNDECIDED)
"""The three verdicts, in the order a table explains them."""


def verdict(low: float, high: float, threshold: float, *, at_least: bool) -> str:
    """Whether the interval ``[low, high]`` meets the target ``value >= threshold``
    (``at_least``) or ``value <= threshold``: :data:`MET`, :data:`NOT_MET` or
    :data:`UNDECIDED` (see the module's docstring).

    Raises:
        GraftingLensError: A threshold that is not a finite number, or ``low > high``.
    """
    if not math.isfinite(threshold) or low > high:
        raise GraftingLensError(
            f"An interval's low end ({low}) is above its high end ({high}); pass (low, high)."
            if math.isfinite(threshold)
            else f"A target's threshold must be a finite number, got {threshold}."
        )
    if math.isnan(low) or math.isnan(high):
        return UNDECIDED
    meets_low, meets_high = (
        (low >= threshold, high >= threshold) if at_least else (low <= threshold, high <= threshold)
    )
    if meets_low and meets_high:
        return MET
    if not meets_low and not meets_high:
        return NOT_MET
    return UNDECIDED
