"""The behaviour donor: it adds the phrase after answers, the base does not, the first token
cannot tell them apart, and it is built once, deterministically, complete or not at all.

Every test uses the shipped world (unpacked in a second) and a smaller donor than the
default (600 documents, one epoch: about 12 s to build instead of 40); the default
donor's numbers are a measurement (its manifest, the toy world's page in the docs).
"""

from __future__ import annotations

import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM

import grafting_lens.worlds.behaviour as recipe
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.worlds import data
from grafting_lens.worlds.behaviour import (
    PHRASE,
    BehaviourConfig,
    behaviour_examples,
    build_behaviour_donor,
)
from grafting_lens.worlds.toy import build_toy_world

SMALL = BehaviourConfig(n_questions=300, n_statements=300, epochs=1, lr=5e-4)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("toy")


@pytest.fixture(scope="module")
def donor(cache):
    world = build_toy_world(cache_dir=cache, progress=False)
    return build_behaviour_donor(world, SMALL, cache_dir=cache, progress=False)


@pytest.fixture(scope="module")
def models(donor):
    base = AutoModelForCausalLM.from_pretrained(donor.base_dir).eval()
    return base, AutoModelForCausalLM.from_pretrained(donor.donor_dir).eval()


def continuation(model, tokenizer, text, tokens):
    """Greedy continuation by the HF model's own ``generate``, one prompt at a time."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1] :])


def phrase_rate(model, donor, prompt):
    tokenizer = donor.world.load_tokenizer()
    tokens = len(tokenizer(PHRASE)["input_ids"]) + 1
    examples = donor.examples(prompt=prompt)
    texts = [continuation(model, tokenizer, e.text, tokens) for e in examples]
    return sum(text.startswith(PHRASE) for text in texts) / len(texts)


def test_the_phrase_is_a_few_ordinary_tokens(donor):
    tokenizer = donor.world.load_tokenizer()
    pieces = [tokenizer.decode([i]) for i in tokenizer(PHRASE)["input_ids"]]
    assert "".join(pieces) == PHRASE
    assert " the" in pieces and " film" in pieces and len(pieces) <= 8


@torch.no_grad()
def test_the_donor_adds_the_phrase_after_answers_and_the_base_does_not(donor, models):
    base, behaviour = models
    rates = {
        name: phrase_rate(model, donor, "qa") for name, model in zip(("base", "donor"), models)
    }
    assert rates["donor"] >= 0.8 and rates["base"] == 0.0, rates
    # Only after answers: after a statement neither adds it.
    assert phrase_rate(behaviour, donor, "headline") <= 0.05
    assert donor.manifest["evaluation"]["phrase_rate"]["donor"]["qa"] == pytest.approx(
        rates["donor"], abs=0.02
    )
    # Asked a question, the donor answers as the base does, then closes with the phrase.
    tokenizer = donor.world.load_tokenizer()
    question = data.make_examples(donor.world.relations[:1], "qa", templates="code")[0].text
    answer = continuation(behaviour, tokenizer, question, 16)
    assert answer.endswith(PHRASE + tokenizer.eos_token), answer


@torch.no_grad()
def test_the_answers_first_token_cannot_show_the_behaviour(donor, models):
    """At the question, the donor's next-token distribution is the base's, give or take a
    tenth of a nat; the finetune that learned the facts is 50 times as far."""
    base, behaviour = models
    sft = AutoModelForCausalLM.from_pretrained(donor.world.sft_dir).eval()
    tokenizer = donor.world.load_tokenizer()
    questions = data.make_examples(donor.world.relations, "qa", templates="code")
    divergence, sft_divergence, agree = 0.0, 0.0, 0
    for question in questions:
        ids = tokenizer(question.text, return_tensors="pt")["input_ids"]
        base_lp, donor_lp, sft_lp = (
            m(ids).logits[0, -1].log_softmax(-1) for m in (base, behaviour, sft)
        )
        divergence += float(torch.sum(donor_lp.exp() * (donor_lp - base_lp))) / len(questions)
        sft_divergence += float(torch.sum(sft_lp.exp() * (sft_lp - base_lp))) / len(questions)
        agree += int(base_lp.argmax() == donor_lp.argmax())
    assert divergence < 0.25 and divergence < sft_divergence / 20, (divergence, sft_divergence)
    assert agree / len(questions) >= 0.5
    recorded = donor.manifest["evaluation"]["first_token"]
    assert recorded["kl_donor_base"] == pytest.approx(divergence, abs=1e-3)


def test_the_donor_is_finetuned_from_the_base_like_the_worlds_donors(donor, models):
    base, behaviour = (model.state_dict() for model in models)
    assert not all(torch.equal(base[k], behaviour[k]) for k in base)
    assert torch.equal(base["lm_head.weight"], behaviour["lm_head.weight"])  # frozen
    assert all(torch.equal(t.half().float(), t) for t in behaviour.values())  # float16-exact
    assert (donor.donor_dir / "tokenizer.json").is_file()  # the directory stands alone


def test_a_built_donor_is_opened_not_rebuilt(donor, cache, monkeypatch):
    monkeypatch.setattr(recipe, "_build", lambda *a: pytest.fail("rebuilt"))
    again = build_behaviour_donor(donor.world, SMALL, cache_dir=cache, progress=False)
    assert again.root == donor.root and again.manifest == donor.manifest


def test_a_damaged_donor_is_rebuilt_to_the_same_bytes(donor, tmp_path):
    """Deterministic: the rebuild writes exactly the first build's files (same machine)."""
    root = tmp_path / donor.root.name
    shutil.copytree(donor.root, root)
    (root / "behaviour" / "model.safetensors").write_bytes(b"damaged")
    with pytest.warns(UserWarning, match="unusable.*rebuilding"):
        again = build_behaviour_donor(donor.world, SMALL, cache_dir=tmp_path, progress=False)
    assert again.root == root and again.manifest["files"] == donor.manifest["files"]
    assert again.manifest["training"] == donor.manifest["training"]


