"""What the fuzzer's long profile found, kept as plain regression tests: each raised a raw
error (or wrote where it was not asked to) before, and is refused by name now."""

from __future__ import annotations

import contextlib

import pytest
import torch

import grafting_lens as gl
from grafting_lens.core.errors import GraftingLensError


def test_a_position_function_that_raises_is_named(world):
    batch = world.batch
    with pytest.raises(gl.errors.SelectionError, match="The position function .* raised"):
        gl.select_positions(object, batch.spans, batch.attention_mask)  # object() takes none


def test_positions_as_0d_tensors_are_indices(world):
    tokens = world.batch.tokens[:1, :6]
    given = gl.GraftMask.build(world.models, tokens, positions=[torch.tensor(2)])
    plain = gl.GraftMask.build(world.models, tokens, positions=[2])
    assert all(torch.equal(given[key], plain[key]) for key in plain.keys())


@pytest.mark.parametrize(
    "call, error, named",
    [
        (
            lambda w: gl.patch_forward(w.models, w.batch.tokens, "resid_pre", direction=[]),
            "ArgumentTypeError",
            "[]",
        ),
        (
            lambda w: gl.attribute_grafts(w.models, w.batch, metric=[], progress=False),
            "ArgumentTypeError",
            "[]",
        ),
        (
            lambda w: gl.run_position_grafting(
                w.models, w.batch, source=torch.tensor([1, 2]), progress=False
            ),
            "GraftingLensError",
            "source",
        ),
        (lambda w: gl.resolve_layers("all", 1.5), "ArgumentTypeError", "n_layers"),
        (
            lambda w: gl.load_models(w.base, w.donor, names=["a", "a"], tokenizer=w.tokenizer),
            "GraftingLensError",
            "'a' twice",
        ),
        (
            lambda w: gl.run_experiment(w.models, [], ["PRE"]),
            "ExperimentError",
            "test_sets",
        ),
    ],
    ids=["direction=[]", "metric=[]", "source tensor", "n_layers=1.5", "names twice", "no sets"],
)
def test_arguments_the_fuzzer_found_are_refused_by_name(world, call, error, named):
    with pytest.raises(GraftingLensError) as refused:
        call(world)
    assert type(refused.value).__name__ == error or error == "GraftingLensError"
    assert named in str(refused.value)


def test_an_empty_cache_dir_is_refused_not_the_working_directory(tmp_path):
    with contextlib.chdir(tmp_path), pytest.raises(gl.errors.WorldCacheError, match="cache_dir=''"):
        gl.build_toy_world(cache_dir="", progress=False)
    assert not list(tmp_path.iterdir())
