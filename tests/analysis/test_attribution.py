"""Graft attribution: the relaxation's gradient against finite differences of exact grafts,
its ends against the base and the graft, and the estimates against measured effects."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import no_forward_pass, random_mask, random_model, random_tokens

import grafting_lens as gl
from grafting_lens.analysis.attribution import (
    ATTRIBUTION_COLUMNS,
    attribute_grafts,
    attribution_agreement,
)
from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.engine.relaxation import relaxing
from grafting_lens.worlds import data


def answer_logprob(logits: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """log P(answer) at the last position, written here rather than taken from the library."""
    return torch.log_softmax(logits[:, -1].double(), dim=-1)[torch.arange(len(answers)), answers]


def batch_for(models: gl.ModelSet, n: int = 4, seed: int = 0, answers: str = "donor"):
    """Tokenized prompts with FE/LT spans, padded; the answer is the donor's top token (so the
    donor beats the base), or the data's own answer."""
    relations = data.make_relations("fake_movies_real_actors", n=n, seed=seed)
    # The library's wording and tokenization (a BOS, the answer read in context), which the
    # fractions these tests ask for were chosen on.
    examples = data.make_examples(relations, prompt="qa", templates="library")
    batch = tokenize_examples(
        examples, models.tokenizer, bos="always", target="in_context", spans="characters"
    )
    if answers == "donor":
        with torch.no_grad():
            logits = models[1](batch.tokens, attention_mask=batch.attention_mask)
        last = batch.attention_mask.sum(dim=1) - 1
        batch = dataclasses.replace(
            batch, target_ids=logits[torch.arange(len(batch)), last].argmax(-1)
        )
    return batch


def last_logprob(logits: torch.Tensor, batch) -> torch.Tensor:
    """The metric of these tests, computed on its own: log P(answer) at each row's last real
    token (the only position of logits="last", the default)."""
    last = (
        batch.attention_mask.sum(dim=1) - 1
        if logits.shape[1] > 1
        else torch.zeros_like(batch.target_ids)
    )
    final = logits[torch.arange(len(last)), last].double()
    return torch.log_softmax(final, dim=-1)[torch.arange(len(last)), batch.target_ids]


# ------------------------------------------------------------------ the relaxation


def interpolated(family: str, alpha: float):
    """An HF model whose every weight is ``base + alpha * (donor - base)`` (seeds 0 and 1)."""
    base, donor = random_model(family, 0), random_model(family, 1)
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(base.named_parameters(), donor.named_parameters()):
            mine.copy_(mine + alpha * (theirs - mine))
    return base


# Components at layers and positions; every component of these families computes an
# output affine in its weights, so grafting interpolated weights is mixing the outputs.
CELLS = [
    (("q", 0), [2, 3]),
    (("ln1", 1), [1, 4, 5]),
    (("mlp_out", 1), [5]),
    (("ln2", 2), [0, 1, 2, 3, 4, 5]),
    (("embed", None), [1, 4]),
    (("unembed", None), [5]),
]


def test_gradient_equals_a_finite_difference_of_exact_grafts(family, tokenizer):
    """At alpha = 0.4, d metric / d alpha (summed over a cell's positions) equals the central
    difference of grafts of checkpoints interpolated to alpha +- h, Richardson-extrapolated."""
    alpha, h = 0.4, 2e-3
    offsets = (h, -h, h / 2, -h / 2)
    sources = [random_model(family, 0), random_model(family, 1)]
    sources += [interpolated(family, alpha + offset) for offset in offsets]
    models = gl.load_models(*sources, tokenizer=tokenizer)
    tokens = random_tokens(2, 6, seed=3)
    answers = torch.tensor([5, 17])
    for key, positions in CELLS:
        selected = torch.zeros(tokens.shape, dtype=torch.bool)
        selected[:, positions] = True
        weight = (selected.double() * alpha).float().requires_grad_()
        with relaxing(models, {key: weight}, source=1) as model:
            value = answer_logprob(model(tokens), answers).sum()
        (gradient,) = torch.autograd.grad(value, weight)
        estimate = float(gradient[selected].sum())

        grafted = []
        for source in (2, 3, 4, 5):
            mask = gl.GraftMask.from_dict(models, {key: selected.long() * source})
            with torch.no_grad():
                logits = gl.graft_forward(models, tokens, mask, logits="all")
            grafted.append(float(answer_logprob(logits, answers).sum()))
        plus, minus, half_plus, half_minus = grafted
        wide = (plus - minus) / (2 * h)
        narrow = (half_plus - half_minus) / h
        difference = (4 * narrow - wide) / 3
        assert abs(estimate - difference) <= 3e-3 + 5e-3 * abs(difference), (
            key,
            estimate,
            difference,
        )
        assert abs(difference) > 1e-2, key  # the cell moves the metric, so the check can fail


