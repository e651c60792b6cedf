"""Position selectors: per-row indices, spans, last token, complements, padding."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grafting_lens.core.errors import ArgumentTypeError, SelectionError
from grafting_lens.engine import positions

PADDED = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
PAD_0 = SimpleNamespace(pad_token_id=0, eos_token_id=2)


def test_last_token_follows_each_rows_padding():
    assert positions.last_token((2, 5), PADDED).nonzero().tolist() == [[0, 4], [1, 2]]
    assert positions.last_token((2, 5)).nonzero().tolist() == [[0, 4], [1, 4]]


def test_indices_negative_indices_and_per_row_lists():
    assert positions.resolve_positions(-1, (2, 5), PADDED).nonzero().tolist() == [[0, 4], [1, 2]]
    per_row = positions.resolve_positions([[0, 1], [2]], (2, 5), PADDED)
    assert per_row.nonzero().tolist() == [[0, 0], [0, 1], [1, 2]]
    # A row with no position is fine when another row has some.
    assert positions.resolve_positions([[], [1]], (2, 5)).nonzero().tolist() == [[1, 1]]


def test_spans_and_complement_never_touch_padding():
    span = positions.span_positions((2, 5), starts=[1, 0], ends=[3, 2], attention_mask=PADDED)
    assert span.nonzero().tolist() == [[0, 1], [0, 2], [1, 0], [1, 1]]
    rest = positions.complement(span, PADDED)
    assert rest.nonzero().tolist() == [[0, 0], [0, 3], [0, 4], [1, 2]]


def test_attention_masks_of_any_zero_one_dtype_give_the_lengths():
    assert positions.row_lengths((2, 5), PADDED.bool()).tolist() == [5, 3]
    assert positions.row_lengths((2, 5), PADDED.float()).tolist() == [5, 3]


@pytest.mark.parametrize(
    ("attention_mask", "message"),
    [
        # The model reads the mask as given (a 2 moves its logits); lengths read here
        # would silently disagree with it.
        (PADDED * 2, r"only 0 \(padding\) and 1 \(real token\).*got torch.int64"),
        (PADDED * 0.5, r"only 0 \(padding\) and 1"),
        (PADDED * -1, r"only 0 \(padding\) and 1"),
        (torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]), "with right padding"),
        (torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]), "a real token in every row"),
        (PADDED[:, :4], r"must be a \[batch, pos\] = \[2, 5\] tensor.*shape \[2, 4\]"),
        (PADDED.tolist(), "attention_mask must be a .*got list"),
        (PADDED.to("meta"), "on meta"),  # torch: "Cannot copy out of meta tensor"
    ],
)
def test_row_lengths_refuses_attention_masks_no_model_reads_as_lengths(attention_mask, message):
    with pytest.raises(SelectionError, match=message):
        positions.row_lengths((2, 5), attention_mask)


def test_padding_without_an_attention_mask_is_refused_unless_its_tokens_are_real():
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0], [5, 6, 7, 0]])
    positions.check_padding(tokens, (tokens != 0).long(), PAD_0)  # given: fine
    positions.check_padding(tokens, torch.ones_like(tokens), PAD_0)  # "they are real"
    positions.check_padding(tokens[:1], None, PAD_0)  # no row ends in padding
    positions.check_padding(tokens, None, SimpleNamespace(pad_token_id=None, eos_token_id=None))
    positions.check_padding(tokens, None, None)
    # A BOS that is the pad token (GPT-2's) starts every row once: not padding.
    positions.check_padding(torch.tensor([[0, 5, 6, 7], [0, 8, 9, 10]]), None, PAD_0)


@pytest.mark.parametrize(
    ("tokens", "tokenizer", "fix", "message"),
    [
        (
            torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0], [5, 6, 7, 0]]),
            PAD_0,
            None,
            r"2 of 3 rows \(rows 1, 2\) end in the pad token 0.*\nPass the tokenizer's",
        ),
        # A tokenizer without a pad token pads with EOS (GPT-2's, tokenize_examples).
        (
            torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]]),
            SimpleNamespace(pad_token_id=None, eos_token_id=0),
            None,
            "end in the pad token 0",
        ),
        # A left-padded batch without its mask was taken as real tokens.
        (
            torch.tensor([[5, 6, 7, 8], [0, 0, 5, 6], [0, 5, 6, 7]]),
            PAD_0,
            None,
            r"2 of 3 rows \(rows 1, 2\) start with more pad tokens \(0\) than the others",
        ),
        (torch.tensor([[0, 5, 6, 7], [0, 0, 0, 8]]), PAD_0, None, r"rows \(rows 1\) start with"),
        (
            torch.tensor([[5, 6, 7, 8], [0, 0, 5, 6]]),
            PAD_0,
            "Generate one at a time.",
            r"than the others.*\nGenerate one at a time\.$",
        ),
    ],
)
def test_check_padding_refuses_padded_rows_without_their_attention_mask(
    tokens, tokenizer, fix, message
):
    with pytest.raises(SelectionError, match=message):
        positions.check_padding(tokens, None, tokenizer, fix=fix)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([3], r"Position 3 is beyond row 1, which has 3 real tokens \(positions 0..2"),
        ([-4], "Position -4 is beyond row 1"),
        (torch.ones(2, 5, dtype=torch.bool), r"selecting padding in row 1 \(it has 3 real"),
        (torch.ones(2, 4, dtype=torch.bool), r"boolean \[batch, pos\] = \[2, 5\].*shape \[2, 4\]"),
        (torch.ones(2, 5, dtype=torch.long), r"must be a boolean .*got torch.int64"),
        (torch.zeros(2, 5, dtype=torch.bool, device="meta"), "on meta"),
        ([], r"positions=\[\] selects no position"),
        ([[], []], "selects no position in any row"),
        ([(), np.array([], int)], r"selects no position in any row.*\nGive at least one"),
        (True, "Cannot read positions from True"),  # would read as position 1
        (False, "Cannot read positions from False"),
        ([[True], [1]], "Cannot read positions from"),
        ([1.0], r"Cannot read positions from \[1.0\]"),
        ([[1], 2], "Cannot read positions from"),
        ([[1], [2], [3]], r"one list of ints per row \(2 rows\)"),
        ("first", "Cannot read positions from 'first'"),
    ],
)
def test_resolve_positions_refuses_what_selects_no_real_token(spec, message):
    with pytest.raises(SelectionError, match=message):
        positions.resolve_positions(spec, (2, 5), PADDED)


@pytest.mark.parametrize(
    ("starts", "ends", "message"),
    [
        (2, 2, "with start < end; got starts=2, ends=2"),
        (True, 3, "Spans need starts and ends that are ints"),
        ([0, 1.5], 3, r"starts=\[0, 1.5\]"),
        ([0, 1, 2], 3, r"one per row of 2"),
        ([0, 2], 4, r"Position 3 is beyond row 1"),
    ],
)
def test_span_positions_refuses_empty_or_malformed_spans(starts, ends, message):
    with pytest.raises(SelectionError, match=message):
        positions.span_positions((2, 5), starts, ends, PADDED)


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


def test_span_expressions_parse_with_complement_binding_tighter_than_union():
    assert positions.parse_span_expression("(FE+LT)^C") == (
        "complement",
        ("union", (("span", "first_entity"), ("span", "last_token"))),
    )
    assert positions.parse_span_expression("FE+LT^c") == (
        "union",
        (("span", "first_entity"), ("complement", ("span", "last_token"))),
    )
    assert positions.parse_span_expression(" ALL ^C^C ") == ("complement", ("complement", ("all",)))
    assert positions.span_names("((M)+REL)^C+x") == {"movie", "relation", "x"}


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("(FE+LT", "Unbalanced parentheses"),
        ("FE+LT)", "Unbalanced parentheses"),
        ("FE-LT", "Cannot read '-' there in the span expression 'FE-LT'"),
        ("FE+", "A name is missing at the end"),
        ("FE LT", "Cannot read 'LT' there"),
        ("()", "Cannot read '\\)' there"),
        ("", "Nothing to read"),
        (3, "Nothing to read in the span expression 3"),
    ],
)
def test_span_expressions_that_do_not_parse_say_where(expression, message):
    wrong = not isinstance(expression, str)  # a TypeError: the one refusal of a wrong type
    with pytest.raises(ArgumentTypeError if wrong else SelectionError, match=message):
        positions.parse_span_expression(expression)


SPANS = {"first_entity": torch.tensor([[False, True, True, False, False]] * 2)}


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ("LT", "EF"),
            r"Unknown position set 'EF': this batch has no 'EF' span. Did you mean 'FE'",
        ),
        ("M", r"no 'movie' span. It has \['first_entity'\]; use a prompt that names the movie"),
        ({"mine": lambda spans, mask: mask}, r"position function .*'s result must be a boolean"),
        ({"mine": lambda spans, mask: torch.ones(2, 5).bool()}, "selecting padding in row 1"),
        ({}, "positions must be span expressions"),
        (("LT", "LT"), "each label once"),
        ({"mine": 3}, r"positions must be span expressions.*got \{'mine': 3\}"),
        ({"x": torch.ones(2, 5, dtype=torch.bool)}, "selecting padding in row 1"),
        ({"x": "FE+(LT"}, "Unbalanced parentheses"),
    ],
)
def test_position_sets_refuse_what_the_batch_cannot_select(sets, message):
    with pytest.raises(SelectionError, match=message):
        positions.position_sets(sets, SPANS, PADDED)


def test_position_sets_label_span_expressions_tensors_and_functions():
    chosen = torch.zeros(2, 5, dtype=torch.bool)
    chosen[1, 0] = True
    sets = positions.position_sets(
        {"FE": "FE", "rest": "(FE+LT)^C", "x": chosen, "f": lambda spans, mask: chosen},
        SPANS,
        PADDED,
    )
    assert sets["FE"].nonzero().tolist() == [[0, 1], [0, 2], [1, 1], [1, 2]]
    assert sets["rest"].nonzero().tolist() == [[0, 0], [0, 3], [1, 0]]
    assert torch.equal(sets["x"], chosen) and torch.equal(sets["f"], chosen)
