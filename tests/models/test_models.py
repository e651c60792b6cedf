"""Loading model sets: sources of every kind, alignment errors, weight differences."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import family_config, no_forward_pass, random_model, random_tokens, tiny_config
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GPT2Config, GPT2Model, PreTrainedTokenizerFast

import grafting_lens as gl
from grafting_lens.models.components import checkpoint_parameters


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
    bridge = gl.load_models(random_model("gpt2", 0), random_model("gpt2", 1), tokenizer=tokenizer)[
        1
    ]
    mixed = gl.load_models(random_model("gpt2", 2), bridge, tokenizer=tokenizer)
    assert mixed[1] is bridge


def test_missing_checkpoint_explains_the_offline_hub():
    with pytest.raises(gl.GraftingLensError, match="(?s)as a hub id: .*HF_HUB_OFFLINE"):
        gl.load_models("nobody/no-such-model", "nobody/no-such-model-either")


def test_missing_path_is_named_as_a_path_not_a_hub_id(tmp_path):
    with pytest.raises(
        gl.GraftingLensError, match="nowhere'\\) is not a directory \\(no such path\\)"
    ):
        gl.load_models(str(tmp_path / "nowhere"), str(tmp_path / "nowhere-else"))


def test_alignment_errors_name_the_first_difference(tokenizer):
    with pytest.raises(
        gl.errors.AlignmentError, match="is a LlamaForCausalLM, the base .* is a GPT2LMHeadModel"
    ):
        gl.load_models(random_model("gpt2", 0), random_model("llama", 0), tokenizer=tokenizer)
    deeper = AutoModelForCausalLM.from_config(
        GPT2Config(**{**family_config("gpt2").to_dict(), "n_layer": 2})
    )
    with pytest.raises(gl.errors.AlignmentError, match="has 2 layers, the base has 3"):
        gl.load_models(random_model("gpt2", 0), deeper, tokenizer=tokenizer)
    wider = AutoModelForCausalLM.from_config(
        GPT2Config(**{**family_config("gpt2").to_dict(), "n_embd": 64})
    )
    with pytest.raises(gl.errors.AlignmentError, match="d_model=64"):
        gl.load_models(random_model("gpt2", 0), wider, tokenizer=tokenizer)
    model = random_model("gpt2", 0)
    with pytest.raises(gl.errors.AlignmentError, match="same model object"):
        gl.load_models(model, model, tokenizer=tokenizer)
    with pytest.raises(gl.errors.AlignmentError, match="at least two"):
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
    other_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=other, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    for name, tok in (("base", tokenizer), ("donor", other_tokenizer)):
        random_model("llama", 0).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    with pytest.raises(gl.errors.AlignmentError, match="vocabulary|tokens"):
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
        1 if c in gl.models.components.GLOBAL_COMPONENTS else loaded.n_layers
        for c in loaded.components
    )


def test_components_per_family(three_models, family):
    expected = {"embed", "pos_embed", "ln1", "q", "k", "v", "o", "ln2", "mlp_gate", "mlp_in"}
    expected |= {"mlp_out", "ln_final", "unembed"}
    if family != "gpt2":
        expected.discard("pos_embed")
    if family in ("gpt2", "neox"):
        expected.discard("mlp_gate")
    assert set(three_models.components) == expected


def test_register_component_paths_validates(tokenizer):
    with pytest.raises(gl.errors.ComponentError, match="must contain"):
        gl.models.components.register_component_paths("MyArch", {"q": "blocks.attn.q"})
    with pytest.raises(gl.errors.ComponentError, match="Unknown component 'queries'"):
        gl.models.components.register_component_paths(
            "MyArch", {"queries": "blocks.{layer}.attn.q"}
        )


def test_dtype_argument_casts_every_source(tokenizer):
    loaded = gl.load_models(
        random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer, dtype=torch.float64
    )
    for bridge in loaded:
        assert {p.dtype for p in bridge.original_model.parameters()} == {torch.float64}
    tokens = random_tokens(1, 4)
    mask = gl.GraftMask.build(loaded, tokens, positions="last", components="all", source=1)
    assert gl.graft_forward(loaded, tokens, mask, logits="all").dtype == torch.float64


def test_bridges_with_processed_weights_are_refused(tokenizer):
    bridge = gl.load_models(random_model("gpt2", 0), random_model("gpt2", 1), tokenizer=tokenizer)[
        1
    ]
    bridge.process_weights()
    with pytest.raises(gl.errors.AlignmentError, match="processed weights"):
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
    with pytest.raises(gl.errors.AlignmentError, match=f"source 1 .*configuration has {named}"):
        gl.load_models(random_model(family, 0), _donor_with(family, **fields), tokenizer=tokenizer)


@pytest.mark.parametrize(
    "case", ["llama-rope_theta", "neox-rotary_fraction", "gpt2-scale_by_layer"]
)
def test_the_refused_differences_would_have_grafted_a_wrong_model(tokenizer, case, monkeypatch):
    # Why the check exists: let the donor through, graft every component, and the
    # result is far from the donor's own output (the base's rotary or scaling was used).
    family, fields, _ = FORWARD_CHANGES[case]
    monkeypatch.setattr(gl.models.alignment, "_check_hf_config", lambda *args: None)
    monkeypatch.setattr(gl.models.alignment, "_check_buffers", lambda *args: None)
    loaded = gl.load_models(
        random_model(family, 0), _donor_with(family, **fields), tokenizer=tokenizer
    )
    tokens = random_tokens(2, 12, seed=3)
    everything = gl.GraftMask.build(loaded, tokens, components="all", source=1)
    grafted = gl.graft_forward(loaded, tokens, everything, logits="all")
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
    assert "attention_dropout" in gl.models.alignment.IGNORED_CONFIG_FIELDS
    loaded = gl.load_models(random_model("llama", 0), donor, tokenizer=tokenizer)
    assert len(loaded) == 2


def test_a_buffer_that_differs_is_refused(tokenizer):
    donor = random_model("llama", 1)
    donor.model.rotary_emb.inv_freq.mul_(0.5)  # as another rope scaling would have made it
    with pytest.raises(
        gl.errors.AlignmentError, match="buffer 'model.rotary_emb.inv_freq' differs"
    ):
        gl.load_models(random_model("llama", 0), donor, tokenizer=tokenizer)
    # Rounded through bfloat16 and back is the same configuration.
    rounded = random_model("llama", 1).bfloat16().float()
    assert len(gl.load_models(random_model("llama", 0), rounded, tokenizer=tokenizer)) == 2


def test_sources_of_other_dtypes_or_devices_are_refused(tokenizer):
    with pytest.raises(
        gl.errors.AlignmentError, match="is torch.float16, the base's is torch.float32.*dtype="
    ):
        gl.load_models(
            random_model("llama", 0), random_model("llama", 1).half(), tokenizer=tokenizer
        )
    with pytest.raises(gl.errors.AlignmentError, match="is on meta, the base's on cpu.*device="):
        gl.load_models(
            random_model("llama", 0), random_model("llama", 1).to("meta"), tokenizer=tokenizer
        )
    # dtype= casts every source, so the same pair loads.
    loaded = gl.load_models(
        random_model("llama", 0),
        random_model("llama", 1).half(),
        tokenizer=tokenizer,
        dtype="float32",
    )
    assert {p.dtype for bridge in loaded for p in bridge.original_model.parameters()} == {
        torch.float32
    }


def test_dtype_names_are_accepted_and_bad_devices_and_dtypes_named(tokenizer):
    assert gl.models.loading.resolve_placement("cpu", "bfloat16") == (
        torch.device("cpu"),
        torch.bfloat16,
    )
    assert gl.models.loading.resolve_placement(None, "torch.float16") == (None, torch.float16)
    with pytest.raises(gl.GraftingLensError, match="dtype='banana' is not a torch dtype"):
        gl.models.loading.resolve_placement(dtype="banana")
    with pytest.raises(gl.GraftingLensError, match="not a floating dtype"):
        gl.models.loading.resolve_placement(dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype or its name"):
        gl.models.loading.resolve_placement(dtype=16)
    with pytest.raises(gl.GraftingLensError, match="device='banana' cannot be used"):
        gl.models.loading.resolve_placement(device="banana")
    if not torch.cuda.is_available():
        with pytest.raises(gl.GraftingLensError, match="cannot be used"):
            gl.models.loading.resolve_placement(device="cuda")
    with pytest.raises(gl.GraftingLensError, match="device='banana'"):
        gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer,
                       device="banana")  # fmt: skip
    with pytest.raises(TypeError, match="tokenizer must be a Hugging Face tokenizer"):
        gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=123)


def test_directories_that_are_not_checkpoints_are_named(tmp_path, tokenizer):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        gl.GraftingLensError, match="directory without a config.json.*holds nothing"
    ):
        gl.load_models(str(empty), str(empty))
    good, broken = tmp_path / "good", tmp_path / "broken"
    for directory, seed in ((good, 0), (broken, 1)):
        random_model("llama", seed).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # an interrupted save
    with pytest.raises(
        gl.GraftingLensError, match="source 1 .*broken.*model.safetensors.*truncated"
    ):
        gl.load_models(str(good), str(broken))
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    with pytest.raises(gl.GraftingLensError, match="is not a directory \\(it is a file\\)"):
        gl.load_models(str(a_file), str(good))


def test_a_model_built_from_a_config_loads_and_records_its_architecture(tokenizer):
    base, donor = random_model("gemma", 0), random_model("gemma", 1)
    assert base.config.architectures is None  # what from_config gives
    gl.load_models(base, donor, tokenizer=tokenizer)
    assert base.config.architectures == ["GemmaForCausalLM"]


def test_an_unsupported_model_gets_a_short_error(tokenizer):
    headless = [GPT2Model(family_config("gpt2")) for _ in range(2)]
    with pytest.raises(gl.errors.UnsupportedArchitectureError) as caught:
        gl.load_models(*headless, tokenizer=tokenizer)
    message = str(caught.value)
    assert "GPT2Model (model_type 'gpt2')" in message
    assert "Nearest supported: GPT2LMHeadModel" in message
    assert "AutoModelForCausalLM" in message and len(message) < 600


def test_coverage_names_every_parameter(three_models, family):
    coverage = three_models.coverage()
    assert coverage.covered.all()
    names = dict(zip(coverage.parameter, coverage.component))
    assert set(names) == {
        name for name, _ in checkpoint_parameters(three_models.base.original_model)
    }
    if family == "gpt2":  # tied embeddings and a fused QKV matrix
        assert names["transformer.wte.weight"] == "embed+unembed"
        assert names["transformer.h.0.attn.c_attn.weight"] == "q+k+v"
    assert str(coverage["layer"].dtype) == "Int64"


def test_the_layout_knows_which_components_share_a_parameter(three_models, family):
    model = three_models.base.original_model
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    layout = three_models.layout
    assert layout.shares_parameter("embed", "unembed") == tied
    assert layout.shares_parameter("q", "k", "v") == (family in ("gpt2", "neox"))
    assert layout.shares_parameter("q", "k") == (family in ("gpt2", "neox"))
    assert not layout.shares_parameter("q", "o")


def test_a_graft_around_uncovered_weights_is_refused_unless_allowed(tokenizer):
    sources = [random_model("llama", seed) for seed in (0, 1)]
    for model in sources:  # a weight in layer 1's MLP that no component names
        model.model.layers[1].mlp.scale = torch.nn.Parameter(torch.ones(32))
    models = gl.load_models(*sources, tokenizer=tokenizer)
    coverage = models.coverage()
    uncovered = coverage[~coverage.covered]
    assert uncovered.parameter.tolist() == ["model.layers.1.mlp.scale"]
    assert uncovered.path.tolist() == ["blocks.1.mlp"]
    for components in ("ffn", "block", "all"):
        with pytest.raises(
            gl.errors.ComponentError, match=r"model\.layers\.1\.mlp\.scale.*allow_uncovered"
        ):
            gl.GraftMask.build(models, (1, 4), components=components)
    # Part of the region, or the region at layers without the gap, is what it says.
    gl.GraftMask.build(models, (1, 4), components="mlp_in+mlp_out+attn")
    gl.GraftMask.build(models, (1, 4), components="ffn", layers=[0, 2])
    models.allow_uncovered = True
    gl.GraftMask.build(models, (1, 4), components="all")


def test_an_unverified_architecture_loads_with_a_warning_and_reports_its_gaps(tokenizer):
    # LFM2's short convolutions mix positions with weights: no component names them.
    config = tiny_config("lfm2", layer_types=["conv", "full_attention"])
    sources = [AutoModelForCausalLM.from_config(config) for _ in range(2)]
    with pytest.warns(
        gl.errors.UnverifiedArchitectureWarning, match="Lfm2ForCausalLM .* not verified"
    ):
        models = gl.load_models(*sources, tokenizer=tokenizer)
    coverage = models.coverage()
    assert set(coverage.path[~coverage.covered]) == {
        "blocks.0.conv.conv",
        "blocks.0.conv.in",
        "blocks.0.conv.out",
    }
    with pytest.raises(gl.errors.ComponentError, match="no component covers"):
        gl.GraftMask.build(models, (1, 4), components="block", layers=[0])
    gl.GraftMask.build(models, (1, 4), components="block", layers=[1])


def test_registered_paths_name_weights_the_bridge_keys_do_not(tokenizer):
    """Apertus's learnable activation holds parameters at blocks.{layer}.mlp.act_fn."""
    from grafting_lens.models import components

    config = tiny_config("apertus")
    torch.manual_seed(0)
    sources = [AutoModelForCausalLM.from_config(config).eval() for _ in range(2)]
    with torch.no_grad():
        for parameter in sources[1].parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    tokens = random_tokens(2, 5)
    expected = sources[1](tokens).logits.detach()
    gl.models.components.register_component_paths(
        "ApertusForCausalLM", {"mlp_in": ["blocks.{layer}.mlp.in", "blocks.{layer}.mlp.act_fn"]}
    )
    try:
        with pytest.warns(gl.errors.UnverifiedArchitectureWarning):
            models = gl.load_models(*sources, tokenizer=tokenizer)
        coverage = models.coverage()
        assert coverage.covered.all()
        assert set(coverage.parameter[coverage.path == "blocks.0.mlp.act_fn"]) == {
            "model.layers.0.mlp.act_fn.alpha_p",
            "model.layers.0.mlp.act_fn.alpha_n",
        }
        assert len(models.slots("mlp_in", 0)) == 2
        mask = gl.GraftMask.build(models, tokens, components="all")
        assert (gl.graft_forward(models, tokens, mask, logits="all") - expected).abs().max() <= 1e-4
    finally:
        components._ARCHITECTURE_PATHS.pop("ApertusForCausalLM", None)