def test_weights_of_zero_are_the_base_and_of_one_the_graft(three_models):
    tokens = random_tokens(2, 7, seed=4)
    zeros = {pair: torch.zeros(tokens.shape) for pair in three_models.pairs}
    with relaxing(three_models, zeros) as model:
        relaxed = model(tokens)
    assert torch.equal(relaxed, three_models.base(tokens))
    # Ones at random positions of every component: the graft of source 2 there.
    mask = random_mask(three_models, tokens.shape, seed=5)
    ones = {pair: (mask[pair] == 2).float() for pair in three_models.pairs}
    with relaxing(three_models, ones, source=2) as model:
        relaxed = model(tokens)
    only_two = gl.GraftMask.from_dict(
        three_models, {pair: (mask[pair] == 2).long() * 2 for pair in three_models.pairs}
    )
    assert (
        relaxed - gl.graft_forward(three_models, tokens, only_two, logits="all")
    ).abs().max() <= 1e-5
    assert (relaxed - three_models.base(tokens)).abs().max() > 1.0
    everywhere = {pair: torch.ones(tokens.shape) for pair in three_models.pairs}
    with relaxing(three_models, everywhere, source=1) as model:
        assert torch.equal(model(tokens), three_models[1](tokens))


def test_the_base_is_restored_and_relaxations_do_not_nest(three_models):
    tokens = random_tokens(1, 5, seed=6)
    before = three_models.base(tokens)
    weights = {("o", 1): torch.full(tokens.shape, 0.5)}
    with pytest.raises(RuntimeError, match="inside"):
        with relaxing(three_models, weights):
            raise RuntimeError("inside")
    with relaxing(three_models, weights):
        with pytest.raises(gl.errors.AttributionError, match="do not nest"):
            with relaxing(three_models, weights):
                pass
        with pytest.raises(gl.errors.AttributionError, match=r"\[1, 4\].*\[1, 5\]"):
            three_models.base(tokens[:, :4])
    assert torch.equal(three_models.base(tokens), before)


def test_relaxing_inside_grafting_mixes_the_graft_and_hooks_see_it(three_models):
    """Inside grafting(), a weight mixes the enclosing graft's output with the donor's: the
    hooked activation is the mean of two exact grafts, and hooks that edit the run reach the
    gradient."""
    tokens = random_tokens(2, 6, seed=7)
    key, t = ("mlp_out", 1), 4
    noisy = random_mask(three_models, tokens.shape, seed=8)
    entries = {pair: noisy[pair].clone() for pair in noisy.keys()}
    entries[key][:, t] = 2  # the graft gives source 2 there; the weight mixes in the donor
    mask = gl.GraftMask.from_dict(three_models, entries)
    weight = torch.zeros(tokens.shape)
    weight[:, t] = 0.5
    hook = "blocks.1.mlp.out.hook_out"
    with gl.grafting(three_models, mask) as model:
        with relaxing(three_models, {key: weight.clone().requires_grad_()}, source=1):
            _, cache = model.run_with_cache(tokens, names_filter=hook)
    with_donor = {pair: mask[pair].clone() for pair in mask.keys()}
    with_donor[key][:, t] = 1
    runs = []
    for grafted in (mask, gl.GraftMask.from_dict(three_models, with_donor)):
        with gl.grafting(three_models, grafted) as model:
            runs.append(model.run_with_cache(tokens, names_filter=hook)[1][hook])
    expected = runs[0].clone()
    expected[:, t] = (runs[0][:, t] + runs[1][:, t]) / 2
    assert torch.allclose(cache[hook], expected, atol=1e-5)
    assert not torch.allclose(runs[0][:, t], runs[1][:, t], atol=1e-2)

    def zero_attention(activation, hook):
        return torch.zeros_like(activation)

    # Zeroing layer 2's attention cuts position t off from the last one (the model has
    # three layers): the gradient of the last position's logit at t goes from nonzero to 0.
    gradients = []
    for hooks in ([], [("blocks.2.hook_attn_out", zero_attention)]):
        leaf = weight.clone().requires_grad_()
        with gl.grafting(three_models, mask) as model:
            with relaxing(three_models, {key: leaf}, source=1):
                logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
        logits[:, -1, 3].sum().backward()
        assert leaf.grad is not None
        gradients.append(leaf.grad[:, t].clone())
    assert gradients[0].abs().min() > 1e-4
    assert torch.equal(gradients[1], torch.zeros(2))


# ------------------------------------------------------------------ attribute_grafts


@pytest.fixture(scope="module")
def llama(tokenizer):
    return gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer)


