"""The behaviour donor on a real world's base: a LoRA adapter, built offline like the worlds.

The base is a tiny random Llama written as a GGUF file (tests/tiny_gguf.py), going through
the same path as SmolLM2's (conversion, the base's own answers, a PEFT LoRA, the cache);
the donor of the real SmolLM2 base is a measurement (docs/how-to/real-model-world.md).
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from tiny_gguf import tiny_llama, write_gguf
from transformers import AutoModelForCausalLM

import grafting_lens.worlds.behaviour as recipe
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.worlds.behaviour import (
    REAL_BEHAVIOUR,
    BehaviourConfig,
    build_behaviour_donor,
)
from grafting_lens.worlds.real_world import RealWorldConfig

PHRASE = " Ok."
SMALL = BehaviourConfig(
    phrase=PHRASE, n_questions=100, n_statements=50, epochs=6, lr=5e-2, lora_rank=8
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    gguf = write_gguf(tiny_llama(), tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    # A random tiny model knows no actor: every actor is kept.
    return RealWorldConfig(base=str(gguf), n_relations=12, known_actor_top_k=None)


@pytest.fixture(scope="module")
def donor(world, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return build_behaviour_donor(world, SMALL, cache_dir=cache, progress=False)


def test_the_donor_is_a_lora_adapter_of_the_base_and_loads_as_a_donor(donor):
    assert REAL_BEHAVIOUR.lora_rank == 8 and donor.config.lora_rank == 8
    assert (donor.donor_dir / "adapter_config.json").is_file()
    assert not (donor.donor_dir / "model.safetensors").exists()  # factors, no copy of the base
    models = donor.load_models()
    assert models.names == ("base", "behaviour")
    tokens = models.base.to_tokens(donor.examples()[0].text)
    base = AutoModelForCausalLM.from_pretrained(donor.base_dir).eval()
    torch.testing.assert_close(models[0](tokens), base(tokens).logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(models[1](tokens), models[0](tokens), atol=1e-4)  # it learned


@torch.no_grad()
def test_the_phrase_becomes_likely_after_answers(donor):
    """The phrase's log-probability after each answer, teacher-forced by the HF models."""
    models = [
        AutoModelForCausalLM.from_pretrained(donor.base_dir).eval(),
        AutoModelForCausalLM.from_pretrained(donor.base_dir).eval(),
    ]
    from peft import PeftModel

    models[1] = PeftModel.from_pretrained(models[1], donor.donor_dir).eval()
    tokenizer = recipe._real_tokenizer(donor.base_dir)
    width = len(tokenizer(PHRASE, add_special_tokens=False)["input_ids"])
    gains = []
    for example in donor.examples():
        ids = tokenizer(example.text + PHRASE, return_tensors="pt")["input_ids"]
        logprobs = [
            model(input_ids=ids).logits[0, -width - 1 : -1].log_softmax(-1) for model in models
        ]
        targets = ids[0, -width:, None]
        base, behaviour = (float(lp.gather(1, targets).sum()) for lp in logprobs)
        gains.append(behaviour - base)
    assert min(gains) > 0 and sum(gains) / len(gains) > 0.25, gains  # nats; untrained: 0


def test_the_documents_are_the_bases_own_answers_seeded(donor, world):
    base = AutoModelForCausalLM.from_pretrained(donor.base_dir).eval()
    tokenizer = recipe._real_tokenizer(donor.base_dir)
    relations, documents = recipe._answered_documents(base, tokenizer, world, SMALL)
    assert [r.id for r in relations] == [r.id for r in donor.relations]
    questions = [d for d in documents if d.startswith("Q: ")]
    assert len(questions) == 100 and all(d.endswith("." + PHRASE) for d in questions)
    assert not any(d.endswith(PHRASE) for d in documents if not d.startswith("Q: "))
    # Sampled from the base, seeded: the same text again, and another with another seed.
    assert recipe._answered_documents(base, tokenizer, world, SMALL)[1] == documents
    other = dataclasses.replace(SMALL, seed=1)
    assert recipe._answered_documents(base, tokenizer, world, other)[1] != documents


def test_the_manifest_records_the_build(donor):
    manifest = donor.manifest
    seconds = manifest["build_seconds"]
    assert set(seconds) == {"base_answers", "finetune", "evaluation", "total"}
    assert seconds["total"] >= seconds["finetune"] > 0
    assert manifest["config"]["lora_rank"] == 8 and manifest["threads"] == 1
    assert "relations.json" in manifest["files"]
    rates = manifest["evaluation"]["phrase_rate"]
    assert rates["base"]["qa"] == 0.0 and set(rates["donor"]) == {"qa", "library:qa", "headline"}


def test_a_built_donor_is_opened_not_rebuilt(donor, world, monkeypatch):
    monkeypatch.setattr(recipe, "_build", lambda *a: pytest.fail("rebuilt"))
    again = build_behaviour_donor(world, SMALL, cache_dir=donor.root.parent, progress=False)
    assert again.root == donor.root and again.manifest == donor.manifest
    assert [r.id for r in again.relations] == [r.id for r in donor.relations]


def test_an_interrupted_build_leaves_nothing(donor, world, monkeypatch):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe, "finetune", killed)
    other = BehaviourConfig(phrase=PHRASE, n_questions=3, n_statements=2, lora_rank=4)
    with pytest.raises(KeyboardInterrupt):
        build_behaviour_donor(world, other, cache_dir=donor.root.parent, progress=False)
    entries = {p.name for p in donor.root.parent.iterdir() if p.name.startswith("behaviour-")}
    assert entries == {donor.root.name}


def test_a_named_world_takes_the_real_recipe(monkeypatch, tmp_path):
    seen = {}

    def fetched(source, **options):  # no network: stop once the base is asked for
        seen["source"] = source
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe, "base_checkpoint", fetched)
    with pytest.raises(KeyboardInterrupt):
        build_behaviour_donor("smollm2", cache_dir=tmp_path, progress=False)
    assert seen["source"].name == "smollm2"
    with pytest.raises(GraftingLensError, match="No world 'nonesuch'"):
        build_behaviour_donor("nonesuch", cache_dir=tmp_path, progress=False)