def test_a_checkpoint_whose_weights_are_not_its_models_is_refused(tmp_path, tokenizer, family):
    # transformers fills a weight the file lacks with random values and logs it where
    # TransformerLens has silenced its logger; the model would not be the checkpoint.
    random_model(family, 0).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    complete = tmp_path / "complete"
    random_model(family, 1).save_pretrained(complete)
    # Tied unembeddings (GPT-2, Gemma) are not in the file and not missing.
    tokens = random_tokens(1, 5)
    models = gl.load_models(tmp_path / "base", complete, tokenizer=tokenizer)
    assert (models[1](tokens) - random_model(family, 1)(tokens).logits).abs().max() <= 1e-5
    weights = load_file(str(complete / "model.safetensors"))
    dropped = next(name for name in sorted(weights) if ".mlp." in name)
    cases = {
        "missing": (
            {name: t for name, t in weights.items() if name != dropped},
            rf"lacks 1 weight\(s\) of the model \({re.escape(dropped)}\), which transformers "
            "filled with random values",
        ),
        "extra": (
            {**weights, "extra.weight": torch.zeros(3)},
            r"holds 1 weight\(s\) the model does not have \(extra.weight\)",
        ),
        "reshaped": (
            {**weights, dropped: weights[dropped].reshape(-1)[:7].clone()},
            rf"another shape than the model's \({re.escape(dropped)} \(\(7,\) in the checkpoint",
        ),
    }
    for case, (tensors, named) in cases.items():
        broken = tmp_path / case
        random_model(family, 1).config.save_pretrained(broken)
        save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(gl.GraftingLensError, match=named) as caught:
            gl.load_models(tmp_path / "base", broken, tokenizer=tokenizer)
        assert "save or download it again" in str(caught.value)
    with pytest.raises(gl.GraftingLensError, match="lacks 1 weight"):  # a base too
        gl.load_models(tmp_path / "missing", tmp_path / "base", tokenizer=tokenizer)