def exact_effect(models, batch, component, layer, selection, *, direction="sufficiency"):
    """metric(cell switched) - metric(start), per prompt, from grafts built here."""
    tokens, attention_mask = batch.tokens, batch.attention_mask
    if direction == "sufficiency":
        start = gl.GraftMask.from_dict(models, {}, tokens.shape, attention_mask=attention_mask)
        switched = gl.GraftMask.from_dict(
            models, {(component, layer): selection.long()}, attention_mask=attention_mask
        )
    else:  # the donor everywhere; the cell back to the base
        start = gl.GraftMask.build(models, tokens, attention_mask=attention_mask)
        entries = {key: start[key].clone() for key in start.keys()}
        entries[(component, layer)][selection] = 0
        switched = gl.GraftMask.from_dict(models, entries, attention_mask=attention_mask)
    with torch.no_grad():
        values = [
            last_logprob(
                gl.graft_forward(models, tokens, mask, attention_mask, logits="all"), batch
            )
            for mask in (start, switched)
        ]
    return values[1] - values[0], values[0]


@pytest.mark.parametrize("direction", ["sufficiency", "necessity"])
def test_verified_effects_are_the_grafts_effects(llama, direction):
    batch = batch_for(llama, n=5)
    result = attribute_grafts(
        llama,
        batch,
        components="o+mlp_in+unembed",
        layers=[0, 2],
        positions=("FE", "LT"),
        direction=direction,
        verify="all",
        batch_size=2,
        rows_per_forward=8,
        progress=False,
    )
    frame = result.frame
    assert list(frame.columns) == list(ATTRIBUTION_COLUMNS)
    assert len(frame) == 2 * (2 * 2 + 1)  # (o, mlp_in at 2 layers + unembed) x 2 groups
    assert (frame.direction == direction).all() and (frame.n == 5).all()
    for _, row in frame.iterrows():
        layer = None if pd.isna(row.layer) else int(row.layer)
        span = "first_entity" if row.positions == "FE" else "last_token"
        effect, start = exact_effect(
            llama, batch, row.component, layer, batch.spans[span], direction=direction
        )
        assert row.exact == pytest.approx(float(effect.mean()), abs=1e-4)
        assert row.exact_se == pytest.approx(float(effect.std() / np.sqrt(5)), abs=1e-4)
    assert result.start_metric == pytest.approx(float(start.mean()), abs=1e-4)
    assert frame.exact.abs().max() > 0.1
    agreement = result.agreement
    assert list(agreement.positions) == ["FE", "LT", "all"]
    assert list(agreement.cells) == [5, 5, 10]


def test_estimate_is_the_gradient_at_the_start_and_each_position_is_a_cell(llama):
    """positions='each': one cell per index; the estimate equals a finite difference of exact
    grafts of the cell at the start (weights +-h), and padding positions are nobody's."""
    batch = batch_for(llama, n=3)
    result = attribute_grafts(
        llama, batch, components="mlp_out", layers=[1], positions="each", progress=False
    )
    length = batch.tokens.shape[1]
    assert list(result.frame.positions) == [str(t) for t in range(length)]
    # Without verification no graft runs: the start comes from the relaxed pass itself.
    assert result.all_cells_metric is None and result.frame.exact.isna().all()
    with torch.no_grad():
        base = last_logprob(llama.base(batch.tokens, attention_mask=batch.attention_mask), batch)
    assert result.start_metric == pytest.approx(float(base.mean()), abs=1e-5)
    h = 1e-2
    for t in (1, length - 1):
        weights = {}
        values = []
        for sign in (1, -1):
            weight = torch.zeros(batch.tokens.shape)
            weight[:, t] = sign * h * batch.attention_mask[:, t]
            weights = {("mlp_out", 1): weight}
            with torch.no_grad(), relaxing(llama, weights) as model:
                logits = model(batch.tokens, attention_mask=batch.attention_mask)
            values.append(last_logprob(logits, batch))
        difference = float(((values[0] - values[1]) / (2 * h)).mean())
        estimate = float(result.frame.loc[result.frame.positions == str(t), "estimate"].iloc[0])
        assert estimate == pytest.approx(difference, abs=1e-3, rel=1e-2)


def test_integrated_estimates_add_up_to_the_graft_of_every_cell(tokenizer):
    """Completeness: along the joint path, disjoint cells' estimates sum to the whole graft's
    effect, to the midpoint rule's error (small weights keep the path smooth enough for a
    few steps)."""
    gentle = gl.load_models(
        random_model("llama", 0, scale=0.1),
        random_model("llama", 1, scale=0.1),
        tokenizer=tokenizer,
    )
    batch = batch_for(gentle, n=3)
    result = attribute_grafts(
        gentle,
        batch,
        components="all",
        positions=("FE", "LT", "(FE+LT)^C"),
        method="integrated",
        steps=32,
        progress=False,
    )
    total = result.all_cells_metric - result.start_metric
    assert abs(total) > 0.5
    assert result.frame.estimate.sum() == pytest.approx(total, rel=1e-2)
    assert result.steps == 32


