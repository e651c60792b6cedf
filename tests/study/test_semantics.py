"""Semantics: each switch between the paper's released code and the library's clean reading.

The whole of REFERENCE is checked against an independent oracle of the authors' code in
test_authors_reference.py. Here each switch is flipped on its own and the test says what
it must change, and that nothing else moves.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from conftest import make_tokenizer, random_model

import grafting_lens as gl
from grafting_lens.analysis.batch import as_batch, tokenize_examples
from grafting_lens.core.errors import ComponentError, ExperimentError, RunError
from grafting_lens.study import (
    CLEAN,
    DEFAULT_SEMANTICS,
    HYBRID,
    HYBRID_CONFIGS,
    REFERENCE,
    RELATION,
    TASK,
    ExperimentSpec,
    Graft,
    GraftConfig,
    Part,
    RunOptions,
    Semantics,
    TestSet,
    as_semantics,
    config_masks,
    get_configs,
    make_test_sets,
    resolve_components,
    run_experiment,
    run_named_experiment,
    run_position_grafting,
)
from grafting_lens.study.semantics import SEMANTICS_CHOICES
from grafting_lens.study.stacking import resolve_configs
from grafting_lens.worlds import data

_SETS: dict = {}


def models_of(family: str, tied: bool, n_layers: int | None = None, sources: int = 2):
    """A model set of random models of one family (built once per session)."""
    key = (family, tied, n_layers, sources)
    if key not in _SETS:
        built = [
            random_model(family, seed, tied=tied, n_layers=n_layers) for seed in range(sources)
        ]
        _SETS[key] = gl.load_models(*built, tokenizer=make_tokenizer())
    return _SETS[key]


def resolved(models, config, semantics, registry="position"):
    """The checked grafts of one configuration: ``{(positions, source): (components, layers)}``."""
    (chosen,) = get_configs([config], registry, semantics=semantics)
    (grafts,) = resolve_configs([chosen], "test", models, semantics=semantics)
    table: dict = {}
    for graft in grafts:
        key = (graft.positions, graft.source)
        components, layers = table.get(key, ((), ()))
        table[key] = (
            tuple(dict.fromkeys(components + graft.components)),
            tuple(sorted(set(layers) | set(graft.layers))),
        )
    return table


def every_switch():
    for name, values in SEMANTICS_CHOICES.items():
        for value in values:
            yield name, value


# ------------------------------------------------------------------------- naming


def test_the_presets_and_their_labels():
    assert REFERENCE.label == "reference" and CLEAN.label == "clean"
    # One default: a Semantics with no switch set is the paper's code, as everything that
    # takes a semantics and is given none runs.
    assert Semantics() == REFERENCE and gl.study.DEFAULT_SEMANTICS is REFERENCE
    assert Semantics() != CLEAN
    assert dataclasses.replace(REFERENCE, unembed="base").label == "reference+unembed=base"
    assert dataclasses.replace(CLEAN, final_norm=False).label == "clean+final_norm=false"
    assert REFERENCE.differences(CLEAN)["unembed"] == "follow_embed"
    assert set(REFERENCE.differences(CLEAN)) == set(SEMANTICS_CHOICES) - {
        "lm_head",
        "embed",
        "ffn_up_gate",
        "hybrid_last_token_layers",
    }
    assert gl.REFERENCE is REFERENCE and gl.study.Semantics is Semantics


@pytest.mark.parametrize(("name", "value"), list(every_switch()))
def test_every_single_switch_reads_back_from_its_label(name, value):
    for preset in (REFERENCE, CLEAN):
        changed = dataclasses.replace(preset, **{name: value})
        assert as_semantics(changed.label) == changed
        assert changed.describe()[name] == value


def test_labels_that_do_not_read_are_refused():
    assert as_semantics("reference+unembed=follow-embed+final-norm=yes") == dataclasses.replace(
        REFERENCE, final_norm=True
    )
    for label, message in [
        ("referense", "Unknown semantics 'referense'. Did you mean 'reference'"),
        ("clean+unembed", "Cannot read 'unembed'"),
        ("clean+colour=red", "Cannot read 'colour=red'"),
        ("clean+unembed=nowhere", "Semantics.unembed must be one of"),
        ("clean+final_norm=maybe", "Semantics.final_norm must be True or False.*got 'maybe'"),
    ]:
        with pytest.raises(ExperimentError, match=message):
            as_semantics(label)
    with pytest.raises(ExperimentError, match="Semantics.final_norm must be True or False"):
        Semantics(final_norm="no")
    with pytest.raises(TypeError, match="semantics must be a Semantics or its label"):
        as_semantics(3)


# ------------------------------------------------------------------------- what a graft takes


@pytest.mark.parametrize(("family", "tied"), [("gpt2", True), ("gpt2", False), ("llama", True)])
def test_unembed_follows_a_grafted_embedding_only_where_the_two_are_tied(family, tied):
    models = models_of(family, tied)
    follow = resolved(models, "FE^C", REFERENCE)
    base = resolved(models, "FE^C", dataclasses.replace(REFERENCE, unembed="base"))
    donor = resolved(models, "FE^C", dataclasses.replace(REFERENCE, unembed="donor"))
    components = follow[("FE^C", 1)][0]
    assert ("unembed" in components) == tied
    assert "unembed" not in base[("FE^C", 1)][0] and "unembed" in donor[("FE^C", 1)][0]
    # Nothing else moves.
    assert set(components) - {"unembed"} == set(base[("FE^C", 1)][0])
    # Without a grafted embedding there is nothing to follow.
    no_embed = dataclasses.replace(REFERENCE, embed=False)
    assert "unembed" not in resolved(models, "FE^C", no_embed)[("FE^C", 1)][0]


def test_lm_head_always_reads_the_last_token_through_the_donor_but_not_in_plain_baselines():
    models = models_of("llama", False)
    always = dataclasses.replace(REFERENCE, lm_head="always")
    for name in ("FE", "LT", "(FE+LT)^C"):
        expected = resolved(models, name, REFERENCE)
        components, layers = expected.get(("LT", 1), ((), ()))
        assert "unembed" not in components  # llama untied: no tie to follow
        expected[("LT", 1)] = ((*components, "unembed"), layers)
        assert resolved(models, name, always) == expected, name
    assert resolved(models, "PRE", always) == {}
    assert ("LT", 1) not in resolved(models, "SFT", always)  # the donor itself
    grafted_sft = dataclasses.replace(always, sft="grafted")
    assert resolved(models, "SFT", grafted_sft)[("LT", 1)] == (("unembed",), ())


@pytest.mark.parametrize(
    ("switch", "component", "family"),
    [
        ("final_norm", "ln_final", "llama"),
        ("pos_embed", "pos_embed", "gpt2"),
        ("embed", "embed", "gpt2"),
    ],
)
def test_group_switches_take_one_component_in_or_out_of_all(switch, component, family):
    models = models_of(family, False)
    for preset in (REFERENCE, CLEAN):
        on = resolve_components(
            "all", models, semantics=dataclasses.replace(preset, **{switch: True})
        )
        off = resolve_components(
            "all", models, semantics=dataclasses.replace(preset, **{switch: False})
        )
        assert component in on and set(on) - set(off) == {component}
        # A component named on its own is taken whatever the switch says.
        named = dataclasses.replace(preset, **{switch: False})
        assert component in resolve_components(f"o+{component}", models, semantics=named)


def test_clean_all_is_every_component_but_the_unembedding_and_reference_the_codes_targets():
    models = models_of("gpt2", True)
    assert set(resolve_components("all", models, semantics=CLEAN)) == set(models.components) - {
        "unembed"
    }
    assert set(resolve_components("all", models, semantics=REFERENCE)) == set(models.components) - {
        "unembed",
        "ln_final",
        "pos_embed",
    }


@pytest.mark.parametrize("family", ["gpt2", "neox", "llama"])
def test_fused_qkv_as_code_makes_q_the_fused_matrix_and_k_v_nothing(family):
    models = models_of(family, False)
    code = dataclasses.replace(CLEAN, fused_qkv="as_code")
    fused = family in ("gpt2", "neox")
    assert resolve_components("q", models, semantics=code) == (("q", "k", "v") if fused else ("q",))
    assert resolve_components("q", models, semantics=CLEAN) == ("q",)
    assert resolve_components("o+k", models, semantics=code) == (("o",) if fused else ("k", "o"))
    assert resolve_components("ATTN", models, semantics=code) == ("q", "k", "v")
    if fused:
        with pytest.raises(ComponentError, match="k and v without q are nothing"):
            resolve_components("k", models, semantics=code)


def test_ffn_up_takes_the_gate_unless_told_not_to():
    models = models_of("llama", False)
    assert resolve_components("FFN-up", models, semantics=REFERENCE) == ("mlp_gate", "mlp_in")
    no_gate = dataclasses.replace(REFERENCE, ffn_up_gate=False)
    assert resolve_components("FFN-up", models, semantics=no_gate) == ("mlp_in",)
    assert resolve_components("FFN", models, semantics=no_gate) == ("mlp_gate", "mlp_in", "mlp_out")


def test_layer_arithmetic_changes_named_ranges_only_where_the_depth_is_not_a_multiple_of_four():
    for depth, differs in ((16, False), (18, True)):
        models = models_of("gemma", True, n_layers=depth)
        for name in ("O@third_quarter", "O@last_half"):
            code = resolved(models, name, REFERENCE, registry="component")[("LT", 1)][1]
            fractions = dataclasses.replace(REFERENCE, layers="fractions")
            clean = resolved(models, name, fractions, registry="component")[("LT", 1)][1]
            assert (code != clean) == differs, (depth, name)
    models = models_of("gemma", True, n_layers=18)
    assert resolved(models, "O@third_quarter", REFERENCE, "component")[("LT", 1)][1] == (
        8,
        9,
        10,
        11,
    )
    assert resolved(models, "O@last_half", REFERENCE, "component")[("LT", 1)][1] == tuple(
        range(8, 18)
    )


def test_sft_donor_is_the_donor_itself_and_grafted_a_graft_like_any_other():
    models = models_of("gpt2", True)
    whole = resolved(models, "SFT", REFERENCE)
    assert whole == {("ALL", 1): (models.components, tuple(range(models.n_layers)))}
    grafted = resolved(models, "SFT", dataclasses.replace(REFERENCE, sft="grafted"))
    assert set(grafted[("ALL", 1)][0]) == set(
        resolve_components("all", models, semantics=REFERENCE)
    ) | {
        "unembed"  # tied: the unembedding follows the embedding
    }
    assert "ln_final" not in grafted[("ALL", 1)][0]
    # Every whole-donor baseline of the registries, and only those.
    two = models_of("llama", False)
    for registry, name in (("component", "DONOR"), ("component", "O@all")):
        table = resolved(two, name, REFERENCE, registry)
        assert ("unembed" in next(iter(table.values()))[0]) == (name == "DONOR")


@pytest.mark.parametrize("reading", ["last_half", "all"])
def test_the_codes_hybrid_takes_relation_o_and_ffn_up_down_from_layer_n_over_2(reading):
    models = models_of("llama", False, n_layers=6, sources=3)
    semantics = dataclasses.replace(REFERENCE, hybrid_last_token_layers=reading)
    (config,) = get_configs(["LT+FE:O+FFN"], "hybrid", semantics=semantics)
    assert config.grafts[0] == Graft("LT", "ATTN+O+FFN", reading, HYBRID)
    table = resolved(models, "LT+FE:O+FFN", semantics, registry="hybrid")
    lt_layers = (2, 3, 4, 5) if reading == "last_half" else tuple(range(6))  # 6 // 4 = 1
    grafts = resolve_configs([config], "test", models, semantics=semantics)[0]
    by_source = {(g.positions, g.source, g.components): g.layers for g in grafts}
    assert by_source[("LT", TASK, ("q", "k", "v", "mlp_gate"))] == lt_layers
    assert by_source[("LT", RELATION, ("o", "mlp_in", "mlp_out"))] == (3, 4, 5)  # 6 // 2 = 3
    below = tuple(layer for layer in lt_layers if layer < 3)
    assert by_source[("LT", TASK, ("o", "mlp_in", "mlp_out"))] == below
    assert table[("FE", TASK)] == (("o", "mlp_gate", "mlp_in", "mlp_out"), tuple(range(6)))
    # The clean hybrid: task ATTN over all layers, relation O+FFN (gate included) over the last half.
    clean = resolved(models, "LT", dataclasses.replace(REFERENCE, hybrid="clean"), "hybrid")
    assert clean[("LT", TASK)] == (("q", "k", "v"), tuple(range(6)))
    assert clean[("LT", RELATION)] == (("o", "mlp_gate", "mlp_in", "mlp_out"), (2, 3, 4, 5))


@pytest.mark.parametrize("registry", ["hybrid", "position", HYBRID_CONFIGS])
def test_hybrid_configurations_given_as_objects_run_as_the_semantics_says(registry):
    """Objects and names agree: under the code's hybrid, the library's LT object is the code's."""
    objects = get_configs(list(HYBRID_CONFIGS.values()), registry, semantics=REFERENCE)
    by_name = get_configs(list(HYBRID_CONFIGS), "hybrid", semantics=REFERENCE)
    assert objects == by_name
    assert objects[HYBRID_CONFIGS_NAMES.index("LT")].grafts[0].source == HYBRID
    # Under the library's hybrid, the objects are themselves.
    clean = get_configs(list(HYBRID_CONFIGS.values()), registry, semantics=CLEAN)
    assert clean == list(HYBRID_CONFIGS.values())
    # A configuration of the caller's own is taken as it is under any semantics.
    own = GraftConfig("mine", (Graft("LT", "O", "all", RELATION),))
    assert get_configs([own], registry, semantics=REFERENCE) == [own]


