"""Directions analysed: per-cell strengths and ranks, dose-response, attribution over directions
and the directions a minimal graft keeps, against hand-made checkpoints and exact grafts."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch
from conftest import random_model, random_tokens
from conftest import top_directions as top
from test_attribution import batch_for, last_logprob

import grafting_lens as gl
from grafting_lens.analysis.directions import attribute_directions, dose_response, read_directions
from grafting_lens.core.errors import ArgumentTypeError, SelectionError

# The HF weights of mlp_out and o, by family: GPT-2's c_proj (Conv1D), NeoX's dense ones,
# Llama's and Gemma's down_proj and o_proj.
MLP_OUT = ("mlp.c_proj", "dense_4h_to_h", "down_proj")
O = ("attn.c_proj", "attention.dense", "o_proj")


def hand_made(base, donor, edits):
    """A copy of ``base`` whose parameters named by ``edits`` (``{(layer, names): edit}``) are
    ``edit(W_base, W_donor)``, in float64."""
    made = copy.deepcopy(base)
    donors = dict(donor.named_parameters())
    with torch.no_grad():
        for name, parameter in made.named_parameters():
            for (layer, names), edit in edits.items():
                if f".{layer}." in name and any(n in name for n in names):
                    parameter.copy_(edit(parameter.double(), donors[name].double()))
    return made


def logits_of(model, tokens, attention_mask=None):
    with torch.no_grad():
        return model(tokens, attention_mask=attention_mask).logits


def test_a_strength_and_a_rank_per_cell_are_hand_made_checkpoints(family, tokenizer):
    base, donor = random_model(family, 0), random_model(family, 1)
    models = gl.load_models(base, donor, tokenizer=tokenizer)
    tokens = random_tokens(2, 7, seed=3)
    cells = {("mlp_out", 1): 0.5, ("o", 2): 0.25}
    hand = hand_made(
        base,
        donor,
        {(1, MLP_OUT): lambda b, d: b + 0.5 * (d - b), (2, O): lambda b, d: b + 0.25 * (d - b)},
    )
    derived = models.directions(1, strength=cells)
    everywhere = torch.full(tokens.shape, 2)
    mask = gl.GraftMask.from_dict(derived, dict.fromkeys(cells, everywhere))
    grafted = gl.graft_forward(derived, tokens, mask, logits="all")
    assert torch.allclose(grafted, logits_of(hand, tokens), atol=1e-4, rtol=1e-4)
    assert "strength=per cell" in derived.names[2]
    if family == "llama":  # a rank per cell; Llama has no biases, so the SVD is all of dW
        hand = hand_made(base, donor, {(1, MLP_OUT): top(2), (2, O): top(5)})
        derived = models.directions(1, rank={("mlp_out", 1): 2, ("o", 2): 5})
        grafted = gl.graft_forward(derived, tokens, mask, logits="all")
        assert torch.allclose(grafted, logits_of(hand, tokens), atol=1e-4, rtol=1e-4)


def test_an_answer_is_found_by_its_first_token_alone(tokenizer):
    base = random_model("llama", 0)
    donor = copy.deepcopy(base)
    (movie,) = tokenizer.encode(" movie", add_special_tokens=False)
    first, second = tokenizer.encode("a movie", add_special_tokens=False)
    assert second == movie
    unembedding = base.lm_head.weight.detach()
    with torch.no_grad():  # a rank-one change writing " movie"
        write = unembedding[movie] / unembedding[movie].norm()
        reading = torch.randn(64, generator=torch.Generator().manual_seed(0))
        donor.model.layers[1].mlp.down_proj.weight += 20 * torch.outer(write, reading)
    models = gl.load_models(base, donor, tokenizer=tokenizer)
    answers = ["a movie", " movie"]
    row = read_directions(models, "mlp_out", 1, k=1, tokens=3, answers=answers).iloc[0]
    listed = [*row.output_top, *row.output_bottom]
    assert row.output_top[0] == tokenizer.convert_ids_to_tokens(movie)
    assert tokenizer.convert_ids_to_tokens(first) not in listed
    # "a movie"'s second token is listed but not its first: not found; " movie"'s first is.
    assert row.answers_found == [" movie"]


@pytest.fixture(scope="module")
def llama(tokenizer):
    base, donor = random_model("llama", 0), random_model("llama", 1)
    return base, donor, gl.load_models(base, donor, tokenizer=tokenizer)


def test_the_dose_response_runs_from_the_base_to_the_graft_through_hand_made_checkpoints(llama):
    base, donor, models = llama
    batch = batch_for(models, n=6)
    halfway = copy.deepcopy(base)  # every parameter halfway, interpolated by hand
    with torch.no_grad():
        for parameter, other in zip(halfway.parameters(), donor.parameters()):
            parameter.copy_(parameter + 0.5 * (other - parameter))
    own = {  # each prompt's metric, from HF forwards of these checkpoints
        name: last_logprob(logits_of(model, batch.tokens, batch.attention_mask), batch)
        for name, model in {"base": base, "half": halfway, "donor": donor}.items()
    }
    table = dose_response(models, batch, strengths=[0, 0.5, 1], positions="ALL")
    assert list(table.strength) == [0, 0.5, 1] and list(table.n) == [6] * 3
    for row, name in zip(table.itertuples(), ("base", "half", "donor")):
        assert row.metric == pytest.approx(float(own[name].mean()), abs=1e-4)
        assert row.metric_low <= row.metric <= row.metric_high
    assert table.recovery.iloc[0] == 0 and table.recovery.iloc[-1] == 1
    assert table.recovery_low.iloc[1] <= table.recovery.iloc[1] <= table.recovery_high.iloc[1]
    # Ranks: the top 3 directions of every o and MLP matrix, at every position.
    ranked = dose_response(models, batch, ranks=[0, 3, None], components="o+ffn", positions="ALL")
    hand = hand_made(
        base, donor, {(i, (*MLP_OUT, *O, "up_proj", "gate_proj")): top(3) for i in range(3)}
    )
    three = last_logprob(logits_of(hand, batch.tokens, batch.attention_mask), batch)
    assert ranked.metric.iloc[1] == pytest.approx(float(three.mean()), abs=1e-4)
    assert ranked.metric.iloc[0] == pytest.approx(float(own["base"].mean()), abs=1e-4)
    assert ranked["rank"].isna().tolist() == [False, False, True]
    # A minimal graft's cells, given as the result (its position groups) or as its table.
    found = gl.find_minimal_graft(models, batch, fraction=0.3, components="o+ffn", progress=False)
    by_result = dose_response(models, batch, strengths=[0.5], cells=found)
    assert by_result.equals(dose_response(models, batch, strengths=[0.5], cells=found.cells))


def test_direction_estimates_are_finite_differences_and_exact_effects_hand_made_grafts(llama):
    base, donor, models = llama
    batch = batch_for(models, n=4)
    table = attribute_directions(models, batch, components="mlp_out", layers=[2], k=3)
    assert list(table.direction) == [0, 1, 2] and set(table.cell) == {"mlp_out[2]@LT"}
    last = batch.spans["last_token"]

    def metric(source_models, source):
        mask = gl.GraftMask.from_dict(
            source_models,
            {("mlp_out", 2): last.long() * source},
            attention_mask=batch.attention_mask,
        )
        logits = gl.graft_forward(
            source_models, batch.tokens, mask, batch.attention_mask, logits="all"
        )
        return last_logprob(logits, batch)

    start = metric(models, 0)
    for i in range(3):
        h = 1e-2  # a central difference of exact grafts of strength +-h of direction i alone
        plus, minus = (metric(models.directions(1, rank=[i], strength=s), 2) for s in (h, -h))
        difference = float((plus - minus).mean()) / (2 * h)
        estimate = table.estimate.iloc[i]
        assert abs(estimate - difference) <= 1e-3 + 1e-2 * abs(difference), (
            i,
            estimate,
            difference,
        )

        def one(b, d, i=i):
            U, S, Vh = torch.linalg.svd(d - b, full_matrices=False)
            return b + S[i] * torch.outer(U[:, i], Vh[i])

        single = gl.load_models(
            base, hand_made(base, donor, {(2, MLP_OUT): one}), tokenizer=models.tokenizer
        )
        assert table.exact.iloc[i] == pytest.approx(
            float((metric(single, 1) - start).mean()), abs=1e-4
        )
    assert (table.share > 0).all() and table.singular_value.is_monotonic_decreasing


def test_the_minimal_graft_reports_the_directions_it_kept_and_they_recover(llama):
    _, _, models = llama
    batch = batch_for(models, n=4)
    found = gl.find_minimal_graft(
        models,
        batch,
        fraction=0.6,
        components="attn+o+ffn",
        positions=("FE", "LT"),
        proposals=4,
        progress=False,
        directions=True,
    )
    kept = found.directions
    assert list(kept.cell) == list(found.cells.cell)
    assert ((kept.directions.isna()) | (kept.directions < kept["of"])).all()
    assert kept.recovery.iloc[-1] >= 0.6
    # The graft with each cell cut as reported, rebuilt here: a source per rank kept.
    derived, entries = models, {}
    shape = tuple(batch.tokens.shape)
    for row in kept.itertuples():
        source = 1
        if not pd.isna(row.directions):  # <NA>: the cell whole
            derived = derived.directions(1, rank=int(row.directions), name=f"cut {row.order}")
            source = len(derived) - 1
        value = entries.setdefault((row.component, int(row.layer)), torch.zeros(shape).long())
        where = batch.spans["first_entity" if row.positions == "FE" else "last_token"]
        value[where] = source
    with torch.no_grad():
        grafted = last_logprob(
            gl.graft_forward(
                derived,
                batch.tokens,
                gl.GraftMask.from_dict(derived, entries, attention_mask=batch.attention_mask),
                batch.attention_mask,
                logits="all",
            ),
            batch,
        )
        ends = [
            last_logprob(m(batch.tokens, attention_mask=batch.attention_mask), batch)
            for m in models
        ]
    recovery = float((grafted.mean() - ends[0].mean()) / (ends[1].mean() - ends[0].mean()))
    assert recovery == pytest.approx(kept.recovery.iloc[-1], abs=1e-4)


@pytest.mark.parametrize(
    ("call", "error", "named"),
    [
        (lambda m, b: dose_response(m, b), SelectionError, "sweeps one setting"),
        (lambda m, b: dose_response(m, b, strengths=[1], ranks=[1]), SelectionError, "one setting"),
        (lambda m, b: dose_response(m, b, strengths=[]), SelectionError, "non-empty"),
        (
            lambda m, b: dose_response(m, b, strengths=[float("nan")]),
            SelectionError,
            "strength=nan",
        ),
        (lambda m, b: dose_response(m, b, ranks=[-1]), SelectionError, "rank=-1"),
        (lambda m, b: dose_response(m, b, ranks=[[0, 1]]), SelectionError, "takes counts"),
        (
            lambda m, b: dose_response(m, b, ranks=[1], components="ln1"),
            SelectionError,
            "ln1 holds none",
        ),
        (
            lambda m, b: dose_response(m, b, strengths=[1], cells="mlp_out"),
            ArgumentTypeError,
            "cells=",
        ),
        (lambda m, b: dose_response(m, b, strengths=[1], donor=3), SelectionError, "donor=3"),
        (lambda m, b: attribute_directions(m, b, k=0), SelectionError, "k=0"),
        (lambda m, b: attribute_directions(m, b, k=2.5), ArgumentTypeError, "k=2.5"),
        (lambda m, b: attribute_directions(m, b, verify="yes"), ArgumentTypeError, "verify="),
        (lambda m, b: attribute_directions(m, b, components="ln1"), SelectionError, "no linear"),
        (lambda m, b: m.directions(1, strength={("nope", 1): 0.5}), SelectionError, "per-cell"),
        (lambda m, b: m.directions(1, strength={"o": 0.5}), ArgumentTypeError, "per-cell"),
        (lambda m, b: m.directions(1, rank={("o", 1): -2}), SelectionError, "rank=-2"),
        (
            lambda m, b: gl.find_minimal_graft(m, b, directions="yes"),
            ArgumentTypeError,
            "directions=",
        ),
    ],
)
def test_hostile_directions_analyses_are_refused_naming_the_argument(llama, call, error, named):
    _, _, models = llama
    batch = batch_for(models, n=2)
    with pytest.raises(error, match=named.replace("(", r"\(").replace("[", r"\[")):
        call(models, batch)


def test_the_figures_draw_a_band_and_a_panel_per_cell():
    from grafting_lens.analysis.figure_style import figure_problems
    from grafting_lens.analysis.plots import plot_directions, plot_dose_response

    table = pd.DataFrame(
        {"rank": pd.array([0, 4, None], dtype="Int64"), "n": 20, "recovery": [0, 0.5, 1.0]}
    ).assign(recovery_low=lambda t: t.recovery - 0.1, recovery_high=lambda t: t.recovery + 0.1)
    fig = plot_dose_response(table)
    high, low, line = fig.data
    assert list(line.x) == ["0", "4", "all"] and list(line.y) == [0, 0.5, 1.0]
    assert low.fill == "tonexty" and list(low.y) == [-0.1, 0.4, 0.9] and not figure_problems(fig)
    read = pd.DataFrame(
        {
            "component": ["o", "o", "mlp_out"],
            "layer": pd.array([1, 1, 2], dtype="Int64"),
            "direction": [0, 1, 0],
            "share": [0.5, 0.2, 0.9],
            "output_top": [["a", "b", "c", "d"], ["e"], ["f"]],
            "input_top": [[], [], []],
            "answers_found": [["a"], [], []],
        }
    )
    fig = plot_directions(read, tokens=2)
    assert [list(bar.text) for bar in fig.data] == [["a, b *", "e"], ["f"]]
    assert [a.text for a in fig.layout.annotations][:2] == ["o[1]", "mlp_out[2]"]
    assert not figure_problems(fig)
    with pytest.raises(gl.GraftingLensError, match="value"):
        plot_dose_response(table, value="top1")
    with pytest.raises(gl.GraftingLensError, match="lacking the columns"):
        plot_directions(table)
    with pytest.raises(SelectionError, match="tokens=0"):
        plot_directions(read, tokens=0)
