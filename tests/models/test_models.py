"""Loading model sets: sources of every kind, alignment errors, weight differences."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import (
    family_config,
    no_forward_pass,
    random_mask,
    random_model,
    random_tokens,
    tiny_config,
)
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
    first = gl.load_models(random_model("gpt2", 0), random_model("gpt2", 1), tokenizer=tokenizer)
    # A bridge, and the model a bridge wraps, are taken as the checkpoint they hold.
    mixed = gl.load_models(first[1], first[0].original_model, tokenizer=tokenizer)
    tokens = random_tokens(2, 5)
    assert torch.equal(mixed[0](tokens), first[1](tokens))
    assert torch.equal(mixed[1](tokens), first[0](tokens))


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


@pytest.mark.parametrize(
    "paths, message",
    [
        ({"q": "blocks.attn.q"}, r"Cannot register 'q' at 'blocks.attn.q'.*\{layer\}"),
        ({"queries": "blocks.{layer}.attn.q"}, "Unknown component 'queries'"),
        ({"attn": "blocks.{layer}.attn"}, "register the members of a group"),
    ],
)
def test_register_component_paths_refuses(paths, message):
    with pytest.raises(gl.errors.ComponentError, match=message):
        gl.models.components.register_component_paths("MyArch", paths)
    assert "MyArch" not in gl.models.components._ARCHITECTURE_PATHS


def test_dtype_argument_casts_every_source(tokenizer):
    loaded = gl.load_models(
        random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer, dtype=torch.float64
    )
    for bridge in loaded:
        assert {p.dtype for p in bridge.original_model.parameters()} == {torch.float64}
    tokens = random_tokens(1, 4)
    mask = gl.GraftMask.build(loaded, tokens, positions="last", components="all", source=1)
    assert gl.graft_forward(loaded, tokens, mask, logits="all").dtype == torch.float64


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
            rf"1 weight\(s\) missing, which transformers filled with random values "
            rf"\({re.escape(dropped)}\)",
        ),
        "extra": (
            {**weights, "extra.weight": torch.zeros(3)},
            r"1 weight\(s\) the model does not have \(extra.weight\)",
        ),
        "reshaped": (
            {**weights, dropped: weights[dropped].reshape(-1)[:7].clone()},
            rf"of another shape than the model's, filled with random values \({re.escape(dropped)}",
        ),
    }
    for case, (tensors, named) in cases.items():
        broken = tmp_path / case
        random_model(family, 1).config.save_pretrained(broken)
        save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(gl.GraftingLensError, match=named) as caught:
            gl.load_models(tmp_path / "base", broken, tokenizer=tokenizer)
        assert "save or download it again" in str(caught.value)
    with pytest.raises(gl.GraftingLensError, match="1 weight\\(s\\) missing"):  # a base too
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
        with pytest.raises(gl.errors.TokenError, match=r"tokens is empty"):
            gl.patch_forward(three_models, empty, "resid_pre")
        with pytest.raises(gl.errors.TokenError, match=r"tokens is empty"):
            gl.resid_patch_sweep(three_models, empty, lambda logits: logits[:, -1, 0])
        with pytest.raises(
            gl.errors.GraftMaskError, match=r"\(batch, pos\) = \(2, 0\) describes no"
        ):
            gl.GraftMask.build(three_models, (2, 0))


# ---------------------------------------- load_models refuses, before anything is grafted


def _saved(tmp_path, tokenizer, name, model=None, with_tokenizer=True):
    """``model`` (a Llama of seed 0 by default) saved as a checkpoint directory."""
    (model if model is not None else random_model("llama", 0)).save_pretrained(tmp_path / name)
    if with_tokenizer:
        tokenizer.save_pretrained(tmp_path / name)
    return tmp_path / name


def _other_vocabulary(tmp_path, tokenizer):
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(tokenizer),
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    other.train_from_iterator(["completely different text about zebras and quokkas"] * 50, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=other, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    donor = _saved(tmp_path, tokenizer, "donor", with_tokenizer=False)
    wrapped.save_pretrained(donor)
    return [_saved(tmp_path, tokenizer, "base"), donor], {}


def _truncated(tmp_path, tokenizer):
    broken = _saved(tmp_path, tokenizer, "broken", random_model("llama", 1))
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # interrupted
    return [_saved(tmp_path, tokenizer, "good"), broken], {}


def _file(path):
    path.write_bytes(b"")
    return path


def _processed(tokenizer):
    bridge = gl.load_models(random_model("gpt2", 0), random_model("gpt2", 1), tokenizer=tokenizer)[
        1
    ]
    bridge.process_weights()
    return bridge


def _pair(**options):
    """In-memory Llamas of seeds 0 and 1, with the shared tokenizer unless told."""
    return lambda tmp_path, tokenizer: (
        [random_model("llama", 0), random_model("llama", 1)],
        {"tokenizer": tokenizer, **options},
    )


def _donor(donor, family="llama"):
    """An in-memory base of ``family`` and ``donor()``, with the shared tokenizer."""
    return lambda tmp_path, tokenizer: (
        [random_model(family, 0), donor()],
        {"tokenizer": tokenizer},
    )


def _saved_pair(**options):
    """A Llama base and donor saved as checkpoint directories, with ``options``."""
    return lambda tmp_path, tokenizer: (
        [_saved(tmp_path, tokenizer, "base"), _saved(tmp_path, tokenizer, "donor")],
        options,
    )


# A GPU this machine does not have: past the last one, or any on a CPU-only machine.
MISSING_GPU = torch.cuda.device_count()
PER_LAYER = {
    name: MISSING_GPU
    for name in ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
}
PLACEMENTS = {
    "disk": ({"device_map": {"": "disk"}}, gl.errors.AlignmentError, "offloads modules to disk"),
    "disk by name": ({"device_map": "disk"}, gl.errors.AlignmentError, "offloads modules to disk"),
    "meta": ({"device_map": {"": "meta"}}, gl.errors.AlignmentError, "offloads modules to meta"),
    "cpu beside a GPU": (
        {"device_map": {"model.layers.0": 0, "lm_head": "cpu"}},
        gl.errors.AlignmentError,
        "offloads modules to cpu",
    ),
    "no such strategy": ({"device_map": "everywhere"}, gl.GraftingLensError, "nor a strategy"),
    "no such device": ({"device_map": {"": "gpu7"}}, gl.GraftingLensError, "'gpu7' cannot be used"),
    "a missing GPU by name": (
        {"device_map": f"cuda:{MISSING_GPU}"},
        gl.GraftingLensError,
        "cannot be used: it is not a device torch can use here",
    ),
    "a missing GPU by index": (
        {"device_map": MISSING_GPU},
        gl.GraftingLensError,
        "cannot be used: it is not a device torch can use here",
    ),
    "a per-layer map onto a missing GPU": (
        {"device_map": PER_LAYER},
        gl.GraftingLensError,
        "cannot be used: it is not a device torch can use here",
    ),
    "device= a missing GPU": (
        {"device": f"cuda:{MISSING_GPU}"},
        gl.GraftingLensError,
        "cannot be used: it is not a device torch can use here",
    ),
    "not a map": ({"device_map": []}, gl.GraftingLensError, "non-empty dict"),
    "a map and a device": (
        {"device_map": "auto", "device": "cpu"},
        gl.GraftingLensError,
        "pass one",
    ),
    "max_memory alone": ({"max_memory": {0: "1GiB"}}, gl.GraftingLensError, "device_map='auto'"),
    "max_memory not a dict": (
        {"device_map": "auto", "max_memory": "1GiB"},
        gl.GraftingLensError,
        "max_memory= is a dict",
    ),
}

_model = random_model("llama", 0)
_inv_freq_halved = random_model("llama", 1)
_inv_freq_halved.model.rotary_emb.inv_freq.mul_(0.5)  # as another rope scaling makes it

REFUSALS = {
    # (build sources and options, the error, what its message says)
    "one source": (
        lambda tmp_path, tokenizer: ([_model], {"tokenizer": tokenizer}),
        gl.errors.AlignmentError,
        "at least two",
    ),
    "names of another length": (_pair(names=["a"]), gl.GraftingLensError, "1 names for 2"),
    "lazy, not a choice": (_pair(lazy="yes"), gl.GraftingLensError, "True, False or 'verify'"),
    "a number as a source": (
        lambda tmp_path, tokenizer: ([_model, 3], {"tokenizer": tokenizer}),
        TypeError,
        r"sources\[1\] is a int",
    ),
    "a tokenizer of another type": (_pair(tokenizer=123), TypeError, "tokenizer must be"),
    "no tokenizer for in-memory models": (
        lambda tmp_path, tokenizer: ([random_model("llama", 0), _model], {}),
        gl.GraftingLensError,
        "Source 0 \\(an in-memory LlamaForCausalLM\\) has no tokenizer, and none was given",
    ),
    "a processed bridge": (
        lambda tmp_path, tokenizer: (
            [random_model("gpt2", 2), _processed(tokenizer)],
            {"tokenizer": tokenizer},
        ),
        gl.errors.AlignmentError,
        "processed weights",
    ),
    "a dtype torch lacks": (
        _pair(dtype="banana"),
        gl.GraftingLensError,
        "'banana' is not a floating",
    ),
    "an integer dtype": (_pair(dtype=torch.int64), gl.GraftingLensError, "not a floating torch"),
    "a number as dtype": (_pair(dtype=16), gl.GraftingLensError, "dtype=16 is not a floating"),
    "a device torch lacks": (
        _pair(device="banana"),
        gl.GraftingLensError,
        "device='banana' cannot be used",
    ),
    "another architecture": (
        _donor(lambda: random_model("llama", 1), family="gpt2"),
        gl.errors.AlignmentError,
        "source 1 \\(source1\\) is a LlamaForCausalLM, the base is a GPT2LMHeadModel",
    ),
    "another depth": (
        _donor(lambda: random_model("gpt2", 1, n_layers=2), family="gpt2"),
        gl.errors.AlignmentError,
        "configuration has n_layer=2, the base's n_layer=3",
    ),
    "another width": (
        _donor(
            lambda: AutoModelForCausalLM.from_config(
                GPT2Config(**{**family_config("gpt2").to_dict(), "n_embd": 64})
            ),
            family="gpt2",
        ),
        gl.errors.AlignmentError,
        "n_embd=64",
    ),
    **{
        f"another computation ({case})": (
            _donor(
                lambda case=case: _donor_with(FORWARD_CHANGES[case][0], **FORWARD_CHANGES[case][1]),
                family=FORWARD_CHANGES[case][0],
            ),
            gl.errors.AlignmentError,
            f"source 1 .*configuration has {FORWARD_CHANGES[case][2]}",
        )  # fmt: skip
        for case in FORWARD_CHANGES
    },
    "another buffer": (
        _donor(lambda: _inv_freq_halved),
        gl.errors.AlignmentError,
        "buffer 'model.rotary_emb.inv_freq' is not the base's",
    ),
    "another dtype": (
        _donor(lambda: random_model("llama", 1).half()),
        gl.errors.AlignmentError,
        "is torch.float16 on cpu, the base's torch.float32 on cpu.*dtype=",
    ),
    "another vocabulary": (
        _other_vocabulary,
        gl.errors.AlignmentError,
        "vocabulary .* not the base",
    ),
    "a path that does not exist": (
        lambda tmp_path, tokenizer: ([tmp_path / "nowhere", tmp_path / "else"], {}),
        gl.GraftingLensError,
        "nowhere'\\) is not a directory \\(no such path\\)",
    ),
    "a file": (
        lambda tmp_path, tokenizer: ([_file(tmp_path / "w.bin"), tmp_path], {}),
        gl.GraftingLensError,
        "is a \\.bin weight file alone.*config\\.json.*a \\.gguf file, or a hub id",
    ),
    "a directory without config.json": (
        lambda tmp_path, tokenizer: ([tmp_path, tmp_path], {}),
        gl.GraftingLensError,
        "directory without a config.json.*holds nothing",
    ),
    "a truncated weights file": (
        _truncated,
        gl.GraftingLensError,
        "source 1 .*broken.*model.safetensors.*truncated",
    ),
    "a hub id not in the offline cache": (
        lambda tmp_path, tokenizer: (["nobody/no-such-model", "nobody/either"], {}),
        gl.GraftingLensError,
        "not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 forbids",
    ),
    "a base directory without a tokenizer": (
        lambda tmp_path, tokenizer: (
            [_saved(tmp_path, tokenizer, "base", with_tokenizer=False), _model],
            {},
        ),
        gl.GraftingLensError,
        "Source 0 \\(.*base\\) has no tokenizer, and none was given",
    ),
    "a tokenizer path that does not exist": (
        lambda tmp_path, tokenizer: (
            [_model, random_model("llama", 1)],
            {"tokenizer": tmp_path / "no"},
        ),
        gl.GraftingLensError,
        "tokenizer='.*no' holds no usable tokenizer",
    ),
    "a tokenizer path that is a file": (
        lambda tmp_path, tokenizer: (
            [_model, random_model("llama", 1)],
            {"tokenizer": _saved(tmp_path, tokenizer, "b", with_tokenizer=False) / "config.json"},
        ),
        gl.GraftingLensError,
        "config.json' holds no usable tokenizer",
    ),
    # transformers makes a tokenizer from config.json alone, holding nothing but its
    # special tokens: every text would tokenize to nothing.
    "a tokenizer path with only a config": (
        lambda tmp_path, tokenizer: (
            [_model, random_model("llama", 1)],
            {"tokenizer": _saved(tmp_path, tokenizer, "b", with_tokenizer=False)},
        ),
        gl.GraftingLensError,
        "holds no usable tokenizer",
    ),
    **{
        f"placement: {case}": (_saved_pair(**options), error, message)
        for case, (options, error, message) in PLACEMENTS.items()
    },
    "a headless model": (
        lambda tmp_path, tokenizer: (
            [GPT2Model(family_config("gpt2")), GPT2Model(family_config("gpt2"))],
            {"tokenizer": tokenizer},
        ),
        gl.errors.UnsupportedArchitectureError,
        "GPT2Model \\(model_type 'gpt2'\\).*Nearest supported: GPT2LMHeadModel.*AutoModelForCausalLM",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_load_models_refuses(tmp_path, tokenizer, case):
    build, error, message = REFUSALS[case]
    sources, options = build(tmp_path, tokenizer)
    with pytest.raises(error, match=message) as caught:
        gl.load_models(*sources, **options)
    assert len(str(caught.value)) < 600  # what is wrong and the fix; the story is on its page


def test_one_model_given_twice_is_grafted_into_itself(tokenizer):
    model = random_model("llama", 0)
    models = gl.load_models(model, model, tokenizer=tokenizer)
    tokens = random_tokens(2, 5)
    mask = random_mask(models, tokens.shape)
    torch.testing.assert_close(
        gl.graft_forward(models, tokens, mask, logits="all"), models.base(tokens)
    )


def test_a_donor_rounded_through_bfloat16_is_the_same_configuration(tokenizer):
    rounded = random_model("llama", 1).bfloat16().float()
    assert len(gl.load_models(random_model("llama", 0), rounded, tokenizer=tokenizer)) == 2


def test_dtype_names_are_accepted_and_cast_every_source(tokenizer):
    assert gl.models.loading.resolve_placement("cpu", "bfloat16") == (
        torch.device("cpu"),
        torch.bfloat16,
    )
    assert gl.models.loading.resolve_placement(None, "torch.float16") == (None, torch.float16)
    loaded = gl.load_models(
        random_model("llama", 0), random_model("llama", 1).half(), tokenizer=tokenizer,
        dtype="float32",
    )  # fmt: skip
    assert {p.dtype for bridge in loaded for p in bridge.original_model.parameters()} == {
        torch.float32
    }


def test_a_tokenizer_is_taken_from_a_directory_and_a_donor_borrows_the_bases(tmp_path, tokenizer):
    base = _saved(tmp_path, tokenizer, "base")
    donor = _saved(tmp_path, tokenizer, "donor", random_model("llama", 1), with_tokenizer=False)
    assert gl.load_models(base, donor).tokenizer.get_vocab() == tokenizer.get_vocab()
    loaded = gl.load_models(donor, base, tokenizer=base)
    assert loaded.tokenizer.get_vocab() == tokenizer.get_vocab()


# ---------------------------------------- what the caller gives is never changed


def _snapshot(model, tokens):
    """A model's state_dict (copied), config, mode and own forward, as the caller sees them."""
    training = model.training
    with torch.no_grad():
        logits = model.eval()(tokens).logits.clone()
    model.train(training)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return state, model.config.to_dict(), training, logits


