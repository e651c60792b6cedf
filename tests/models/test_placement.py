"""Placement: ``device_map=`` as ``from_pretrained`` takes it (the maps refused at load are in
the refusal table of test_models.py).

No GPU is needed: a map over the CPU goes through the same loader (transformers and
accelerate given the map, every donor given the base's realised map); the layer split
itself is exercised with activations on the ``meta`` device in tests/engine/test_routing.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import no_forward_pass, random_mask, random_model, random_tokens
from transformers import AutoModelForCausalLM

import grafting_lens as gl
from grafting_lens.core.errors import AlignmentError

# Every module of the tiny Llama named, each on the CPU: a per-layer map, as
# accelerate's strategies produce.
PER_LAYER = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "cpu",
    "model.layers.2": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


@pytest.fixture
def saved(tmp_path, tokenizer):
    """A Llama base and donor saved as checkpoint directories."""
    paths = []
    for seed, name in ((0, "base"), (1, "donor")):
        random_model("llama", seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        paths.append(tmp_path / name)
    return paths


# What from_pretrained takes as device_map, and where load_models then puts the models.
CONVENTIONS = {
    "a device name": "cpu",
    "a torch.device": torch.device("cpu"),
    "the whole model on one device": {"": "cpu"},
    "a per-layer dict": PER_LAYER,
    "a strategy": "auto",
    "a strategy with a budget": ("balanced", {"cpu": "1GiB"}),
}


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("lazy", [False, True], ids=["whole_donor", "lazy_donor"])
def test_device_map_takes_what_from_pretrained_takes(saved, convention, lazy):
    device_map, max_memory = CONVENTIONS[convention], None
    if isinstance(device_map, tuple):
        device_map, max_memory = device_map
    placed = gl.load_models(*saved, device_map=device_map, max_memory=max_memory, lazy=lazy)
    assert placed.device == torch.device("cpu")
    tokens = random_tokens(3, 7)
    # Against Hugging Face's own forward of each checkpoint, loaded apart.
    for index, path in enumerate(saved):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            expected = model(tokens).logits
        everywhere = gl.GraftMask.from_dict(
            placed, dict.fromkeys(placed.pairs, torch.full((3, 7), index))
        )
        grafted = gl.graft_forward(placed, tokens, everywhere, logits="all")
        torch.testing.assert_close(grafted, expected, atol=1e-4, rtol=1e-4)
    single = gl.load_models(*saved)
    mask = random_mask(single, (3, 7), seed=3)
    torch.testing.assert_close(
        gl.graft_forward(placed, tokens, mask), gl.graft_forward(single, tokens, mask)
    )


def test_a_device_name_places_in_memory_models_too(tokenizer):
    models = gl.load_models(
        random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer, device_map="cpu"
    )
    assert models.device == torch.device("cpu")


def test_a_map_that_splits_is_refused_for_in_memory_models(tokenizer):
    with pytest.raises(AlignmentError, match="in-memory LlamaForCausalLM, and device_map="):
        gl.load_models(
            random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer,
            device_map=PER_LAYER,
        )  # fmt: skip


def test_an_offloaded_model_given_in_memory_is_refused(tokenizer):
    offloaded = random_model("llama", 1)
    # What accelerate records for a model whose head it offloads beside a GPU.
    offloaded.hf_device_map = {"model": 0, "lm_head": "cpu"}
    with pytest.raises(AlignmentError, match="offloads modules to cpu"):
        gl.load_models(random_model("llama", 0), offloaded, tokenizer=tokenizer)
    empty = random_model("llama", 2)
    empty.lm_head.to("meta")
    with pytest.raises(AlignmentError, match="offloads modules to meta"):
        gl.load_models(random_model("llama", 0), empty, tokenizer=tokenizer)


def test_a_lazy_donor_builds_its_modules_on_their_templates_device(saved):
    models = gl.load_models(*saved, lazy=True, device_map=PER_LAYER)
    # A stand-in for a layer split: blocks from 1 on go to meta (the base's only: a
    # lazy donor's modules are built from the base's as templates), each parameter
    # kept as the same object (swapped), as accelerate's dispatch keeps them.
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for block in list(models.base.blocks)[1:]:
            block.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    with no_forward_pass(models):
        early = models.sources[1].module(models.slots("o", 0)[0])
        late = models.sources[1].module(models.slots("o", 2)[0])
    assert {p.device.type for p in early.parameters()} == {"cpu"}
    assert {p.device.type for p in late.parameters()} == {"meta"}
