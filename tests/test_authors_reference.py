"""The oracle of the authors' procedure (tests/authors_reference.py), checked on its own terms.

Each test asserts something that must hold of the authors' script whatever grafting-lens does,
and computes the expected value another way: with the models' own Hugging Face forward, with
``inputs_embeds``, or with weights moved by hand. The last section checks that grafting-lens's
engine, told what the script does through a hand-built mask, agrees with the oracle: the plan
for the "reference" preset (see docs/concepts/paper-code-library.md once it exists).
"""

from __future__ import annotations

import copy

import pytest
import torch
from authors_reference import (
    EVERY_TARGET,
    HYBRID_TARGETS,
    POSITION_CONFIGS,
    AuthorsConfig,
    Patch,
    authors_run,
    build_hybrid,
    component_config,
    hybrid_config,
    hybrid_layers,
    layer_groups,
    layout_of,
    position_config,
    resolve_layers,
    token_patches,
)
from conftest import FAMILIES, make_tokenizer, random_model
from tokenizers import processors

import grafting_lens as gl

TEXT = "Hugh Grant starred in a"
ENTITY = "Hugh Grant"
TARGET = "movie"  # " movie" is one token of the tiny vocabulary
SPANS = {"first_actor": ENTITY}
LOGIT_TOLERANCE = 1e-4  # token-by-token vs full pass: float32 rounding of logits of a few units
PROB_TOLERANCE = 1e-5

FAMILY_TIES = [(family, tied) for family in FAMILIES for tied in (True, False)]
FUSED_QKV = {"gpt2", "neox"}
FINAL_NORM = {
    "gpt2": "transformer.ln_f",
    "neox": "gpt_neox.final_layer_norm",
    "llama": "model.norm",
    "gemma": "model.norm",
}


def code_tokenizer(family: str):
    """The tiny tokenizer, adding a BOS by itself where the family's real tokenizer does."""
    tokenizer = make_tokenizer()
    if family in ("llama", "gemma"):
        bos = tokenizer.bos_token
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokenizer.bos_token_id)],
        )
    return tokenizer


_PAIRS: dict[tuple, tuple] = {}


def model_pair(family: str, tied: bool, n_layers: int | None = None):
    """Distinct random base and donor of one family (built once per session)."""
    key = (family, tied, n_layers)
    if key not in _PAIRS:
        _PAIRS[key] = tuple(
            random_model(family, seed, tied=tied, n_layers=n_layers) for seed in (10, 11)
        )
    return _PAIRS[key]


@pytest.fixture(
    params=FAMILY_TIES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in FAMILY_TIES]
)
def case(request):
    family, tied = request.param
    base, donor = model_pair(family, tied)
    return family, tied, base, donor, code_tokenizer(family)


def ids_of(tokenizer) -> torch.Tensor:
    return tokenizer(TEXT, return_tensors="pt")["input_ids"]


def run(case, config, **kwargs):
    _, _, base, donor, tokenizer = case
    return authors_run(base, donor, tokenizer, TEXT, TARGET, config, spans=SPANS, **kwargs)


def nothing_grafted(case):
    return run(case, AuthorsConfig("nothing"))


# ------------------------------------------------------------------------- the models' own forward


def test_token_by_token_run_with_nothing_grafted_equals_the_full_forward(case):
    _, _, base, _, tokenizer = case
    result = nothing_grafted(case)
    with torch.no_grad():
        full = base(ids_of(tokenizer)).logits[0, -1]
    assert (result.logits - full).abs().max() <= LOGIT_TOLERANCE


def test_pre_and_sft_are_the_pretrained_and_finetuned_forward(case):
    _, _, base, donor, tokenizer = case
    with torch.no_grad():
        pre, sft = (model(ids_of(tokenizer)).logits[0, -1] for model in (base, donor))
    assert torch.equal(run(case, position_config("PRE")).logits, pre)
    assert torch.equal(run(case, position_config("SFT")).logits, sft)
    # patch_lm_head does not touch the no_patching baselines.
    assert torch.equal(run(case, position_config("PRE", patch_lm_head="always")).logits, pre)