@pytest.mark.parametrize("family", ["gpt2"])
def test_narrow_integer_tokens_run_as_their_ids_and_empty_tokens_are_refused(three_models):
    """uint8 or int16 ids (a compact dataset on disk) mean the same ids at every entry point
    that runs tokens, where torch's embedding takes int64 only; empty tokens are refused by
    every entry point before a forward pass, naming the fix."""
    tokens = random_tokens(2, 5, seed=41)
    assert 127 < int(tokens.max()) < 256  # past int8 (which would wrap), within uint8
    mask = gl.GraftMask.build(three_models, tokens, positions="last", components="o+ffn")
    expected = gl.graft_forward(three_models, tokens, mask, logits="all")
    patched = gl.patch_forward(three_models, tokens, "resid_pre", layers=1, positions="last")
    targets = tokens[:, 0]
    scored = gl.analysis.scoring.LastTokenScorer()(expected, targets)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        narrow = tokens.to(dtype)
        assert (
            gl.GraftMask.build(three_models, narrow, positions="last", components="o+ffn") == mask
        )
        assert torch.equal(gl.graft_forward(three_models, narrow, mask, logits="all"), expected)
        reference = gl.graft_forward_reference(three_models, narrow, mask)
        assert (reference - expected).abs().max() <= 1e-4
        generated = gl.graft_generate(three_models, narrow, mask, max_new_tokens=2)
        assert torch.equal(generated[:, :5], tokens)
        assert torch.equal(
            gl.patch_forward(three_models, narrow, "resid_pre", layers=1, positions="last"),
            patched,
        )
        assert gl.analysis.scoring.LastTokenScorer()(expected, targets.to(dtype)) == scored

    empty = tokens[:, :0]
    with no_forward_pass(three_models):
        for call in (
            lambda: gl.GraftMask.build(three_models, empty),
            lambda: gl.graft_forward(three_models, empty, mask, logits="all"),
            lambda: gl.graft_forward_reference(three_models, empty, mask),
            lambda: gl.graft_generate(three_models, empty, mask),
        ):
            with pytest.raises(
                gl.errors.TokenError, match=r"tokens is empty \(shape \[2, 0\]\).*tokeniz"
            ):
                call()
        with pytest.raises(gl.errors.PatchingError, match=r"tokens is empty"):
            gl.patch_forward(three_models, empty, "resid_pre")
        with pytest.raises(gl.errors.PatchingError, match=r"tokens is empty"):
            gl.resid_patch_sweep(three_models, empty, lambda logits: logits[:, -1, 0])
        with pytest.raises(
            gl.errors.GraftMaskError, match=r"\(batch, pos\) = \(2, 0\) describes no"
        ):
            gl.GraftMask.build(three_models, (2, 0))


