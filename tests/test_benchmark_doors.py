"""The benchmark scripts refuse a bad option before any work, in one line (issue 44)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its helpers (devices.py) beside it
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--world", "mars"], "choose from 'toy', 'smollm2', 'gemma3'"),
        (["--relations", "0"], "--relations: '0' is not a whole number >= 1"),
        (["--threads", "0"], "--threads: '0' is not a whole number >= 1"),
        (["--batch-size", "x"], "--batch-size: 'x' is not a whole number >= 1"),
        (["--fraction", "nan"], "--fraction: 'nan' is not a fraction in (0, 1]"),
        (["--cells", "{tmp}"], "is a directory"),
        (["--cells", "{tmp}/file.txt/cells.csv"], "must be a directory"),
    ],
)
def test_the_minimal_graft_benchmark_refuses_bad_options_before_the_search(
    tmp_path, capsys, monkeypatch, argv, named
):
    (tmp_path / "file.txt").write_text("")
    script = _script("minimal_graft", monkeypatch)
    monkeypatch.setattr(script, "real_world_setup", lambda *a, **k: pytest.fail("it loaded"))
    monkeypatch.setattr(script.study, "toy_setup", lambda *a, **k: pytest.fail("it loaded"))
    with pytest.raises(SystemExit) as stopped:
        script.main([arg.format(tmp=tmp_path) for arg in argv])
    assert stopped.value.code == 2
    assert named in capsys.readouterr().err