HYBRID_CONFIGS_NAMES = list(HYBRID_CONFIGS)


def test_a_hybrid_graft_needs_three_sources():
    with pytest.raises(gl.errors.GraftMaskError, match="the hybrid graft needs"):
        resolved(models_of("llama", False), "LT", REFERENCE, registry="hybrid")


# ------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def relations():
    return data.make_relations("fake_movies_real_actors", n=4, seed=0)


def test_every_row_records_its_semantics_and_a_run_directory_keeps_to_one(relations, tmp_path):
    models = models_of("llama", False)
    test_sets = make_test_sets(relations, prompts=("headline",), templates="library")
    table = run_experiment(
        models, test_sets, ["PRE", "LT"], out=tmp_path, semantics=CLEAN, progress=False
    )
    assert set(table.semantics) == {"clean"}
    assert {"text", "target_id", "target_prob", "target_rank"} <= set(table.columns)
    with pytest.raises(RunError):
        run_experiment(
            models,
            test_sets,
            ["PRE", "LT"],
            out=tmp_path,
            semantics=dataclasses.replace(CLEAN, unembed="donor"),
            progress=False,
        )


def test_the_paper_experiments_default_to_reference_and_word_the_prompts_as_the_code(relations):
    models = models_of("llama", False)
    table = run_named_experiment("demo", models, relations, progress=False)
    assert set(table.semantics) == {"reference"}
    assert all(" stars in " in text for text in table.text)
    clean = run_named_experiment("demo", models, relations, semantics="clean", progress=False)
    assert set(clean.semantics) == {"clean"} and all(" starred in " in t for t in clean.text)


