"""LoRA adapters as donors, against PEFT's own model: unmerged forward, merged donor, oracle."""

from __future__ import annotations

import copy
import json
import sys

import peft
import pytest
import torch
from conftest import random_mask, random_model, random_tokens, tiny_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import grafting_lens as gl
from grafting_lens.models.lora_source import LoraLinear

TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # Conv1D; c_attn is split into Q, K, V by the bridge
    "neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],  # interleaved QKV
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def lora_model(family: str, seed: int = 7, **settings) -> peft.PeftModel:
    """A PEFT model of the family's base (seed 0) with a random, non-zero LoRA adapter."""
    config = peft.LoraConfig(
        **{
            "r": 4,
            "lora_alpha": 8,
            "target_modules": TARGETS[family],
            "init_lora_weights": False,  # B is random too, so the adapter changes the model
            "fan_in_fan_out": family == "gpt2",
            **settings,
        }
    )
    base = random_model(family, 0)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.mul_(2.0)  # large enough to move the logits by several units
    return model.eval()


_ADAPTERS: dict[str, tuple] = {}


@pytest.fixture
def adapter(family, tmp_path_factory):
    """A saved adapter directory, its PEFT model and the merged model, once per family."""
    if family not in _ADAPTERS:
        model = lora_model(family)
        directory = tmp_path_factory.mktemp(f"lora_{family}")
        model.save_pretrained(directory)
        merged = copy.deepcopy(model).merge_and_unload().eval()
        _ADAPTERS[family] = (directory, model, merged)
    return _ADAPTERS[family]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float32 rounding, relative to the logits' size (a merged weight sums in
    another order than ``W x + B (A x)``)."""
    return bool((a - b).abs().max() <= 1e-4 * max(1.0, float(b.abs().max())))


def test_an_adapter_runs_alone_as_peft_runs_it(family, adapter, tokenizer):
    directory, model, _ = adapter
    models = gl.load_models(random_model(family, 0), directory, tokenizer=tokenizer)
    assert [source.kind for source in models.sources] == ["checkpoint", "lora"]
    tokens = random_tokens(2, 9, seed=1)
    with torch.no_grad():
        expected = model(tokens).logits
    assert close(models[1](tokens), expected)
    assert (expected - models.base(tokens)).abs().max() > 1.0  # the adapter does something


def test_an_adapter_alone_moves_inputs_as_the_dispatched_base_does(family, adapter, tokenizer):
    # A base dispatched across devices carries accelerate's hooks; the bridge an adapter
    # runs alone in shares the base's tensors and must carry the same hooks. Here every
    # block's execution device is the CPU: the hooks are there, the numbers unchanged.
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from grafting_lens.models.components import checkpoint_modules

    directory, model, _ = adapter
    base = random_model(family, 0)
    blocks = [name for name, module in base.named_modules() if name.endswith((".0", ".1"))]
    for name in blocks:
        add_hook_to_module(base.get_submodule(name), AlignDevicesHook(execution_device="cpu"))
    models = gl.load_models(base, directory, tokenizer=tokenizer)
    alone = dict(checkpoint_modules(models[1].original_model))  # through the bridge
    for name in blocks:
        hook = getattr(alone[name + "."], "_hf_hook", None)
        assert isinstance(hook, AlignDevicesHook) and hook.execution_device == "cpu"
        assert hook is not base.get_submodule(name)._hf_hook  # its own per-call state
    tokens = random_tokens(2, 9, seed=1)
    with torch.no_grad():
        assert close(models[1](tokens), model(tokens).logits)


def test_a_lora_graft_equals_the_merged_donors_graft_and_the_oracle(family, adapter, tokenizer):
    directory, _, merged = adapter
    lora = gl.load_models(random_model(family, 0), directory, tokenizer=tokenizer)
    full = gl.load_models(random_model(family, 0), copy.deepcopy(merged), tokenizer=tokenizer)
    tokens = random_tokens(3, 8, seed=2)
    mask = random_mask(lora, tokens.shape, seed=3)
    grafted = gl.graft_forward(lora, tokens, mask, logits="all")
    assert close(grafted, gl.graft_forward(full, tokens, mask, logits="all"))
    assert close(grafted, gl.graft_forward_reference(lora, tokens, mask))
    assert (grafted - lora.base(tokens)).abs().max() > 1.0


def test_a_component_the_adapter_does_not_touch_is_the_bases(tokenizer, tmp_path):
    model = lora_model("llama", target_modules=["q_proj"])
    model.save_pretrained(tmp_path)
    models = gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)
    assert {path.rsplit(".", 1)[1] for path in models.sources[1].adapted} == {"q"}
    slot = models.slots("mlp_out", 1)[0]
    assert models.sources[1].module(slot) is slot.module(models.base)
    tokens = random_tokens(2, 7, seed=4)
    untouched = gl.GraftMask.build(models, tokens, components="ffn+o+k+v+ln1+ln2", source=1)
    assert torch.equal(
        gl.graft_forward(models, tokens, untouched, logits="all"), models.base(tokens)
    )
    queries = gl.GraftMask.build(models, tokens, components="q", source=1)
    assert (
        gl.graft_forward(models, tokens, queries, logits="all") - models.base(tokens)
    ).abs().max() > 0.1


def test_a_fused_qkv_adapter_is_split_as_the_bridge_splits(tokenizer, tmp_path):
    # PEFT adapts GPT-2's c_attn whole; the bridge computes Q, K and V apart. A graft of
    # Q alone must take Q's rows of B, and equal the merged model's Q.
    model = lora_model("gpt2", target_modules=["c_attn"])
    model.save_pretrained(tmp_path)
    merged = copy.deepcopy(model).merge_and_unload()
    lora = gl.load_models(random_model("gpt2", 0), tmp_path, tokenizer=tokenizer)
    full = gl.load_models(random_model("gpt2", 0), merged, tokenizer=tokenizer)
    tokens = random_tokens(2, 8, seed=5)
    for component in ("q", "k", "v"):
        mask = gl.GraftMask.build(lora, tokens, positions=[2, 5], components=component)
        grafted = gl.graft_forward(lora, tokens, mask, logits="all")
        assert close(grafted, gl.graft_forward(full, tokens, mask, logits="all"))
        assert (grafted - lora.base(tokens)).abs().max() > 0.1
    q = lora.sources[1].module(lora.slots("q", 0)[0])
    assert isinstance(q, LoraLinear) and q.lora_B.shape == (32, 4)


@pytest.mark.parametrize(
    "model_type, targets",
    [
        ("phi3", ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"]),  # fused Q/K/V (GQA), gate/up
        ("falcon", ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
        ("bloom", ["query_key_value", "dense"]),
    ],
)
def test_fused_projections_of_other_architectures(tokenizer, model_type, targets):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    with torch.no_grad():
        for parameter in base.parameters():
            parameter.mul_(10)  # logits that vary by tens
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.mul_(3)
    merged = copy.deepcopy(model).merge_and_unload()
    lora = gl.load_models(copy.deepcopy(base), model, tokenizer=tokenizer)
    full = gl.load_models(copy.deepcopy(base), merged, tokenizer=tokenizer)
    tokens = random_tokens(2, 7)
    with torch.no_grad():
        assert close(lora[1](tokens), model(tokens).logits)
    mask = random_mask(lora, tokens.shape, seed=2)
    grafted = gl.graft_forward(lora, tokens, mask, logits="all")
    assert close(grafted, gl.graft_forward(full, tokens, mask, logits="all"))
    assert (grafted - lora.base(tokens)).abs().max() > 1.0


@pytest.mark.parametrize(
    "settings",
    [
        {"use_rslora": True},  # scale alpha / sqrt(r)
        {"rank_pattern": {"o_proj": 2}, "alpha_pattern": {"down_proj": 32}},
    ],
    ids=["rslora", "patterns"],
)
def test_scales_follow_peft(tokenizer, tmp_path, settings):
    model = lora_model("llama", **settings)
    model.save_pretrained(tmp_path)
    models = gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)
    tokens = random_tokens(2, 7, seed=6)
    with torch.no_grad():
        expected = model(tokens).logits
    assert close(models[1](tokens), expected)
    merged = gl.load_models(
        random_model("llama", 0), copy.deepcopy(model).merge_and_unload(), tokenizer=tokenizer
    )
    assert close(models[1](tokens), merged[1](tokens))


@pytest.mark.parametrize("family_name", ["llama", "gemma"])
def test_embedding_adapters_and_modules_to_save(tokenizer, tmp_path, family_name):
    # Gemma scales its embedding lookup by sqrt(d_model); PEFT scales the update too.
    # Gemma ties its unembedding to the embedding, so only Llama saves lm_head whole.
    targets = ["embed_tokens", "q_proj"] + ([] if family_name == "gemma" else ["lm_head"])
    model = lora_model(
        family_name,
        target_modules=targets,
        modules_to_save=None if family_name == "gemma" else ["o_proj"],
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modules_to_save" in name:
                parameter.add_(torch.randn_like(parameter))
    model.save_pretrained(tmp_path)
    models = gl.load_models(random_model(family_name, 0), tmp_path, tokenizer=tokenizer)
    kinds = {path: type(module).__name__ for path, module in models.sources[1]._modules.items()}
    assert kinds["embed"] == "LoraEmbedding"
    tokens = random_tokens(2, 7, seed=7)
    with torch.no_grad():
        expected = model(tokens).logits
    assert close(models[1](tokens), expected)
    embed = gl.GraftMask.build(models, tokens, components="embed", source=1)
    assert (
        gl.graft_forward(models, tokens, embed, logits="all") - models.base(tokens)
    ).abs().max() > 0.1
    if family_name == "llama":
        assert {"unembed", "blocks.0.attn.o"} <= set(kinds)


def test_a_peft_model_object_is_a_donor(tokenizer):
    model = lora_model("llama")
    models = gl.load_models(random_model("llama", 0), model, tokenizer=tokenizer)
    assert models.sources[1].kind == "lora"
    tokens = random_tokens(2, 6, seed=8)
    with torch.no_grad():
        expected = model(tokens).logits
    assert close(models[1](tokens), expected)


def test_memory_counts_the_factors_and_shares_the_base(family, adapter, tokenizer):
    directory, _, merged = adapter
    lora = gl.load_models(random_model(family, 0), directory, tokenizer=tokenizer)
    factors = sum(
        t.numel() * t.element_size()
        for t in load_file(str(directory / "adapter_model.safetensors")).values()
    )
    memory = lora.memory()
    assert list(memory.columns) == [
        "source",
        "name",
        "kind",
        "resident_bytes",
        "declared_bytes",
        "full_bytes",
        "disk_bytes",
    ]
    assert memory.loc[1, "kind"] == "lora"
    # GPT-2 and NeoX split the fused QKV factor B into three, which is the same bytes.
    assert memory.loc[1, "resident_bytes"] == factors
    full = gl.load_models(random_model(family, 0), copy.deepcopy(merged), tokenizer=tokenizer)
    assert full.memory().loc[1, "resident_bytes"] > 5 * factors
    assert memory.loc[1, "full_bytes"] == full.memory().loc[1, "full_bytes"]


def test_weight_diff_of_an_adapter_is_the_merged_models(family, adapter, tokenizer):
    directory, _, merged = adapter
    lora = gl.load_models(random_model(family, 0), directory, tokenizer=tokenizer)
    full = gl.load_models(random_model(family, 0), copy.deepcopy(merged), tokenizer=tokenizer)
    ours, theirs = lora.weight_diff(), full.weight_diff()
    assert (ours["relative_change"] - theirs["relative_change"]).abs().max() <= 1e-5
    assert theirs["relative_change"].max() > 0.01


def test_fingerprints_tell_adapters_apart(tokenizer, adapter, family):
    directory, _, _ = adapter
    base = random_model(family, 0)
    first = gl.load_models(copy.deepcopy(base), directory, tokenizer=tokenizer)
    again = gl.load_models(copy.deepcopy(base), directory, tokenizer=tokenizer)
    other = gl.load_models(copy.deepcopy(base), lora_model(family, seed=8), tokenizer=tokenizer)
    fingerprints = [m.sources[1].fingerprint() for m in (first, again, other)]
    assert fingerprints[0] == fingerprints[1] != fingerprints[2]
    assert first.sources[0].fingerprint() != fingerprints[0]


# ------------------------------------------------------------------ refusals


def test_an_adapter_for_another_base_is_refused(tokenizer, tmp_path):
    lora_model("llama").save_pretrained(tmp_path / "llama")
    with pytest.raises(
        gl.errors.AdapterError,
        match=r"adapts model\.layers\.0\.\S+, which the base lacks: it was made for another model",
    ):
        gl.load_models(random_model("gpt2", 0), tmp_path / "llama", tokenizer=tokenizer)
    # Same module names, other shapes: a wider Llama.
    wider = random_model("llama", 0)
    config = wider.config
    config.hidden_size, config.intermediate_size = 48, 96

    other = peft.get_peft_model(
        AutoModelForCausalLM.from_config(config),
        peft.LoraConfig(r=4, target_modules=TARGETS["llama"], init_lora_weights=False),
    )
    other.save_pretrained(tmp_path / "wide")
    with pytest.raises(
        gl.errors.AdapterError,
        match=r"but the base.s \S+ maps \d+ to \d+ features \(A must be \[r, \d+\]",
    ):
        gl.load_models(random_model("llama", 0), tmp_path / "wide", tokenizer=tokenizer)
    assert issubclass(gl.errors.AdapterError, gl.errors.AlignmentError)


def test_an_adapter_naming_another_base_warns(tokenizer, tmp_path):
    lora_model("llama").save_pretrained(tmp_path / "adapter")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "meta-llama/Llama-3.1-8B"
    config_path.write_text(json.dumps(config))
    random_model("llama", 0).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    with pytest.warns(UserWarning, match="trained on 'meta-llama/Llama-3.1-8B'"):
        gl.load_models(tmp_path / "base", tmp_path / "adapter")


@pytest.mark.parametrize(
    "setting, value, named",
    [
        ("use_dora", True, "DoRA"),
        ("lora_bias", True, "bias on LoRA's B"),
        ("bias", "all", "trained biases"),
        ("peft_type", "IA3", "is a IA3 adapter"),
        ("trainable_token_indices", [1, 2], "trainable token embeddings"),
    ],
)
def test_adapters_that_compute_something_else_are_refused(
    tokenizer, tmp_path, setting, value, named
):
    lora_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config[setting] = value
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(gl.errors.AdapterError, match=f"{named}.*merge_and_unload"):
        gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)


def test_unknown_lora_tensors_and_missing_factors_are_refused(tokenizer, tmp_path):
    lora_model("llama").save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "adapter_model.safetensors"))
    key = next(k for k in weights if k.endswith("q_proj.lora_B.weight"))
    save_file(
        {k: v for k, v in weights.items() if k != key}, str(tmp_path / "adapter_model.safetensors")
    )
    with pytest.raises(gl.errors.AdapterError, match="no B"):
        gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)
    weights[key.replace("lora_B.weight", "lora_magnitude_vector")] = torch.ones(32)
    save_file(weights, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(
        gl.errors.AdapterError, match="lora_magnitude_vector, a LoRA tensor of a kind"
    ):
        gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(gl.errors.AdapterError, match="holds no adapter tensors"):
        gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)


def test_an_adapter_is_not_a_base_and_a_base_holds_no_adapter(tokenizer, tmp_path):
    model = lora_model("llama")
    model.save_pretrained(tmp_path)
    with pytest.raises(gl.errors.AlignmentError, match="Source 0 is a LoRA adapter"):
        gl.load_models(tmp_path, random_model("llama", 0), tokenizer=tokenizer)
    with pytest.raises(gl.errors.AlignmentError, match="Source 0 is a LoRA adapter"):
        gl.load_models(model, random_model("llama", 0), tokenizer=tokenizer)
    # PeftModel wraps its base in place: that base no longer computes the checkpoint.
    with pytest.raises(gl.errors.AlignmentError, match="holding PEFT layers"):
        gl.load_models(model.get_base_model(), tmp_path, tokenizer=tokenizer)


def test_patching_runs_the_adapter_alone(tokenizer, adapter, family):
    directory, _, merged = adapter
    lora = gl.load_models(random_model(family, 0), directory, tokenizer=tokenizer)
    full = gl.load_models(random_model(family, 0), copy.deepcopy(merged), tokenizer=tokenizer)
    tokens = random_tokens(2, 6, seed=9)
    for direction in ("sufficiency", "necessity"):  # the adapter gives, then it runs
        options = dict(site="resid_pre", layers=1, positions="last", direction=direction)
        patched = gl.patch_forward(lora, tokens, **options)
        assert close(patched, gl.patch_forward(full, tokens, **options))


def test_an_adapter_directory_needs_no_peft(tokenizer, tmp_path, monkeypatch):
    # PEFT is an optional extra: reading and grafting an adapter directory never imports it.
    lora_model("llama").save_pretrained(tmp_path)
    monkeypatch.setitem(sys.modules, "peft", None)  # an import of peft now fails
    with pytest.raises(ImportError):
        import peft  # noqa: F401
    models = gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)
    tokens = random_tokens(2, 6, seed=9)
    mask = gl.GraftMask.build(models, tokens, components="q", source=1)
    assert (
        gl.graft_forward(models, tokens, mask, logits="all") - models.base(tokens)
    ).abs().max() > 0.1


# ------------------------------------------------------------------ not plain LoRA on the base


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.parametrize(
    "family_name, saved, other",
    [
        ("gpt2", "lm_head", "embed"),  # tied: the saved head must leave the lookup alone
        ("gemma", "lm_head", "embed"),
        ("gemma", "embed_tokens", "unembed"),  # and a saved embedding the head
    ],
)
def test_modules_to_save_on_a_tied_weight_change_only_their_module(
    tokenizer, tmp_path, family_name, saved, other
):
    # PEFT trains a copy of each module in modules_to_save; the base's tied matrix,
    # which the other module keeps computing with, is not changed.
    model = lora_model(
        family_name, target_modules=TARGETS[family_name][:1], modules_to_save=[saved]
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modules_to_save" in name:
                parameter.add_(torch.randn_like(parameter))
    model.save_pretrained(tmp_path)
    models = gl.load_models(random_model(family_name, 0), tmp_path, tokenizer=tokenizer)
    tokens = random_tokens(2, 7, seed=10)
    with torch.no_grad():
        expected = model(tokens).logits
    assert close(models[1](tokens), expected)
    untouched = gl.GraftMask.build(models, tokens, components=other, source=1)
    assert torch.equal(
        gl.graft_forward(models, tokens, untouched, logits="all"), models.base(tokens)
    )
    changed = gl.GraftMask.build(models, tokens, components=saved_component(saved), source=1)
    assert (
        gl.graft_forward(models, tokens, changed, logits="all") - models.base(tokens)
    ).abs().max() > 1.0


def saved_component(module: str) -> str:
    return {"lm_head": "unembed", "embed_tokens": "embed"}[module]


@pytest.mark.filterwarnings("ignore:(PiSSA|OLoRA) changes the base weights")
@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_initialisations_that_rewrite_the_base_are_refused_and_their_conversion_loads(
    tokenizer, tmp_path, init
):
    # PiSSA and OLoRA subtract the initial factors' product from W when PEFT creates
    # or loads the adapter: the trained model is not W x + B A x * scale on the base.
    base = random_model("llama", 0)
    config = peft.LoraConfig(r=4, target_modules=TARGETS["llama"], init_lora_weights=init)
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    model.save_pretrained(tmp_path / "initial")
    torch.manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))  # "training"
    model.save_pretrained(tmp_path / "trained")
    refused = rf"init_lora_weights='{init}'.*rewrites the base's weights.*path_initial_model"
    with pytest.raises(gl.errors.AdapterError, match=refused):
        gl.load_models(copy.deepcopy(base), tmp_path / "trained", tokenizer=tokenizer)
    with pytest.raises(gl.errors.AdapterError, match=refused):
        gl.load_models(copy.deepcopy(base), model, tokenizer=tokenizer)
    # The fix the message names: PEFT's conversion to plain LoRA on the original base.
    model.save_pretrained(
        tmp_path / "converted", path_initial_model_for_weight_conversion=str(tmp_path / "initial")
    )
    models = gl.load_models(copy.deepcopy(base), tmp_path / "converted", tokenizer=tokenizer)
    tokens = random_tokens(2, 7, seed=11)
    with torch.no_grad():
        expected = model(tokens).logits
    assert close(models[1](tokens), expected)
    assert (expected - models.base(tokens)).abs().max() > 1.0


def test_an_unknown_initialisation_is_refused(tokenizer, tmp_path):
    lora_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config["init_lora_weights"] = "something_new"
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(
        gl.errors.AdapterError, match="init_lora_weights='something_new', unknown.*merge_and_unload"
    ):
        gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)


@pytest.mark.parametrize(
    "change",
    [{"r": 8}, {"rank_pattern": {"o_proj": 2}}],
    ids=["r", "rank_pattern"],
)
def test_a_rank_that_disagrees_with_the_factors_is_refused_as_peft_refuses_it(
    tokenizer, tmp_path, change
):
    lora_model("llama").save_pretrained(tmp_path)  # rank 4 everywhere
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config.update(change)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="size mismatch"):
        peft.PeftModel.from_pretrained(random_model("llama", 0), str(tmp_path))
    with pytest.raises(
        gl.errors.AdapterError, match=r"factors of rank 4, .* config gives that module rank"
    ):
        gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)


def test_an_adapter_file_without_tensors_is_refused(tokenizer, tmp_path):
    lora_model("llama").save_pretrained(tmp_path)
    save_file({}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(
        gl.errors.AdapterError, match="adapter_model.safetensors holds no adapter tensors.*again"
    ):
        gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)


@pytest.mark.parametrize("embed", [False, True], ids=["linear", "embedding_and_modules_to_save"])
def test_factors_named_with_the_adapter_name_are_read_as_peft_computes(tokenizer, tmp_path, embed):
    # A file written from the PEFT model's own state_dict names every factor with the
    # adapter's name (q_proj.lora_A.default.weight), as PEFT's model does.
    settings = (
        {"target_modules": ["embed_tokens", "q_proj"], "modules_to_save": ["o_proj"]}
        if embed
        else {}
    )
    model = lora_model("llama", **settings)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modules_to_save" in name:
                parameter.add_(torch.randn_like(parameter))
    model.peft_config["default"].save_pretrained(tmp_path)
    state = {
        key: tensor.contiguous()
        for key, tensor in model.state_dict().items()
        if "lora_" in key or "modules_to_save" in key or "original_module" in key
    }
    assert any(".lora_A.default." in key for key in state)
    save_file(state, str(tmp_path / "adapter_model.safetensors"))
    models = gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)
    tokens = random_tokens(2, 7, seed=12)
    with torch.no_grad():
        expected = model(tokens).logits
    assert close(models[1](tokens), expected)
    assert (expected - models.base(tokens)).abs().max() > 1.0
    # Two adapters in one file are two donors.
    other = {key.replace(".default.", ".other."): t.clone() for key, t in state.items()}
    save_file({**state, **other}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(
        gl.errors.AdapterError, match=r"several adapters \(default, other\).*selected"
    ):
        gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)


def _edit_config(path, edit):
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage, named",
    [
        (
            lambda p: (p / "adapter_config.json").write_text(
                (p / "adapter_config.json").read_text()[:40]
            ),
            r"adapter_config.json is not the JSON object .*\(JSONDecodeError",
        ),
        (
            lambda p: (p / "adapter_config.json").write_text("[1, 2]"),
            r"adapter_config.json is not the JSON object of LoraConfig fields .*\(a JSON list\)",
        ),
        (
            lambda p: _edit_config(p, lambda c: c.update(lora_alpha=None)),
            "has lora_alpha=None, which must be a finite number",
        ),
        (lambda p: _edit_config(p, lambda c: c.update(r=0)), "has r=0, which must be an integer"),
        (
            lambda p: _edit_config(p, lambda c: c.update(alpha_pattern={"o_proj": "x"})),
            "has alpha_pattern=\\{'o_proj': 'x'\\}; it must map module names",
        ),
        (
            lambda p: _edit_config(p, lambda c: c.pop("peft_type")),
            "has no peft_type in its config",
        ),
        (
            lambda p: (p / "adapter_model.safetensors").write_bytes(
                (p / "adapter_model.safetensors").read_bytes()[:1000]
            ),
            r"adapter_model.safetensors cannot be read as adapter weights \(.*truncated or damaged",
        ),
    ],
    ids=[
        "truncated_config",
        "list_config",
        "null_alpha",
        "rank_0",
        "alpha_pattern",
        "no_peft_type",
        "truncated_weights",
    ],
)
def test_malformed_adapter_files_name_the_problem_and_the_fix(tokenizer, tmp_path, damage, named):
    lora_model("llama").save_pretrained(tmp_path)
    damage(tmp_path)
    with pytest.raises(gl.errors.AdapterError, match=named) as caught:
        gl.load_models(random_model("llama", 0), tmp_path, tokenizer=tokenizer)
    assert "again" in str(caught.value)  # the fix: save or download it again
