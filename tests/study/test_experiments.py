"""The experiments runner: configurations as data, one batched runner, resumable runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch
from conftest import VOCAB_SIZE, make_tokenizer, random_model
from transformers import AutoModelForCausalLM, LlamaConfig

import grafting_lens as gl
from grafting_lens import study
from grafting_lens import study as experiments
from grafting_lens.analysis import scoring
from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.analysis.metrics import last_token_logits, target_probability, target_rank
from grafting_lens.core.errors import ComponentError, GraftingLensError, GraftMaskError, RunError
from grafting_lens.engine.positions import select_positions
from grafting_lens.study import (
    COMPONENT_CONFIGS,
    POSITION_CONFIGS,
    Graft,
    GraftConfig,
    TestSet,
    as_semantics,
    cli,
    config_masks,
    make_test_sets,
    run_experiment,
)
from grafting_lens.study.configs import MOVIE_CONFIGS
from grafting_lens.worlds import data


def _llama(seed: int, n_layers: int = 4):
    """A 4-layer Llama (so every quarter of the layers is one layer) with large random weights."""
    config = LlamaConfig(
        num_hidden_layers=n_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_size=16,
        intermediate_size=32,
        max_position_embeddings=64,
        vocab_size=VOCAB_SIZE,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.5
            parameter.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn_like(parameter))
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def three(tokenizer):
    """Pretrained, task and relation stand-ins: three 4-layer Llamas."""
    return gl.load_models(
        *(_llama(seed) for seed in (0, 1, 2)),
        tokenizer=tokenizer,
        names=["pre", "task", "relation"],
    )


@pytest.fixture(scope="module")
def two(three):
    return gl.ModelSet(three[:2], ["pre", "sft"])


@pytest.fixture(scope="module")
def relations():
    return data.make_relations("fake_movies_real_actors", n=5, seed=0)


def _hand_batch():
    # Row 0: BOS, FE FE, REL, M, LT (6 real tokens). Row 1: BOS, FE, REL, M(2) ... 5 real + 1 pad.
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])

    def span(rows):
        return torch.tensor(rows, dtype=torch.bool)

    spans = {
        "first_entity": span([[0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]]),
        "relation": span([[0, 0, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0]]),
        "movie": span([[0, 0, 0, 0, 1, 0], [0, 0, 0, 1, 1, 0]]),
        "last_token": span([[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 0]]),
    }
    return spans, attention_mask


def _rows(mask_rows):
    return [[bool(v) for v in row] for row in mask_rows]


# ------------------------------------------------------------------ span expressions


def test_span_expressions_select_the_positions_they_name():
    spans, attention_mask = _hand_batch()
    expected = {
        "FE": [[0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]],
        "LT": [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 0]],
        "M": [[0, 0, 0, 0, 1, 0], [0, 0, 0, 1, 1, 0]],
        "ALL": [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]],
        "FE+LT": [[0, 1, 1, 0, 0, 1], [0, 1, 0, 0, 1, 0]],
        "(FE+LT)^C": [[1, 0, 0, 1, 1, 0], [1, 0, 1, 1, 0, 0]],
        "FE^C": [[1, 0, 0, 1, 1, 1], [1, 0, 1, 1, 1, 0]],
        "FE+M+LT": [[0, 1, 1, 0, 1, 1], [0, 1, 0, 1, 1, 0]],
        "REL + FE^C^C": [[0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0]],
    }
    for expression, rows in expected.items():
        assert select_positions(expression, spans, attention_mask).tolist() == _rows(rows), (
            expression
        )
    # LT follows from the padding when a hand-made batch does not mark it.
    without_lt = {k: v for k, v in spans.items() if k != "last_token"}
    assert torch.equal(select_positions("LT", without_lt, attention_mask), spans["last_token"])
    assert gl.engine.positions.span_names("(FE+LT)^C+M") == {"first_entity", "last_token", "movie"}


def test_bad_span_expressions_say_what_is_wrong():
    spans, attention_mask = _hand_batch()
    with pytest.raises(GraftMaskError, match="Unbalanced"):
        Graft("(FE+LT")
    with pytest.raises(GraftMaskError, match="Cannot read"):
        Graft("FE-LT")
    with pytest.raises(GraftingLensError, match="'movie' span.*MOVIE_PROMPTS"):
        select_positions("M", {"first_entity": spans["first_entity"]}, attention_mask)


# ------------------------------------------------------------- registries build masks


def _cell(mask, key, row=0, position=None):
    values = mask[key]
    return values[row].tolist() if position is None else int(values[row, position])


def test_position_registry_grafts_every_component_but_the_unembedding(two):
    spans, attention_mask = _hand_batch()
    lt_row0 = [0, 0, 0, 0, 0, 1]
    for name, config in {**POSITION_CONFIGS, **MOVIE_CONFIGS}.items():
        mask = config_masks(two, [name], spans, attention_mask, semantics="clean")
        expected = [[0] * 6, [0] * 6] if name == "PRE" else None
        if expected is None:
            positions = "ALL" if name == "SFT" else name
            expected = select_positions(positions, spans, attention_mask).long().tolist()
        for key in [("embed", None), ("q", 0), ("mlp_gate", 3), ("ln_final", None)]:
            assert mask[key].tolist() == expected, (name, key)
        assert ("unembed", None) not in mask
    # Hand-checked cells: LT is position 5 in row 0, 4 in row 1 (row 1 has one pad).
    mask = config_masks(two, ["LT"], spans, attention_mask, semantics="clean")
    assert _cell(mask, ("o", 2)) == lt_row0 and _cell(mask, ("o", 2), row=1) == [0, 0, 0, 0, 1, 0]
    # The semantics' switches: the donor's unembedding, the base's embeddings.
    semantics = "clean+unembed=donor+embed=false+pos_embed=false"
    mask = config_masks(two, ["FE"], spans, attention_mask, semantics=semantics)
    assert _cell(mask, ("unembed", None)) == [0, 1, 1, 0, 0, 0]
    assert ("embed", None) not in mask


def test_component_registry_grafts_its_matrices_at_the_last_token_over_its_layers(two):
    spans, attention_mask = _hand_batch()
    lt = [0, 0, 0, 0, 0, 1]
    every = {c: l for c, l in two.pairs}
    claims = {
        "O+FFN@last_half": ({"o", "mlp_in", "mlp_gate", "mlp_out"}, {2, 3}),
        "ATTN+O+FFN@all": ({"q", "k", "v", "o", "mlp_in", "mlp_gate", "mlp_out"}, {0, 1, 2, 3}),
        "ATTN+O@first_quarter": ({"q", "k", "v", "o"}, {0}),
        "ATTN+FFN@second_quarter": ({"q", "k", "v", "mlp_in", "mlp_gate", "mlp_out"}, {1}),
        "O@third_quarter": ({"o"}, {2}),
        "FFN@last_quarter": ({"mlp_in", "mlp_gate", "mlp_out"}, {3}),
        "O+FFN-up@all": ({"o", "mlp_in", "mlp_gate"}, {0, 1, 2, 3}),
        "O+FFN-down@all": ({"o", "mlp_out"}, {0, 1, 2, 3}),
    }
    assert every  # the model set has pairs to check
    for name, (components, layers) in claims.items():
        mask = config_masks(
            two, [name], spans, attention_mask, registry="component", semantics="clean"
        )
        grafted = {(c, l) for c, l in mask.keys()}
        assert grafted == {(c, l) for c in components for l in layers}, name
        for key in grafted:
            assert _cell(mask, key) == lt and _cell(mask, key, row=1) == [0, 0, 0, 0, 1, 0], (
                name,
                key,
            )
    clean = {"registry": "component", "semantics": "clean"}
    assert not config_masks(two, ["BASE"], spans, attention_mask, **clean).keys()
    donor = config_masks(two, ["DONOR"], spans, attention_mask, **clean)
    assert _cell(donor, ("embed", None)) == [1] * 6 and ("unembed", None) not in donor
    assert len(COMPONENT_CONFIGS) == 2 + 8 * 6


def test_hybrid_registry_mixes_three_sources(three):
    spans, attention_mask = _hand_batch()
    fe, lt = [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1]

    def at(cells, source):
        return [source * v for v in cells]

    clean = {"registry": "hybrid", "semantics": "clean"}  # the library's hybrid
    mask = config_masks(three, ["LT"], spans, attention_mask, **clean)
    for layer in range(4):
        assert _cell(mask, ("q", layer)) == at(lt, 1)  # task ATTN at LT, all layers
    assert _cell(mask, ("o", 2)) == at(lt, 2) and _cell(mask, ("mlp_out", 3)) == at(lt, 2)
    assert ("o", 1) not in mask and ("mlp_in", 0) not in mask  # relation O+FFN: last half only
    assert ("embed", None) not in mask
    variants = {
        "LT+FE:ATTN": {"q", "k", "v"},
        "LT+FE:ATTN+O": {"q", "k", "v", "o"},
        "LT+FE:FFN": {"mlp_in", "mlp_gate", "mlp_out"},
        "LT+FE:O+FFN": {"o", "mlp_in", "mlp_gate", "mlp_out"},
        "LT+FE:ALL": {"ln1", "q", "k", "v", "o", "ln2", "mlp_in", "mlp_gate", "mlp_out"},
    }
    for name, components in variants.items():
        mask = config_masks(three, [name], spans, attention_mask, **clean)
        for component in components:
            # Layer 0: the task model's weights at FE; ATTN also at LT (the core hybrid).
            expected = fe if component not in ("q", "k", "v") else [a + b for a, b in zip(fe, lt)]
            assert _cell(mask, (component, 0)) == at(expected, 1), (name, component)
        assert ("ln1", 0) in mask if name == "LT+FE:ALL" else ("ln1", 0) not in mask
        # O+FFN in the last half: task weights at FE, relation weights at LT.
        if "o" in components:
            assert _cell(mask, ("o", 3)) == [a + b for a, b in zip(at(fe, 1), at(lt, 2))]
    full = config_masks(three, ["LT+FE:ALL"], spans, attention_mask, **clean)
    assert _cell(full, ("embed", None)) == at(fe, 1)
    relation = config_masks(three, ["RELATION"], spans, attention_mask, **clean)
    assert _cell(relation, ("q", 0)) == [2] * 6


def test_ffn_up_takes_the_gate_only_where_there_is_one(tokenizer):
    gpt2 = gl.load_models(random_model("gpt2", 0), random_model("gpt2", 1), tokenizer=tokenizer)
    assert experiments.resolve_components("O+FFN-up", gpt2) == ("o", "mlp_in")
    assert experiments.resolve_components("FFN-down", gpt2) == ("mlp_out",)
    assert "mlp_gate" not in experiments.resolve_components("FFN", gpt2)
    with pytest.raises(ComponentError, match="no 'mlp_gate'"):
        experiments.resolve_components("o+mlp_gate", gpt2)


# ------------------------------------------------------------------------- the runner


def _expected(models, tokenized, mask_for):
    """Ranks and probabilities of a configuration computed the long way, one plain mask."""
    mask = mask_for(tokenized)
    logits = gl.graft_forward(
        models, tokenized.tokens, mask, attention_mask=tokenized.attention_mask, logits="all"
    )
    final = last_token_logits(logits, tokenized.attention_mask)
    return (
        target_rank(final, tokenized.target_ids).tolist(),
        target_probability(final, tokenized.target_ids).tolist(),
    )


def test_runner_scores_each_configuration_like_a_plain_graft(three, relations):
    tokenized = tokenize_examples(
        data.make_examples(relations, prompt="qa"),
        three.tokenizer,
        **experiments.CLEAN.tokenization(),
    )
    assert tokenized.attention_mask.sum(1).unique().numel() > 1  # padded rows
    results = run_experiment(
        three,
        TestSet(tokenized),
        ["PRE", "LT", "LT+FE:ATTN+O"],
        registry="hybrid",
        batch_size=2,
        semantics="clean",  # the library's hybrid, on a batch tokenized its way
        progress=False,
    )
    last = tokenized.spans["last_token"]
    entity = tokenized.spans["first_entity"]

    def build(positions, components, layers, source):
        return lambda t: gl.GraftMask.build(
            three,
            t.tokens,
            positions=positions,
            components=components,
            layers=layers,
            source=source,
            attention_mask=t.attention_mask,
        )

    def hybrid(with_entity):
        def make(t):
            parts = [build(last, "attn", "all", 1)(t), build(last, "o+ffn", "last_half", 2)(t)]
            if with_entity:
                parts.append(build(entity, "attn+o", "all", 1)(t))
            return gl.GraftMask.union(*parts)

        return make

    oracles = {
        "PRE": lambda t: gl.GraftMask.from_dict(three, {}, shape=tuple(t.tokens.shape)),
        "LT": hybrid(False),
        "LT+FE:ATTN+O": hybrid(True),
    }
    for name, mask_for in oracles.items():
        rows = results[results.config == name].sort_values("example")
        ranks, probabilities = _expected(three, tokenized, mask_for)
        assert rows.target_rank.tolist() == ranks, name
        assert rows.target_prob.to_numpy() == pytest.approx(probabilities, rel=1e-4, abs=1e-7)
    assert results.first_entity.tolist()[: len(tokenized)] == ["-"] * len(tokenized)
    # The hybrid grafts change the prediction.
    by_config = results.groupby("config", sort=False).target_prob.apply(tuple)
    assert len(set(by_config)) == 3


def test_runner_equals_running_each_configuration_alone(two, relations):
    test_sets = make_test_sets(relations, prompts=("headline", "qa"), dataset="fmra", seed=0)
    names = ["BASE", "DONOR", "O+FFN@last_half", "ATTN+O@all", "FFN@last_quarter"]
    together = run_experiment(
        two,
        test_sets,
        names,
        registry="component",
        batch_size=3,
        progress=False,
        seeds={"world": 7},
    )
    assert len(together) == len(names) * 2 * len(relations)
    assert list(together.columns[:8]) == [
        "models",
        "dataset",
        "prompt",
        "direction",
        "example",
        "relation_id",
        "text",
        "config",
    ]
    assert {"component_set", "layer_range", "data_seed", "world_seed"} <= set(together.columns)
    assert set(together.world_seed) == {7} and set(together.data_seed) == {0}
    # Ordered by test set, then configuration (as given), then example.
    assert list(dict.fromkeys(together.prompt)) == ["headline", "qa"]
    assert list(dict.fromkeys(together[together.prompt == "qa"].config)) == names
    for name in names:
        alone = run_experiment(
            two,
            test_sets,
            [name],
            registry="component",
            batch_size=len(relations),
            progress=False,
            seeds={"world": 7},
        )
        rows = together[together.config == name].reset_index(drop=True)
        assert rows.target_rank.tolist() == alone.target_rank.tolist(), name
        assert rows.topk_ids.tolist() == alone.topk_ids.tolist(), name
        assert rows.target_prob.to_numpy() == pytest.approx(
            alone.target_prob.to_numpy(), rel=1e-4, abs=1e-7
        )
    assert together.groupby("config").target_prob.apply(tuple).nunique() == len(names)


def test_runner_keeps_every_configuration_of_a_full_registry_apart(two, relations):
    # The stacked mask combines many graft tensors; it once cached them by id(), and a
    # freed tensor's reused id gave some configurations another one's mask (the last
    # layer's grafts of the component sweep came out identical to BASE).
    test_sets = make_test_sets(relations, prompts=("headline",), dataset="fmra", seed=0)
    names = list(COMPONENT_CONFIGS)
    together = run_experiment(
        two, test_sets, names, registry="component", batch_size=len(relations), progress=False
    )
    for name in names:
        alone = run_experiment(
            two, test_sets, [name], registry="component", batch_size=len(relations), progress=False
        )
        rows = together[together.config == name].reset_index(drop=True)
        assert rows.topk_ids.tolist() == alone.topk_ids.tolist(), name


def test_model_sets_and_test_sets_form_a_grid(two, relations):
    swapped = gl.ModelSet([two[1], two[0]], ["sft", "pre"])
    results = run_experiment(
        {"forward": two, "swapped": swapped},
        make_test_sets(relations[:3], prompts=("headline", "qa"), templates="library"),
        ["PRE", "SFT"],
        semantics="clean+unembed=donor",
        progress=False,
    )
    assert len(results) == 2 * 2 * 2 * 3
    assert list(dict.fromkeys(results.models)) == ["forward", "swapped"]
    # With the unembedding grafted too, SFT of one set is PRE of the other: the donor alone.
    forward = results[(results.models == "forward") & (results.config == "SFT")]
    backward = results[(results.models == "swapped") & (results.config == "PRE")]
    assert forward.target_rank.tolist() == backward.target_rank.tolist()
    assert forward.target_prob.to_numpy() == pytest.approx(
        backward.target_prob.to_numpy(), rel=1e-4
    )


def test_rows_and_figures_say_which_layers_a_range_name_grafted(tokenizer, relations):
    # On 6 layers "last_half" is 3-5 in fractions and 2-5 in the code's n // 4 quarters
    # (a quarter is one layer, the last takes the remainder): the row and the legend say so.
    six = gl.load_models(_llama(0, 6), _llama(1, 6), tokenizer=tokenizer, names=["pre", "sft"])
    configs = ["O+FFN@last_half", "O+FFN@first_quarter", "BASE"]
    for semantics, arithmetic in (("reference", "quarters"), ("clean", "fractions")):
        test_sets = make_test_sets(
            relations[:2], prompts=("headline",), templates=as_semantics(semantics).prompts
        )
        results = run_experiment(
            six, test_sets, configs, registry="component", semantics=semantics, progress=False
        )
        for name, layer_range in (
            ("O+FFN@last_half", "last_half"),
            ("O+FFN@first_quarter", "first_quarter"),
        ):
            expected = gl.resolve_layers(layer_range, 6, arithmetic=arithmetic)
            shown = f"{expected[0]}-{expected[-1]}" if len(expected) > 1 else str(expected[0])
            assert set(results.layers[results.config == name]) == {shown}, (semantics, name)
        assert set(results.layers[results.config == "BASE"]) == {"-"}
        summary = gl.summarize(results, by=study.paper.COMPONENT_SUMMARY)
        heatmap = study.report.component_heatmap(summary, "t")
        shown_half = "2-5" if arithmetic == "quarters" else "3-5"
        assert f"last half ({shown_half})" in list(heatmap.data[0].y)


# --------------------------------------------------------------------- saving, resuming


@pytest.fixture
def count_forwards(monkeypatch):
    """Count the runner's forward passes; make the ``fail_on``-th one raise."""
    calls = {"n": 0, "fail_on": None}
    real = scoring.graft_forward  # the pass the runner asks the score for

    def counted(*args, **kwargs):
        calls["n"] += 1
        if calls["fail_on"] is not None and calls["n"] == calls["fail_on"]:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(scoring, "graft_forward", counted)
    return calls


