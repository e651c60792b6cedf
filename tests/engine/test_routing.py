"""Routing: plans made on the host, indices on the device of the activation they index."""

from __future__ import annotations

import pytest
import torch
from conftest import DeviceMixes, random_mask, random_model, random_tokens, split_onto_meta

import grafting_lens as gl
from grafting_lens.engine import routing
from grafting_lens.engine.relaxation import relaxing
from grafting_lens.engine.routing import GraftState, Plan


def test_plans_are_made_on_the_host_and_placed_per_device(three_models):
    mask = random_mask(three_models, (3, 5))
    state = GraftState(mask)
    # The full window's plans exist before any forward pass, on the host.
    distinct = {id(values) for values in state.masks.values()}
    assert len(state._plans) == len(distinct)
    plan = state.plan(next(iter(mask.keys())))
    assert plan.single is None
    assert all(index.device.type == "cpu" for _, index in plan.parts)
    meta = torch.device("meta")
    placed = plan.parts_on(meta)
    assert [source for source, _ in placed] == [source for source, _ in plan.parts]
    assert all(index.device == meta for _, index in placed)
    assert [index.shape for _, index in placed] == [index.shape for _, index in plan.parts]
    assert plan.parts_on(meta) is placed  # copied once per device, then kept
    assert plan.window_on(meta).device == meta
    assert plan.window_on(meta).shape == plan.window.shape


@pytest.fixture
def split_pair(family, tokenizer) -> gl.ModelSet:
    """A fresh pair of ``family`` whose blocks from 1 on, final norm and unembedding are on ``meta``."""
    models = gl.load_models(random_model(family, 0), random_model(family, 1), tokenizer=tokenizer)
    split_onto_meta(models)
    return models


@pytest.mark.parametrize("logits", ["all", "last"])
def test_a_graft_on_a_layer_split_model_indexes_on_each_layers_device(split_pair, logits):
    tokens = random_tokens(3, 7)
    mask = random_mask(split_pair, (3, 7), seed=1)
    with DeviceMixes() as mixes:
        out = gl.graft_forward(split_pair, tokens, mask, logits=logits)
    # Every grafted slot of blocks 1-2 and the unembedding routed meta activations: an
    # index left on the CPU would meet one there.
    assert mixes.calls == []
    assert out.device.type == "meta"
    assert out.shape == (3, 1 if logits == "last" else 7, split_pair.base.cfg.d_vocab)


def test_a_relaxation_on_a_layer_split_model_mixes_on_each_layers_device(split_pair):
    tokens = random_tokens(2, 6)
    weights = {
        ("mlp_out", 0): torch.full((2, 6), 0.5, requires_grad=True),
        ("mlp_out", 2): torch.full((2, 6), 0.5, requires_grad=True),
        ("ln_final", None): torch.full((2, 6), 0.5, requires_grad=True),
    }
    with DeviceMixes() as mixes, relaxing(split_pair, weights) as model:
        logits = model(tokens)
    assert mixes.calls == []
    assert logits.device.type == "meta"


def test_a_patch_on_a_layer_split_model_writes_on_each_layers_device(split_pair):
    tokens = random_tokens(2, 6)
    with DeviceMixes() as mixes:
        logits = gl.patch_forward(split_pair, tokens, "resid_pre", layers="all", positions=[1, 4])
    assert mixes.calls == []
    assert logits.device.type == "meta"
    assert logits.shape == (2, 6, split_pair.base.cfg.d_vocab)


def test_a_graft_on_each_device_equals_the_oracle(device, tokenizer):
    models = gl.load_models(
        random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer, device=device
    )
    tokens = random_tokens(2, 6)
    mask = random_mask(models, (2, 6), seed=2)
    logits = gl.graft_forward(models, tokens, mask, logits="all")
    assert logits.device.type == device.type
    expected = gl.graft_forward_reference(models, tokens, mask)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


# ------------------------------------------ slices where the mask's positions form runs


