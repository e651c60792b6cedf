"""Every bridged architecture, end to end, with tiny random models built from fresh configs.

For each architecture of the matrix: the model loads although ``from_config`` leaves
``config.architectures`` empty; every checkpoint parameter belongs to a component; a
graft of every component equals the donor's own Hugging Face forward pass (and an
empty mask the base's), and so do the ends of the relaxed graft attribution differentiates; the single grafted pass equals the token-by-token procedure
on random masks over every component and on the README's graft; and no donor weight
that changes the donor's output is ignored by the every-component graft. The
comparison with the HF model's own forward is what proves coverage: an oracle built
on the component registry could not see a weight the registry misses.

``python tests/models/test_architectures.py`` rewrites the supported-architectures table in
``docs/architectures.md`` from this matrix; a test checks that the page is current.
"""

from __future__ import annotations

import copy
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import VOCAB_SIZE, make_tokenizer, tiny_config  # noqa: E402

import grafting_lens as gl  # noqa: E402
from grafting_lens.models.components import checkpoint_parameters  # noqa: E402

TOLERANCE = 1e-4
PAGE = Path(__file__).parents[2] / "docs" / "architectures.md"

MATRIX: dict[str, dict] = {
    # id: settings beyond conftest's TINY. The id's part before ":" is the model_type.
    "gpt2": {},
    "gpt_neox": dict(rotary_pct=0.5, tie_word_embeddings=False),
    "llama": {},
    "gemma": dict(num_key_value_heads=1),
    "gemma2": {},
    "gemma3_text": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "mixtral": {},
    "olmo": {},
    "olmo2": {},
    "olmoe": {},
    "phi": {},
    "phi3": {},
    "gptj": dict(rotary_dim=4),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32),
    "falcon": {},
    # TransformerLens 4.3 splits the new layout's fused QKV for one key/value head only.
    "falcon:new_decoder_architecture": dict(new_decoder_architecture=True, num_kv_heads=1),
    "stablelm": dict(num_key_value_heads=4),
    "stablelm:qk_layernorm": dict(num_key_value_heads=4, qk_layernorm=True),
    "qwen2_moe": {},
    "qwen2_moe:dense_and_sparse_layers": dict(mlp_only_layers=[0]),
    "granite": {},
    "cohere": dict(logit_scale=1.0),
    "cohere:qk_norm": dict(logit_scale=1.0, use_qk_norm=True),
    # Further architectures TransformerLens bridges and transformers builds.
    "arcee": {},
    "bloom": {},
    "codegen": dict(rotary_dim=4, n_ctx=64),
    "cohere2": dict(logit_scale=1.0),
    "ernie4_5": {},
    "ernie4_5_moe": {},
    "exaone4": {},
    "flex_olmo": {},
    "glm": {},
    "glm4": {},
    "glm4_moe": {},
    "gpt_bigcode": {},
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),
    "granitemoe": {},
    "hunyuan_v1_dense": {},
    "jais2": {},
    "laguna": {},
    "ministral3": {},
    "mpt": {},
    "nemotron": {},
    "olmo3": {},
    "phimoe": {},
    "qwen3_moe": {},
    "seed_oss": {},
    "smollm3": {},
    "starcoder2": {},
    "vaultgemma": {},
    "xglm": {},
}


def matrix_config(model_id: str):
    """The tiny config of a matrix entry."""
    return tiny_config(model_id.split(":")[0], **MATRIX[model_id])


