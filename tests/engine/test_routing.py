"""Routing: plans made on the host, indices on the device of the activation they index."""

from __future__ import annotations

import pytest
import torch
from conftest import DeviceMixes, random_mask, random_model, random_tokens, split_onto_meta

import grafting_lens as gl
from grafting_lens.engine.relaxation import relaxing
from grafting_lens.engine.routing import GraftState


def test_plans_are_made_on_the_host_and_placed_per_device(three_models):
    mask = random_mask(three_models, (3, 5))
    state = GraftState(mask)
    # The full window's plans exist before any forward pass, on the host.
    distinct = {id(values) for values in state.masks.values()}
    assert len(state._plans) == len(distinct)
    plan = state.plan(next(iter(mask.keys())))
    assert plan.single is None
    assert all(index.device.type == "cpu" for _, index in plan.parts)
    meta = torch.device("meta")
    placed = plan.parts_on(meta)
    assert [source for source, _ in placed] == [source for source, _ in plan.parts]
    assert all(index.device == meta for _, index in placed)
    assert [index.shape for _, index in placed] == [index.shape for _, index in plan.parts]
    assert plan.parts_on(meta) is placed  # copied once per device, then kept
    assert plan.window_on(meta).device == meta
    assert plan.window_on(meta).shape == plan.window.shape


@pytest.fixture
def split_pair(family, tokenizer) -> gl.ModelSet:
    """A fresh pair of ``family`` whose blocks from 1 on, final norm and unembedding are on ``meta``."""
    models = gl.load_models(random_model(family, 0), random_model(family, 1), tokenizer=tokenizer)
    split_onto_meta(models)
    return models


@pytest.mark.parametrize("logits", ["all", "last"])
def test_a_graft_on_a_layer_split_model_indexes_on_each_layers_device(split_pair, logits):
    tokens = random_tokens(3, 7)
    mask = random_mask(split_pair, (3, 7), seed=1)
    with DeviceMixes() as mixes:
        out = gl.graft_forward(split_pair, tokens, mask, logits=logits)
    # Every grafted slot of blocks 1-2 and the unembedding routed meta activations: an
    # index left on the CPU would meet one there.
    assert mixes.calls == []
    assert out.device.type == "meta"
    assert out.shape == (3, 1 if logits == "last" else 7, split_pair.base.cfg.d_vocab)


def test_a_relaxation_on_a_layer_split_model_mixes_on_each_layers_device(split_pair):
    tokens = random_tokens(2, 6)
    weights = {
        ("mlp_out", 0): torch.full((2, 6), 0.5, requires_grad=True),
        ("mlp_out", 2): torch.full((2, 6), 0.5, requires_grad=True),
        ("ln_final", None): torch.full((2, 6), 0.5, requires_grad=True),
    }
    with DeviceMixes() as mixes, relaxing(split_pair, weights) as model:
        logits = model(tokens)
    assert mixes.calls == []
    assert logits.device.type == "meta"


def test_a_patch_on_a_layer_split_model_writes_on_each_layers_device(split_pair):
    tokens = random_tokens(2, 6)
    with DeviceMixes() as mixes:
        logits = gl.patch_forward(split_pair, tokens, "resid_pre", layers="all", positions=[1, 4])
    assert mixes.calls == []
    assert logits.device.type == "meta"
    assert logits.shape == (2, 6, split_pair.base.cfg.d_vocab)


def test_a_graft_on_each_device_equals_the_oracle(device, tokenizer):
    models = gl.load_models(
        random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer, device=device
    )
    tokens = random_tokens(2, 6)
    mask = random_mask(models, (2, 6), seed=2)
    logits = gl.graft_forward(models, tokens, mask, logits="all")
    assert logits.device.type == device.type
    expected = gl.graft_forward_reference(models, tokens, mask)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