def test_a_killed_run_resumes_without_recomputing_or_losing_a_row(
    two, relations, tmp_path, count_forwards
):
    test_sets = make_test_sets(relations, prompts=("headline", "qa"), seed=0)
    options = dict(configs=["PRE", "FE", "LT", "FE+LT"], batch_size=2, chunk_size=2, progress=False)
    whole = run_experiment(two, test_sets, **options)
    chunks = 2 * 3  # two test sets of five examples, two per chunk
    assert count_forwards["n"] == chunks

    out = tmp_path / "run"
    count_forwards.update(n=0, fail_on=3)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(two, test_sets, out=out, **options)
    assert len(list((out / "chunks").glob("*.json"))) == 2
    (out / "chunks" / ".m0-t1-c0.json.abc.partial").write_text("half a file")  # a killed write

    count_forwards.update(n=0, fail_on=None)
    resumed = run_experiment(two, test_sets, out=out, **options)
    assert count_forwards["n"] == chunks - 2  # the two saved chunks were read, not recomputed
    pd.testing.assert_frame_equal(resumed, whole)
    assert not list((out / "chunks").glob(".*.partial"))

    count_forwards.update(n=0)
    again = run_experiment(two, test_sets, out=out, **options)
    assert count_forwards["n"] == 0
    pd.testing.assert_frame_equal(again, whole)


