"""The oracle of the authors' procedure (tests/authors_reference.py), checked on its own terms.

Each test asserts something that must hold of the authors' script whatever grafting-lens does,
and computes the expected value another way: with the models' own Hugging Face forward, with
``inputs_embeds``, or with weights moved by hand. The last section checks that grafting-lens's
library, run end to end under its ``REFERENCE`` semantics, agrees with the oracle (see
docs/concepts/paper-code-library.md).
"""

from __future__ import annotations

import copy
import dataclasses

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
from conftest import FAMILIES, VOCAB_SIZE, make_tokenizer, random_model
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


# ------------------------------------------------------------------------- grafting-lens, REFERENCE
# The library's own API end to end (examples -> TestSet -> run_experiment under REFERENCE:
# tokenization, configurations -> masks, graft, scoring) against the oracle. Only the
# configurations are written here, in the library's language; what they mean is the preset's.

EXAMPLE = gl.worlds.data.Example(
    relation_id=0,
    prompt_name="test",
    text=TEXT,
    target=" " + TARGET,
    spans={"first_entity": (0, len(ENTITY))},
)


def test_the_example_matches_the_oracles_prompt():
    assert EXAMPLE.text[slice(*EXAMPLE.spans["first_entity"])] == SPANS["first_actor"]


_MODEL_SETS: dict = {}


def library_models(family, tied, n_layers=None, sources=2):
    """The oracle's models, and a model set of copies, with the family's tokenizer."""
    key = (family, tied, n_layers, sources)
    if key not in _MODEL_SETS:
        models = list(model_pair(family, tied, n_layers))
        if sources == 3:
            models.append(random_model(family, 12, tied=tied, n_layers=n_layers))
        copies = (copy.deepcopy(m) for m in models)  # load_models wraps HF models in place
        _MODEL_SETS[key] = (models, gl.load_models(*copies, tokenizer=code_tokenizer(family)))
    return _MODEL_SETS[key]


def run_library(models, configs, semantics, registry="position"):
    """``run_experiment`` on the one example; every token's probability comes back
    (``top_k`` = the vocabulary), rows in ``configs`` order."""
    return gl.study.run_experiment(
        models,
        gl.study.TestSet([EXAMPLE]),
        configs,
        registry=registry,
        semantics=semantics,
        top_k=VOCAB_SIZE,
        progress=False,
    )


def library_probs(row) -> torch.Tensor:
    probs = torch.zeros(VOCAB_SIZE)
    probs[torch.tensor(row.topk_ids)] = torch.tensor(row.topk_probs)
    return probs


def assert_agrees(row, oracle, what):
    # topk_probs are rounded to six decimals, well inside the tolerance.
    gap = (library_probs(row) - oracle.probs).abs().max().item()
    assert gap <= PROB_TOLERANCE, (what, gap)
    assert row.target_id == oracle.target_id, what
    assert abs(row.target_prob - oracle.probability) <= PROB_TOLERANCE, what
    assert row.target_rank == oracle.rank, (what, row.target_rank, oracle.rank)
    assert row.semantics == gl.study.as_semantics(row.semantics).label


def test_reference_tokenizes_as_the_code(case):
    family, tied = case[:2]
    _, models = library_models(family, tied)
    batch = gl.study.TestSet([EXAMPLE]).batch(models, gl.REFERENCE)
    oracle = nothing_grafted(case)
    assert batch.tokens[0].tolist() == oracle.input_ids
    assert int(batch.target_ids[0]) == oracle.target_id
    entity = gl.engine.positions.select_positions("FE", batch.spans, batch.attention_mask)
    patches = token_patches(position_config("FE"), oracle.input_ids, case[4], SPANS, 3)
    assert entity[0].nonzero().flatten().tolist() == sorted(patches)


@pytest.mark.parametrize("lm_head", ["never", "always"])
def test_reference_equals_the_oracle_on_position_configs(case, lm_head):
    family, tied = case[:2]
    (base, donor), models = library_models(family, tied)
    semantics = dataclasses.replace(gl.REFERENCE, lm_head=lm_head)
    table = run_library(models, list(POSITION_CONFIGS), semantics)
    _, _, _, _, tokenizer = case
    for name, (_, row) in zip(POSITION_CONFIGS, table.iterrows()):
        assert row.config == name
        config = position_config(name, patch_lm_head=lm_head)
        oracle = authors_run(base, donor, tokenizer, TEXT, TARGET, config, spans=SPANS)
        assert_agrees(row, oracle, (name, lm_head))


# The code's component sets, and the same in the library's words (FFN-up without the gate
# is a semantics switch: the released configuration files are unknown on that point).
COMPONENT_SETS = {
    "q": ("q", {}),
    "o": ("O", {}),
    "o+mlp_up+mlp_down": ("O+FFN-up+FFN-down", {"ffn_up_gate": False}),
    "o+gate+mlp_up+mlp_down": ("O+FFN", {}),
    "all": ("all", {}),
}
LAYER_RANGES = {  # the code's names -> the library's
    "all": "all",
    "first_quarter": "first_quarter",
    "second_quarter": "second_quarter",
    "third_quarter": "third_quarter",
    "fourth_quarter": "last_quarter",
    ("third_quarter", "fourth_quarter"): "last_half",  # the sweep's "last half"
}