def _tokenizer_state(tokenizer):
    return (
        dict(tokenizer.init_kwargs),
        dict(tokenizer.special_tokens_map),
        tokenizer.get_vocab(),
        tokenizer.padding_side,
        tokenizer.backend_tokenizer.to_str(),
    )


@pytest.mark.parametrize("dtype", [None, torch.float64], ids=["as_given", "cast"])
def test_load_models_leaves_the_models_and_tokenizer_it_is_given_as_they_were(
    tmp_path, family, dtype
):
    from conftest import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.init_kwargs.pop("name_or_path", None)  # what the bridge wants filled in
    base, donor = random_model(family, 0), random_model(family, 1).train()
    tokens = random_tokens(2, 6)
    before = [_snapshot(model, tokens) for model in (base, donor)]
    words = _tokenizer_state(tokenizer)
    models = gl.load_models(base, donor, tokenizer=tokenizer, dtype=dtype)
    mask = random_mask(models, tokens.shape)
    gl.graft_forward(models, tokens, mask)  # the set is used, then the caller's objects read
    assert _tokenizer_state(tokenizer) == words
    for index, (model, (state, config, training, logits)) in enumerate(zip((base, donor), before)):
        after = model.state_dict()
        assert list(after) == list(state)
        assert all(torch.equal(after[name], value) for name, value in state.items())
        assert model.config.to_dict() == config and model.training == training
        with torch.no_grad():
            assert torch.equal(model.eval()(tokens).logits, logits)
        model.save_pretrained(tmp_path / str(index))
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / str(index)).state_dict()
        assert all(torch.equal(reloaded[name], value) for name, value in state.items())
        # The set computes what the caller's model computes, in the dtype asked for.
        alone = models[index](tokens)
        assert alone.dtype == (dtype or torch.float32)
        assert (alone.float() - logits).abs().max() <= 1e-4


