"""Files the library reads back, with a field missing, NaN, zero or the wrong type.

A run directory (its manifest and chunk files) and the minimal-graft search's state file,
each written by a real run, then damaged one field at a time: the same call again either
gives the undamaged result (the file was rewritten or recomputed) or raises a
GraftingLensError naming the file.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

import grafting_lens as gl
from fuzz.strategies import budget
from grafting_lens.study.run_directory import _content_hash

# What a field of a JSON file becomes: gone, NaN, zero, empty, the wrong type, absurd.
DAMAGE = st.sampled_from(["missing", math.nan, 0, -1, "", None, [], {}, "text", 10**12, 1.5, True])


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside a JSON document (dict keys and list indices)."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):
            found += _paths(item, (*prefix, index))
    return found


def _damage(document: Any, path: tuple, damage: Any) -> Any:
    holder = document
    for key in path[:-1]:
        holder = holder[key]
    if damage == "missing":
        del holder[path[-1]]  # a dict's key, or a list's item
    else:
        holder[path[-1]] = damage
    return document


def _refused_by_name(error: gl.GraftingLensError, file: Path) -> None:
    message = str(error)
    assert file.name in message or str(file.parent) in message, (
        f"a damaged {file.name} refused without naming it: {message!r}"
    )


_RUNS: dict[str, Any] = {}


def _first_run(world) -> tuple[Path, pd.DataFrame]:
    """A run directory written by run_experiment, and its rows (once per session)."""
    if "run" not in _RUNS:
        from grafting_lens.study import make_test_sets

        relations = gl.worlds.data.make_relations("fake_movies_real_actors", n=3, seed=0)
        (test_set,) = make_test_sets(relations, prompts=("headline",))
        out = Path(tempfile.mkdtemp(prefix="fuzz-run-"))
        rows = gl.run_experiment(
            world.models, test_set, ["PRE", "SFT", "LT"], out=out, progress=False
        )
        _RUNS["run"] = (out, test_set, rows)
    return _RUNS["run"]


@budget(30)
@given(data=st.data())
def test_run_directory_files(world, data):
    out, test_set, rows = _first_run(world)
    files = sorted(p for p in out.rglob("*.json") if p.is_file())
    file = data.draw(st.sampled_from(files), "file")
    document = json.loads(file.read_text())
    paths = _paths(document)
    path = data.draw(st.sampled_from(paths), "field")
    damage = data.draw(DAMAGE, "damage")
    resign = data.draw(st.booleans(), "hash rewritten")
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch, "out")
        shutil.copytree(out, copy)
        damaged_file = copy / file.relative_to(out)
        damaged = _damage(json.loads(file.read_text()), path, damage)
        if resign and isinstance(damaged, dict) and "sha256" in damaged:
            damaged["sha256"] = _content_hash(damaged)  # as if written so, not changed after
        damaged_file.write_text(json.dumps(damaged))
        try:
            again = gl.run_experiment(
                world.models, test_set, ["PRE", "SFT", "LT"], out=copy, progress=False
            )
        except gl.GraftingLensError as error:
            _refused_by_name(error, damaged_file)
            return
    columns = ["config", "text", "target", "target_rank", "target_prob"]
    pd.testing.assert_frame_equal(
        again[columns].reset_index(drop=True),
        rows[columns].reset_index(drop=True),
        check_exact=False,
        rtol=1e-5,
    )


def _search(world, state: Path):
    return gl.find_minimal_graft(
        world.models,
        world.search_batch,
        fraction=0.5,
        components="o+ffn",
        layers=[1, 2],
        steps=2,
        state=state,
        progress=False,
    )


@budget(25)
@given(data=st.data())
def test_search_state_file(world, data):
    if "search" not in _RUNS:
        state = Path(tempfile.mkdtemp(prefix="fuzz-search-"), "state.json")
        _RUNS["search"] = (state, _search(world, state))
    state, found = _RUNS["search"]
    document = json.loads(state.read_text())
    path = data.draw(st.sampled_from(_paths(document)), "field")
    damage = data.draw(DAMAGE, "damage")
    with tempfile.TemporaryDirectory() as scratch:
        damaged_file = Path(scratch, "state.json")
        damaged_file.write_text(json.dumps(_damage(json.loads(state.read_text()), path, damage)))
        try:
            again = _search(world, damaged_file)
        except gl.GraftingLensError as error:
            _refused_by_name(error, damaged_file)
            return
    assert again.cells["cell"].tolist() == found.cells["cell"].tolist(), f"{path}={damage!r}"
    assert again.recovery == pytest.approx(found.recovery, abs=1e-6)