def test_an_exception_in_on_chunk_stops_the_run_after_its_chunk_is_saved(
    two, relations, tmp_path, count_forwards
):
    test_sets = make_test_sets(relations, prompts=("headline",))
    seen = []

    def stop_after_two(info):
        seen.append(info)
        if len(seen) == 2:
            raise RuntimeError("stop")

    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="stop"):
        run_experiment(
            two,
            test_sets,
            ["PRE", "LT"],
            out=out,
            chunk_size=2,
            progress=False,
            on_chunk=stop_after_two,
        )
    assert [info.chunk_id for info in seen] == ["m0-t0-c0", "m0-t0-c1"] and seen[0].total == 3
    assert all(info.path.is_file() and info.rows == 4 for info in seen)
    count_forwards.update(n=0)
    resumed = run_experiment(two, test_sets, ["PRE", "LT"], out=out, chunk_size=2, progress=False)
    assert count_forwards["n"] == 1 and len(resumed) == 2 * len(relations)


def test_a_directory_holding_a_different_run_is_refused(two, relations, tmp_path, count_forwards):
    test_sets = make_test_sets(relations[:2], prompts=("headline",))
    out = tmp_path / "run"
    run_experiment(two, test_sets, ["PRE", "LT"], out=out, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["spec"]["configs"][1]["name"] == "LT" and manifest["fingerprint"]
    count_forwards.update(n=0)
    with pytest.raises(
        RunError, match=r"holds a different run.*configs \(\['PRE', 'LT'\] vs \['PRE', 'FE'\]\)"
    ):
        run_experiment(two, test_sets, ["PRE", "FE"], out=out, progress=False)
    with pytest.raises(RunError, match=r"options \(top_k\)"):
        run_experiment(two, test_sets, ["PRE", "LT"], out=out, top_k=5, progress=False)
    other_models = gl.ModelSet([two[1], two[0]], ["pre", "sft"])  # same names, other weights
    with pytest.raises(RunError, match="differs in models"):
        run_experiment(other_models, test_sets, ["PRE", "LT"], out=out, progress=False)
    assert count_forwards["n"] == 0
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match="not a run directory"):
        run_experiment(two, test_sets, ["PRE"], out=stray, progress=False)
    # Another batch size is the same run: it resumes.
    run_experiment(two, test_sets, ["PRE", "LT"], out=out, batch_size=1, progress=False)
    assert count_forwards["n"] == 0