def test_load_models_leaves_a_bridge_and_a_peft_model_as_they_were(tmp_path, tokenizer):
    import peft

    bridge = gl.load_models(
        random_model("llama", 2), random_model("llama", 3), tokenizer=tokenizer
    )[1]
    adapter = peft.get_peft_model(
        random_model("llama", 0),
        peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False),
    ).eval()
    tokens = random_tokens(2, 6)
    states = [
        {name: t.detach().clone() for name, t in thing.state_dict().items()}
        for thing in (bridge, adapter)
    ]
    with torch.no_grad():
        outputs = [bridge(tokens).clone(), adapter(tokens).logits.clone()]
    gl.load_models(
        random_model("llama", 0), bridge, adapter, tokenizer=tokenizer, dtype=torch.float64
    )
    for thing, state in zip((bridge, adapter), states):
        after = thing.state_dict()
        assert list(after) == list(state)
        assert all(torch.equal(after[name], value) for name, value in state.items())
    with torch.no_grad():
        assert torch.equal(bridge(tokens), outputs[0])
        assert torch.equal(adapter(tokens).logits, outputs[1])


def test_a_model_built_from_a_config_loads_and_keeps_its_config(tokenizer):
    base, donor = random_model("gemma", 0), random_model("gemma", 1)
    assert base.config.architectures is None  # what from_config gives
    models = gl.load_models(base, donor, tokenizer=tokenizer)
    assert models.architecture == "GemmaForCausalLM"
    assert base.config.architectures is None