def test_padded_rows_are_attributed_as_if_alone(llama):
    batch = batch_for(llama, n=4)
    lengths = batch.attention_mask.sum(dim=1)
    assert lengths.unique().numel() > 1
    options = dict(components="q+mlp_gate", layers=[1, 2], positions=("FE", "LT"), progress=False)
    whole = attribute_grafts(llama, batch, batch_size=3, **options).frame
    alone = [attribute_grafts(llama, batch.rows([row]), **options).frame for row in range(4)]
    mean = sum(frame.estimate for frame in alone) / 4
    assert np.allclose(whole.estimate, mean, atol=1e-4)


def test_attribution_on_top_of_a_graft(llama):
    """start=mask: the start is that graft, and a cell's exact effect is measured on top of it."""
    batch = batch_for(llama, n=3)
    start = gl.GraftMask.build(
        llama,
        batch.tokens,
        positions=batch.spans["first_entity"],
        components="attn",
        attention_mask=batch.attention_mask,
    )
    result = attribute_grafts(
        llama,
        batch,
        components="mlp_out",
        layers=[0],
        positions=("LT",),
        start=start,
        verify=1,
        progress=False,
    )
    with torch.no_grad():
        started = last_logprob(
            gl.graft_forward(llama, batch.tokens, start, batch.attention_mask, logits="all"), batch
        )
        on_top = gl.GraftMask.union(
            start,
            gl.GraftMask.build(
                llama,
                batch.tokens,
                positions=batch.spans["last_token"],
                components="mlp_out",
                layers=[0],
                attention_mask=batch.attention_mask,
            ),
        )
        switched = last_logprob(
            gl.graft_forward(llama, batch.tokens, on_top, batch.attention_mask, logits="all"), batch
        )
    assert result.start_metric == pytest.approx(float(started.mean()), abs=1e-4)
    assert result.frame.exact.iloc[0] == pytest.approx(float((switched - started).mean()), abs=1e-4)


def test_spearman_is_the_rank_correlation():
    frame = pd.DataFrame(
        {
            "positions": ["LT"] * 4 + ["FE"] * 3,
            "estimate": [1.0, 2.0, 3.0, 4.0, 1.0, 1.0, 2.0],
            "exact": [10.0, 30.0, 20.0, 40.0, 5.0, 6.0, np.nan],
        }
    )
    agreement = attribution_agreement(frame).set_index("positions")
    # 1 - 6 * sum(d^2) / (n (n^2 - 1)) with rank differences (0, 1, 1, 0): 1 - 12/60.
    assert agreement.loc["LT", "spearman"] == pytest.approx(0.8)
    # Pearson by its definition: the covariance over the product of the deviations.
    x, y = np.array([1.0, 2.0, 3.0, 4.0]), np.array([10.0, 30.0, 20.0, 40.0])
    dx, dy = x - x.mean(), y - y.mean()
    expected = (dx * dy).sum() / np.sqrt((dx**2).sum() * (dy**2).sum())
    assert agreement.loc["LT", "pearson"] == pytest.approx(expected)
    assert np.isnan(agreement.loc["FE", "spearman"])  # a constant estimate
    assert agreement.loc["FE", "cells"] == 2 and agreement.loc["all", "cells"] == 6


# ------------------------------------------------------------------ the search


def graft_recovery(models, result, prompts) -> float:
    """A search result's recovery, from the donor's and the base's own forward passes."""
    with torch.no_grad():
        base, donor = (
            last_logprob(model(prompts.tokens, attention_mask=prompts.attention_mask), prompts)
            for model in models
        )
        mask = result.mask(models, prompts)
        grafted = last_logprob(
            gl.graft_forward(models, prompts.tokens, mask, prompts.attention_mask, logits="all"),
            prompts,
        )
    return float((grafted.mean() - base.mean()) / (donor.mean() - base.mean()))


def test_the_minimal_graft_reaches_the_fraction_it_reports(llama):
    batch = batch_for(llama, n=4, seed=0)
    held_out = batch_for(llama, n=3, seed=1)
    found = gl.find_minimal_graft(
        llama,
        batch,
        fraction=0.6,
        held_out=held_out,
        components="attn+o+ffn",
        positions=("FE", "LT", "(FE+LT)^C"),
        proposals=4,
        progress=False,
    )
    assert found.reached and len(found.cells) >= 1

    def recovery(result, prompts) -> float:
        return graft_recovery(llama, result, prompts)

    assert recovery(found, batch) == pytest.approx(found.recovery, abs=1e-4)
    assert recovery(found, held_out) == pytest.approx(found.held_out_recovery, abs=1e-4)
    assert found.recovery >= 0.6
    search = found.curve[found.curve.prompts == "search"]
    assert list(search.cells) == list(range(len(found.cells) + 1))
    assert search.recovery.iloc[0] == pytest.approx(0.0, abs=1e-6)
    assert search.recovery.iloc[-1] == found.recovery
    # Pruned to 1-minimal: without any one of its cells the graft falls short.
    for dropped in range(len(found.cells)):
        smaller = dataclasses.replace(found, cells=found.cells.drop(index=dropped))
        assert recovery(smaller, batch) < 0.6