def test_a_tokenizer_path_that_is_missing_or_holds_no_tokenizer_is_named(tmp_path, tokenizer):
    for name, seed in (("base", 0), ("donor", 1)):
        random_model("gpt2", seed).save_pretrained(tmp_path / name)
    (tmp_path / "empty").mkdir()
    base, donor = tmp_path / "base", tmp_path / "donor"
    cases = [
        (tmp_path / "nope", r"tokenizer='.*nope' does not exist \(no such path, and not a hub"),
        (base / "config.json", r"config\.json' is a file; give the directory a tokenizer"),
        (tmp_path / "empty", r"'.*empty': no tokenizer could be loaded from the directory"),
        # transformers makes a tokenizer of GPT-2's class from config.json alone, holding
        # nothing but <|endoftext|>: every text would tokenize to nothing.
        (base, r"'.*base' holds no tokenizer: .*knows only its 1 special token"),
    ]
    for path, message in cases:
        with pytest.raises(gl.GraftingLensError, match=message):
            gl.load_models(base, donor, tokenizer=path)
    # The base's own directory has no tokenizer either: named, with the fix.
    with pytest.raises(gl.GraftingLensError, match=r"'.*base' has no tokenizer and none was"):
        gl.load_models(base, donor)
    # A donor without one borrows the base's (it was "1 token" against the base's 300).
    tokenizer.save_pretrained(base)
    loaded = gl.load_models(base, donor)
    assert loaded.tokenizer.get_vocab() == tokenizer.get_vocab()