# ------------------------------------------------------------------------ bad input


def test_bad_input_fails_before_any_forward_pass(
    two, tokenizer, relations, tmp_path, count_forwards
):
    count_forwards["fail_on"] = 1  # any forward pass would raise KeyboardInterrupt
    headline = make_test_sets(relations, prompts=("headline",))
    # What the library's reading refuses, on prompts worded its way.
    library = make_test_sets(relations, prompts=("headline",), templates="library")
    out = tmp_path / "never"
    with pytest.raises(
        GraftingLensError,
        match=r"Unknown component-grafting configuration 'O\+FFN@lats_half'.*"
        r"Did you mean 'O\+FFN@last_half'.*Known: BASE, DONOR",
    ):
        run_experiment(two, headline, ["BASE", "O+FFN@lats_half"], registry="component", out=out)
    with pytest.raises(
        GraftMaskError, match=r"Configuration 'deep'.*Layer 7 is outside the model, which has 4"
    ):
        run_experiment(two, headline, [GraftConfig("deep", (Graft("LT", "O", layers=7),))], out=out)
    gpt2 = gl.load_models(random_model("gpt2", 0), random_model("gpt2", 1), tokenizer=tokenizer)
    with pytest.raises(ComponentError, match="'gate'.*GPT2LMHeadModel has no 'mlp_gate'"):
        run_experiment(gpt2, headline, [GraftConfig("gate", (Graft("LT", "mlp_gate"),))], out=out)
    with pytest.raises(
        GraftMaskError, match="'O@third_quarter'.*selects no layer of a 3-layer model"
    ):
        run_experiment(
            gpt2,
            library,
            ["O@last_quarter", "O@third_quarter"],
            registry="component",
            semantics="clean",  # round fractions of the depth
            out=out,
        )
    with pytest.raises(GraftMaskError, match="source 2.*2 sources.*hybrid"):
        run_experiment(two, library, ["LT"], registry="hybrid", semantics="clean", out=out)
    with pytest.raises(GraftingLensError, match="'M' on test set 'custom/headline'.*'movie' span"):
        run_experiment(two, headline, ["M"], out=out)
    three_sources = gl.ModelSet([two[0], two[1], two[0]], ["a", "b", "c"])
    clash = GraftConfig("clash", (Graft("FE+LT", "O", source=1), Graft("LT", "O+FFN", source=2)))
    with pytest.raises(GraftMaskError, match="'clash': grafts 0 and 1 both set 'o'"):
        run_experiment(three_sources, headline, [clash], out=out)
    with pytest.raises(GraftingLensError, match="'custom'/'headline' has no examples"):
        make_test_sets([], prompts=("headline",))
    with pytest.raises(GraftingLensError, match="no examples"):
        TestSet([])
    with pytest.raises(GraftingLensError, match=r"test_sets=\[\] holds nothing"):
        run_experiment(two, [], ["PRE"], out=out)
    with pytest.raises(GraftingLensError, match="No configuration"):
        run_experiment(two, headline, [], out=out)
    with pytest.raises(GraftingLensError, match="listed twice"):
        run_experiment(two, headline, ["PRE", "PRE"], out=out)
    with pytest.raises(GraftingLensError, match="batch_size"):
        run_experiment(two, headline, ["PRE"], batch_size=0, out=out)
    # Rows that could not be told apart: a summary would count each example twice.
    with pytest.raises(GraftingLensError, match=r"Test sets 0 and 1 are both .*/headline'"):
        run_experiment(two, make_test_sets(relations, prompts=("headline", "headline")), ["PRE"])
    with pytest.raises(GraftingLensError, match="Test sets 0 and 1"):
        run_experiment(two, [headline[0], headline[0]], ["PRE"])
    with pytest.raises(GraftingLensError, match=r"both be labelled '1'"):
        run_experiment({1: two, "1": two}, headline, ["PRE"])
    for n_examples in (-1, 0, 2.5, True):
        with pytest.raises(GraftingLensError, match="n_examples is how many relations"):
            experiments.run_named_experiment("demo", two, relations, n_examples=n_examples)
    assert count_forwards["n"] == 0
    assert not out.exists()  # nothing was written either


