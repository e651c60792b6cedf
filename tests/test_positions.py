"""Position selectors: per-row indices, spans, last token, complements, padding."""

from __future__ import annotations

import pytest
import torch

from grafting_lens import GraftMaskError, positions

PADDED = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


def test_last_token_follows_each_rows_padding():
    assert positions.last_token((2, 5), PADDED).nonzero().tolist() == [[0, 4], [1, 2]]
    assert positions.last_token((2, 5)).nonzero().tolist() == [[0, 4], [1, 4]]


def test_indices_negative_indices_and_per_row_lists():
    assert positions.resolve_positions(-1, (2, 5), PADDED).nonzero().tolist() == [[0, 4], [1, 2]]
    per_row = positions.resolve_positions([[0, 1], [2]], (2, 5), PADDED)
    assert per_row.nonzero().tolist() == [[0, 0], [0, 1], [1, 2]]


def test_spans_and_complement_never_touch_padding():
    span = positions.span_positions((2, 5), starts=[1, 0], ends=[3, 2], attention_mask=PADDED)
    assert span.nonzero().tolist() == [[0, 1], [0, 2], [1, 0], [1, 1]]
    rest = positions.complement(span, PADDED)
    assert rest.nonzero().tolist() == [[0, 0], [0, 3], [0, 4], [1, 2]]


def test_positions_beyond_the_sequence_are_errors():
    with pytest.raises(GraftMaskError, match="Position 3 is beyond row 1, which has 3 real tokens"):
        positions.resolve_positions([3], (2, 5), PADDED)
    with pytest.raises(GraftMaskError, match="padding"):
        positions.resolve_positions(torch.ones(2, 5, dtype=torch.bool), (2, 5), PADDED)
    with pytest.raises(GraftMaskError, match="empty"):
        positions.span_positions((2, 5), 2, 2)


def test_left_padding_is_rejected():
    with pytest.raises(GraftMaskError, match="right padding"):
        positions.row_lengths((1, 3), torch.tensor([[0, 1, 1]]))
