"""A target's verdict reads its interval: met, not met or undecided, whatever the point
estimate says."""

from __future__ import annotations

import math

import pytest

from grafting_lens.core.errors import GraftingLensError
from grafting_lens.study.verdicts import MET, NOT_MET, UNDECIDED, verdict


@pytest.mark.parametrize(
    ("low", "high", "threshold", "at_least", "expected"),
    [
        (0.75, 0.90, 0.70, True, MET),  # the whole interval past the threshold
        (0.40, 0.60, 0.70, True, NOT_MET),  # the whole interval short of it
        (0.57, 1.00, 0.70, True, UNDECIDED),  # SmolLM2's O+FFN / ATTN+O+FFN, 0.83
        (0.70, 0.90, 0.70, True, MET),  # touching the threshold: every value meets >= 0.70
        (0.50, 0.70, 0.70, True, UNDECIDED),  # touching from below: 0.70 itself meets it
        (0.01, 0.07, 0.10, False, MET),  # an upper target (PRE <= 10%)
        (0.12, 0.30, 0.10, False, NOT_MET),
        (0.05, 0.10, 0.10, False, MET),  # touching an upper threshold
        (0.10, 0.20, 0.10, False, UNDECIDED),
        (0.94, 0.985, 0.95, True, UNDECIDED),  # the toy world's SFT top-5, 0.965
        (math.nan, math.nan, 0.70, True, UNDECIDED),  # no interval (a ratio of zeros)
    ],
)
def test_the_verdict_reads_the_interval(low, high, threshold, at_least, expected):
    assert verdict(low, high, threshold, at_least=at_least) == expected


@pytest.mark.parametrize(
    ("low", "high", "threshold", "message"),
    [
        (0.9, 0.1, 0.5, "low end .* is above its high end"),
        (0.1, 0.9, math.nan, "threshold must be a finite number"),
    ],
)
def test_a_verdict_of_a_malformed_interval_is_refused(low, high, threshold, message):
    with pytest.raises(GraftingLensError, match=message):
        verdict(low, high, threshold, at_least=True)
