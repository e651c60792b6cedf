"""Where grafting-lens keeps files, and writing them so that a file that exists is complete.

Everything grafting-lens caches (toy worlds, the kernel decisions of this machine)
lives under one root, :func:`cache_root`.

Runs get killed (a notebook kernel restarted, a job out of time). A table or
figure written in place would then be left half-written yet look finished, and a
resumed run would trust it. Every file grafting-lens writes goes to a temporary
sibling first and is renamed into place, which is atomic on one filesystem. A file
that records a decision (:func:`write_once`) is linked into place instead, so that of
two processes writing it at once the first wins and both read the same.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """The root of every cache: ``$GRAFTING_LENS_CACHE``, else ``~/.cache/grafting_lens``."""
    root = os.environ.get("GRAFTING_LENS_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "grafting_lens"


def atomic_write(path: str | os.PathLike, content: bytes) -> Path:
    """Write ``content`` to ``path`` through a temporary sibling and a rename.

    Returns:
        The path written.
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".partial"
    )
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(content)
        os.chmod(temporary, 0o644)  # mkstemp makes it private; results are meant to be shared
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return path


def write_once(path: str | os.PathLike, content: bytes) -> bytes:
    """Write ``content`` to ``path`` unless the file exists; return what the file holds.

    A complete temporary sibling is hard-linked into place, which fails if the path
    exists: of two processes writing at once, the first to link wins and both read
    its content. Where a file system has no hard links, the sibling is renamed into
    place if the path is still absent (two writers can then race in the gap).
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".partial"
    )
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(content)
        os.chmod(temporary, 0o644)
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
        except OSError:
            if not path.exists():
                os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path.read_bytes()
