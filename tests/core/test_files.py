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
        errno.EFBIG: r"a file-size limit, `ulimit -f`\): raise the limit",
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


class _FullDisk:
    """A file whose writes fail as on a full disk, after part of the content went out."""

    def __init__(self, file, code):
        self.file, self.code = file, code

    def write(self, content):
        self.file.write(content[:10])
        raise OSError(self.code, os.strerror(self.code))

    def __enter__(self):
        return self

    def __exit__(self, *error):
        self.file.close()


@pytest.mark.parametrize(
    ("code", "cause"),
    [
        (errno.ENOSPC, r"\(No space left on device\); its disk is full"),
        (errno.EFBIG, r"\(File too large\); .*a file-size limit, `ulimit -f`"),
    ],
    ids=["a full disk", "a file-size limit"],
)
@pytest.mark.parametrize("write", [files.atomic_write, files.write_once], ids=lambda f: f.__name__)
def test_no_room_for_a_file_is_one_line_naming_it_and_saying_the_command_resumes(
    tmp_path, monkeypatch, code, cause, write
):
    path = tmp_path / "figure.html"
    files.atomic_write(path, b"the last complete figure")
    real = os.fdopen
    monkeypatch.setattr(
        files.os, "fdopen", lambda handle, mode: _FullDisk(real(handle, mode), code)
    )
    with pytest.raises(RunError) as raised:
        write(path, b"a figure too large for the disk")
    message = str(raised.value)
    assert "\n" not in message
    assert __import__("re").match(rf"The file {path} cannot be written {cause}", message), message
    assert message.endswith("run the same command again to carry on.")
    assert path.read_bytes() == b"the last complete figure"  # nothing lost
    assert os.listdir(tmp_path) == ["figure.html"]  # nor a partial file left


def test_a_file_size_limit_is_an_error_not_the_end_of_the_process(tmp_path):
    """Under ``ulimit -f`` the kernel sends SIGXFSZ, which kills a process that does not ignore
    it: Python ignores it, so the write fails with EFBIG, said as above."""
    import subprocess
    import sys

    script = (
        "import resource, sys\n"
        "from grafting_lens.core import files\n"
        "from grafting_lens.core.errors import RunError\n"
        "hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))\n"
        "try:\n"
        "    files.atomic_write(sys.argv[1], bytes(200_000))\n"
        "except RunError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "big.html")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "big.html cannot be written (File too large)" in done.stdout
    assert os.listdir(tmp_path) == []


def test_a_file_where_a_directory_must_be_is_named_as_such(tmp_path):
    from grafting_lens.core import directories
    from grafting_lens.core.errors import WorldCacheError

    run = tmp_path / "run"
    run.mkdir()
    (run / "chunks").write_text("")  # a run directory whose chunks/ was replaced by a file
    said = rf"\(Not a directory\); {run / 'chunks'} is a file where a directory must be: move"
    for make in (
        lambda: (run / "chunks").mkdir(exist_ok=True),
        lambda: files.atomic_write(run / "chunks" / "m0-t0-c0.json", b"{}"),
    ):
        with pytest.raises(RunError, match=said):
            with files.writing("The run directory", run):
                make()
    with pytest.raises(RunError, match=said):
        files.DirectoryLock(run / "chunks" / "deeper").acquire()
    with pytest.raises(WorldCacheError, match=said):
        directories.make_directory(run / "chunks" / "world")