def test_target_probability_and_rank(case):
    _, _, _, donor, tokenizer = case
    result = run(case, position_config("SFT"))
    assert tokenizer.decode([result.target_id]) == " " + TARGET
    with torch.no_grad():
        probs = torch.softmax(donor(ids_of(tokenizer)).logits[0, -1], dim=-1)
    assert result.probability == probs[result.target_id].item()
    # Rank: the target's place in the descending order, ties counted in its favour.
    ordered = torch.sort(probs, descending=True).values
    assert result.rank == int((ordered == probs[result.target_id]).nonzero()[0])
    assert result.top_ids == torch.topk(probs, 20).indices.tolist()


def test_bos_is_what_the_tokenizer_adds(case):
    family, _, _, _, tokenizer = case
    result = nothing_grafted(case)
    has_bos = family in ("llama", "gemma")
    assert (result.input_ids[0] == tokenizer.bos_token_id) == has_bos
    patches = token_patches(position_config("FE"), result.input_ids, tokenizer, SPANS, 3)
    entity = tokenizer.encode(ENTITY, add_special_tokens=False)
    assert sorted(patches) == list(range(int(has_bos), int(has_bos) + len(entity)))


# ------------------------------------------------------------------------- what is grafted


def test_every_target_everywhere_is_the_donor_with_the_base_final_norm(case):
    """Never the final norm or GPT-2's position embedding; the unembedding only through a tie."""
    family, tied, base, donor, tokenizer = case
    expected = copy.deepcopy(donor)
    with torch.no_grad():
        paths = [FINAL_NORM[family]] + (["transformer.wpe"] if family == "gpt2" else [])
        if not tied:
            paths.append(layout_of(base).lm_head)
        for path in paths:
            expected.get_submodule(path).load_state_dict(base.get_submodule(path).state_dict())
        wanted = expected(ids_of(tokenizer)).logits[0, -1]
        donor_logits = donor(ids_of(tokenizer)).logits[0, -1]
    everything = AuthorsConfig("all", (Patch("other", EVERY_TARGET, "all"),))
    result = run(case, everything)
    assert (result.logits - wanted).abs().max() <= LOGIT_TOLERANCE
    assert (result.logits - donor_logits).abs().max() > 0.1  # the final norm is the base's


def test_every_target_everywhere_with_the_donor_head_is_the_donor_when_final_norms_agree(case):
    family, _, base, donor, tokenizer = case
    donor = copy.deepcopy(donor)
    with torch.no_grad():
        for path in [FINAL_NORM[family]] + (["transformer.wpe"] if family == "gpt2" else []):
            donor.get_submodule(path).load_state_dict(base.get_submodule(path).state_dict())
        wanted = donor(ids_of(tokenizer)).logits[0, -1]
    everything = AuthorsConfig(
        "all", (Patch("other", EVERY_TARGET, "all"),), patch_lm_head="always"
    )
    result = authors_run(base, donor, tokenizer, TEXT, TARGET, everything)
    assert (result.logits - wanted).abs().max() <= LOGIT_TOLERANCE


def test_grafted_embeddings_decode_through_the_donor_unembedding_on_tied_models(case):
    """The last token read through the donor's embedding; on a tied model also decoded by it."""
    _, tied, base, donor, tokenizer = case
    ids = ids_of(tokenizer)
    with torch.no_grad():
        embedded = base.get_input_embeddings()(ids)
        embedded[:, -1] = donor.get_input_embeddings()(ids[:, -1:])[:, 0]
        hidden = base(inputs_embeds=embedded, output_hidden_states=True).hidden_states[-1][0, -1]
        unembedding = (donor if tied else base).get_output_embeddings().weight
        other = (base if tied else donor).get_output_embeddings().weight
    result = run(case, AuthorsConfig("LT embeddings", (Patch(-1, {"embeddings"}, "all"),)))
    assert (result.logits - hidden @ unembedding.T).abs().max() <= LOGIT_TOLERANCE
    assert (result.logits - hidden @ other.T).abs().max() > 0.1


