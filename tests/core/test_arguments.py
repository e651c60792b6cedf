"""A user's numbers: numpy's scalars count as Python's, a bool never counts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import random_tokens

import grafting_lens as gl
from grafting_lens.core.arguments import is_integer, is_number, plain
from grafting_lens.study import Graft, RunOptions


def test_numpy_scalars_are_numbers_and_bools_are_not():
    for value in (3, np.int64(3), np.int8(3), np.uint16(3)):
        assert is_integer(value) and is_number(value)
    for value in (0.5, np.float32(0.5), np.float16(0.5)):
        assert is_number(value) and not is_integer(value)
    for value in (True, np.bool_(True), "3", None, 3j, [3]):
        assert not is_integer(value) and not is_number(value)
    assert type(plain(np.float32(0.5))) is float and type(plain(np.int64(3))) is int
    assert plain("x") == "x"


def test_torch_scalars_are_numbers_and_tensors_with_elements_are_not():
    for value in (torch.tensor(3), torch.tensor(3, dtype=torch.int8), torch.tensor([3, 4]).max()):
        assert is_integer(value) and is_number(value) and type(plain(value)) is int
    assert is_number(torch.tensor(0.5)) and not is_integer(torch.tensor(0.5))
    assert type(plain(torch.tensor(0.5))) is float
    for value in (torch.tensor(True), torch.tensor([3]), torch.tensor(1j)):
        assert not is_integer(value) and not is_number(value)
    assert type(RunOptions(batch_size=torch.tensor(4)).batch_size) is int


@pytest.mark.parametrize("family", ["llama"])
def test_numpy_numbers_are_taken_where_python_numbers_are(three_models):
    """Each of these refused a numpy number as if it were out of range; fraction first."""
    tokens = random_tokens(1, 5)
    # fraction is checked first: with a numpy float the refusal is the next argument's.
    with pytest.raises(gl.errors.AttributionError, match="method"):
        gl.find_minimal_graft(three_models, None, fraction=np.float32(0.9), method="none")
    for fraction in (True, np.float32(1.5)):
        with pytest.raises(gl.errors.AttributionError, match="fraction must be a number in"):
            gl.find_minimal_graft(three_models, None, fraction=fraction)
    mask = gl.GraftMask.build(three_models, tokens, positions="last", source=np.int64(2))
    assert mask == gl.GraftMask.build(three_models, tokens, positions="last", source=2)
    generated = gl.graft_generate(
        three_models, tokens, mask, max_new_tokens=np.int64(2), new_token_sources=np.int32(1)
    )
    assert torch.equal(
        generated, gl.graft_generate(three_models, tokens, mask, 2, new_token_sources=1)
    )
    with pytest.raises(gl.errors.GraftingError, match="max_new_tokens must be an int >= 1"):
        gl.graft_generate(three_models, tokens, mask, max_new_tokens=np.bool_(True))
    assert gl.analysis.scoring.LastTokenScorer(top_k=np.int64(3)).top_k == 3
    with pytest.raises(gl.GraftingLensError, match=r"k \(ks=, k=\) must be an integer >= 1"):
        gl.analysis.metrics.top_k_tokens(three_models.base(tokens)[:, -1], k=True)


def test_numbers_kept_in_a_runs_description_are_pythons():
    options = RunOptions(batch_size=np.int64(4), chunk_size=np.int32(8))
    assert type(options.batch_size) is int and type(options.chunk_size) is int
    graft = Graft("LT", source=np.int64(1))
    json.dumps(graft.describe())  # numpy's int64 would not serialize
    assert graft.describe() == Graft("LT", source=1).describe()
    with pytest.raises(gl.errors.ExperimentError, match="batch_size must be an integer >= 1"):
        RunOptions(batch_size=True)
