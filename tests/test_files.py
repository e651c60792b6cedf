"""Where files live, and writes that leave either nothing or a whole file."""

from __future__ import annotations

import os
from pathlib import Path

from grafting_lens import files


def test_the_cache_root_is_the_environment_variable_else_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAFTING_LENS_CACHE", str(tmp_path))
    assert files.cache_root() == tmp_path
    monkeypatch.delenv("GRAFTING_LENS_CACHE")
    assert files.cache_root() == Path.home() / ".cache" / "grafting_lens"


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "table.csv"
    files.atomic_write(path, b"old")
    files.atomic_write(path, b"new")
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["table.csv"]


def test_write_once_keeps_the_first_content(tmp_path):
    path = tmp_path / "decision.json"
    assert files.write_once(path, b"first") == b"first"
    assert files.write_once(path, b"second") == b"first"
    assert path.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["decision.json"]


def test_write_once_without_hard_links_still_keeps_the_first(tmp_path, monkeypatch):
    def no_links(source, target):
        raise PermissionError("this file system has no hard links")

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "decision.json"
    assert files.write_once(path, b"first") == b"first"
    assert files.write_once(path, b"second") == b"first"
    assert os.listdir(tmp_path) == ["decision.json"]