def test_q_loads_fused_qkv_and_k_v_gate_do_nothing_on_gpt2_and_neox(case):
    family = case[0]
    none = nothing_grafted(case).logits

    def at_last(*targets):
        return run(case, AuthorsConfig("c", (Patch(-1, set(targets), "all"),))).logits

    q, qkv = at_last("q"), at_last("q", "k", "v")
    if family in FUSED_QKV:
        assert torch.equal(q, qkv)
        for target in ("k", "v", "gate"):
            assert torch.equal(at_last(target), none)
    else:
        assert (q - qkv).abs().max() > 1e-3
        for target in ("k", "v", "gate"):
            assert (at_last(target) - none).abs().max() > 1e-3
    assert (q - none).abs().max() > 1e-3


def test_a_patch_without_layers_loads_nothing_not_even_embeddings(case):
    none = nothing_grafted(case).logits
    for layers in (None, []):
        config = AuthorsConfig("e", (Patch(-1, {"embeddings"}, layers),))
        assert torch.equal(run(case, config).logits, none)
    grafted = run(case, AuthorsConfig("e", (Patch(-1, {"embeddings"}, [0]),))).logits
    assert (grafted - none).abs().max() > 1e-3


def test_patch_lm_head_last_token_is_never_and_always_uses_the_donor_head(case):
    _, _, base, donor, tokenizer = case
    lt = position_config("LT")
    never = run(case, lt).logits
    last_token = run(case, position_config("LT", patch_lm_head="last_token")).logits
    assert torch.equal(never, last_token)
    with torch.no_grad():
        hidden = base(ids_of(tokenizer), output_hidden_states=True).hidden_states[-1][0, -1]
        wanted = hidden @ donor.get_output_embeddings().weight.T
    empty_always = run(case, AuthorsConfig("nothing", patch_lm_head="always")).logits
    assert (empty_always - wanted).abs().max() <= LOGIT_TOLERANCE


# ------------------------------------------------------------------------- positions and layers


def test_one_patch_per_token_later_places_replace_earlier_ones():
    tokenizer = code_tokenizer("llama")  # with a BOS
    ids = tokenizer(TEXT)["input_ids"]
    config = AuthorsConfig(
        "mixed",
        (
            Patch(-1, {"mlp_up"}, "all"),
            Patch("first_actor", {"q"}, 1),
            Patch("other", {"o"}, range(2)),
        ),
    )
    patches = token_patches(config, ids, tokenizer, SPANS, 3)
    entity = range(1, 1 + len(tokenizer.encode(ENTITY, add_special_tokens=False)))
    assert sorted(patches) == list(range(len(ids)))
    for index, patch in patches.items():
        if index == len(ids) - 1:
            assert (patch.targets, patch.layers) == ({"mlp_up"}, [0, 1, 2])
        elif index in entity:
            assert (patch.targets, patch.layers) == ({"q"}, [1])
        else:
            assert (patch.targets, patch.layers) == ({"o"}, [0, 1])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_position_configs_graft_the_papers_tokens(family):
    tokenizer = code_tokenizer(family)
    ids = tokenizer(TEXT)["input_ids"]
    start = int(family == "llama")
    fe = set(range(start, start + len(tokenizer.encode(ENTITY, add_special_tokens=False))))
    lt = {len(ids) - 1}
    every = set(range(len(ids)))
    expected = {
        "FE": fe, "LT": lt, "FE+LT": fe | lt, "(FE+LT)^C": every - fe - lt,
        "FE^C": every - fe, "LT^C": every - lt,
    }  # fmt: skip
    for name, tokens in expected.items():
        patches = token_patches(position_config(name), ids, tokenizer, SPANS, 3)
        grafted = {index for index, patch in patches.items() if patch.active}
        assert grafted == tokens, name
        assert all(patches[i].targets == EVERY_TARGET for i in grafted)


def test_the_codes_layer_arithmetic():
    assert layer_groups(16) == {
        "all": list(range(16)),
        "first_quarter": [0, 1, 2, 3],
        "second_quarter": [4, 5, 6, 7],
        "third_quarter": [8, 9, 10, 11],
        "fourth_quarter": [12, 13, 14, 15],
    }
    groups = layer_groups(18)
    assert [groups[q] for q in ("first_quarter", "second_quarter", "third_quarter")] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
    ]  # fmt: skip
    assert groups["fourth_quarter"] == list(range(12, 18))
    assert hybrid_layers(16) == list(range(8, 16))
    assert hybrid_layers(18) == list(range(9, 18))
    # Two quarters named together: the union, which for 18 layers is not the hybrid's half.
    assert resolve_layers(["third_quarter", "fourth_quarter"], 18) == list(range(8, 18))
    with pytest.raises(ValueError, match="Unknown layer group"):
        resolve_layers("last_half", 16)