def test_test_sets_worded_for_another_semantics_are_refused(relations):
    models = models_of("llama", False)
    code = make_test_sets(relations, prompts=("headline",), templates="code")
    with pytest.raises(ExperimentError, match="templates='library'"):
        run_experiment(models, code, ["PRE"], semantics=CLEAN, progress=False)
    run_experiment(models, code, ["PRE"], semantics=REFERENCE, progress=False)
    # Examples of one's own have no wording to check.
    own = TestSet(data.make_examples(relations, "headline"))
    run_experiment(models, own, ["PRE"], semantics=REFERENCE, progress=False)


def test_a_semantics_with_a_dtype_refuses_models_of_another(relations):
    models = gl.load_models(
        *(random_model("llama", seed) for seed in (0, 1)),
        tokenizer=make_tokenizer(),
        dtype=torch.bfloat16,
    )
    test_sets = make_test_sets(relations, prompts=("headline",), templates="code")
    with pytest.raises(ExperimentError, match=r"runs models in float32.*bfloat16"):
        run_experiment(models, test_sets, ["PRE"], semantics=REFERENCE, progress=False)
    checkpoint = dataclasses.replace(REFERENCE, dtype="checkpoint")
    run_experiment(models, test_sets, ["PRE"], semantics=checkpoint, progress=False)