def _runs_mask(kind: str, batch: int = 4, pos: int = 16) -> torch.Tensor:
    """``[batch, pos]`` source indices (of three sources) shaped as ``kind`` says."""
    values = torch.zeros(batch, pos, dtype=torch.long)
    if kind == "shared":  # the paper's spans, the same in every row: FE, LT, (FE+LT)^C
        values[:, 2:5] = 1
        values[:, -1] = 2
    elif kind == "holes":  # a span with a hole in it
        values[:, 2:7] = 1
        values[:, 4] = 0
    elif kind == "per_row":  # each row's entity at its own place
        for row in range(batch):
            values[row, row : row + 2] = 1 + row % 2
    elif kind == "left_padded":  # the runs of a left-padded batch: each row's end
        for row in range(batch):
            values[row, pos - 2 - row : pos - row] = 1
            values[row, -1] = 2
    elif kind == "whole_rows":  # one configuration per row
        values[: batch // 2] = 1
    elif kind == "scattered":  # no runs: every position its own source
        generator = torch.Generator().manual_seed(3)
        values = torch.randint(0, 3, (batch, pos), generator=generator)
    return values


@pytest.mark.parametrize(
    ("kind", "path", "grid"),
    [
        ("shared", "slices", (4, 16)),
        ("holes", "slices", (4, 16)),
        ("per_row", "slices", (1, 64)),
        ("left_padded", "slices", (1, 64)),
        ("whole_rows", "slices", (1, 64)),
        ("scattered", "gather", (1, 64)),
    ],
)
def test_a_mask_whose_positions_form_runs_takes_the_slice_path(kind, path, grid):
    plan = Plan.of(_runs_mask(kind), 3)
    assert plan.path == path
    assert plan.grid == grid
    if path == "slices":
        # The runs cover the grid's row once, in order, each naming a part.
        assert plan.runs is not None
        assert plan.runs[0][1] == 0 and plan.runs[-1][2] == grid[1]
        assert all(a[2] == b[1] for a, b in zip(plan.runs, plan.runs[1:]))
    assert Plan.of(torch.ones(4, 16, dtype=torch.long), 3).path == "single"


def test_a_source_whose_rows_are_one_run_is_handed_a_view():
    plan = Plan.of(_runs_mask("whole_rows"), 3)
    rows = torch.randn(64, 5)
    taken = [plan.take(rows, part) for part in range(len(plan.parts))]
    # Rows 0-1 (positions 0-31) are the donor's, rows 2-3 the base's: views, nothing copied.
    assert [piece.data_ptr() for piece in taken] == [rows[32].data_ptr(), rows[0].data_ptr()]
    assert torch.equal(plan.put(taken), rows)


@pytest.mark.parametrize("kind", ["shared", "holes", "per_row", "left_padded", "whole_rows"])
def test_take_and_put_by_slices_equal_them_by_index(kind):
    values = _runs_mask(kind)
    sliced = Plan.of(values, 3)
    gathered = Plan(sliced.window, None, sliced.parts)  # the same parts, no runs
    assert sliced.path == "slices" and gathered.path == "gather"
    rows = torch.randn(64, 2, 3)
    for part, (source, index) in enumerate(sliced.parts):
        assert torch.equal(sliced.take(rows, part), rows[index])
        assert torch.equal(gathered.take(rows, part), rows[index])
        assert bool((values.reshape(-1)[index] == source).all())
    pieces = [gathered.take(rows, part) * 2 for part in range(len(sliced.parts))]
    assert torch.equal(sliced.put(pieces), rows * 2)
    assert torch.equal(gathered.put(pieces), rows * 2)


def _right_padded(batch: int, pos: int) -> torch.Tensor:
    lengths = torch.tensor([pos - row % 3 for row in range(batch)])
    return (torch.arange(pos)[None, :] < lengths[:, None]).long()


@pytest.mark.parametrize(
    "kind", ["shared", "holes", "per_row", "left_padded", "whole_rows", "scattered", "padded"]
)
@pytest.mark.parametrize("logits", ["all", "last"])
def test_the_slice_path_and_the_gather_path_give_identical_logits(
    three_models, monkeypatch, kind, logits
):
    tokens = random_tokens(4, 16, seed=4)
    attention_mask = _right_padded(4, 16) if kind == "padded" else None
    values = _runs_mask("shared" if kind == "padded" else kind)
    if attention_mask is not None:  # the last real token of each row, never the padding
        values = values * attention_mask
        values[torch.arange(4), attention_mask.sum(1) - 1] = 2
    mask = gl.GraftMask.from_dict(
        three_models,
        {pair: values for pair in three_models.pairs},
        attention_mask=attention_mask,
    )
    key = next(iter(mask.keys()))
    results, paths = [], []
    for rows in (1, 10**6):  # every mask by slices, then every mask by index
        monkeypatch.setattr(routing, "MIN_RUN_ROWS", rows)
        paths.append(GraftState(mask).plan(key).path)
        results.append(
            gl.graft_forward(
                three_models, tokens, mask, attention_mask=attention_mask, logits=logits
            )
        )
    assert paths == ["slices", "gather"]
    assert torch.equal(results[0], results[1])
    # The donors moved the logits: the two paths agree on a real graft.
    base = gl.GraftMask.from_dict(
        three_models,
        {pair: torch.zeros_like(values) for pair in three_models.pairs},
        attention_mask=attention_mask,
    )
    plain = gl.graft_forward(
        three_models, tokens, base, attention_mask=attention_mask, logits=logits
    )
    assert (results[0] - plain).abs().max() > 1e-3
