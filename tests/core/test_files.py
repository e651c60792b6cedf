"""Where files live, and writes that leave either nothing or a whole file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from grafting_lens.core import files
from grafting_lens.core.errors import RunError


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


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_taking_a_lock_names_the_directory_and_the_fix(tmp_path, monkeypatch):
    real_write = os.write

    def write(handle, data):
        if handle <= 2:  # the test's own output
            return real_write(handle, data)
        _disk_full()

    monkeypatch.setattr(files.os, "write", write)
    lock = files.DirectoryLock(tmp_path / "out", "The output directory (--out)")
    with pytest.raises(RunError, match=r"--out\) .*out cannot be written \(No space left on devi"):
        lock.acquire()
    assert not lock.held
    monkeypatch.undo()
    with files.DirectoryLock(tmp_path / "out"):  # nothing was left held
        pass


def test_writing_names_the_cause_that_decides_the_fix(tmp_path):
    causes = {
        errno.ENOSPC: "its disk is full .*: free some space there, or choose a directory on anoth",
        errno.EROFS: "its filesystem is read-only: choose a directory on a writable one",
        errno.EISDIR: "table.csv is a directory where a file belongs: remove or rename it",
        errno.EACCES: r"\(Permission denied\); choose a directory you can write to",
    }
    for code, message in causes.items():
        with pytest.raises(
            RunError, match=rf"^The table .*table\.csv cannot be written .*{message}"
        ):
            with files.writing("The table", tmp_path / "table.csv"):
                raise OSError(code, os.strerror(code))
    with files.writing("The table", tmp_path / "table.csv"):
        pass  # nothing raised, nothing to say