def test_bos_target_and_spans_reach_the_tokenizer(relations):
    models = models_of("llama", False)
    examples = data.make_examples(relations, "headline", templates="code")
    for semantics in (REFERENCE, dataclasses.replace(REFERENCE, bos="always"), CLEAN):
        batch = TestSet(examples).batch(models, semantics)
        expected = tokenize_examples(examples, models.tokenizer, **semantics.tokenization())
        assert torch.equal(batch.tokens, expected.tokens)
        assert torch.equal(batch.spans["first_entity"], expected.spans["first_entity"])
    # The tiny tokenizer adds no BOS of its own, so the code's prompts start on the name.
    assert TestSet(examples).batch(models, REFERENCE).spans["first_entity"][:, 0].all()


# ------------------------------------------------------------------------- the old switches


def test_the_removed_group_switches_are_refused_not_ignored(relations):
    models = models_of("gpt2", True)
    with pytest.raises(TypeError):
        RunOptions(include_unembed=True)
    with pytest.raises(TypeError):
        resolve_components("all", models, include_unembed=True)
    spans = {"first_entity": torch.tensor([[False, True, True, False]])}
    spans["last_token"] = torch.tensor([[False, False, False, True]])
    with pytest.raises(TypeError):
        config_masks(
            models, ["FE"], spans, torch.ones(1, 4, dtype=torch.long), include_embeddings=False
        )