# ---------------------------------------- one dtype policy: Hugging Face's


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_dtype_loads_every_path_as_from_pretrained_does(tmp_path, tokenizer, family):
    # HF's own bf16 load keeps rotary frequencies in float32 (computed at init), and makes
    # Gemma's embedding scale in bfloat16; a cast with .to() would make both bfloat16.
    paths = [
        _saved(tmp_path, tokenizer, name, random_model(family, seed))
        for name, seed in (("base", 0), ("donor", 1))
    ]
    hf = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.bfloat16).eval()
    expected = {name: buffer.dtype for name, buffer in hf.named_buffers()}
    assert expected["model.rotary_emb.inv_freq"] == torch.float32
    tokens = random_tokens(2, 40, seed=4)
    loads = {
        "paths": gl.load_models(*paths, dtype=torch.bfloat16),
        "paths, device_map": gl.load_models(*paths, dtype=torch.bfloat16, device_map={"": "cpu"}),
        "in memory": gl.load_models(
            *(random_model(family, seed) for seed in (0, 1)), tokenizer=tokenizer,
            dtype=torch.bfloat16,
        ),
    }  # fmt: skip
    grafted = {}
    for how, loaded in loads.items():
        for source in loaded:
            found = {
                name.replace("._original_component", ""): buffer.dtype
                for name, buffer in source.original_model.named_buffers()
            }
            assert {name: found[name] for name in expected} == expected, how
        everywhere = gl.GraftMask.from_dict(
            loaded, dict.fromkeys(loaded.pairs, torch.ones(tokens.shape, dtype=torch.long))
        )
        grafted[how] = gl.graft_forward(loaded, tokens, everywhere)
    # Every path computes the same numbers, bit for bit.
    assert all(torch.equal(logits, grafted["paths"]) for logits in grafted.values())