def test_movie_prompts_mark_the_movie_span(two, relations):
    (movie,) = make_test_sets(relations[:3], prompts=("headline_movie",))
    results = run_experiment(two, movie, ["M", "FE+M+LT"], progress=False)
    assert results.text.str.contains(relations[0].movie_title, regex=False).any()
    assert set(results.config) == {"M", "FE+M+LT"}


def test_registering_a_configuration_makes_it_nameable(monkeypatch, two, relations):
    configurations = experiments.get_experiment("position").configurations
    monkeypatch.setitem(configurations, "REL", None)  # removed again after the test
    del configurations["REL"]
    experiments.register_config(GraftConfig("REL", (Graft("REL"),)))
    with pytest.raises(GraftingLensError, match="overwrite=True"):
        experiments.register_config(GraftConfig("REL", (Graft("FE"),)))
    results = run_experiment(
        two, make_test_sets(relations[:2], prompts=("qa",)), ["REL"], progress=False
    )
    assert set(results.config) == {"REL"}
    assert "REL" in experiments.get_experiment("demo").configurations  # shared with position
    with pytest.raises(GraftingLensError, match="runs no configurations of its own"):
        experiments.register_config(GraftConfig("X", (Graft("FE"),)), "patching_vs_grafting")


SPEC = dict(name="mine", title="Mine", roles=("base", "sft"), donors={"sft": ("--donor", "")})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(name=""), "needs a non-empty name"),
        (dict(roles=("base",), donors={}), "at least two roles"),
        (dict(donors={}), "an option for every role after the base \\(sft\\)"),
        (dict(relations="some"), "relations must be one of"),
        (dict(parts=(), run=None), "neither parts to run nor a run function"),
        (dict(names=("PRE",)), "1 names for 2 roles"),
        (dict(semantics="refrence"), "Did you mean 'reference'"),
    ],
)
def test_an_experiment_spec_with_a_mistake_names_it(changes, message):
    spec = {**SPEC, "parts": (experiments.Part("p", ("qa",), ("PRE",)),), **changes}
    with pytest.raises(GraftingLensError, match=message):
        experiments.ExperimentSpec(**spec)