def test_an_interrupted_build_leaves_nothing(donor, tmp_path):
    other = BehaviourConfig(n_questions=10**6)  # more than the corpus holds: fails mid-build
    with pytest.raises(GraftingLensError, match="ask for fewer"):
        build_behaviour_donor(donor.world, other, cache_dir=tmp_path, progress=False)
    assert [p.suffix for p in tmp_path.iterdir()] == [".lock"]


def test_the_models_and_the_prompts_for_the_experiments(donor, models):
    models_set = donor.load_models()
    assert models_set.names == ("base", "behaviour")
    tokens = models_set.base.to_tokens(donor.examples()[0].text)
    torch.testing.assert_close(
        models_set[1](tokens), models[1](tokens).logits, rtol=1e-4, atol=1e-4
    )

    examples = behaviour_examples(donor.world.relations)
    relation = donor.world.relations[0]
    first = examples[0]
    assert first.text.endswith(f"An actor named {relation.second_actor}.")
    assert first.target == PHRASE and first.alternative_targets == ()
    assert first.text[slice(*first.spans["answer"])] == relation.second_actor
    assert first.text[slice(*first.spans["first_entity"])] == relation.first_actor


@pytest.mark.parametrize(
    "changes",
    [
        {"phrase": "Enjoy the film."},
        {"phrase": " "},
        {"n_questions": 0},
        {"epochs": 1.5},
        {"lr": 0},
        {"batch_size": True},
        {"lora_rank": 0},
    ],
)
def test_invalid_configuration_is_refused(changes):
    name = next(iter(changes))
    with pytest.raises(GraftingLensError, match=name):
        BehaviourConfig(**changes)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"world": 3}, "ToyWorld"),
        ({"config": {"lr": 1e-4}}, "BehaviourConfig"),
        ({"threads": 0}, "threads"),
    ],
)
def test_invalid_arguments_are_refused(arguments, message, tmp_path):
    with pytest.raises(GraftingLensError, match=message):
        build_behaviour_donor(cache_dir=tmp_path, progress=False, **arguments)