# ---------------------------------------- ModelSet.check_tokens, the one token check


@pytest.mark.parametrize("family", ["gpt2"])
@pytest.mark.parametrize(
    "tokens, message",
    [
        (torch.ones(3, dtype=torch.long), r"must be a \[batch, pos\] tensor .*got shape \[3\]"),
        ([[1, 2]], r"must be a \[batch, pos\] tensor .*got list"),
        (torch.ones(1, 3), "must hold integer token ids, got torch.float32"),
        (torch.ones(1, 0, dtype=torch.long), r"is empty \(shape \[1, 0\]\)"),
        (torch.ones(1, 3, dtype=torch.long, device="meta"), "on the meta device"),
        (torch.full((1, 3), 300), r"must lie in 0\.\.299.*got 300\.\.300"),
        (torch.ones(1, 70, dtype=torch.long), "70 positions.*learned position embeddings for 64"),
    ],
    ids=["1d", "list", "float", "empty", "meta", "vocabulary", "too_long"],
)
def test_check_tokens_refuses(three_models, tokens, message):
    error = (
        gl.errors.TokenError if isinstance(tokens, torch.Tensor) else gl.errors.ArgumentTypeError
    )
    with pytest.raises(error, match=message):
        three_models.check_tokens(tokens)
    assert three_models.check_tokens(torch.ones(2, 4, dtype=torch.uint8)) == (2, 4)
