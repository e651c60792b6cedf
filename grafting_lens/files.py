"""Writing result files so that a file that exists is complete.

Runs get killed (a notebook kernel restarted, a job out of time). A table or
figure written in place would then be left half-written yet look finished, and a
resumed run would trust it. Every file grafting-lens writes goes to a temporary
sibling first and is renamed into place, which is atomic on one filesystem.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
