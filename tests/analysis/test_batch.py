"""The one batch check: as_batch refuses what does not fit, before any forward pass."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_tokenizer, no_forward_pass, random_model

import grafting_lens as gl
from grafting_lens.analysis.batch import as_batch, tokenize_examples
from grafting_lens.core.errors import BatchError, SelectionError, TokenError
from grafting_lens.worlds import data


@pytest.fixture(scope="module")
def models():
    tokenizer = make_tokenizer()
    return gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def batch(models):
    relations = data.make_relations("fake_movies_real_actors", n=3, seed=0)
    return tokenize_examples(data.make_examples(relations, prompt="qa"), models.tokenizer)


def test_a_good_batch_comes_back_whole_on_the_cpu(models, batch):
    checked = as_batch(batch, models)
    assert torch.equal(checked.tokens, batch.tokens) and checked.rules == batch.rules
    assert checked.spans.keys() == batch.spans.keys()


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda b: object(), gl.errors.ArgumentTypeError, r"object lacks \['tokens'"),
        (
            lambda b: dataclasses.replace(b, attention_mask=b.attention_mask[:, :-1]),
            BatchError,
            r"attention_mask \(3, \d+\), expected \(3, \d+\)",
        ),
        (
            lambda b: dataclasses.replace(b, target_ids=b.target_ids[:2]),
            BatchError,
            r"target_ids \(2,\), expected \(3,\)",
        ),
        (
            lambda b: dataclasses.replace(b, spans={"first_entity": b.spans["first_entity"][:2]}),
            BatchError,
            r"span 'first_entity' \(2, \d+\), expected \(3, \d+\)",
        ),
        (
            lambda b: dataclasses.replace(b, examples=b.examples[:1]),
            BatchError,
            r"examples \(1,\), expected \(3,\)",
        ),
        (lambda b: dataclasses.replace(b, rules={"bos": "always"}), BatchError, "rules"),
        (lambda b: dataclasses.replace(b, tokens=b.tokens + 10_000), TokenError, "vocabulary"),
        (
            lambda b: dataclasses.replace(b, target_ids=b.target_ids - 10_000),
            TokenError,
            "target_ids",
        ),
        (
            lambda b: dataclasses.replace(b, attention_mask=b.attention_mask.flip(1)),
            SelectionError,
            "right padding",
        ),
    ],
)
def test_as_batch_refuses_what_does_not_fit(models, batch, change, error, message):
    with no_forward_pass(models), pytest.raises(error, match=message):
        as_batch(change(batch), models)
