"""A user's numbers: numpy's scalars count as Python's, a bool never counts."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import random_tokens

import grafting_lens as gl
from grafting_lens.core.arguments import (
    as_table,
    as_texts,
    check_table,
    is_integer,
    is_number,
    plain,
)
from grafting_lens.core.errors import ArgumentTypeError, ExperimentError, check_known
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
    for fraction, error in ((True, "ArgumentTypeError"), (np.float32(1.5), "AttributionError")):
        with pytest.raises(getattr(gl.errors, error), match="fraction must be a number in"):
            gl.find_minimal_graft(three_models, None, fraction=fraction)
    mask = gl.GraftMask.build(three_models, tokens, positions="last", source=np.int64(2))
    assert mask == gl.GraftMask.build(three_models, tokens, positions="last", source=2)
    generated = gl.graft_generate(
        three_models, tokens, mask, max_new_tokens=np.int64(2), new_token_sources=np.int32(1)
    )
    assert torch.equal(
        generated, gl.graft_generate(three_models, tokens, mask, 2, new_token_sources=1)
    )
    with pytest.raises(gl.errors.ArgumentTypeError, match="max_new_tokens must be an int >= 1"):
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


def test_a_wrong_type_is_an_argument_type_error_and_a_bad_value_the_doors_own():
    for value in (3, None, b"x", {"a": 1}, [None]):
        with pytest.raises(ArgumentTypeError, match="names"):
            as_texts(value, "names", "a name", ExperimentError)
    for value in ([], [" "]):
        with pytest.raises(ExperimentError, match="names"):
            as_texts(value, "names", "a name", ExperimentError)


def test_one_wording_of_an_unknown_name_and_a_type_error_for_a_non_name():
    assert check_known("b", ["a", "b"], "letter") == "b"
    with pytest.raises(ExperimentError, match=r"Unknown letter 'B2'\. Did you mean 'b2'\? Known"):
        check_known("B2", ["a", "b2"], "letter", ExperimentError)
    with pytest.raises(ArgumentTypeError, match="Unknown letter 3"):
        check_known(3, ["a", "b"], "letter", ExperimentError)


def test_records_and_a_dataset_are_read_as_tables_and_a_column_named_twice_is_refused():
    records = [{"text": "a", "target": "b"}, {"text": "c", "target": "d"}]
    pd.testing.assert_frame_equal(as_table(records), pd.DataFrame(records))
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(records)
    pd.testing.assert_frame_equal(as_table(dataset), pd.DataFrame(records))
    assert as_table(["a"]) == ["a"]
    twice = pd.concat([pd.DataFrame(records), pd.DataFrame(records)[["text"]]], axis=1)
    with pytest.raises(ExperimentError, match="t= has two columns named 'text'"):
        check_table(twice, "t", "a table", ExperimentError)
    with pytest.raises(ArgumentTypeError, match="t= takes a table; got list"):
        check_table(records, "t", "a table")
