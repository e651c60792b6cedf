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


def test_missing_checkpoint_explains_the_offline_hub():
    with pytest.raises(gl.GraftingLensError, match="(?s)as a hub id: .*HF_HUB_OFFLINE"):
        gl.load_models("nobody/no-such-model", "nobody/no-such-model-either")


def test_missing_path_is_named_as_a_path_not_a_hub_id(tmp_path):
    with pytest.raises(gl.GraftingLensError, match="nowhere'\\) is not a directory \\(no such path\\)"):
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


# ---------------------------------------- alignment compares what the models compute


def _donor_with(family: str, seed: int = 1, **fields):
    """A donor of ``family`` whose configuration differs in ``fields`` (same shapes)."""
    config = family_config(family)
    for name, value in fields.items():
        setattr(config, name, value)
    donor = AutoModelForCausalLM.from_config(config).eval()
    donor.load_state_dict(random_model(family, seed).state_dict())
    return donor


def _rope(family: str, **changes):
    return {**family_config(family).rope_parameters, **changes}


FORWARD_CHANGES = {
    "llama-rope_theta": ("llama", {"rope_parameters": _rope("llama", rope_theta=500000.0)},
                         "rope_parameters.rope_theta=500000.0"),
    "llama-rope_scaling": ("llama", {"rope_parameters": _rope("llama", rope_type="linear", factor=2.0)},
                           "rope_parameters.factor=2.0"),
    "neox-rotary_fraction": ("neox", {"rope_parameters": _rope("neox", partial_rotary_factor=1.0)},
                             "rope_parameters.partial_rotary_factor=1.0"),
    "gemma-rope_theta": ("gemma", {"rope_parameters": _rope("gemma", rope_theta=1234.0)},
                         "rope_parameters.rope_theta=1234.0"),
    "gpt2-scale_attn_weights": ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights=False"),
    "gpt2-scale_by_layer": ("gpt2", {"scale_attn_by_inverse_layer_idx": True},
                            "scale_attn_by_inverse_layer_idx=True"),
}  # fmt: skip


@pytest.mark.parametrize("case", FORWARD_CHANGES)
def test_a_donor_that_computes_differently_is_refused(tokenizer, case):
    # TransformerLens 4.3 reports rotary_base=10000 and rotary_dim=None for all of
    # these, so only the Hugging Face configurations tell them apart.
    family, fields, named = FORWARD_CHANGES[case]
    with pytest.raises(gl.AlignmentError, match=f"source 1 .*configuration has {named}"):
        gl.load_models(random_model(family, 0), _donor_with(family, **fields), tokenizer=tokenizer)


@pytest.mark.parametrize("case", ["llama-rope_theta", "neox-rotary_fraction", "gpt2-scale_by_layer"])
def test_the_refused_differences_would_have_grafted_a_wrong_model(tokenizer, case, monkeypatch):
    # Why the check exists: let the donor through, graft every component, and the
    # result is far from the donor's own output (the base's rotary or scaling was used).
    family, fields, _ = FORWARD_CHANGES[case]
    monkeypatch.setattr(gl.models, "_check_hf_config", lambda *args: None)
    monkeypatch.setattr(gl.models, "_check_buffers", lambda *args: None)
    loaded = gl.load_models(random_model(family, 0), _donor_with(family, **fields), tokenizer=tokenizer)
    tokens = random_tokens(2, 12, seed=3)
    everything = gl.GraftMask.build(loaded, tokens, components="all", source=1)
    grafted = gl.graft_forward(loaded, tokens, everything)
    # Far beyond float32 rounding (the equivalence tests hold the graft to 1e-4).
    assert (grafted - loaded[1](tokens)).abs().max() > 0.1


def test_fields_that_do_not_change_the_forward_pass_are_ignored(tokenizer):
    donor = _donor_with(
        "llama",
        attention_dropout=0.3,
        initializer_range=0.5,
        use_cache=False,
        pad_token_id=5,
        output_hidden_states=True,
    )
    donor.config._name_or_path = "somewhere/else"
    assert "attention_dropout" in gl.models.IGNORED_CONFIG_FIELDS
    loaded = gl.load_models(random_model("llama", 0), donor, tokenizer=tokenizer)
    assert len(loaded) == 2


def test_a_buffer_that_differs_is_refused(tokenizer):
    donor = random_model("llama", 1)
    donor.model.rotary_emb.inv_freq.mul_(0.5)  # as another rope scaling would have made it
    with pytest.raises(gl.AlignmentError, match="buffer 'model.rotary_emb.inv_freq' differs"):
        gl.load_models(random_model("llama", 0), donor, tokenizer=tokenizer)
    # Rounded through bfloat16 and back is the same configuration.
    rounded = random_model("llama", 1).bfloat16().float()
    assert len(gl.load_models(random_model("llama", 0), rounded, tokenizer=tokenizer)) == 2


def test_sources_of_other_dtypes_or_devices_are_refused(tokenizer):
    with pytest.raises(gl.AlignmentError, match="is torch.float16, the base's is torch.float32.*dtype="):
        gl.load_models(random_model("llama", 0), random_model("llama", 1).half(), tokenizer=tokenizer)
    with pytest.raises(gl.AlignmentError, match="is on meta, the base's on cpu.*device="):
        gl.load_models(random_model("llama", 0), random_model("llama", 1).to("meta"), tokenizer=tokenizer)
    # dtype= casts every source, so the same pair loads.
    loaded = gl.load_models(
        random_model("llama", 0), random_model("llama", 1).half(), tokenizer=tokenizer, dtype="float32"
    )
    assert {p.dtype for bridge in loaded for p in bridge.original_model.parameters()} == {torch.float32}


def test_dtype_names_are_accepted_and_bad_devices_and_dtypes_named(tokenizer):
    assert gl.models.resolve_placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    assert gl.models.resolve_placement(None, "torch.float16") == (None, torch.float16)
    with pytest.raises(gl.GraftingLensError, match="dtype='banana' is not a torch dtype"):
        gl.models.resolve_placement(dtype="banana")
    with pytest.raises(gl.GraftingLensError, match="not a floating dtype"):
        gl.models.resolve_placement(dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype or its name"):
        gl.models.resolve_placement(dtype=16)
    with pytest.raises(gl.GraftingLensError, match="device='banana' cannot be used"):
        gl.models.resolve_placement(device="banana")
    if not torch.cuda.is_available():
        with pytest.raises(gl.GraftingLensError, match="cannot be used"):
            gl.models.resolve_placement(device="cuda")
    with pytest.raises(gl.GraftingLensError, match="device='banana'"):
        gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer,
                       device="banana")  # fmt: skip
    with pytest.raises(TypeError, match="tokenizer must be a Hugging Face tokenizer"):
        gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=123)


def test_directories_that_are_not_checkpoints_are_named(tmp_path, tokenizer):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(gl.GraftingLensError, match="directory without a config.json.*holds nothing"):
        gl.load_models(str(empty), str(empty))
    good, broken = tmp_path / "good", tmp_path / "broken"
    for directory, seed in ((good, 0), (broken, 1)):
        random_model("llama", seed).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # an interrupted save
    with pytest.raises(gl.GraftingLensError, match="source 1 .*broken.*model.safetensors.*truncated"):
        gl.load_models(str(good), str(broken))
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    with pytest.raises(gl.GraftingLensError, match="is not a directory \\(it is a file\\)"):
        gl.load_models(str(a_file), str(good))
