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
    with pytest.raises(gl.errors.ArgumentTypeError, match="Cannot read layers from 1.5"):
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
    with pytest.raises(
        gl.errors.GraftMaskError, match=r"disagree at \('q', 0\), row 0, position 0"
    ):
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
def test_build_with_an_attention_mask_grafts_each_rows_last_real_token(three_models):
    tokens, attention_mask = _padded()
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
    assert unpadded.extend(3).lengths.tolist() == [9] * 4


@pytest.mark.parametrize("family", ["llama"])
def test_from_dict_with_an_attention_mask_records_the_rows(three_models):
    tokens, attention_mask = _padded()
    real_last = gl.engine.positions.last_token((4, 6), attention_mask).long()
    mask = gl.GraftMask.from_dict(
        three_models, {("q", 0): real_last}, attention_mask=attention_mask
    )
    assert mask.lengths.tolist() == [6, 4, 4, 4]


@pytest.mark.parametrize("family", ["llama"])
def test_builders_read_numpy_numbers_and_iterators_like_python_ones(three_models):
    tokens = random_tokens(2, 5)
    from_numpy = gl.GraftMask.build(
        three_models, tokens, positions=np.array([1]), layers=np.int64(1)
    )
    assert from_numpy == gl.GraftMask.build(three_models, tokens, positions=[1], layers=1)
    assert gl.resolve_layers([np.int64(0), 2], 3) == (0, 2)
    # An iterator of names is read once, like a list of them.
    assert gl.GraftMask.build(
        three_models, tokens, components=(name for name in ["o", "ffn"])
    ) == gl.GraftMask.build(three_models, tokens, components=["o", "ffn"])
    by_numpy = gl.GraftMask.from_dict(three_models, {("q", np.int64(-1)): np.ones((2, 5), int)})
    assert by_numpy.keys() == [("q", three_models.n_layers - 1)]


ERRORS = gl.errors


def _build(tokens=None, **options):
    given = random_tokens(2, 5) if tokens is None else tokens
    return lambda models: gl.GraftMask.build(models, given, **options)


@pytest.mark.parametrize("family", ["llama"])
@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        # True would read as source 1.
        (_build(source=True), ERRORS.ArgumentTypeError, "give an int 0..2"),
        (_build(source=1.0), ERRORS.GraftMaskError, "give an int 0..2"),
        (_build(source=5), ERRORS.GraftMaskError, "source=5, but the model set has 3"),
        (_build(tokens=[[1, 2]]), ERRORS.TokenError, r"\[\[1, 2\]\] describes no token"),
        (_build(tokens=(2, 0)), ERRORS.TokenError, r"\(batch, pos\) = \(2, 0\) describes no"),
        (_build(tokens=random_tokens(2, 5).float()), ERRORS.TokenError, "integer token ids"),
        (_build(positions=[]), ERRORS.SelectionError, r"positions=\[\] selects no position"),
        (_build(positions=True), ERRORS.SelectionError, "Cannot read positions from True"),
        # One empty list per row used to build a mask that grafts nothing, silently.
        (_build(positions=[[], []]), ERRORS.SelectionError, "selects no position in any row"),
        (_build(positions=[np.array([], int)] * 2), ERRORS.SelectionError, "selects no position"),
        (_build(layers="x"), ERRORS.SelectionError, "Cannot read layers from 'x'|Unknown layer"),
        (_build(layers=[7]), ERRORS.SelectionError, "outside the model"),
        *[
            (_build(components=bad), TypeError, "components must")
            for bad in (3, None, ["o", 3], b"o")
        ],
        (_build(components="mlp_ot"), ERRORS.ComponentError, "Did you mean 'mlp_out'"),
        (_build(components="pos_embed"), ERRORS.ComponentError, "has no 'pos_embed' component"),
        (_build(components="experts"), ERRORS.ComponentError, "has no 'experts' component"),
        (
            _build(tokens=_padded()[0], positions="last"),
            ERRORS.SelectionError,  # "last" would be the padding column of rows 1-3
            r"3 of 4 rows \(rows 1, 2, 3\) end in the pad",
        ),
        (
            _build(attention_mask=torch.ones(2, 5, device="meta")),
            ERRORS.SelectionError,  # torch: "Cannot copy out of meta tensor"
            "attention_mask must be a .* on meta",
        ),
    ],
)
def test_build_refuses_at_the_door(three_models, build, error, message):
    with pytest.raises(error, match=message):
        build(three_models)


def _from_dict(entries, shape=None, **options):
    return lambda models: gl.GraftMask.from_dict(models, entries, shape, **options)


ONES = torch.ones(2, 4, dtype=torch.long)