def test_a_beam_search_keeps_several_sets_and_reports_exact_recoveries(llama):
    batch = batch_for(llama, n=3, seed=2)
    found = gl.find_minimal_graft(
        llama,
        batch,
        fraction=0.5,
        components="o+mlp_out",
        positions=("FE", "LT"),
        search="greedy",
        proposals=3,
        beam=2,
        prune=False,
        progress=False,
    )
    assert found.reached and found.held_out_recovery is None
    assert graft_recovery(llama, found, batch) == pytest.approx(found.recovery, abs=1e-4)
    kept = found.search.groupby("step").kept.sum()
    assert (kept[:-1] == 2).all()  # two sets carried from each step to the next
    # Each logged recovery is that of the candidate set, measured: the kept ones rank first.
    for _, step in found.search.groupby("step"):
        assert step[step.kept].recovery.min() >= step[~step.kept].recovery.max() - 1e-9


SEARCH = dict(fraction=0.6, components="attn+o+ffn", positions=("FE", "LT", "(FE+LT)^C"))


def test_a_search_killed_and_started_again_goes_on_from_its_state_file(llama, tmp_path):
    batch = batch_for(llama, n=4, seed=0)
    state = tmp_path / "search.json"
    # Stopped after two cells, as a kill between steps leaves it: its file holds two cells.
    with pytest.warns(UserWarning, match="short of"):
        gl.find_minimal_graft(llama, batch, max_cells=2, prune=False, state=state, **SEARCH)
    saved = json.loads(state.read_text())
    assert len(saved["cells"]) == 2 and saved["pruned"] is None
    resumed = gl.find_minimal_graft(llama, batch, state=state, progress=False, **SEARCH)
    # It went on from the saved steps (their log kept), and its result is measured afresh.
    assert resumed.search.iloc[: len(saved["log"])].to_dict("records") == saved["log"]
    assert resumed.search.step.max() > saved["step"]
    assert resumed.reached
    assert graft_recovery(llama, resumed, batch) == pytest.approx(resumed.recovery, abs=1e-4)
    for dropped in range(len(resumed.cells)):  # 1-minimal
        smaller = dataclasses.replace(resumed, cells=resumed.cells.drop(index=dropped))
        assert graft_recovery(llama, smaller, batch) < 0.6
    # A finished search's file gives its result again without searching.
    again = gl.find_minimal_graft(llama, batch, state=state, progress=False, **SEARCH)
    assert again.cells.equals(resumed.cells) and len(again.search) == len(resumed.search)


def test_a_state_file_of_another_search_is_refused(llama, tmp_path):
    batch = batch_for(llama, n=4, seed=0)
    state = tmp_path / "search.json"
    gl.find_minimal_graft(llama, batch, state=state, progress=False, **SEARCH)
    written = state.read_bytes()
    with no_forward_pass(llama), pytest.raises(gl.errors.AttributionError, match="fraction 0.6"):
        gl.find_minimal_graft(
            llama, batch, state=state, progress=False, **{**SEARCH, "fraction": 0.5}
        )
    other = batch_for(llama, n=4, seed=3)  # other prompts: the saved cells recover otherwise
    with pytest.raises(gl.errors.AttributionError, match="here they recover"):
        gl.find_minimal_graft(llama, other, state=state, progress=False, **SEARCH)
    state.write_text("{not json")
    with pytest.raises(gl.errors.AttributionError, match="cannot be used"):
        gl.find_minimal_graft(llama, batch, state=state, progress=False, **SEARCH)
    assert written  # the file is the user's: refused, never rewritten or deleted
    assert state.read_text() == "{not json"


def _without(saved: dict, field: str) -> dict:
    return {key: value for key, value in saved.items() if key != field}


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda s: _without(s, "size"), "no 'size'"),
        (lambda s: {**s, "size": 0}, "'size' is 0"),
        (lambda s: {**s, "size": True}, "'size' is True"),
        (lambda s: {**s, "step": -1}, "'step' is -1"),
        # NaN compared false with the measured recovery, so another search's file passed.
        (lambda s: {**s, "recovery": float("nan")}, "not a finite number"),
        (lambda s: {**s, "recovery": "0.8"}, "not a number"),
        (lambda s: {**s, "cells": [["ffn", 99, "LT"]]}, "not one of this search's candidate"),
        (lambda s: {**s, "cells": [["ffn", [0], "LT"]]}, "not one of this search's candidate"),
        (lambda s: {**s, "cells": "ffn"}, "'cells' is not a list"),
        (lambda s: {**s, "pruned": [["nope"]]}, "'pruned' holds"),
        (lambda s: {**s, "log": "steps"}, "'log' is not a list"),
        (lambda s: {**s, "settings": []}, "'settings' is not a mapping"),
        (lambda s: [s], "holds a list"),
    ],
)
def test_a_damaged_state_file_is_refused_whole_naming_the_file(llama, tmp_path, damage, named):
    batch = batch_for(llama, n=4, seed=0)
    state = tmp_path / "search.json"
    with pytest.warns(UserWarning, match="short of"):
        gl.find_minimal_graft(llama, batch, max_cells=1, prune=False, state=state, **SEARCH)
    damaged = json.dumps(damage(json.loads(state.read_text())))
    state.write_text(damaged)
    with no_forward_pass(llama), pytest.raises(gl.errors.AttributionError) as refused:
        gl.find_minimal_graft(llama, batch, state=state, progress=False, **SEARCH)
    assert named in str(refused.value) and str(state) in str(refused.value)
    assert state.read_text() == damaged  # the user's file, refused, never rewritten


