"""The fuzzer's hypothesis profiles and the tiny models it drives, built once per session.

``HYPOTHESIS_PROFILE`` picks the profile: ``ci`` (the default: derandomized, so a run is
repeatable and CI's time bounded) or ``long`` (random, many times the examples, for a long
local run: ``HYPOTHESIS_PROFILE=long python -m pytest tests/fuzz``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tokenizer, random_model
from hypothesis import HealthCheck, settings

import grafting_lens as gl
from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.worlds import data

# A forward pass of a tiny model takes milliseconds, but a search or a sweep takes up to a
# second: no deadline, and no complaint that generating examples is slow.
_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=_SLOW, database=None
)
settings.register_profile(
    "long", derandomize=False, deadline=None, suppress_health_check=_SLOW, database=None
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

PROMPT = "Keanu Reeves starred in a movie alongside"
# The tiny tokenizer's words whose first token is a word, not a bare space.
ANSWERS = ("movie", "starred", "Keanu", " movie")


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Llama and a donor sharing its final norm and unembedding.

    A donor like a finetune of the body only, so that a graft of every component everywhere
    equals the donor under every semantics, including the paper's code's, which never
    grafts the final norm.
    """
    base, donor = random_model("llama", 0), random_model("llama", 1)
    with torch.no_grad():
        donor.model.norm.weight.copy_(base.model.norm.weight)
        donor.lm_head.weight.copy_(base.lm_head.weight)
    return base, donor


class World(SimpleNamespace):
    def __repr__(self) -> str:  # shown in every falsifying example: the tensors would bury it
        return "world"


@pytest.fixture(scope="session")
def world() -> World:
    """The models (``pre``, ``sft``), untouched HF copies of them, and a tokenized batch."""
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    base, donor = _pair()
    models = gl.load_models(
        copy.deepcopy(base), copy.deepcopy(donor), tokenizer=tokenizer, names=["pre", "sft"]
    )
    relations = data.make_relations("fake_movies_real_actors", n=4, seed=0)
    examples = data.make_examples(relations)
    batch = tokenize_examples(examples, tokenizer)
    with torch.no_grad():  # answers the donor gives: a search has a gap to recover
        logits = models[1](batch.tokens, attention_mask=batch.attention_mask)
    last = batch.attention_mask.sum(dim=1) - 1
    top = logits[torch.arange(len(batch)), last].argmax(-1)
    return World(
        search_batch=dataclasses.replace(batch, target_ids=top),
        tokenizer=tokenizer,
        base=base,
        donor=donor,
        models=models,
        examples=examples,
        batch=tokenize_examples(examples, tokenizer),
    )
