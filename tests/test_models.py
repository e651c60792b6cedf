"""Loading model sets: sources of every kind, alignment errors, weight differences."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import family_config, random_model, random_tokens
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

import grafting_lens as gl


def test_directories_load_offline_with_their_tokenizer(tmp_path, tokenizer):
    for name, seed in (("base", 0), ("donor", 1)):
        random_model("llama", seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    loaded = gl.load_models(tmp_path / "base", tmp_path / "donor")
    assert loaded.names == ("base", "donor")
    assert loaded.architecture == "LlamaForCausalLM"
    tokens = random_tokens(1, 5)
    expected = random_model("llama", 1)(tokens).logits
    assert (loaded[1](tokens) - expected).abs().max() <= 1e-5


def test_bridges_and_models_mix(tokenizer):
    bridge = gl.load_models(random_model("gpt2", 0), random_model("gpt2", 1), tokenizer=tokenizer)[1]
    mixed = gl.load_models(random_model("gpt2", 2), bridge, tokenizer=tokenizer)
    assert mixed[1] is bridge


def test_missing_checkpoint_explains_the_offline_hub(tmp_path):
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        gl.load_models(str(tmp_path / "nowhere"), str(tmp_path / "nowhere-else"))


def test_alignment_errors_name_the_first_difference(tokenizer):
    with pytest.raises(gl.AlignmentError, match="is a LlamaForCausalLM, the base .* is a GPT2LMHeadModel"):
        gl.load_models(random_model("gpt2", 0), random_model("llama", 0), tokenizer=tokenizer)
    deeper = AutoModelForCausalLM.from_config(GPT2Config(**{**family_config("gpt2").to_dict(), "n_layer": 2}))
    with pytest.raises(gl.AlignmentError, match="has 2 layers, the base has 3"):
        gl.load_models(random_model("gpt2", 0), deeper, tokenizer=tokenizer)
    wider = AutoModelForCausalLM.from_config(GPT2Config(**{**family_config("gpt2").to_dict(), "n_embd": 64}))
    with pytest.raises(gl.AlignmentError, match="d_model=64"):
        gl.load_models(random_model("gpt2", 0), wider, tokenizer=tokenizer)
    model = random_model("gpt2", 0)
    with pytest.raises(gl.AlignmentError, match="same model object"):
        gl.load_models(model, model, tokenizer=tokenizer)
    with pytest.raises(gl.AlignmentError, match="at least two"):
        gl.load_models(model, tokenizer=tokenizer)


def test_different_vocabularies_are_rejected(tmp_path, tokenizer):
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(tokenizer),
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    other.train_from_iterator(["completely different text about zebras and quokkas"] * 50, trainer)
    other_tokenizer = PreTrainedTokenizerFast(tokenizer_object=other, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    for name, tok in (("base", tokenizer), ("donor", other_tokenizer)):
        random_model("llama", 0).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    with pytest.raises(gl.AlignmentError, match="vocabulary|tokens"):
        gl.load_models(tmp_path / "base", tmp_path / "donor")


def test_a_model_already_wrapped_by_an_earlier_load_is_refused(tokenizer):
    base, donor = random_model("gpt2", 0), random_model("gpt2", 1)
    first = gl.load_models(base, donor, tokenizer=tokenizer)
    with pytest.raises(gl.GraftingLensError, match="already wraps.*models\\[i\\]"):
        gl.load_models(base, random_model("gpt2", 2), tokenizer=tokenizer)
    # The bridge itself is the way to reuse it.
    again = gl.load_models(first.base, random_model("gpt2", 2), tokenizer=tokenizer)
    assert again.base is first.base


def test_weight_diff_reports_what_changed(tokenizer):
    base = random_model("llama", 0)
    donor = copy.deepcopy(base)
    with torch.no_grad():
        donor.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    loaded = gl.load_models(base, donor, tokenizer=tokenizer)
    frame = loaded.weight_diff()
    changed = frame[frame.relative_change > 0]
    assert changed[["component", "layer"]].values.tolist() == [["mlp_out", 1]]
    assert str(frame["layer"].dtype) == "Int64"
    assert changed.relative_change.iloc[0] == pytest.approx(0.5, rel=1e-5)
    assert len(frame) == len(loaded.pairs)
    assert len(loaded.pairs) == sum(
        1 if c in gl.GLOBAL_COMPONENTS else loaded.n_layers for c in loaded.components
    )


def test_components_per_family(three_models, family):
    expected = set(gl.COMPONENTS)
    if family != "gpt2":
        expected.discard("pos_embed")
    if family in ("gpt2", "neox"):
        expected.discard("mlp_gate")
    assert set(three_models.components) == expected


def test_register_component_paths_validates(tokenizer):
    with pytest.raises(gl.ComponentError, match="must contain"):
        gl.register_component_paths("MyArch", {"q": "blocks.attn.q"})
    with pytest.raises(gl.ComponentError, match="Unknown component 'queries'"):
        gl.register_component_paths("MyArch", {"queries": "blocks.{layer}.attn.q"})


def test_dtype_argument_casts_every_source(tokenizer):
    loaded = gl.load_models(
        random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer, dtype=torch.float64
    )
    for bridge in loaded:
        assert {p.dtype for p in bridge.original_model.parameters()} == {torch.float64}
    tokens = random_tokens(1, 4)
    mask = gl.GraftMask.build(loaded, tokens, positions="last", components="all", source=1)
    assert gl.graft_forward(loaded, tokens, mask).dtype == torch.float64


def test_bridges_with_processed_weights_are_refused(tokenizer):
    bridge = gl.load_models(random_model("gpt2", 0), random_model("gpt2", 1), tokenizer=tokenizer)[1]
    bridge.process_weights()
    with pytest.raises(gl.AlignmentError, match="processed weights"):
        gl.load_models(random_model("gpt2", 2), bridge, tokenizer=tokenizer)