def test_the_search_prints_a_line_per_step_where_nobody_watches(llama, capsys):
    batch = batch_for(llama, n=4, seed=0)
    found = gl.find_minimal_graft(llama, batch, curve_points=2, **SEARCH)  # stderr: not a tty
    lines = capsys.readouterr().err.splitlines()
    assert any("step 1:" in line for line in lines) and "done:" in lines[-1]
    assert all(line.startswith("[") and "] graft search: " in line for line in lines)
    # Two points of the curve: no cells and all of them.
    assert list(found.curve[found.curve.prompts == "search"].cells) == [0, len(found.cells)]
    gl.find_minimal_graft(llama, batch, progress=False, **SEARCH)
    assert capsys.readouterr().err == ""


def test_a_search_for_a_metric_the_donor_does_not_raise_is_refused(llama):
    batch = batch_for(llama, n=2)  # the answer is the donor's top token

    def negated(logits, batch):
        return -last_logprob(logits, batch).float()

    with pytest.raises(gl.errors.AttributionError, match="donor does not beat the base"):
        gl.find_minimal_graft(llama, batch, metric=negated, components="o", progress=False)


def test_a_search_that_cannot_reach_the_fraction_says_so(llama):
    batch = batch_for(llama, n=3)
    with pytest.warns(UserWarning, match="short of"):
        found = gl.find_minimal_graft(
            llama,
            batch,
            fraction=1.0,
            components="ln1",
            layers=[0],
            positions=("LT",),
            progress=False,
        )
    assert not found.reached and found.recovery < 1.0


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(components="mlp_gates"), gl.errors.ComponentError, "mlp_gates"),
        (dict(layers=[7]), gl.errors.SelectionError, "outside the model"),
        (dict(positions=("EF",)), gl.errors.SelectionError, "Unknown position set 'EF'"),
        (dict(metric="logprobs"), gl.errors.AttributionError, r"metric must be one of .*got 'logp"),
        (dict(metric=3), gl.errors.ArgumentTypeError, r"or a function .* got 3"),
        (dict(method="ig"), gl.errors.AttributionError, "Unknown method 'ig'"),
        (dict(method="integrated", steps=0), gl.errors.AttributionError, "steps must be"),
        (dict(verify="some"), gl.errors.AttributionError, "verify must be"),
        (dict(source=0), gl.errors.AttributionError, "source 0 is the base"),
        (dict(direction="backward"), gl.errors.AttributionError, "Unknown direction 'backward'"),
        (dict(logits="first"), gl.errors.AttributionError, "Unknown logits 'first'"),
        (dict(batch_size=0), gl.errors.AttributionError, "batch_size must be"),
        (
            dict(start="LT"),
            gl.errors.ArgumentTypeError,
            r"start must be a GraftMask for this batch",
        ),
        (dict(start=(1, 3)), gl.errors.AttributionError, r"\[batch, pos\] = \[2, \d+\]"),
        (dict(models=[]), TypeError, "models must be a ModelSet, got list"),
    ],
)
def test_attribute_grafts_refuses_before_any_forward_pass(llama, options, error, message):
    batch = batch_for(llama, n=2, answers="data")
    if options.get("start") == (1, 3):
        options = dict(start=gl.GraftMask.from_dict(llama, {}, (1, 3)))
    arguments = {**dict(models=llama, tokenized=batch, progress=False), **options}
    with no_forward_pass(llama), pytest.raises(error, match=message):
        attribute_grafts(**arguments)