# ------------------------------------------------------------------------- one default
# Every entry point that takes a semantics, given none, does what semantics=REFERENCE does.
# On a tied GPT-2 REFERENCE and CLEAN graft different weights (the unembedding follows a
# grafted embedding, no final norm, the fused QKV), tokenize differently and word the
# prompts differently, so a CLEAN default left anywhere fails here.


def test_one_default_for_what_configurations_mean_and_how_prompts_are_worded(relations):
    models = models_of("gpt2", True)
    assert DEFAULT_SEMANTICS is REFERENCE and Semantics() == REFERENCE
    # make_test_sets: the default semantics' wording, the code's.
    (default_set,) = make_test_sets(relations, prompts=("headline",))
    (code_set,) = make_test_sets(relations, prompts=("headline",), templates="code")
    (library_set,) = make_test_sets(relations, prompts=("headline",), templates="library")
    assert default_set.templates == REFERENCE.prompts == "code"
    assert default_set.examples == code_set.examples != library_set.examples
    # TestSet.batch: tokenized by the default semantics' rules.
    assert default_set.batch(models).rules == REFERENCE.tokenization() != CLEAN.tokenization()
    assert torch.equal(
        default_set.batch(models).tokens, default_set.batch(models, REFERENCE).tokens
    )
    # resolve_components, get_configs, resolve_configs, config_masks.
    components = {
        s: resolve_components("all", models, semantics=s) for s in (None, REFERENCE, CLEAN)
    }
    assert components[None] == components[REFERENCE] != components[CLEAN]
    hybrid = {s: get_configs(["LT"], "hybrid", semantics=s) for s in (None, REFERENCE, CLEAN)}
    assert hybrid[None] == hybrid[REFERENCE] != hybrid[CLEAN]
    configs = get_configs(["FE", "SFT"], "position")
    grafts = {
        s: resolve_configs(configs, "gpt2", models, semantics=s) for s in (None, REFERENCE, CLEAN)
    }
    assert grafts[None] == grafts[REFERENCE] != grafts[CLEAN]
    batch = default_set.batch(models)
    masks = {
        s: config_masks(models, configs, batch.spans, batch.attention_mask, semantics=s)
        for s in (None, REFERENCE, CLEAN)
    }
    assert masks[None] == masks[REFERENCE] != masks[CLEAN]
    # RunOptions and a newly registered experiment.
    assert RunOptions().fingerprint() == RunOptions(semantics=REFERENCE).fingerprint()
    assert RunOptions().fingerprint() != RunOptions(semantics=CLEAN).fingerprint()
    spec = ExperimentSpec(
        "mine",
        "Mine",
        ("base", "sft"),
        donors={"sft": ("--donor", "the donor")},
        parts=(Part("all", ("headline",), ("PRE", "LT")),),
    )
    assert as_semantics(spec.semantics) == REFERENCE