@pytest.mark.parametrize(
    ("family", "depth"), [("llama", 16), ("gemma", 18), ("gpt2", 18), ("neox", 16)]
)
def test_reference_equals_the_oracle_on_component_grafts_over_the_codes_ranges(family, depth):
    tied = family != "neox"
    (base, donor), models = library_models(family, tied, depth)
    tokenizer = code_tokenizer(family)
    # Every set over the last quarter, and O+FFN over every range: each mapping and range once.
    cases = [(code, "fourth_quarter", "never") for code in COMPONENT_SETS]
    cases += [("o+gate+mlp_up+mlp_down", r, "never") for r in LAYER_RANGES if r != "fourth_quarter"]
    cases.append(("all", "all", "always"))
    for code, layers, lm_head in cases:
        components, changes = COMPONENT_SETS[code]
        semantics = dataclasses.replace(gl.REFERENCE, lm_head=lm_head, **changes)
        config = gl.study.GraftConfig(
            f"{components}@{LAYER_RANGES[layers]}",
            (gl.study.Graft("LT", components, LAYER_RANGES[layers]),),
        )
        ((_, row),) = run_library(models, [config], semantics).iterrows()
        code_layers = list(layers) if isinstance(layers, tuple) else layers
        oracle = authors_run(
            base,
            donor,
            tokenizer,
            TEXT,
            TARGET,
            component_config(code, code_layers, patch_lm_head=lm_head),
            spans=SPANS,
        )
        assert_agrees(row, oracle, (code, layers, lm_head))


def test_the_component_registry_under_reference_is_the_codes_o_ffn_over_its_ranges():
    (base, donor), models = library_models("gemma", True, 18)
    tokenizer = code_tokenizer("gemma")
    names = [f"O+FFN@{library}" for library in LAYER_RANGES.values()]
    table = run_library(models, names, gl.REFERENCE, registry="component")
    for (code, _), (_, row) in zip(LAYER_RANGES.items(), table.iterrows()):
        code_layers = list(code) if isinstance(code, tuple) else code
        config = component_config("o+gate+mlp_up+mlp_down", code_layers)
        oracle = authors_run(base, donor, tokenizer, TEXT, TARGET, config, spans=SPANS)
        assert_agrees(row, oracle, code)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("reading", ["all", "last_half"])
def test_reference_equals_the_oracle_on_the_hybrid(family, reading):
    tied = family != "neox"
    (pretrained, task, relation), models = library_models(family, tied, 6, sources=3)
    hybrid = build_hybrid(task, relation)
    tokenizer = code_tokenizer(family)
    semantics = dataclasses.replace(gl.REFERENCE, hybrid_last_token_layers=reading)
    choices = {"LT": None, "LT+FE:ATTN+O": "ATTN+O", "LT+FE:FFN": "FFN", "LT+FE:ALL": "all"}
    table = run_library(models, list(choices), semantics, registry="hybrid")
    code_layers = "all" if reading == "all" else ["third_quarter", "fourth_quarter"]
    for (name, first_entity), (_, row) in zip(choices.items(), table.iterrows()):
        config = hybrid_config(first_entity, last_token_layers=code_layers)
        oracle = authors_run(
            pretrained, task, tokenizer, TEXT, TARGET, config, spans=SPANS, hybrid=hybrid
        )
        assert_agrees(row, oracle, (name, reading))


def test_reference_equals_the_oracle_on_the_hybrid_at_18_layers_with_the_donor_head():
    """18 layers: the code's hybrid split (n // 2 = 9) is not its last half (8..17)."""
    (pretrained, task, relation), models = library_models("gemma", True, 18, sources=3)
    hybrid = build_hybrid(task, relation)
    tokenizer = code_tokenizer("gemma")
    semantics = dataclasses.replace(gl.REFERENCE, lm_head="always")
    ((_, row),) = run_library(models, ["LT+FE:O+FFN"], semantics, registry="hybrid").iterrows()
    config = hybrid_config(
        "O+FFN", last_token_layers=["third_quarter", "fourth_quarter"], patch_lm_head="always"
    )
    oracle = authors_run(
        pretrained, task, tokenizer, TEXT, TARGET, config, spans=SPANS, hybrid=hybrid
    )
    assert_agrees(row, oracle, "hybrid at 18 layers")


def test_clean_differs_from_the_oracle_where_the_code_does():
    """The check above could not pass by accident: the library's clean reading of the same
    configurations moves the tied LT row (base unembedding, final norm grafted, a BOS)."""
    (base, donor), models = library_models("gpt2", True)
    tokenizer = code_tokenizer("gpt2")
    ((_, row),) = run_library(models, ["LT"], gl.CLEAN).iterrows()
    oracle = authors_run(base, donor, tokenizer, TEXT, TARGET, position_config("LT"), spans=SPANS)
    assert (library_probs(row) - oracle.probs).abs().max().item() > 0.01