@pytest.mark.parametrize(
    "options, message",
    [
        *((dict(fraction=fraction), "fraction must be") for fraction in (0, 1.5, -0.1)),
        (dict(reference="sft"), "Unknown reference 'sft'"),
        (dict(beam=0, search="greedy"), "beam must be"),
        (dict(beam=2), "beam is a setting of search='greedy'"),
        (dict(search="beam"), "Unknown search 'beam'"),
        (dict(curve_points=1), "curve_points must be at least 2"),
        (dict(max_cells=0), "max_cells must be"),
    ],
)
def test_find_minimal_graft_refuses_before_any_forward_pass(llama, options, message):
    batch = batch_for(llama, n=2, answers="data")
    with no_forward_pass(llama), pytest.raises(gl.errors.AttributionError, match=message):
        gl.find_minimal_graft(llama, batch, progress=False, **options)
    # A value of the wrong type is a TypeError at this door too.
    for wrong in (dict(fraction=True), dict(fraction="0.5"), dict(state=3)):
        with no_forward_pass(llama), pytest.raises(gl.errors.ArgumentTypeError):
            gl.find_minimal_graft(llama, batch, progress=False, **wrong)


@pytest.mark.parametrize(
    ("metric", "message"),
    [
        (lambda logits, batch: logits[:, -1].logsumexp(-1).mean(), r"shape \[\] from logits"),
        (lambda logits, batch: logits[:, -1, :2], r"shape \[2, 2\]"),
        (lambda logits, batch: [0.0, 1.0], "list"),
        (lambda logits, batch: batch.target_ids, "torch.int64"),
        (lambda logits, batch: logits[:, -1, 0].detach(), "no gradient through the grafted run"),
        (lambda logits, batch: logits[:, -1, 0] * float("nan"), "not finite"),
        # Rebuilt from copied values: it requires a gradient, but not through the run.
        (
            lambda logits, batch: torch.tensor(logits[:, -1, 0].tolist(), requires_grad=True),
            "no gradient through the grafted run",
        ),
    ],
)
def test_a_metric_that_is_not_one_differentiable_value_per_prompt_is_named(llama, metric, message):
    batch = batch_for(llama, n=2, answers="data")
    with pytest.raises(gl.errors.AttributionError, match=message):
        attribute_grafts(llama, batch, metric=metric, components="o", progress=False)


def test_relaxing_refuses_bad_weights(three_models):
    tokens = random_tokens(1, 4)
    for weights, error, message in [
        ({}, gl.errors.AttributionError, "non-empty mapping"),
        ({("o", 0): torch.zeros(4)}, gl.errors.AttributionError, r"\[batch, pos\]"),
        ({("o", 0): torch.zeros(1, 4, dtype=torch.long)}, gl.errors.AttributionError, "floating"),
        (
            {("o", 0): torch.zeros(1, 4), ("q", 0): torch.zeros(2, 4)},
            gl.errors.AttributionError,
            "several shapes",
        ),
        ({("mlp_gates", 0): torch.zeros(1, 4)}, gl.errors.ComponentError, "mlp_gates"),
        ({("o", 9): torch.zeros(1, 4)}, gl.errors.GraftMaskError, "9"),
    ]:
        with pytest.raises(error, match=message):
            with relaxing(three_models, weights):
                pass
    with pytest.raises(gl.errors.AttributionError, match="source"):
        with relaxing(three_models, {("o", 0): torch.zeros(1, 4)}, source=3):
            pass
    assert three_models.base(tokens).shape == (1, 4, 300)


def test_the_last_tokens_logits_alone_give_the_same_attribution(llama):
    """logits="last" (the default) runs the unembedding at the scored tokens only."""
    batch = batch_for(llama, n=3)
    options = dict(components="o+ffn", positions=("FE", "LT"), verify="all", progress=False)
    last = attribute_grafts(llama, batch, **options)
    every = attribute_grafts(llama, batch, logits="all", **options)
    for column in ("estimate", "exact"):
        expected = every.frame[column].to_numpy()
        assert last.frame[column].to_numpy() == pytest.approx(expected, abs=1e-5)
    assert abs(every.frame["exact"]).max() > 1e-3  # the cells move the metric


@pytest.mark.parametrize(
    ("metric", "message"),
    [
        (lambda logits, batch: logits[:, -2, 0], r"IndexError: .*needs logits='all'"),
        # Silently the last token's logit before: logits="last" passes that position only.
        (lambda logits, batch: logits[:, 0, 0], r"reads positions other than the last"),
    ],
)
@pytest.mark.parametrize("search", [False, True])
def test_a_metric_reading_other_positions_needs_all_logits(llama, metric, message, search):
    batch = batch_for(llama, n=2, answers="data")
    door = gl.find_minimal_graft if search else attribute_grafts
    with pytest.raises(gl.errors.AttributionError, match=message):
        door(llama, batch, metric=metric, components="o", progress=False)
    if not search:  # with every position, as asked
        attribute_grafts(llama, batch, metric=metric, components="o", logits="all", progress=False)


