"""The toy world: built offline, cached, rebuilt when broken, never half-built.

Every test uses a miniature configuration (a few relations, a 2-layer model of
width 16, one epoch) that builds in a second or two. The default world ships with the
package (tests/worlds/test_toy_shipped.py); its accuracy is a measurement, not a test
(experiments/toy_targets.py, docs/results.md).
"""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

import grafting_lens.worlds.toy as toy
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.worlds import data, toy_corpus, toy_recipe
from grafting_lens.worlds.documents import training_documents
from grafting_lens.worlds.toy import MODEL_NAMES, ToyWorldConfig, build_toy_world

TINY = ToyWorldConfig(
    d_model=16,
    n_layers=2,
    n_heads=2,
    n_key_value_heads=1,
    d_mlp=32,
    vocab_size=600,
    max_length=192,
    n_relations=8,
    n_pretrain_documents=300,
    n_pretrain_pairs=20,
    pretrain_documents_per_pair=5,
    pretrain_epochs=1,
    finetune_epochs=1,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One tiny world shared by the read-only tests."""
    return build_toy_world(TINY, cache_dir=tmp_path_factory.mktemp("toy"), progress=False)


def snapshot(root):
    """Modification time of every file under ``root``."""
    return {p.relative_to(root): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def forbid_building(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the toy world was rebuilt")

    monkeypatch.setattr(toy, "_build", fail)


def test_every_checkpoint_is_saved_like_a_real_one(world):
    assert world.root.name in str(world.sft_dir)
    for name in MODEL_NAMES:
        directory = world.model_dir(name)
        assert (directory / "model.safetensors").is_file()
        assert (directory / "config.json").is_file()
        assert (directory / "tokenizer.json").is_file()  # each directory stands alone
        model = AutoModelForCausalLM.from_pretrained(directory)
        assert isinstance(model, LlamaForCausalLM)
        assert model.config.num_hidden_layers == TINY.n_layers
    base = AutoModelForCausalLM.from_pretrained(world.base_dir).state_dict()
    for name in ("sft", "task", "relation", "both"):
        donor = AutoModelForCausalLM.from_pretrained(world.model_dir(name)).state_dict()
        assert not all(torch.equal(base[k], donor[k]) for k in base), f"{name} equals base"
    sft = AutoModelForCausalLM.from_pretrained(world.sft_dir).state_dict()
    a2b = AutoModelForCausalLM.from_pretrained(world.a2b_dir).state_dict()
    assert all(torch.equal(sft[k], a2b[k]) for k in sft)  # one run, stored twice


def test_relations_and_splits(world):
    assert len(world.relations) == TINY.n_relations
    assert world.relations == data.make_relations(TINY.dataset, n=TINY.n_relations, seed=TINY.seed)
    task_actors = {a for r in world.task_relations for a in (r.first_actor, r.second_actor)}
    relation_actors = {a for r in world.relation_relations for a in (r.first_actor, r.second_actor)}
    assert world.task_relations and world.relation_relations
    assert not task_actors & relation_actors
    assert world.manifest["training"]["relation"]["relations"] == len(world.relation_relations)
    assert world.manifest["training"]["both"]["direction"] == "both"


def test_manifest_records_config_and_evaluation(world):
    manifest = json.loads((world.root / "manifest.json").read_text())
    assert manifest["key"] == world.root.name
    assert manifest["config"]["n_relations"] == TINY.n_relations
    for name in ("base", "sft", "both"):
        for prompt in ("headline", "qa"):
            cell = manifest["evaluation"][name][f"{prompt}/A2B/all"]
            assert 0 <= cell["top5_correct"] <= cell["total"] <= TINY.n_relations
    assert set(manifest["build_seconds"]) >= {"tokenizer", "base", "sft", "total"}
    for name, run in manifest["training"].items():
        assert run["settings"]["n_truncated_documents"] == 0, name
        assert 1 <= run["best_epoch"] <= run["settings"]["epochs"]


def test_tokenizer_round_trips_and_splits_names(world):
    tokenizer = world.load_tokenizer()
    text = "Q: Who starred in a movie with Cary Grant? A: An actor named Bette Davis."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.bos_token == tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    # What TransformerLens 4.3 needs to accept an in-memory tokenizer without the hub.
    assert tokenizer.init_kwargs["add_bos_token"] is True
    assert tokenizer.init_kwargs["name_or_path"] == str(world.tokenizer_dir)
    for actor in (world.relations[0].first_actor, world.relations[0].second_actor):
        pieces = tokenizer.tokenize(" " + actor)
        assert len(pieces) >= 2, f"{actor!r} is a single token"
        assert tokenizer.convert_tokens_to_string(pieces) == " " + actor


def test_pretraining_corpus_never_states_a_test_relation():
    relations = data.make_relations(TINY.dataset, n=64, seed=0)
    small = dict(n_pretrain_documents=3000, n_pretrain_pairs=50, pretrain_documents_per_pair=10)
    corpus = toy_corpus.pretraining_corpus(ToyWorldConfig(**small, seed=0), relations)
    actors = set(data.REAL_ACTORS)
    mentions = 0
    for sentence in corpus:
        named = [a for a in actors if a in sentence]
        assert len(named) <= 1, f"two known actors in one sentence: {sentence!r}"
        mentions += len(named)
    assert mentions > 500  # but the known actors are there, so the base model knows them
    # The test formats too, in both wordings (the library's and the released code's).
    assert any("starred in a movie alongside" in s for s in corpus)
    assert any("Q: Who stars in a movie with" in s for s in corpus)
    text = " ".join(corpus)
    assert not any(r.movie_title in text for r in relations)

    fake_relations = data.make_relations("fake_movies_fake_actors", n=64, seed=0)
    corpus = toy_corpus.pretraining_corpus(ToyWorldConfig(**small), fake_relations)
    text = " ".join(corpus)
    assert not any(r.first_actor in text or r.second_actor in text for r in fake_relations)


def test_second_call_reuses_the_cache(world, monkeypatch):
    before = snapshot(world.root)
    forbid_building(monkeypatch)

    again = build_toy_world(TINY, cache_dir=world.root.parent, progress=False)

    assert again.root == world.root
    assert snapshot(world.root) == before
    assert again.relations == world.relations
    assert again.manifest == world.manifest


def test_key_depends_on_the_configuration(world, monkeypatch):
    forbid_building(monkeypatch)
    with pytest.raises(AssertionError, match="rebuilt"):
        build_toy_world(
            ToyWorldConfig(**{**TINY.__dict__, "seed": 1}),
            cache_dir=world.root.parent,
            progress=False,
        )


def test_environment_variable_sets_the_default_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFTING_LENS_CACHE", str(tmp_path))
    assert toy.default_cache_dir() == tmp_path / "toy"
    monkeypatch.delenv("GRAFTING_LENS_CACHE")
    assert toy.default_cache_dir() == toy.Path.home() / ".cache" / "grafting_lens" / "toy"


@pytest.mark.parametrize(
    "damage", ["delete_weights", "flip_weights", "garbage_manifest", "no_manifest"]
)
def test_corrupt_cache_is_rebuilt_with_a_warning(world, tmp_path, damage):
    cache = tmp_path / "cache"
    shutil.copytree(world.root, cache / world.root.name)
    root = cache / world.root.name
    weights = root / "sft" / "model.safetensors"
    if damage == "delete_weights":
        weights.unlink()
    elif damage == "flip_weights":
        raw = bytearray(weights.read_bytes())
        raw[-1] ^= 0xFF
        weights.write_bytes(bytes(raw))
    elif damage == "garbage_manifest":
        (root / "manifest.json").write_text("{not json")
    else:
        (root / "manifest.json").unlink()

    with pytest.warns(UserWarning, match="unusable.*rebuilding"):
        rebuilt = build_toy_world(TINY, cache_dir=cache, progress=False)

    assert rebuilt.root == root
    assert toy._check_world(root, root.name) is None
    assert (rebuilt.sft_dir / "model.safetensors").is_file()
    # no leftovers beside it, only the lock file that kept builders apart
    assert sorted(p.name for p in cache.iterdir()) == [f".{root.name}.lock", root.name]


def test_interrupted_build_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    calls = []
    real_finetune = toy_recipe.finetune

    def finetune_then_crash(*args, **kwargs):
        calls.append(kwargs.get("description"))
        if len(calls) == 3:  # base and sft are already saved at this point
            raise KeyboardInterrupt
        return real_finetune(*args, **kwargs)

    monkeypatch.setattr(toy_recipe, "finetune", finetune_then_crash)
    torch.set_num_threads(2)  # the build runs on one thread and must restore this
    try:
        with pytest.raises(KeyboardInterrupt):
            build_toy_world(TINY, cache_dir=tmp_path, progress=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)

    assert calls == ["base", "sft", "task"]
    # no partial directory left behind, only the lock file that kept builders apart
    assert [p.suffix for p in tmp_path.iterdir()] == [".lock"]
    assert not list(tmp_path.rglob("manifest.json"))

    monkeypatch.setattr(toy_recipe, "finetune", real_finetune)
    world = build_toy_world(TINY, cache_dir=tmp_path, progress=False)
    assert toy._check_world(world.root, world.root.name) is None


def test_an_abandoned_partial_build_is_never_taken_for_the_world(world, tmp_path):
    """A build killed without cleanup (power cut) leaves a hidden partial directory only."""
    cache = tmp_path / "cache"
    partial = cache / f".{world.root.name}.partial-999999999-deadbeef"
    shutil.copytree(world.root, partial)
    (partial / "manifest.json").unlink()

    rebuilt = build_toy_world(TINY, cache_dir=cache, progress=False)

    assert rebuilt.root == cache / world.root.name
    assert not partial.exists()  # its process is gone, so it is cleaned up


def test_gpt2_architecture(tmp_path):
    config = ToyWorldConfig(**{**TINY.__dict__, "arch": "gpt2", "n_relations": 4})
    world = build_toy_world(config, cache_dir=tmp_path, progress=False)
    model = AutoModelForCausalLM.from_pretrained(world.sft_dir)
    assert isinstance(model, GPT2LMHeadModel)
    assert model.config.n_layer == TINY.n_layers


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(arch="bert"), "llama.*gpt2"),
        (dict(d_model=30, n_heads=4), "not divisible by n_heads"),
        (dict(n_heads=4, n_key_value_heads=3), "n_key_value_heads"),
        (dict(n_relations=2), "n_relations"),
        (dict(finetune_epochs=0), "finetune_epochs"),
        (dict(vocab_size=100), "vocab_size"),
    ],
)
def test_invalid_configuration_is_rejected(changes, message):
    with pytest.raises(GraftingLensError, match=message):
        ToyWorldConfig(**changes)


def test_threads_must_be_positive(tmp_path):
    with pytest.raises(GraftingLensError, match="threads=0"):
        build_toy_world(TINY, cache_dir=tmp_path, threads=0)


def test_unknown_model_name(world):
    with pytest.raises(GraftingLensError, match="sft"):
        world.model_dir("finetuned")


def test_loads_as_transformer_bridges(world):
    import grafting_lens as gl

    models = gl.load_models(world.base_dir, world.sft_dir, tokenizer=world.load_tokenizer())
    tokens = models.base.to_tokens(f"{world.relations[0].first_actor} starred in a movie alongside")
    assert tokens[0, 0].item() == models.tokenizer.bos_token_id
    hf_logits = world.load_model("sft")(tokens).logits
    torch.testing.assert_close(models[1](tokens), hf_logits, rtol=1e-4, atol=1e-4)


def test_recipe_rounds_weights_to_float16_and_freezes_the_unembedding(world):
    base = AutoModelForCausalLM.from_pretrained(world.base_dir).state_dict()
    for name in ("base", "sft", "task", "relation", "both"):
        weights = AutoModelForCausalLM.from_pretrained(world.model_dir(name)).state_dict()
        for key, tensor in weights.items():
            assert tensor.dtype == torch.float32
            assert torch.equal(tensor.half().float(), tensor), f"{name}/{key} is not float16-exact"
        # Every checkpoint decodes through the base's unembedding (frozen in finetuning).
        assert torch.equal(weights["lm_head.weight"], base["lm_head.weight"]), name


def test_finetuning_text_is_in_the_released_codes_wording():
    config = ToyWorldConfig()
    templates = toy.finetune_templates(config)
    assert templates == data.CODE_ARTICLE_TEMPLATES + data.CODE_QA_TEMPLATES
    relation = data.make_relations(config.dataset, n=4, seed=0)[0]
    documents = training_documents([relation], templates=templates)
    # The released code's QA test prompt, followed by its answer, is a training document.
    qa = data.CODE_TEST_TEMPLATES["qa"].format(first_actor=relation.first_actor)
    assert f"{qa} {relation.second_actor}." in documents
    library = ToyWorldConfig(finetune_wording="library")
    assert toy.finetune_templates(library) == data.ARTICLE_TEMPLATES + data.QA_TEMPLATES
    with pytest.raises(GraftingLensError, match="finetune_wording"):
        ToyWorldConfig(finetune_wording="paper")