# ------------------------------------------------------------------------- the hybrid


def test_hybrid_model_takes_o_and_mlp_up_down_from_the_relation_model_in_the_last_half():
    task, relation = model_pair("llama", True, n_layers=5)
    hybrid = build_hybrid(task, relation)
    layout = layout_of(task)
    for layer in range(5):
        for target, path in layout.components.items():
            module = f"{layout.layers}.{layer}.{path}"
            source = relation if (layer >= 2 and target in HYBRID_TARGETS) else task
            for name, value in hybrid.get_submodule(module).state_dict().items():
                assert torch.equal(value, source.get_submodule(module).state_dict()[name]), module
    assert torch.equal(hybrid.get_input_embeddings().weight, task.get_input_embeddings().weight)


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_run_takes_the_hybrid_only_at_the_last_token(family):
    pretrained, task = model_pair(family, True)
    relation = random_model(family, 12, tied=True)
    hybrid = build_hybrid(task, relation)
    tokenizer = code_tokenizer(family)

    def go(config, donor, **kwargs):
        return authors_run(
            pretrained, donor, tokenizer, TEXT, TARGET, config, spans=SPANS, **kwargs
        ).logits

    # Only the last token patched: the same as grafting from the hybrid model itself.
    lt_only = hybrid_config(None)
    assert torch.equal(go(lt_only, task, hybrid=hybrid), go(lt_only, hybrid))
    # O+FFN at the first entity come from the task model, not the hybrid: on the first entity
    # the run differs from grafting the hybrid model everywhere.
    fe_o_ffn = hybrid_config("O+FFN")
    assert (go(fe_o_ffn, task, hybrid=hybrid) - go(fe_o_ffn, hybrid)).abs().max() > 1e-3
    # ...while ATTN, which the hybrid model shares with the task model, gives the same either way.
    fe_attn = hybrid_config("ATTN")
    assert torch.equal(go(fe_attn, task, hybrid=hybrid), go(fe_attn, hybrid))


# ------------------------------------------------------------------------- grafting-lens, told the same
# The translation below is the plan for the library's "reference" preset: each of the script's
# targets as grafting-lens components, per family, and the tie as an unembedding graft.


def library_components(target: str, family: str) -> tuple[str, ...]:
    fused = family in FUSED_QKV
    return {
        "embeddings": ("embed",),
        "q": ("q", "k", "v") if fused else ("q",),
        "k": () if fused else ("k",),
        "v": () if fused else ("v",),
        "gate": () if fused else ("mlp_gate",),
        "o": ("o",),
        "mlp_up": ("mlp_in",),
        "mlp_down": ("mlp_out",),
        "ln_1": ("ln1",),
        "ln_2": ("ln2",),
    }[target]


def code_mask(models, family, tied, config, ids, tokenizer, *, donor=1, relation=None):
    """A GraftMask saying what the script does (sources: 0 base, ``donor``, optional ``relation``)."""
    length = len(ids)
    n = models.n_layers
    entries: dict = {}

    def put(component, layer, position, source):
        if (component, layer) not in entries:
            entries[(component, layer)] = torch.zeros((1, length), dtype=torch.long)
        entries[(component, layer)][0, position] = source

    if config.plain == "donor":
        for pair in models.pairs:
            for position in range(length):
                put(*pair, position, donor)
        return gl.GraftMask.from_dict(models, entries, shape=(1, length))
    patches = token_patches(config, ids, tokenizer, SPANS, n)
    for position, patch in patches.items():
        if not patch.active:
            continue
        if "embeddings" in patch.targets:
            put("embed", None, position, donor)
            if tied:  # the tie: this position is decoded through the donor's embedding matrix
                put("unembed", None, position, donor)
        for target in patch.targets - {"embeddings"}:
            for layer in patch.layers:
                source = donor
                last = position == length - 1
                if relation is not None and last and target in HYBRID_TARGETS and layer >= n // 2:
                    source = relation
                for component in library_components(target, family):
                    put(component, layer, position, source)
    if config.patch_lm_head == "always" and config.plain is None:
        put("unembed", None, length - 1, donor)
    return gl.GraftMask.from_dict(models, entries, shape=(1, length))