def test_every_runner_given_no_semantics_writes_the_rows_of_an_explicit_reference(relations):
    models = models_of("gpt2", True)
    test_sets = make_test_sets(relations, prompts=("headline",))
    configs = ["PRE", "FE", "LT", "SFT"]
    examples = data.make_examples(relations, "headline", templates="code")
    batch = tokenize_examples(examples, models.tokenizer, **REFERENCE.tokenization())
    runners = {
        "run_experiment": lambda **semantics: run_experiment(
            models, test_sets, configs, progress=False, **semantics
        ),
        "RunOptions": lambda **semantics: run_experiment(
            models, test_sets, configs, options=RunOptions(progress=False, **semantics)
        ),
        "run_position_grafting": lambda **semantics: run_position_grafting(
            models, batch, configs, progress=False, **semantics
        ),
        "gl.run_position_grafting": lambda **semantics: gl.run_position_grafting(
            models, batch, configs, progress=False, **semantics
        ),
        "run_named_experiment": lambda **semantics: run_named_experiment(
            "demo", models, relations, progress=False, **semantics
        ),
    }
    for name, run in runners.items():
        default = run()
        assert set(default.semantics) == {"reference"}, name
        pd.testing.assert_frame_equal(default, run(semantics=REFERENCE), obj=name)
    # The rows differ from the clean reading's: the column is not all that changes.
    clean = run_experiment(
        models,
        make_test_sets(relations, prompts=("headline",), templates="library"),
        configs,
        semantics=CLEAN,
        progress=False,
    )
    reference = runners["run_experiment"]()
    assert not reference.text.equals(clean.text)
    assert not reference.target_prob.equals(clean.target_prob)


def test_a_batch_tokenized_under_other_rules_than_the_semantics_is_refused(relations):
    models = models_of("llama", False)
    examples = data.make_examples(relations, "headline", templates="code")
    default_rules = tokenize_examples(examples, models.tokenizer)
    assert default_rules.rules == REFERENCE.tokenization()  # the one default
    # The rules survive the checks and the slicing a runner does.
    assert as_batch(default_rules, models).rules == REFERENCE.tokenization()
    assert default_rules.rows([0, 1]).rules == REFERENCE.tokenization()
    library_rules = tokenize_examples(examples, models.tokenizer, **CLEAN.tokenization())
    with pytest.raises(
        ExperimentError,
        match=r"tokenized with bos='always', target='in_context', spans='characters', but the "
        r"semantics 'reference' tokenizes with bos='tokenizer'.*semantics.tokenization\(\)",
    ):
        run_position_grafting(models, library_rules, ["PRE"], progress=False)
    run_position_grafting(models, library_rules, ["PRE"], semantics="clean", progress=False)
    # Under the semantics' own rules, or built by hand (no rules recorded): taken as it is.
    table = run_position_grafting(models, default_rules, ["PRE"], progress=False)
    assert set(table.semantics) == {"reference"}
    by_hand = dataclasses.replace(library_rules, rules=None)
    run_position_grafting(models, by_hand, ["PRE"], progress=False)
    with pytest.raises(gl.GraftingLensError, match="rules are tokenize_examples' bos"):
        as_batch(dataclasses.replace(library_rules, rules={"bos": "always"}), models)