def test_kl_and_a_function_as_the_attributions_score_are_their_grafts(llama):
    """metric=Score.of("kl", at="last"): each verified cell's exact effect is minus the change
    in KL(donor || run) at the last token, computed here from the grafts' and the donor's own
    logits; a function score is its value on the grafts (TransformerLens's convention)."""
    from grafting_lens.analysis.scoring import Score

    batch = batch_for(llama, n=4)
    tokens, attention_mask = batch.tokens, batch.attention_mask
    last = attention_mask.sum(dim=1) - 1
    rows = torch.arange(len(last))

    def logits_of(mask):
        with torch.no_grad():
            out = gl.graft_forward(llama, tokens, mask, attention_mask, logits="all")
        return out[rows, last].float().log_softmax(-1)

    donor = logits_of(gl.GraftMask.build(llama, tokens, attention_mask=attention_mask))
    base = gl.GraftMask.from_dict(llama, {}, tokens.shape, attention_mask=attention_mask)

    def kl(run):
        return (donor.exp() * (donor - run)).sum(-1)

    def top_logprob(logits):  # [batch, pos, d_vocab] -> [batch]
        return logits[:, -1].log_softmax(-1).max(-1).values

    for metric, value in (
        (Score.of("kl", at="last"), lambda run: -kl(run)),
        (Score.of(top_logprob), lambda run: run.max(-1).values),
    ):
        result = attribute_grafts(
            llama,
            batch,
            metric=metric,
            components="o",
            layers=[1],
            positions=("FE", "LT"),
            verify="all",
            batch_size=2,
            progress=False,
        )
        for _, row in result.frame.iterrows():
            span = "first_entity" if row.positions == "FE" else "last_token"
            cell = {("o", 1): batch.spans[span].long()}
            switched = gl.GraftMask.from_dict(llama, cell, attention_mask=attention_mask)
            effect = value(logits_of(switched)) - value(logits_of(base))
            assert row.exact == pytest.approx(float(effect.mean()), abs=1e-4)
        assert result.frame.exact.abs().max() > 1e-3


@pytest.mark.parametrize("score", ["answer_logprob", "kl"])
def test_a_score_over_the_whole_answer_is_the_attributions_and_the_searchs(llama, score):
    """A teacher-forced score: each prompt runs with its answer after it, and a cell that
    switches the prompt's last token switches the answer's positions too. Each verified cell's
    exact effect is its graft of one example at a time, scored here by hand."""
    batch = batch_for(llama, n=3)
    assert max(len(answer) for answer in batch.target_full_ids) > 1

    def value(models, tokens, length, answer, mask):
        with torch.no_grad():
            out = gl.graft_forward(models, tokens, mask, logits="all")[0].float()
        reads = out[length - 1 : length - 1 + len(answer) + (score == "kl")].log_softmax(-1)
        if score == "answer_logprob":
            return float(sum(reads[j, token] for j, token in enumerate(answer)))
        whole = gl.GraftMask.build(models, tokens)
        with torch.no_grad():
            donor = gl.graft_forward(models, tokens, whole, logits="all")[0].float()
        donor = donor[length - 1 : length + len(answer)].log_softmax(-1)
        return -float((donor.exp() * (donor - reads)).sum())

    def exact(cells) -> float:  # the mean score with these (component, layer, positions)
        values = []
        for i, answer in enumerate(batch.target_full_ids):
            length = int(batch.attention_mask[i].sum())
            tokens = torch.tensor([[*batch.tokens[i, :length].tolist(), *answer]])
            entries = {}
            for component, layer, positions in cells:
                where = torch.zeros(tokens.shape, dtype=torch.long)
                if positions == "FE":
                    where[0, :length] = batch.spans["first_entity"][i, :length].long()
                else:
                    where[0, length - 1 :] = 1  # the last token, and the answer's positions
                entries[(component, layer)] = where
            mask = gl.GraftMask.from_dict(llama, entries, tokens.shape)
            values.append(value(llama, tokens, length, answer, mask))
        return sum(values) / len(values)

    result = attribute_grafts(
        llama,
        batch,
        metric=score,
        components="o",
        layers=[1],
        positions=("FE", "LT"),
        verify="all",
        progress=False,
    )
    for _, row in result.frame.iterrows():
        cell = [("o", 1, row.positions)]
        assert row.exact == pytest.approx(exact(cell) - exact([]), abs=1e-4)
    assert result.frame.exact.abs().max() > 1e-3
    if score == "kl":  # the donor is at KL 0 (random answers: the donor need not beat the base)
        found = gl.find_minimal_graft(
            llama, batch, metric=score, components="o", positions=("FE", "LT"), progress=False
        )
        cells = list(found.cells[["component", "layer", "positions"]].itertuples(index=False))
        base = exact([])  # recovery 0; 1 is the donor's own run, at KL 0
        assert found.recovery == pytest.approx((exact(cells) - base) / -base, abs=1e-4)
    with pytest.raises(gl.errors.AttributionError, match=r"start= is a mask over the prompts"):
        start = gl.GraftMask.from_dict(llama, {}, batch.tokens.shape)
        attribute_grafts(llama, batch, metric=score, start=start, progress=False)
