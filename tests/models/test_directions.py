"""Grafts below the matrix (rank=, strength=) against checkpoints whose weights were set by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_model, random_tokens
from conftest import top_directions as top
from test_adapters import close, lora_model

import grafting_lens as gl
from grafting_lens.analysis.directions import read_directions
from grafting_lens.core.errors import ArgumentTypeError, SelectionError

COMPONENTS = "o+ffn"
# The HF weights "o+ffn" grafts, by name: GPT-2's attn.c_proj and MLP, NeoX's dense ones,
# Llama's and Gemma's o_proj and MLP (every one has 32 or more directions at d_model 32).
GRAFTED = ("attn.c_proj", "mlp.", "attention.dense", "o_proj")


def grafted(name: str, parameter: torch.Tensor) -> bool:
    return any(key in name for key in GRAFTED) and parameter.dim() == 2


def hand_made(base, donor, edit):
    """A copy of ``base`` whose grafted weights are ``edit(W_base, W_donor)``."""
    made = copy.deepcopy(base)
    donors = dict(donor.named_parameters())
    with torch.no_grad():
        for name, parameter in made.named_parameters():
            if grafted(name, parameter):
                parameter.copy_(edit(parameter.double(), donors[name].double()))
    return made


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture
def pair(family, tokenizer):
    base, donor = random_model(family, 0), random_model(family, 1)
    return base, donor, gl.load_models(base, donor, tokenizer=tokenizer)


def test_a_rank_k_graft_equals_a_hand_made_checkpoint_and_the_oracle(pair, tokenizer, monkeypatch):
    base, donor, models = pair
    updated = gl.engine.graft.SourceDispatch._updated
    calls = []  # the base's product once, the updates on the grafted rows
    monkeypatch.setattr(
        gl.engine.graft.SourceDispatch, "_updated", lambda *a: calls.append(1) or updated(*a)
    )
    hand = hand_made(base, donor, top(3))
    tokens = random_tokens(2, 9, seed=1)
    derived = models.directions(1, rank=3)
    everywhere = gl.GraftMask.build(derived, tokens, components=COMPONENTS, source=2)
    grafted = gl.graft_forward(derived, tokens, everywhere, logits="all")
    assert close(grafted, hf_logits(hand, tokens))
    assert (grafted - models.base(tokens)).abs().max() > 0.1
    # At some positions: the token-by-token oracle with the hand-made checkpoint as donor.
    reference = gl.load_models(base, hand, tokenizer=tokenizer)
    some = dict(positions=[[1, 4, 8], [0, 5, 6]], components=COMPONENTS, layers=[0, 2])
    fast = gl.graft_forward(
        derived, tokens, gl.GraftMask.build(derived, tokens, source=2, **some), logits="all"
    )
    slow = gl.graft_forward_reference(
        reference, tokens, gl.GraftMask.build(reference, tokens, source=1, **some)
    )
    assert close(fast, slow)
    assert calls


def test_full_rank_is_the_whole_graft_and_rank_zero_the_base(pair):
    base, donor, models = pair
    donor = copy.deepcopy(donor)
    with torch.no_grad():  # a rank graft leaves biases the base's
        for (name, parameter), own in zip(donor.named_parameters(), base.parameters()):
            parameter.copy_(own) if name.endswith("bias") else None
    models = gl.load_models(base, donor, tokenizer=models.tokenizer)
    tokens = random_tokens(3, 8, seed=2)
    options = dict(positions=[[2, 3], [7], [0, 1, 5]], components=COMPONENTS)
    whole = gl.graft_forward(models, tokens, gl.GraftMask.build(models, tokens, **options))
    full = models.directions(1, rank=32)
    assert close(
        gl.graft_forward(full, tokens, gl.GraftMask.build(full, tokens, source=2, **options)),
        whole,
    )
    for none in (models.directions(1, rank=0), models.directions(1, rank=3, strength=0)):
        mask = gl.GraftMask.build(none, tokens, components="all", source=2)
        assert torch.equal(gl.graft_forward(none, tokens, mask, logits="all"), models.base(tokens))


@pytest.mark.parametrize("strength", [0.0, 0.5, 1.0])
def test_strength_grafts_a_hand_interpolated_checkpoint(pair, strength):
    base, donor, models = pair
    hand = copy.deepcopy(base)
    with torch.no_grad():  # every parameter, biases and norms too
        for parameter, other in zip(hand.parameters(), donor.parameters()):
            parameter.copy_(parameter + strength * (other - parameter))
    tokens = random_tokens(2, 7, seed=3)
    derived = models.directions(1, strength=strength)
    mask = gl.GraftMask.build(derived, tokens, components="all", source=2)
    assert close(gl.graft_forward(derived, tokens, mask, logits="all"), hf_logits(hand, tokens))
    assert close(derived[2](tokens), hf_logits(hand, tokens))  # the source run alone


def test_directions_by_index_and_the_svd_memory(tokenizer):
    base, donor = random_model("llama", 0), random_model("llama", 1)
    models = gl.load_models(base, donor, tokenizer=tokenizer)

    def picked(b, d):
        U, S, Vh = torch.linalg.svd(d - b, full_matrices=False)
        return b + (U[:, [0, 2]] * S[[0, 2]]) @ Vh[[0, 2]]

    tokens = random_tokens(2, 7, seed=4)
    derived = models.directions(1, rank=[0, 2])
    mask = gl.GraftMask.build(derived, tokens, components=COMPONENTS, source=2)
    expected = hf_logits(hand_made(base, donor, picked), tokens)
    assert close(gl.graft_forward(derived, tokens, mask, logits="all"), expected)
    # Every o (32 x 32) and MLP matrix (64 x 32) of the 3 layers: U, S and V in float32.
    svds = 3 * (65 * 32 + 3 * 97 * 32) * 4
    assert derived.sources[2].svd_bytes() == svds
    assert int(derived.memory()["resident_bytes"].iloc[2]) >= svds


def test_a_lora_rank_component_is_a_hand_merged_single_rank_adapter(tokenizer, tmp_path):
    model = lora_model("llama")
    model.save_pretrained(tmp_path)
    models = gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)
    single = copy.deepcopy(model)
    with torch.no_grad():  # keep rank component 2 of every adapted module
        for name, parameter in single.named_parameters():
            if "lora_A" in name:
                parameter[[0, 1, 3]] = 0
    tokens = random_tokens(2, 8, seed=5)
    expected = hf_logits(single.merge_and_unload(), tokens)
    derived = models.directions(1, rank=[2])
    mask = gl.GraftMask.build(derived, tokens, components="all", source=2)
    assert close(gl.graft_forward(derived, tokens, mask, logits="all"), expected)
    with pytest.raises(SelectionError, match=r"has 4 directions"):
        gl.graft_forward(models.directions(1, rank=5), tokens, mask)


def test_gl_graft_takes_rank_and_strength(tokenizer):
    models = gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer)
    prompt, answer = "Keanu Reeves starred in a movie alongside", "movie"
    options = dict(at="last", components="o+ffn")
    plain = gl.graft(models, prompt, answer, **options)
    for extra in (dict(rank=0), dict(strength=0.0)):
        table = gl.graft(models, prompt, answer, **options, **extra)
        assert table["target_prob"].iloc[2] == pytest.approx(table["target_prob"].iloc[0], 1e-6)
    table = gl.graft(models, prompt, answer, **options, strength=1.0)
    assert table["target_prob"].iloc[2] == pytest.approx(plain["target_prob"].iloc[2], 1e-5)
    assert list(table["config"]) == list(plain["config"])


@pytest.mark.parametrize(
    ("arguments", "error", "named"),
    [
        (dict(rank=-1), SelectionError, "rank=-1"),
        (dict(rank=[1, 1]), SelectionError, "each index once"),
        (dict(rank=[]), SelectionError, "names no direction"),
        (dict(rank=True), ArgumentTypeError, "rank=True"),
        (dict(rank=1.5), ArgumentTypeError, "rank=1.5"),
        (dict(rank="2"), ArgumentTypeError, "rank='2'"),
        (dict(strength=float("nan")), SelectionError, "strength=nan"),
        (dict(strength=float("inf")), SelectionError, "strength=inf"),
        (dict(strength=True), ArgumentTypeError, "strength=True"),
        (dict(donor=5), SelectionError, "donor=5"),
        (dict(donor=1.0), ArgumentTypeError, "donor=1.0"),
    ],
)
def test_hostile_directions_are_refused_naming_the_argument(tokenizer, arguments, error, named):
    models = gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer)
    with pytest.raises(error, match=named.replace("[", r"\[").replace("(", r"\(")):
        models.directions(**{"donor": 1, **arguments})


def test_directions_past_a_matrix_a_norm_and_a_donor_equal_to_the_base(tokenizer, tmp_path):
    models = gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer)
    tokens = random_tokens(1, 5)
    derived = models.directions(1, rank=20)  # k_proj (16 x 32) has 16
    with pytest.raises(SelectionError, match=r"blocks.0.attn.k's change has 16 directions"):
        gl.graft_forward(derived, tokens, gl.GraftMask.build(derived, tokens, source=2))
    with pytest.raises(SelectionError, match=r"ln1 holds none \(.*RMSNorm\): drop it"):
        gl.graft(models, "Keanu Reeves starred", "movie", components="ln1+o", rank=2)
    same = gl.load_models(random_model("llama", 0), random_model("llama", 0), tokenizer=tokenizer)
    with pytest.raises(SelectionError, match=r"holds the base's weights \(dW = 0\)"):
        same.directions(1, rank=2)
    lora_model("llama", init_lora_weights=True).save_pretrained(tmp_path)  # B = 0, as PEFT starts
    fresh = gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)
    with pytest.raises(SelectionError, match=r"holds the base's weights \(dW = 0\)"):
        fresh.directions(1, strength=0.5)


def test_reading_a_direction_names_the_tokens_it_writes(tokenizer):
    base = random_model("llama", 0)
    donor = copy.deepcopy(base)
    target = tokenizer.encode("movie", add_special_tokens=False)[0]
    unembedding = base.lm_head.weight.detach()
    with torch.no_grad():  # a rank-one change writing the answer's unembedding direction
        write = unembedding[target] / unembedding[target].norm()
        donor.model.layers[1].mlp.down_proj.weight += 20 * torch.outer(write, torch.randn(64))
        donor.model.layers[1].mlp.down_proj.weight += 0.01 * torch.randn(32, 64)
    models = gl.load_models(base, donor, tokenizer=tokenizer)
    table = read_directions(models, "mlp_out", 1, k=3, tokens=5, answers=["movie", "Keanu"])
    change = donor.model.layers[1].mlp.down_proj.weight - base.model.layers[1].mlp.down_proj.weight
    values = torch.linalg.svdvals(change.detach().double())
    assert torch.allclose(torch.tensor(table["singular_value"].values), values[:3], rtol=1e-4)
    assert table["share"].iloc[0] > 0.99
    assert table["output_top"].iloc[0][0] == tokenizer.convert_ids_to_tokens(target)
    assert table["answers_found"].iloc[0] == ["movie"]
    assert table["input_top"].iloc[0] == []  # the MLP's hidden side is not the residual stream
    with pytest.raises(SelectionError, match="holds 0 weight matrices"):
        read_directions(models, "ln1", 1)
