"""Tests for grafting_lens.analysis.generation: grafted generations as text, and judged."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import no_forward_pass, random_model

import grafting_lens as gl
from grafting_lens.analysis.batch import TokenizedExamples
from grafting_lens.analysis.generation import GENERATION_COLUMNS, generate_text, judge_rate
from grafting_lens.analysis.metrics import bootstrap_ci
from grafting_lens.core.errors import ArgumentTypeError, GraftingError, GraftMaskError

TEXTS = ["Keanu Reeves starred in a movie alongside", "Q: Who", "The film was released in"]
NEW = 5


def test_each_prompt_generates_the_checkpoints_own_text(family, three_models, tokenizer):
    """Prompts of three lengths in one call: the base's and the donor's rows are their HF
    generate()'s text, stopped at the end-of-text token; a position graft's rows are each
    prompt generated alone."""
    grafts = {"base": dict(source=0), "donor": {}, "last": dict(positions="last", source=2)}
    table = generate_text(three_models, TEXTS, grafts, max_new_tokens=NEW)
    assert list(table.columns) == list(GENERATION_COLUMNS)
    assert table[["graft", "prompt"]].values.tolist() == [[g, p] for g in grafts for p in range(3)]
    assert table.text.tolist() == TEXTS * 3
    for graft, source in (("base", 0), ("donor", 1)):
        model = random_model(family, source)  # a fresh copy, run by transformers alone
        for prompt, text in enumerate(TEXTS):
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            assert table.generation[(table.graft == graft) & (table.prompt == prompt)].item() == (
                expected
            )
    for prompt, text in enumerate(TEXTS):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        mask = gl.GraftMask.build(three_models, ids, positions="last", source=2)
        alone = gl.graft_generate(three_models, ids, mask, NEW)[0, ids.shape[1] :].tolist()
        eos = tokenizer.eos_token_id
        alone = alone[: alone.index(eos)] if eos in alone else alone
        row = (table.graft == "last") & (table.prompt == prompt)
        assert table.generation[row].item() == tokenizer.decode(alone)


@pytest.mark.parametrize("family", ["llama"])
def test_a_batch_and_its_masks_generate_as_the_text_does(three_models, tokenizer):
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    width = max(map(len, ids))
    tokens = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    attention_mask = (tokens != 0).long()  # no prompt holds the pad token
    batch = TokenizedExamples(None, tokens, attention_mask, tokens[:, 0], None, {})
    mask = gl.GraftMask.build(
        three_models, tokens, positions=[0, 1], source=1, attention_mask=attention_mask
    )
    from_batch = generate_text(three_models, batch, {"first two": mask}, max_new_tokens=NEW)
    from_text = generate_text(
        three_models, TEXTS, {"first two": dict(positions=[0, 1])}, max_new_tokens=NEW
    )
    pd.testing.assert_frame_equal(from_batch, from_text)


def test_the_rate_is_the_share_the_judge_accepts_with_the_librarys_interval():
    generations = pd.DataFrame(
        {
            "graft": ["donor", "base", "donor", "base", "donor", "base"],
            "generation": [" yes, sure", " no", " yes", " never", " nope", " yes"],
        }
    )
    rates = judge_rate(generations, lambda text: text.startswith(" yes"), n_resamples=200, seed=3)
    assert rates.columns.tolist() == ["graft", "n", "rate", "rate_low", "rate_high"]
    assert rates.graft.tolist() == ["donor", "base"]  # in order of first appearance
    assert rates.n.tolist() == [3, 3]
    assert rates.rate.tolist() == [2 / 3, 1 / 3]  # counted by hand
    for row, hits in enumerate(([1, 1, 0], [0, 0, 1])):
        interval = bootstrap_ci(hits, n_resamples=200, seed=3)
        assert (rates.rate_low[row], rates.rate_high[row]) == interval


def _raises(text):
    raise KeyError(text)


@pytest.mark.parametrize(
    ("judge", "error", "message"),
    [
        ("yes", ArgumentTypeError, r"judge= must be a function of the text, got 'yes'"),
        (
            len,
            ArgumentTypeError,
            r"judge= builtins.len returned 3 for generation 0 .*True or False",
        ),
        (lambda text: None, ArgumentTypeError, "returned None for generation 0"),
        (_raises, GraftingError, r"test_generation._raises raised KeyError: 'yes' on generation 0"),
    ],
)
def test_judging_refuses_a_judge_that_is_no_test_of_the_text(judge, error, message):
    generations = pd.DataFrame({"graft": ["base"], "generation": ["yes"]})
    with pytest.raises(error, match=message):
        judge_rate(generations, judge)


@pytest.mark.parametrize(
    ("generations", "error", "message"),
    [
        ({"graft": ["a"]}, ArgumentTypeError, "generations= takes the DataFrame generate_text"),
        (pd.DataFrame({"graft": ["a"]}), GraftingError, r"lacking \['generation'\]"),
        (pd.DataFrame({"graft": [], "generation": []}), GraftingError, "lacking rows"),
    ],
)
def test_judging_refuses_what_is_not_a_table_of_generations(generations, error, message):
    with pytest.raises(error, match=message):
        judge_rate(generations, bool)


@pytest.mark.parametrize("family", ["llama"])
@pytest.mark.parametrize(
    ("prompts", "grafts", "error", "message"),
    [
        (TEXTS, [dict(source=0)], ArgumentTypeError, "grafts= takes names to GraftMasks"),
        (TEXTS, {"base": 0}, ArgumentTypeError, "grafts= takes names to GraftMasks"),
        (TEXTS, {}, GraftingError, "grafts= names no graft"),
        (TEXTS, {"x": dict(position="last")}, GraftingError, r"gives \['position'\]"),
        (TEXTS, {"x": dict(source=5)}, GraftMaskError, "source"),
        (["Q", ""], {"x": {}}, gl.errors.SelectionError, r"prompts\[1\] is ''"),
        (42, {"x": {}}, ArgumentTypeError, "prompts=42 cannot be read"),
        (TEXTS, {"x": None}, ArgumentTypeError, "grafts= takes names"),
    ],
)
def test_generating_refuses_at_the_door(three_models, prompts, grafts, error, message):
    with no_forward_pass(three_models), pytest.raises(error, match=message):
        generate_text(three_models, prompts, grafts, max_new_tokens=2)


@pytest.mark.parametrize("family", ["llama"])
def test_a_mask_for_other_tokens_is_refused_before_anything_runs(three_models):
    mask = gl.GraftMask.build(three_models, (3, 2), positions="last")
    with no_forward_pass(three_models), pytest.raises(GraftMaskError, match="does not fit"):
        generate_text(three_models, TEXTS, {"base": dict(source=0), "x": mask})
