"""Position selectors: per-row indices, spans, last token, complements, padding."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grafting_lens.core.errors import GraftMaskError
from grafting_lens.engine import positions

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


# ------------------------------------------------- one notion of a row's real tokens


@pytest.mark.parametrize("values", [2, 0.5, -1], ids=["two", "half", "minus-one"])
def test_attention_masks_hold_only_zeros_and_ones(values):
    # The model reads the mask as given (a 2 moves its logits); lengths read here
    # would silently disagree with it.
    bad = PADDED * values
    with pytest.raises(GraftMaskError, match="only 0 \\(padding\\) and 1 \\(real token\\)"):
        positions.row_lengths((2, 5), bad)
    with pytest.raises(GraftMaskError, match="only 0"):
        positions.resolve_positions("last", (2, 5), bad)
    assert positions.row_lengths((2, 5), PADDED.bool()).tolist() == [5, 3]
    assert positions.row_lengths((2, 5), PADDED.float()).tolist() == [5, 3]


def test_an_attention_mask_that_is_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="attention_mask must be a \\[batch, pos\\] tensor"):
        positions.row_lengths((2, 5), PADDED.tolist())


def test_rows_ending_in_the_pad_token_need_an_attention_mask():
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0], [5, 6, 7, 0]])
    padded_with_0 = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    with pytest.raises(GraftMaskError, match="2 of 3 rows \\(rows 1, 2\\) end in the pad token 0"):
        positions.check_padding(tokens, None, padded_with_0)
    positions.check_padding(tokens, (tokens != 0).long(), padded_with_0)  # given: fine
    positions.check_padding(tokens, torch.ones_like(tokens), padded_with_0)  # "they are real"
    positions.check_padding(tokens[:1], None, padded_with_0)  # no row ends in padding
    # A tokenizer without a pad token pads with EOS (GPT-2's, tokenize_examples).
    with pytest.raises(GraftMaskError, match="end in the pad token 0"):
        positions.check_padding(tokens, None, SimpleNamespace(pad_token_id=None, eos_token_id=0))
    positions.check_padding(tokens, None, SimpleNamespace(pad_token_id=None, eos_token_id=None))
    positions.check_padding(tokens, None, None)


def test_left_padded_rows_need_an_attention_mask_too():
    """A left-padded batch without its mask was taken as real tokens (right padding was not)."""
    padded_with_0 = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    left = torch.tensor([[5, 6, 7, 8], [0, 0, 5, 6], [0, 5, 6, 7]])
    with pytest.raises(GraftMaskError, match=r"2 of 3 rows \(rows 1, 2\) start with more pad"):
        positions.check_padding(left, None, padded_with_0)
    # A BOS that is the pad token (GPT-2's) starts every row once: not padding.
    with_bos = torch.tensor([[0, 5, 6, 7], [0, 8, 9, 10]])
    positions.check_padding(with_bos, None, padded_with_0)
    with pytest.raises(GraftMaskError, match=r"rows \(rows 1\) start with more pad tokens"):
        positions.check_padding(torch.tensor([[0, 5, 6, 7], [0, 0, 0, 8]]), None, padded_with_0)
    positions.check_padding(left, torch.ones_like(left), padded_with_0)  # "they are real"
    with pytest.raises(GraftMaskError, match=r"than the others.*Generate one at a time\.$"):
        positions.check_padding(left, None, padded_with_0, fix="Generate one at a time.")


def test_empty_and_boolean_position_specs_are_refused():
    with pytest.raises(GraftMaskError, match="positions=\\[\\] selects no position"):
        positions.resolve_positions([], (2, 5))
    for spec in (True, False):  # would read as position 1 or 0
        with pytest.raises(GraftMaskError, match="Cannot read positions from"):
            positions.resolve_positions(spec, (2, 5))
    with pytest.raises(GraftMaskError, match="Position indices must be ints, got True"):
        positions.resolve_positions([[True], [1]], (2, 5))
    with pytest.raises(GraftMaskError, match="Position indices must be ints, got 1.0"):
        positions.resolve_positions([1.0], (2, 5))
    with pytest.raises(GraftMaskError, match="Row 1's positions are 2"):
        positions.resolve_positions([[1], 2], (2, 5))
    # A row with no position is fine when another row has some.
    assert positions.resolve_positions([[], [1]], (2, 5)).nonzero().tolist() == [[1, 1]]


def test_per_row_lists_that_are_all_empty_are_refused():
    # One empty list per row reads as a selection, yet grafts or patches nothing.
    for spec, shape in (([[]], (1, 5)), ([[], []], (2, 5)), ([(), np.array([], int)], (2, 5))):
        with pytest.raises(GraftMaskError, match="selects no position in any row.*positions="):
            positions.resolve_positions(spec, shape)


def test_numpy_positions_read_like_python_ones():
    shape = (2, 5)
    assert torch.equal(
        positions.resolve_positions(np.array([1, -1]), shape, PADDED),
        positions.resolve_positions([1, -1], shape, PADDED),
    )
    assert torch.equal(
        positions.resolve_positions(np.int64(2), shape), positions.resolve_positions(2, shape)
    )
    assert torch.equal(
        positions.resolve_positions([np.array([0]), [np.int32(2)]], shape),
        positions.resolve_positions([[0], [2]], shape),
    )
    selected = np.zeros(shape, dtype=bool)
    selected[1, 2] = True
    assert positions.resolve_positions(selected, shape, PADDED).nonzero().tolist() == [[1, 2]]
    assert torch.equal(
        positions.span_positions(shape, np.int64(1), np.int64(3)),
        positions.span_positions(shape, 1, 3),
    )
    with pytest.raises(GraftMaskError, match="starts must be an int or one int per row, got True"):
        positions.span_positions(shape, True, 3)
    with pytest.raises(GraftMaskError, match="Span starts and ends must be ints, got 1.5"):
        positions.span_positions(shape, [0, 1.5], 3)