def random_model(model_id: str, seed: int):
    """A fresh model of the entry with large random weights (norms near their identity)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(matrix_config(model_id)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                # Scales start at one (or zero where stored as an offset from one).
                identity = 1.0 if bool((parameter == 1).all()) else 0.0
                parameter.copy_(identity + 0.3 * torch.randn_like(parameter))
            else:
                parameter.copy_(0.25 * torch.randn_like(parameter))
    return model


@dataclass
class Loaded:
    """A model set of one matrix entry, with what the HF models computed before loading."""

    model_id: str
    models: gl.ModelSet
    tokens: torch.Tensor
    hf_logits: list[torch.Tensor]
    pristine_donor: torch.nn.Module
    architectures_before: object
    warned: list[str]


_LOADED: dict[str, Loaded] = {}
_TOKENIZER = None


def load(model_id: str) -> Loaded:
    """Build three fresh models of the entry and load them (once per session)."""
    global _TOKENIZER
    if model_id in _LOADED:
        return _LOADED[model_id]
    if _TOKENIZER is None:
        _TOKENIZER = make_tokenizer()
    sources = [random_model(model_id, seed) for seed in (0, 1, 2)]
    tokens = torch.randint(1, VOCAB_SIZE, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = [model(tokens).logits for model in sources]
    pristine = copy.deepcopy(sources[1])
    before = sources[0].config.architectures
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gl.errors.UnverifiedArchitectureWarning)
        models = gl.load_models(*sources, tokenizer=_TOKENIZER)
    warned = [
        str(w.message)
        for w in caught
        if issubclass(w.category, gl.errors.UnverifiedArchitectureWarning)
    ]
    _LOADED[model_id] = Loaded(model_id, models, tokens, hf_logits, pristine, before, warned)
    return _LOADED[model_id]


@pytest.fixture(scope="module", params=list(MATRIX))
def loaded(request) -> Loaded:
    return load(request.param)


def test_loads_from_a_fresh_config_with_every_parameter_covered(loaded):
    models = loaded.models
    assert loaded.architectures_before is None  # what from_config gives
    assert models.architecture in gl.models.architectures.VERIFIED_ARCHITECTURES
    assert not loaded.warned
    coverage = models.coverage()
    assert coverage.covered.all(), coverage[~coverage.covered].to_string()
    hf_names = {name for name, _ in loaded.pristine_donor.named_parameters()}
    assert set(coverage.parameter) == hf_names and coverage.parameter.is_unique
    for names in coverage.component:
        assert set(names.split("+")) <= set(gl.models.components.COMPONENTS)


def test_every_component_graft_is_the_donor_and_an_empty_mask_the_base(loaded):
    models, tokens = loaded.models, loaded.tokens
    for source in (1, 2):
        full = gl.GraftMask.build(models, tokens, components="all", source=source)
        grafted = gl.graft_forward(models, tokens, full, logits="all")
        assert (grafted - loaded.hf_logits[source]).abs().max() <= TOLERANCE
    empty = gl.GraftMask.from_dict(models, {}, shape=tuple(tokens.shape))
    assert (
        gl.graft_forward(models, tokens, empty, logits="all") - loaded.hf_logits[0]
    ).abs().max() <= TOLERANCE
    # The comparisons mean something only if the checkpoints' logits differ a lot.
    assert (loaded.hf_logits[0] - loaded.hf_logits[1]).abs().max() > 0.1


def test_single_pass_equals_the_token_by_token_oracle(loaded):
    models, tokens = loaded.models, loaded.tokens
    generator = torch.Generator().manual_seed(1)
    masks = [
        gl.GraftMask.from_dict(
            models,
            {
                pair: torch.randint(0, n_sources, tokens.shape, generator=generator)
                for pair in models.pairs
            },
        )
        for n_sources in (2, 3)
    ]
    masks.append(
        gl.GraftMask.build(models, tokens, positions="last", layers="last_half", components="o+ffn")
    )
    for mask in masks:
        fast = gl.graft_forward(models, tokens, mask, logits="all")
        slow = gl.graft_forward_reference(models, tokens, mask)
        assert (fast - slow).abs().max() <= TOLERANCE


def test_relaxed_weights_of_zero_and_one_are_the_base_and_the_donor(loaded):
    """Every component relaxed (routers included): the ends are the HF models' own logits,
    and in between the metric has a gradient with respect to the weights."""
    models, tokens = loaded.models, loaded.tokens
    for value, source in ((0.0, 0), (1.0, 1)):
        weights = {pair: torch.full(tokens.shape, value) for pair in models.pairs}
        with torch.no_grad(), gl.engine.relaxation.relaxing(models, weights) as model:
            relaxed = model(tokens)
        assert (relaxed - loaded.hf_logits[source]).abs().max() <= TOLERANCE
    weights = {pair: torch.full(tokens.shape, 0.5, requires_grad=True) for pair in models.pairs}
    with gl.engine.relaxation.relaxing(models, weights) as model:
        value = model(tokens)[:, -1, 3].sum()
    gradients = torch.autograd.grad(value, list(weights.values()), allow_unused=True)
    found = [gradient for gradient in gradients if gradient is not None]
    assert all(bool(torch.isfinite(gradient).all()) for gradient in found)
    assert sum(bool(gradient.abs().sum() > 0) for gradient in found) >= len(weights) // 2


@torch.no_grad()
def test_no_donor_weight_that_matters_is_ignored(loaded):
    """Perturb each donor weight (and the base's, which must not leak) one at a time.

    The bridge reads weights live, except fused matrices it splits into copies when
    the model loads (NeoX's query_key_value); those are perturbed before a fresh load.
    """
    models = loaded.models
    tokens = loaded.tokens[:1, :4]
    mask = gl.GraftMask.build(models, tokens, components="all", source=1)
    coverage = models.coverage()
    split = set(coverage.parameter[coverage.component.str.contains("+", regex=False)])
    split -= set(coverage.parameter[coverage.component == "embed+unembed"])
    donor = dict(checkpoint_parameters(models[1].original_model))
    base = dict(checkpoint_parameters(models.base.original_model))
    pristine = dict(loaded.pristine_donor.named_parameters())
    unperturbed = loaded.pristine_donor(tokens).logits
    generator = torch.Generator().manual_seed(2)
    mattered = 0
    for name, parameter in pristine.items():
        if name in split:
            continue
        delta = 0.5 * torch.randn(parameter.shape, generator=generator)
        leak = 0.5 * torch.randn(parameter.shape, generator=generator)
        changes = ((parameter, delta), (donor[name], delta), (base[name], leak))
        for target, change in changes:
            target.add_(change)
        try:
            expected = loaded.pristine_donor(tokens).logits
            grafted = gl.graft_forward(models, tokens, mask, logits="all")
        finally:
            for target, change in changes:
                target.sub_(change)
        assert (grafted - expected).abs().max() <= TOLERANCE, name
        mattered += bool((expected - unperturbed).abs().max() > 1e-3)
    # Nearly every weight changes the output; the check above saw each one do so.
    assert mattered >= len(pristine) - len(split) - 2
    if split:
        perturbed = copy.deepcopy(loaded.pristine_donor)
        for name, parameter in perturbed.named_parameters():
            if name in split:
                parameter.add_(0.5 * torch.randn(parameter.shape, generator=generator))
        expected = perturbed(tokens).logits
        assert (expected - unperturbed).abs().max() > 1e-3
        fresh = gl.load_models(random_model(loaded.model_id, 0), perturbed, tokenizer=_TOKENIZER)
        grafted = gl.graft_forward(
            fresh, tokens, gl.GraftMask.build(fresh, tokens, components="all"), logits="all"
        )
        assert (grafted - expected).abs().max() <= TOLERANCE


def test_verified_architectures_are_the_matrix():
    expected = {}
    for model_id in MATRIX:
        config = matrix_config(model_id)
        expected[AutoModelForCausalLM.from_config(config).__class__.__name__] = config.model_type
    spelled = {name.lower(): name for name in gl.models.architectures.VERIFIED_ARCHITECTURES}
    assert {spelled.get(name.lower(), name): kind for name, kind in expected.items()} == dict(
        gl.models.architectures.VERIFIED_ARCHITECTURES
    )


def architectures_table() -> str:
    """The supported-architectures table: one row per architecture, its components."""
    rows: dict[str, tuple[str, set[str], list[str]]] = {}
    for model_id in MATRIX:
        models = load(model_id).models
        kind, components, variants = rows.setdefault(
            models.architecture, (model_id.split(":")[0], set(), [])
        )
        components.update(models.components)
        if ":" in model_id:
            variants.append(model_id.split(":")[1].replace("_", " "))
    lines = [
        "| architecture | `model_type` | components | also tested with |",
        "|---|---|---|---|",
    ]
    for architecture in sorted(rows, key=str.lower):
        kind, components, variants = rows[architecture]
        names = ", ".join(f"`{c}`" for c in gl.models.components.COMPONENTS if c in components)
        lines.append(f"| `{architecture}` | `{kind}` | {names} | {'; '.join(variants)} |")
    return "\n".join(lines) + "\n"


_BEGIN = "<!-- begin table: written by `python tests/models/test_architectures.py` -->\n"
_END = "<!-- end table -->\n"


def _page_with(table: str) -> str:
    text = PAGE.read_text()
    pattern = re.compile(re.escape(_BEGIN) + ".*?" + re.escape(_END), re.S)
    return pattern.sub(lambda _: _BEGIN + table + _END, text)


def test_supported_architectures_page_is_current():
    assert PAGE.read_text() == _page_with(architectures_table()), (
        "docs/architectures.md is out of date: run `python tests/models/test_architectures.py`."
    )


if __name__ == "__main__":
    PAGE.write_text(_page_with(architectures_table()))
    print(f"wrote {PAGE}")
