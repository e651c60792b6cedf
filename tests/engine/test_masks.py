"""Building graft masks: layers, components, unions, batches of configurations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from authors_reference import layer_groups
from authors_reference import resolve_layers as code_layers
from conftest import random_tokens

import grafting_lens as gl


@pytest.mark.parametrize("n_layers", range(4, 13))
def test_quarters_partition_the_layers(n_layers):
    quarters = [
        gl.resolve_layers(name, n_layers)
        for name in ("first_quarter", "second_quarter", "third_quarter", "last_quarter")
    ]
    flat = [layer for quarter in quarters for layer in quarter]
    assert flat == list(range(n_layers))
    # Halves round up: with an odd depth the first half has the extra layer.
    assert gl.resolve_layers("last_half", n_layers) == tuple(
        range(n_layers - n_layers // 2, n_layers)
    )
    assert len(gl.resolve_layers("first_half", n_layers)) == n_layers - n_layers // 2


@pytest.mark.parametrize("n_layers", range(4, 49))
def test_quarters_are_the_codes_layer_groups(n_layers):
    groups = layer_groups(n_layers)
    names = {"last_quarter": "fourth_quarter"}
    for name in ("all", "first_quarter", "second_quarter", "third_quarter", "last_quarter"):
        layers = gl.resolve_layers(name, n_layers, arithmetic="quarters")
        assert layers == tuple(groups[names.get(name, name)]), name
    last_half = code_layers(["third_quarter", "fourth_quarter"], n_layers)
    assert gl.resolve_layers("last_half", n_layers, arithmetic="quarters") == tuple(last_half)
    first_half = code_layers(["first_quarter", "second_quarter"], n_layers)
    assert gl.resolve_layers("first_half", n_layers, arithmetic="quarters") == tuple(first_half)
    if n_layers % 4 == 0:  # where the two arithmetics agree
        for name in gl.models.layers.LAYER_FRACTIONS:
            assert gl.resolve_layers(name, n_layers, arithmetic="quarters") == gl.resolve_layers(
                name, n_layers
            )


def test_the_arithmetics_differ_at_18_layers_and_only_for_names():
    assert gl.resolve_layers("third_quarter", 18) == (9, 10, 11, 12, 13)
    assert gl.resolve_layers("third_quarter", 18, arithmetic="quarters") == (8, 9, 10, 11)
    assert gl.resolve_layers("last_half", 18, arithmetic="quarters") == tuple(range(8, 18))
    assert gl.resolve_layers((0.5, 1.0), 18, arithmetic="quarters") == tuple(range(9, 18))
    assert gl.resolve_layers(range(3), 18, arithmetic="quarters") == (0, 1, 2)


def test_quarters_refuse_a_range_they_leave_empty_and_unknown_arithmetics():
    assert gl.resolve_layers("all", 2, arithmetic="quarters") == (0, 1)
    with pytest.raises(
        gl.errors.SelectionError, match="'first_quarter' is empty in a 2-layer model"
    ):
        gl.resolve_layers("first_quarter", 2, arithmetic="quarters")
    with pytest.raises(gl.errors.SelectionError, match="Unknown layer arithmetic 'eighths'"):
        gl.resolve_layers("all", 8, arithmetic="eighths")


def test_layer_forms():
    assert gl.resolve_layers(-1, 6) == (5,)
    assert gl.resolve_layers([3, 1, 3], 6) == (1, 3)
    assert gl.resolve_layers(range(2, 4), 6) == (2, 3)
    assert gl.resolve_layers(slice(-2, None), 6) == (4, 5)
    assert gl.resolve_layers((0.5, 1.0), 6) == (3, 4, 5)
    assert gl.resolve_layers(None, 3) == (0, 1, 2)


def test_layer_errors_name_the_problem():
    with pytest.raises(
        gl.errors.GraftMaskError, match="Layer 6 is outside the model, which has 6 layers"
    ):
        gl.resolve_layers([6], 6)
    with pytest.raises(gl.errors.GraftMaskError, match="Did you mean 'last_half'"):
        gl.resolve_layers("last_hlf", 6)
    with pytest.raises(gl.errors.GraftMaskError, match="selects no layer of a 3-layer model"):
        gl.resolve_layers((0.5, 0.6), 3)
    with pytest.raises(gl.errors.GraftMaskError, match="Cannot read layers from 1.5"):
        gl.resolve_layers(1.5, 6)


def test_build_expands_groups_per_architecture(three_models):
    tokens = random_tokens(2, 5)
    mask = gl.GraftMask.build(
        three_models, tokens, positions="last", layers="last_half", components="ffn"
    )
    components = {component for component, _ in mask.keys()}
    expected = {"mlp_in", "mlp_out"} | (
        {"mlp_gate"} if "mlp_gate" in three_models.components else set()
    )
    assert components == expected
    assert {layer for _, layer in mask.keys()} == set(
        gl.resolve_layers("last_half", three_models.n_layers)
    )
    for key in mask.keys():
        assert mask[key][:, -1].eq(1).all() and mask[key][:, :-1].eq(0).all()


def test_build_ignores_layers_for_global_components(three_models):
    mask = gl.GraftMask.build(three_models, (1, 4), layers=[0], components="embed+unembed+q")
    assert set(mask.keys()) == {("embed", None), ("q", 0), ("unembed", None)}


def test_unknown_and_missing_components(three_models):
    with pytest.raises(gl.errors.ComponentError, match="Did you mean 'mlp_out'"):
        gl.GraftMask.build(three_models, (1, 4), components="mlp_ot")
    with pytest.raises(gl.errors.ComponentError, match="Did you mean 'mlp_in'"):
        gl.GraftMask.from_dict(three_models, {("mlp_inn", 0): torch.ones(1, 4, dtype=torch.long)})
    missing = next(c for c in ("mlp_gate", "pos_embed") if c not in three_models.components)
    with pytest.raises(gl.errors.ComponentError, match=f"has no '{missing}' component"):
        gl.GraftMask.build(three_models, (1, 4), components=missing)


def test_the_papers_labels_are_components_in_any_spelling(three_models):
    available = set(three_models.components)
    up = {"mlp_in", "mlp_gate"} & available  # the gate where the MLP has one
    for spelled in ("FFN-up", "ffn_up", "Ffn-Up"):
        mask = gl.GraftMask.build(three_models, (1, 4), components=f"O+{spelled}")
        assert {name for name, _ in mask.keys()} == {"o"} | up
    mask = gl.GraftMask.build(three_models, (1, 4), components=["ATTN", "FFN-down"])
    assert {name for name, _ in mask.keys()} == (
        {"mlp_out"} | set(gl.models.components.COMPONENT_GROUPS["attn"])
    ) & available
    if "mlp_gate" in available:
        mask = gl.GraftMask.build(three_models, (1, 4), components="FFN-gate")
        assert {name for name, _ in mask.keys()} == {"mlp_gate"}
    else:
        with pytest.raises(gl.errors.ComponentError, match="none of FFN-gate's components"):
            gl.GraftMask.build(three_models, (1, 4), components="FFN-gate")


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [("FFN-upp", "FFN-up"), ("ffn_dwn", "FFN-down"), ("FFNup", "FFN-up"), ("atn", "attn")],
)
def test_a_misspelt_label_suggests_the_label(three_models, typo, suggestion):
    with pytest.raises(
        gl.errors.ComponentError, match=f"Unknown component '{typo}'. Did you mean '{suggestion}'"
    ):
        gl.GraftMask.build(three_models, (1, 4), components=typo)


def test_from_dict_validates_keys_shapes_and_sources(three_models):
    ones = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(gl.errors.GraftMaskError, match="names source 3"):
        gl.GraftMask.from_dict(three_models, {("q", 0): ones * 3})
    with pytest.raises(gl.errors.GraftMaskError, match=r"shape \(2, 5\), expected \(2, 4\)"):
        gl.GraftMask.from_dict(
            three_models, {("q", 0): ones, ("k", 0): torch.ones(2, 5, dtype=torch.long)}
        )
    with pytest.raises(gl.errors.GraftMaskError, match="ambiguous with 3 sources"):
        gl.GraftMask.from_dict(three_models, {("q", 0): ones.bool()})
    with pytest.raises(gl.errors.GraftMaskError, match="global component"):
        gl.GraftMask.from_dict(three_models, {("embed", 0): ones})
    with pytest.raises(gl.errors.GraftMaskError, match="outside the model"):
        gl.GraftMask.from_dict(three_models, {("q", three_models.n_layers): ones})
    with pytest.raises(gl.errors.GraftMaskError, match="source=5"):
        gl.GraftMask.build(three_models, (2, 4), source=5)


def test_union_and_conflicts(three_models):
    tokens = random_tokens(1, 5)
    attention = gl.GraftMask.build(
        three_models, tokens, positions=[0, -1], components="attn", source=1
    )
    recall = gl.GraftMask.build(
        three_models, tokens, positions="last", layers="last_half", components="o+ffn", source=2
    )
    hybrid = gl.GraftMask.union(attention, recall)
    assert hybrid[("q", 0)].tolist() == [[1, 0, 0, 0, 1]]
    last = three_models.n_layers - 1
    assert hybrid[("mlp_out", last)].tolist() == [[0, 0, 0, 0, 2]]
    everything_2 = gl.GraftMask.build(three_models, tokens, positions=[0], components="q", source=2)
    with pytest.raises(gl.errors.GraftMaskError, match="disagree"):
        gl.GraftMask.union(attention, everything_2)
    painted = gl.GraftMask.union(attention, everything_2, on_conflict="last")
    assert painted[("q", 0)].tolist() == [[2, 0, 0, 0, 1]]


def test_cat_stacks_configurations_as_rows(three_models):
    tokens = random_tokens(1, 6, seed=3)
    configurations = [
        gl.GraftMask.from_dict(three_models, {}, shape=(1, 6)),
        gl.GraftMask.build(three_models, tokens, positions="last", components="all", source=1),
        gl.GraftMask.build(three_models, tokens, positions=[0, 1], components="block", source=2),
    ]
    stacked = gl.GraftMask.cat(configurations)
    assert stacked.shape == (3, 6)
    batched = gl.graft_forward(three_models, tokens.repeat(3, 1), stacked)
    for row, mask in enumerate(configurations):
        alone = gl.graft_forward(three_models, tokens, mask)
        assert (batched[row] - alone[0]).abs().max() <= 1e-4


def test_boolean_masks_with_two_sources(tokenizer):
    from conftest import random_model

    models = gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer)
    selected = torch.tensor([[False, True, False]])
    mask = gl.GraftMask.from_dict(models, {("o", 1): selected})
    assert mask[("o", 1)].tolist() == [[0, 1, 0]]
    frame = mask.to_frame()
    assert frame.to_dict("records") == [{"component": "o", "layer": 1, "source": 1, "positions": 1}]


# --------------------------------------------- masks remember the rows they are for

PAD = 0  # the test tokenizer's pad id (also its BOS and EOS)


def _padded(batch: int = 4, pos: int = 6, length: int = 4):
    """Right-padded tokens: row 0 full, the others ``length`` real tokens."""
    tokens = random_tokens(batch, pos, seed=7)
    attention_mask = torch.ones_like(tokens)
    attention_mask[1:, length:] = 0
    return tokens.masked_fill(attention_mask == 0, PAD), attention_mask


@pytest.mark.parametrize("family", ["llama"])
def test_build_refuses_padded_tokens_without_their_attention_mask(three_models):
    tokens, attention_mask = _padded()
    # Without the attention mask "last" would be the padding column of rows 1-3.
    with pytest.raises(
        gl.errors.GraftMaskError, match="3 of 4 rows \\(rows 1, 2, 3\\) end in the pad"
    ):
        gl.GraftMask.build(three_models, tokens, positions="last")
    mask = gl.GraftMask.build(three_models, tokens, positions="last", attention_mask=attention_mask)
    assert mask[("q", 0)].nonzero().tolist() == [[0, 5], [1, 3], [2, 3], [3, 3]]
    assert mask.lengths.tolist() == [6, 4, 4, 4]


@pytest.mark.parametrize("family", ["llama"])
def test_masks_record_row_lengths_through_cat_union_and_extend(three_models):
    tokens, attention_mask = _padded()
    last = gl.GraftMask.build(three_models, tokens, positions="last", attention_mask=attention_mask)
    first = gl.GraftMask.build(
        three_models, tokens, positions=[1], components="o", attention_mask=attention_mask
    )
    assert gl.GraftMask.union(last, first).lengths.tolist() == [6, 4, 4, 4]
    assert gl.GraftMask.cat([last, first]).lengths.tolist() == [6, 4, 4, 4] * 2
    unknown = gl.GraftMask.from_dict(three_models, {}, shape=(4, 6))
    assert unknown.lengths is None
    assert gl.GraftMask.cat([last, unknown]).lengths is None
    unpadded = gl.GraftMask.build(three_models, (4, 6), positions="last")
    with pytest.raises(gl.errors.GraftMaskError, match="built for rows of different lengths"):
        gl.GraftMask.union(last, unpadded)
    assert unpadded.extend(3).lengths.tolist() == [9] * 4
    with pytest.raises(gl.errors.GraftMaskError, match="built for padded rows"):
        last.extend(1)
    with pytest.raises(
        gl.errors.GraftMaskError, match="new_positions must be an int >= 0, got 2.5"
    ):
        unpadded.extend(2.5)


@pytest.mark.parametrize("family", ["llama"])
def test_from_dict_with_an_attention_mask_refuses_grafts_on_padding(three_models):
    tokens, attention_mask = _padded()
    column = torch.zeros(4, 6, dtype=torch.long)
    column[:, -1] = 1  # "the last column": padding in rows 1-3
    with pytest.raises(gl.errors.GraftMaskError, match="grafts \\('q', 0\\) at row 1, position 5"):
        gl.GraftMask.from_dict(three_models, {("q", 0): column}, attention_mask=attention_mask)
    real_last = gl.engine.positions.last_token((4, 6), attention_mask).long()
    mask = gl.GraftMask.from_dict(
        three_models, {("q", 0): real_last}, attention_mask=attention_mask
    )
    assert mask.lengths.tolist() == [6, 4, 4, 4]


@pytest.mark.parametrize("family", ["llama"])
def test_build_arguments_of_the_wrong_kind_are_refused(three_models):
    tokens = random_tokens(2, 5)
    for source in (True, 1.0):  # True would read as source 1
        with pytest.raises(gl.errors.GraftMaskError, match="give an int 0..2"):
            gl.GraftMask.build(three_models, tokens, source=source)
    with pytest.raises(TypeError, match="tokens must be a \\[batch, pos\\] tensor"):
        gl.GraftMask.build(three_models, [[1, 2]])
    with pytest.raises(gl.errors.GraftMaskError, match="positions=\\[\\] selects no position"):
        gl.GraftMask.build(three_models, tokens, positions=[])
    with pytest.raises(gl.errors.GraftMaskError, match="Cannot read positions from True"):
        gl.GraftMask.build(three_models, tokens, positions=True)
    # numpy layers and positions read like Python ones
    from_numpy = gl.GraftMask.build(
        three_models, tokens, positions=np.array([1]), layers=np.int64(1)
    )
    assert from_numpy == gl.GraftMask.build(three_models, tokens, positions=[1], layers=1)
    assert gl.resolve_layers([np.int64(0), 2], 3) == (0, 2)


@pytest.mark.parametrize("family", ["llama"])
def test_selectors_of_the_wrong_type_or_selecting_nothing_name_the_argument(three_models):
    tokens = random_tokens(1, 5)
    for components in (3, None, ["o", 3], b"o"):
        with pytest.raises(TypeError, match="components must"):
            gl.GraftMask.build(three_models, tokens, components=components)
    # One empty list per row used to build a mask that grafts nothing, silently.
    for empty in ([[]], [np.array([], dtype=int)]):
        with pytest.raises(gl.errors.SelectionError, match="selects no position in any row"):
            gl.GraftMask.build(three_models, tokens, positions=empty)
    with pytest.raises(gl.errors.SelectionError, match="Cannot read layers from 'x'|Unknown layer"):
        gl.GraftMask.build(three_models, tokens, layers="x")
    # An iterator of names is read once, like a list of them.
    assert gl.GraftMask.build(
        three_models, tokens, components=(name for name in ["o", "ffn"])
    ) == gl.GraftMask.build(three_models, tokens, components=["o", "ffn"])


def test_numpy_numbers_read_like_python_ones_and_bools_are_refused():
    assert gl.resolve_layers((np.float32(0.5), np.float32(1.0)), 6) == (3, 4, 5)
    assert gl.resolve_layers((np.float64(0.5), 1), 6) == (3, 4, 5)
    assert gl.resolve_layers((0, 2), 6) == (0, 2)  # a tuple of ints is a list of layers
    with pytest.raises(gl.errors.SelectionError, match="Layers must be ints, got True"):
        gl.resolve_layers((True, 0.5), 6)
    with pytest.raises(gl.errors.SelectionError, match="Layers must be ints, got np.False_|False"):
        gl.resolve_layers(np.array([False]), 6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
@pytest.mark.parametrize("family", ["llama"])
def test_masks_of_tensors_on_another_device_are_kept_on_the_cpu(three_models):
    """Masks combine (union, cat, the check against a run's padding) on one device: a mask
    made of GPU tensors is moved to the CPU, and a run moves it to the models'."""
    tokens = random_tokens(2, 5)
    cpu = gl.GraftMask.build(three_models, tokens, positions="last", components="o")
    gpu = gl.GraftMask({key: cpu[key].cuda() for key in cpu.keys()}, cpu.shape, 3)
    assert all(gpu[key].device.type == "cpu" for key in gpu.keys())
    assert gl.GraftMask.union(cpu, gpu) == cpu and len(gl.GraftMask.cat([cpu, gpu])) == 4
    attention_mask = torch.ones_like(tokens).cuda()
    assert torch.equal(
        gl.graft_forward(three_models, tokens, gpu, attention_mask=attention_mask),
        gl.graft_forward(three_models, tokens, cpu),
    )