def test_the_registries_refuse_another_kind_a_taken_name_and_an_unknown_one():
    with pytest.raises(
        GraftingLensError, match="register_experiment takes ExperimentSpec objects, got str"
    ):
        experiments.register_experiment("position")  # type: ignore[arg-type]
    taken = experiments.get_experiment("position")
    with pytest.raises(GraftingLensError, match="'position' is taken; pass overwrite=True"):
        experiments.register_experiment(taken)
    with pytest.raises(
        GraftingLensError, match="register_config\\('position'\\) takes GraftConfig objects"
    ):
        experiments.register_config("FE")  # type: ignore[arg-type]
    with pytest.raises(GraftingLensError, match="Unknown experiment 'postion'. Did you mean"):
        experiments.get_experiment("postion")


def test_the_registry_never_imports_the_paper_itself():
    # The paper's experiments register on import of study.paper (the front door, the
    # command and named import it); the registry below them must not (an import circle).
    code = (
        "import sys\n"
        "from grafting_lens.study import specs\n"
        "assert 'grafting_lens.study.paper' not in sys.modules\n"
        "assert 'position' not in specs.EXPERIMENTS\n"
        "from grafting_lens.study import named\n"
        "assert 'position' in specs.EXPERIMENTS\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    # Every study name of the front door comes with them: run_position_grafting looks
    # "position" up by name (it said "Unknown experiment 'position'. Known: none." once).
    for name in ("run_position_grafting", "run_experiment", "graft", "CLEAN"):
        code = (
            "from grafting_lens.study import specs\n"
            "import grafting_lens as gl\n"
            f"gl.{name}\n"
            "assert 'position' in specs.EXPERIMENTS\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- scripts

TINY_WORLD = {
    "d_model": 16,
    "n_layers": 2,
    "n_heads": 2,
    "n_key_value_heads": 1,
    "d_mlp": 32,
    "vocab_size": 600,
    "max_length": 96,
    "n_relations": 8,
    "n_pretrain_documents": 300,
    "n_pretrain_pairs": 20,
    "pretrain_epochs": 1,
    "finetune_epochs": 1,
}


# The scripts that were in experiments/ are the experiments of `grafting-lens run`.
_EXPERIMENT_OF_SCRIPT = {
    "position_grafting": "position",
    "component_grafting": "component",
    "reversal_grafting": "reversal",
    "hybrid_grafting": "hybrid",
    "patching_vs_grafting": "patching_vs_grafting",
    "graft_attribution": "graft_attribution",
}


def _script(name):
    import types

    experiment = _EXPERIMENT_OF_SCRIPT[name]
    return types.SimpleNamespace(main=lambda argv: cli.main(["run", experiment, *argv]))


@pytest.fixture(scope="module")
def tiny_world_args(tmp_path_factory):
    """Arguments that point a script at a tiny toy world (built once, a few seconds)."""
    return [
        "--cache-dir",
        str(tmp_path_factory.mktemp("toy")),
        "--toy-config",
        json.dumps(TINY_WORLD),
        "--quick",
        "--no-png",
        "--no-progress",
    ]


@pytest.mark.filterwarnings("ignore:.*longer than max_length")  # the tiny world's short context
@pytest.mark.parametrize(
    "script, rows, figures",
    [
        (
            "position_grafting",
            8 * 2 * 8 + 4 * 2 * 8,
            ["position_grafting.html", "position_grafting_movie.html", "position_mean_rank.html"],
        ),
        ("component_grafting", 18 * 2 * 4, ["component_heatmap.html", "component_bars.html"]),
        ("reversal_grafting", 18 * 2 * 8, ["component_heatmap.html"]),
        ("hybrid_grafting", 9 * 2 * 4, ["hybrid_grafting.html"]),
    ],
)
def test_scripts_write_tables_figures_and_resume(
    script, rows, figures, tiny_world_args, tmp_path, count_forwards
):
    out = tmp_path / "out"
    assert _script(script).main(["--out", str(out), *tiny_world_args]) == 0
    results = pd.read_csv(out / "results.csv")
    assert len(results) == rows  # the tiny world's 8 relations, 4 in the relation split
    assert {"config", "prompt", "target_rank", "data_seed", "world_seed"} <= set(results.columns)
    for name in ["summary.csv", "summary.md", *figures]:
        assert (out / name).stat().st_size > 0, name
    assert "| config |" in (out / "summary.md").read_text().replace(
        "| part | config |", "| config |"
    )
    forwards = count_forwards["n"]
    assert _script(script).main(["--out", str(out), *tiny_world_args]) == 0
    assert count_forwards["n"] == forwards  # the second run read every chunk back


@pytest.mark.filterwarnings("ignore:.*longer than max_length")
def test_patching_vs_grafting_script_writes_both_methods(tiny_world_args, tmp_path):
    out = tmp_path / "pvg"
    assert _script("patching_vs_grafting").main(["--out", str(out), *tiny_world_args]) == 0
    results = pd.read_csv(out / "results.csv")
    assert set(results["method"]) == {"graft", "patch"}
    assert set(results["prompt"]) == {"headline", "qa"}
    assert set(results["positions"]) == {"LT", "FE", "FE+LT"}
    assert set(results["layer"]) == {0, 1}  # the tiny world's two layers
    # Each (method, prompt, positions, pair, layer) scores every example once.
    sizes = results.groupby(["method", "prompt", "positions", "pair", "layer"]).size()
    assert sizes.nunique() == 1 and sizes.iloc[0] == 8  # the tiny world's 8 relations
    references = pd.read_csv(out / "references.csv")
    assert {"PRE", "SFT", "SFT stream, PRE readout"} <= set(references["model"])
    for name in ["summary.csv", "summary.md", "top5_sufficiency.html", "prob_sufficiency.html"]:
        assert (out / name).stat().st_size > 0, name
    assert not (out / "top5_sufficiency.png").exists()  # --no-png


@pytest.mark.filterwarnings("ignore:.*longer than max_length")
@pytest.mark.filterwarnings("ignore:The search stopped")  # a tiny world may fall short
def test_graft_attribution_writes_every_cell_verified_and_the_minimal_graft(
    tiny_world_args, tmp_path
):
    out = tmp_path / "attribution"
    assert _script("graft_attribution").main(["--out", str(out), *tiny_world_args]) == 0
    results = pd.read_csv(out / "results.csv")
    # The tiny world's Llama: 9 per-layer components x 2 layers, embed, ln_final, unembed;
    # three position groups; two prompts.
    assert len(results) == (9 * 2 + 3) * 3 * 2
    assert set(results["prompt"]) == {"headline", "qa"}
    assert set(results["positions"]) == {"FE", "LT", "(FE+LT)^C"}
    assert results["exact"].notna().all() and (results["n"] == 8).all()
    agreement = pd.read_csv(out / "agreement.csv")
    assert len(agreement) == 2 * 4 and agreement["spearman"].between(-1, 1).all()
    recovery = pd.read_csv(out / "recovery.csv")
    assert set(recovery["prompts"]) == {"search", "held_out"}
    cells = pd.read_csv(out / "minimal_graft.csv")
    assert recovery["cells"].max() == len(cells)
    for name in [
        "summary.md",
        "references.csv",
        "search.csv",
        "attribution_headline.html",
        "exact_qa.html",
        "recovery.html",
    ]:
        assert (out / name).stat().st_size > 0, name
    assert "## The minimal graft" in (out / "summary.md").read_text()
    bad = ["--out", str(tmp_path / "bad"), "--verify", "some", *tiny_world_args]
    assert _script("graft_attribution").main(bad) == 1


@pytest.mark.filterwarnings("ignore:.*longer than max_length")
@pytest.mark.filterwarnings("ignore:The search stopped")
def test_graft_attribution_writes_the_attribution_first_and_resumes_after_a_kill(
    tiny_world_args, tmp_path, monkeypatch, capsys
):
    from grafting_lens.study import graft_attribution

    out = tmp_path / "attribution"
    arguments = ["--out", str(out), "--verify", "4", *tiny_world_args]

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(graft_attribution, "find_minimal_graft", killed)
        assert _script("graft_attribution").main(arguments) == 130
    kept = out / "runs" / "graft_attribution"
    # Killed as the search started: both prompts' attributions are on disk already.
    assert {p.name for p in kept.iterdir()} == {"attribution_headline.json", "attribution_qa.json"}
    stored = kept.joinpath("attribution_qa.json").read_bytes()

    def not_again(*args, **kwargs):
        pytest.fail("attributed again")

    with monkeypatch.context() as patched:
        patched.setattr(graft_attribution, "attribute_grafts", not_again)
        assert _script("graft_attribution").main(arguments) == 0
    assert kept.joinpath("attribution_qa.json").read_bytes() == stored
    assert (kept / "search.json").exists()
    resumed = pd.read_csv(out / "results.csv")
    # The same as a run never killed, cell for cell and bit for bit.
    fresh = tmp_path / "fresh"
    assert _script("graft_attribution").main(["--out", str(fresh), *arguments[2:]]) == 0
    pd.testing.assert_frame_equal(resumed, pd.read_csv(fresh / "results.csv"))
    for name in ("minimal_graft.csv", "recovery.csv", "agreement.csv", "references.csv"):
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name
    # A kept attribution is read back whole: a NaN where a number was is refused, by name.
    damaged = json.loads(stored)
    damaged["reference"]["start_metric"] = float("nan")
    kept.joinpath("attribution_qa.json").write_text(json.dumps(damaged))
    capsys.readouterr()
    assert _script("graft_attribution").main(arguments) == 1
    said = capsys.readouterr().err
    assert "attribution_qa.json cannot be read back (its reference holds a value" in said


@pytest.mark.filterwarnings("ignore:.*longer than max_length")
def test_scripts_refuse_bad_arguments_before_running(
    tiny_world_args, tmp_path, capsys, count_forwards
):
    position = _script("position_grafting")
    assert position.main(["--out", str(tmp_path / "a"), "--donor", "x", *tiny_world_args]) == 1
    assert "--donor needs --model" in capsys.readouterr().err
    assert position.main(["--out", str(tmp_path / "b"), "--model", "x", *tiny_world_args]) == 1
    assert "also needs --donor" in capsys.readouterr().err
    hybrid = _script("hybrid_grafting")
    assert (
        hybrid.main(
            ["--out", str(tmp_path / "c"), "--model", "x", "--task-model", "y", *tiny_world_args]
        )
        == 1
    )
    assert "--relation-model" in capsys.readouterr().err
    versus = _script("patching_vs_grafting")
    assert versus.main(["--out", str(tmp_path / "d"), "--unembed", "donor", *tiny_world_args]) == 1
    assert "do not apply here" in capsys.readouterr().err
    assert versus.main(["--out", str(tmp_path / "e"), "--donor", "x", *tiny_world_args]) == 1
    assert "--donor needs --model" in capsys.readouterr().err
    assert count_forwards["n"] == 0


# ----------------------------------------------------------------- own prompts from a file


def test_read_prompts_takes_json_and_csv_with_one_test_set_per_name(tmp_path):
    rows = [
        {
            "prompt": "Keanu Reeves starred in a movie alongside",
            "target": " Sandra Bullock",
            "first_entity": "Keanu Reeves",
            "name": "headline",
        },
        {"prompt": "Q: Who starred with Meryl Streep? A:", "target": " Tom Hanks", "name": "qa"},
    ]
    as_json = tmp_path / "facts.json"
    as_json.write_text(json.dumps(rows))
    as_csv = tmp_path / "facts.csv"
    as_csv.write_text(
        "prompt,target,first_entity,name\n"
        "Keanu Reeves starred in a movie alongside, Sandra Bullock,Keanu Reeves,headline\n"
        "Q: Who starred with Meryl Streep? A:, Tom Hanks,,qa\n"
    )
    for path in (as_json, as_csv):
        test_sets = experiments.read_prompts(path)
        assert [(t.dataset, t.prompt, t.templates) for t in test_sets] == [
            ("facts", "headline", None),
            ("facts", "qa", None),
        ]
        headline = test_sets[0].examples[0]
        assert headline.target == " Sandra Bullock"
        assert headline.text[slice(*headline.spans["first_entity"])] == "Keanu Reeves"
        assert test_sets[1].examples[0].spans == {}


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("p.json", "[{'prompt': 1}]", "not valid JSON"),
        ("p.json", '{"prompt": "a", "target": " b"}', "list of objects"),
        ("p.txt", "prompt,target", "neither .json nor .csv"),
        ("p.csv", "prompt,answer\nA b, c\n", "unknown columns \\['answer'\\]"),
        ("p.csv", "prompt,target\n", "no prompts"),
        ("p.json", '[{"prompt": "Who is it?", "target": ""}]', "row 1 has no target"),
        ("p.json", '[{"prompt": "Who is it?", "target": "Bob"}]', "row 1.*write ' Bob'"),
        (
            "p.json",
            '[{"prompt": "Who is it?", "target": " Bob", "first_entity": "Alice"}]',
            "first_entity 'Alice' is not in the prompt",
        ),
        # A value that is not text would run as its Python repr.
        (
            "p.json",
            '[{"prompt": {"q": "Who?"}, "target": " Bob"}]',
            "row 1: prompt is a JSON object",
        ),
        ("p.json", '[{"prompt": "Who?", "target": 7}]', "row 1: target is a JSON number"),
        ("p.json", '[{"prompt": "Who?", "target": " Bob", "name": ["a"]}]', "name is a JSON array"),
        # Set twice: JSON and csv keep the last without a word; a row twice counts twice.
        (
            "p.json",
            '[{"prompt": "Who?", "target": " Bob", "target": " Al"}]',
            "sets 'target' twice",
        ),
        ("p.csv", "prompt,target,target\nWho?, Bob, Al\n", "sets 'target' twice"),
        ("p.csv", "prompt,target\nWho?, Bob\nWho else?, Al\nWho?, Bob\n", "row 3 repeats row 1"),
        ("p.csv", "prompt,target\nWho?, Bob, Al\n", "row 1 has 3 cells but the header 2"),
        ("p.csv", b"prompt,target\nWho is Jos\xe9?, Bob\n", "not UTF-8 text \\(byte 0xe9"),
        ("p.csv/", "", "is a directory"),
        # Spans must be alike within a test set; say which row, not "relation 1".
        (
            "p.csv",
            "prompt,target,first_entity\nAl met Bo, Cy,Al\nBo met Al, Cy,\n",
            "row 2 has no first_entity, but row 1 .* gives one",
        ),
    ],
)
def test_a_prompts_file_with_a_mistake_names_it_and_the_fix(tmp_path, name, text, message):
    path = tmp_path / name
    if name.endswith("/"):
        path.mkdir()
    elif isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(GraftingLensError, match=message):
        experiments.read_prompts(path)
    with pytest.raises(GraftingLensError, match="No prompts file at"):
        experiments.read_prompts(tmp_path / "missing.json")