def library_probs(models, mask, ids):
    with torch.no_grad():
        logits = gl.graft_forward(models, torch.tensor([ids]), mask)[0, -1]
    return torch.softmax(logits.float(), dim=-1)


_MODEL_SETS: dict = {}


def library_models(family, tied, n_layers=None, sources=2):
    key = (family, tied, n_layers, sources)
    if key not in _MODEL_SETS:
        models = list(model_pair(family, tied, n_layers))
        if sources == 3:
            models.append(random_model(family, 12, tied=tied, n_layers=n_layers))
        copies = (copy.deepcopy(m) for m in models)  # load_models wraps HF models in place
        _MODEL_SETS[key] = (models, gl.load_models(*copies, tokenizer=make_tokenizer()))
    return _MODEL_SETS[key]


def assert_engine_agrees(family, tied, configs, n_layers=None):
    (base, donor), models = library_models(family, tied, n_layers)
    tokenizer = code_tokenizer(family)
    for config in configs:
        oracle = authors_run(base, donor, tokenizer, TEXT, TARGET, config, spans=SPANS)
        mask = code_mask(models, family, tied, config, oracle.input_ids, tokenizer)
        gap = (library_probs(models, mask, oracle.input_ids) - oracle.probs).abs().max().item()
        assert gap <= PROB_TOLERANCE, (config.name, gap)


def test_engine_agrees_with_the_oracle_on_position_configs(case):
    family, tied = case[:2]
    configs = [position_config(name) for name in POSITION_CONFIGS]
    configs += [position_config(name, "always") for name in ("FE", "LT", "(FE+LT)^C")]
    assert_engine_agrees(family, tied, configs)


COMPONENT_SETS = ("q", "o", "o+mlp_up+mlp_down", "o+gate+mlp_up+mlp_down", "all")
LAYER_RANGES = (
    "all",
    "first_quarter",
    "second_quarter",
    "third_quarter",
    "fourth_quarter",
    ["third_quarter", "fourth_quarter"],  # the sweep's "last half"
)


@pytest.mark.parametrize(
    ("family", "depth"), [("llama", 16), ("gemma", 18), ("gpt2", 18), ("neox", 16)]
)
def test_engine_agrees_with_the_oracle_on_component_grafts_over_the_codes_ranges(family, depth):
    # Every set over the last quarter, and O+FFN over every range: each mapping and each range once.
    configs = [component_config(s, "fourth_quarter") for s in COMPONENT_SETS]
    configs += [
        component_config("o+gate+mlp_up+mlp_down", r) for r in LAYER_RANGES if r != "fourth_quarter"
    ]
    configs.append(component_config("all", "all", patch_lm_head="always"))
    assert_engine_agrees(family, family != "neox", configs, n_layers=depth)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_agrees_with_the_oracle_on_the_hybrid(family):
    tied = family != "neox"
    (pretrained, task, relation), models = library_models(family, tied, 6, sources=3)
    hybrid = build_hybrid(task, relation)
    tokenizer = code_tokenizer(family)
    for first_entity in (None, "ATTN+O", "FFN", "all"):
        for lt_layers in ("all", ["third_quarter", "fourth_quarter"]):
            config = hybrid_config(first_entity, last_token_layers=lt_layers)
            oracle = authors_run(
                pretrained, task, tokenizer, TEXT, TARGET, config, spans=SPANS, hybrid=hybrid
            )
            mask = code_mask(models, family, tied, config, oracle.input_ids, tokenizer, relation=2)
            gap = (library_probs(models, mask, oracle.input_ids) - oracle.probs).abs().max().item()
            assert gap <= PROB_TOLERANCE, (config.name, lt_layers, gap)