@pytest.mark.parametrize("family", ["llama"])
@pytest.mark.parametrize(
    ("from_dict", "error", "message"),
    [
        (
            _from_dict({("q", 0): ONES * 3}),
            ERRORS.GraftMaskError,
            r"source indices 0..2 .*holding 3..3",
        ),
        (
            _from_dict({("q", 0): ONES, ("k", 0): torch.ones(2, 5, dtype=torch.long)}),
            ERRORS.GraftMaskError,
            r"\('k', 0\) must be a \(2, 4\) \[batch, pos\] tensor.*shape \(2, 5\)",
        ),
        (
            _from_dict({("q", 0): ONES.bool()}),
            ERRORS.GraftMaskError,
            "booleans with two sources.*torch.bool",
        ),
        (_from_dict({("q", 0): ONES.float()}), ERRORS.GraftMaskError, "got torch.float32"),
        # torch: "Cannot copy out of meta tensor"
        (
            _from_dict({("q", 0): ONES.to("meta")}),
            ERRORS.GraftMaskError,
            "not on the meta device; got .* on meta",
        ),
        (
            _from_dict({("embed", 0): ONES}),
            ERRORS.GraftMaskError,
            r"\('embed', None\) for a global",
        ),
        (_from_dict({("q", None): ONES}), ERRORS.GraftMaskError, r"got \('q', None\)"),
        (_from_dict({"q": ONES}), ERRORS.GraftMaskError, "Mask keys are .*got 'q'"),
        (_from_dict({("q", 3): ONES}), ERRORS.SelectionError, "outside the model"),
        (_from_dict({("mlp_inn", 0): ONES}), ERRORS.ComponentError, "Did you mean 'mlp_in'"),
        (_from_dict({("pos_embed", None): ONES}), ERRORS.ComponentError, "has no 'pos_embed'"),
        (
            _from_dict({("q", 0): ONES, ("q", -3): ONES}),
            ERRORS.GraftMaskError,
            r"\('q', 0\) is given twice",
        ),
        (_from_dict({}), ERRORS.GraftMaskError, r"give shape=\(batch, pos\).*got None"),
        (_from_dict({}, (2, 5, 1)), ERRORS.GraftMaskError, r"got \(2, 5, 1\)"),
        (
            # "The last column": padding in rows 1-3.
            _from_dict(
                {("q", 0): torch.zeros(4, 6, dtype=torch.long).index_fill(1, torch.tensor([5]), 1)},
                attention_mask=_padded()[1],
            ),
            ERRORS.GraftMaskError,
            r"grafts \('q', 0\) at row 1, position 5, which the run's attention mask",
        ),
    ],
)
def test_from_dict_refuses_at_the_door(three_models, from_dict, error, message):
    with pytest.raises(error, match=message):
        from_dict(three_models)


def _masks(models):
    tokens, attention_mask = _padded()
    padded = gl.GraftMask.build(models, tokens, positions="last", attention_mask=attention_mask)
    return {
        "padded": padded,
        "unpadded": gl.GraftMask.build(models, (4, 6), positions="last"),
        "short": gl.GraftMask.build(models, (4, 5), positions="last"),
        "narrow": gl.GraftMask.build(models, (1, 6), positions=[0], components="q", source=2),
    }


@pytest.mark.parametrize("family", ["llama"])
@pytest.mark.parametrize(
    ("combine", "message"),
    [
        (
            lambda m: gl.GraftMask.union(m["padded"], m["unpadded"]),
            r"built for the same rows.*\[6, 4, 4, 4\]",
        ),
        (
            lambda m: gl.GraftMask.union(m["unpadded"], m["short"]),
            r"GraftMask.union needs .*\(4, 5\)",
        ),
        (lambda m: gl.GraftMask.union(), "GraftMask.union needs one or more masks"),
        (lambda m: gl.GraftMask.union(m["unpadded"], {}), r"got .*\{\}"),
        (lambda m: gl.GraftMask.union(m["unpadded"], on_conflict="first"), "on_conflict must be"),
        (lambda m: gl.GraftMask.cat([]), "GraftMask.cat needs one or more masks"),
        (lambda m: gl.GraftMask.cat([m["unpadded"], m["short"]]), "of one length and source count"),
        (lambda m: m["padded"].extend(1), r"built for padded rows.\nExtend a mask of unpadded"),
        (lambda m: m["unpadded"].extend(2.5), "new_positions must be an int >= 0, got 2.5"),
        (lambda m: m["unpadded"].extend(-1), "new_positions must be an int >= 0, got -1"),
    ],
)
def test_combining_masks_refuses_what_does_not_fit(three_models, combine, message):
    with pytest.raises(ERRORS.GraftMaskError, match=message):
        combine(_masks(three_models))


def test_numpy_numbers_read_like_python_ones_and_bools_are_refused():
    assert gl.resolve_layers((np.float32(0.5), np.float32(1.0)), 6) == (3, 4, 5)
    assert gl.resolve_layers((np.float64(0.5), 1), 6) == (3, 4, 5)
    assert gl.resolve_layers((0, 2), 6) == (0, 2)  # a tuple of ints is a list of layers
    with pytest.raises(gl.errors.ArgumentTypeError, match="Layers must be ints, got True"):
        gl.resolve_layers((True, 0.5), 6)
    with pytest.raises(
        gl.errors.ArgumentTypeError, match="Layers must be ints, got np.False_|False"
    ):
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