def test_scored_logits_only_give_the_scores_of_every_positions_logits(monkeypatch):
    models = gl.load_models(
        random_model("llama", 0), random_model("llama", 1), tokenizer=make_tokenizer()
    )
    relations = data.make_relations("fake_movies_real_actors", n=4, seed=0)
    test_sets = make_test_sets(relations, prompts=("headline",))
    shapes = []
    real = scoring.graft_forward  # the pass the runner asks the score for

    def recorded(*args, **kwargs):
        logits = real(*args, **kwargs)
        shapes.append((tuple(logits.shape), logits.requires_grad))
        return logits

    monkeypatch.setattr(scoring, "graft_forward", recorded)
    configs = ["PRE", "FE", "LT", "SFT"]  # SFT grafts the unembedding too (every position)
    options = {"batch_size": 4, "progress": False}
    scored = run_experiment(models, test_sets, configs, **options)
    scored_shapes, shapes[:] = list(shapes), []
    every = run_experiment(models, test_sets, configs, logits="all", **options)
    pd.testing.assert_frame_equal(scored, every)
    assert all(shape[1] == 1 and not grad for shape, grad in scored_shapes)
    assert all(shape[1] > 1 for shape, _ in shapes)
    with pytest.raises(GraftingLensError, match="logits must be 'scored'"):
        run_experiment(models, test_sets, configs, logits="last", **options)
