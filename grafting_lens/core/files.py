"""Where grafting-lens keeps files; writing them complete, and one writer at a time.

Everything grafting-lens caches lives under one root, :func:`cache_root`. Runs get killed,
and a table written in place would be left half-written yet look finished: every file goes
to a temporary sibling first and is renamed into place (:func:`atomic_write`), or linked
into place when it records a decision two processes may race to write (:func:`write_once`).
A directory results are written into is held by one process at a time
(:class:`DirectoryLock`, an advisory lock the operating system releases when the process
ends, however it ends), and one that cannot be written is found before any work is done
(:func:`check_writable`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from grafting_lens.core.errors import GraftingLensError, RunError

__all__ = [
    "LOCK_NAME",
    "DirectoryLock",
    "atomic_write",
    "cache_root",
    "cannot_write",
    "check_writable",
    "writing",
    "write_once",
]

LOCK_NAME = ".lock"
"""The file inside a locked directory that holds the lock and names its holder."""

_HELD: dict[Path, list[int]] = {}
"""The directories this process holds: ``[open lock file, how many holders]`` each."""


def cache_root() -> Path:
    """The root of every cache: ``$GRAFTING_LENS_CACHE``, else ``~/.cache/grafting_lens``."""
    root = os.environ.get("GRAFTING_LENS_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "grafting_lens"


def atomic_write(path: str | os.PathLike, content: bytes, *, durable: bool = False) -> Path:
    """Write ``content`` to ``path`` (whose directory exists) through a temporary sibling and a
    rename; ``durable`` also flushes it to disk first, to survive a power cut (slower)."""
    path = Path(path)
    with _complete_sibling(path, content, durable=durable) as temporary:
        os.replace(temporary, path)
    return path


@contextlib.contextmanager
def _complete_sibling(path: Path, content: bytes, *, durable: bool = False) -> Iterator[str]:
    """A temporary file beside ``path`` holding all of ``content``; removed afterwards
    unless the block moved it into place."""
    handle, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".partial"
    )
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(content)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.chmod(temporary, 0o644)  # mkstemp makes it private; results are meant to be shared
        yield temporary
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def check_writable(path: str | os.PathLike, what: str = "The output directory") -> Path:
    """Check, without creating anything, that files can be written in the directory ``path``
    (or, when it does not exist, in its nearest existing parent); return it, ``~`` expanded.

    Raises:
        GraftingLensError: ``path`` is empty, is a file or lies under one, or cannot be
            written; ``what`` names it in the message.
    """
    target = Path(path).expanduser()
    existing = next(p for p in (target, *target.parents) if p.exists() or p == p.parent)
    problem = None
    if not str(path).strip():
        problem = "is an empty path, which would write into the working directory; name a directory"
    elif not existing.is_dir():
        where = "an existing file" if existing == target else f"under the file {existing}"
        problem = f"{target} is {where}; it must be a directory"
    else:
        try:
            handle, probe = tempfile.mkstemp(dir=existing, prefix=".grafting-lens-probe.")
            os.close(handle)
            os.unlink(probe)
        except OSError as error:
            made = "" if existing == target else f" (so {target} cannot be created)"
            problem = (
                f"{target} cannot be written: {existing} refuses new files "
                f"({error.strerror or error}){made}. Choose a directory you can write to"
            )
    if problem:
        raise GraftingLensError(f"{what} {problem}.")
    return target


def cannot_write(what: str, path: str | os.PathLike, error: OSError, note: str = "") -> RunError:
    """The :class:`RunError` for ``path`` that could not be written: the cause as the fix
    depends on it (a full disk, a read-only filesystem...), the fix, then ``note``."""
    path = Path(path)
    code = error.errno
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        fix = "its disk is full (or your quota is used up): free some space there, or choose a "
        fix += "directory on another disk"
    elif code == errno.EROFS:
        fix = "its filesystem is read-only: choose a directory on a writable one"
    elif code == errno.EISDIR:
        fix = f"{path} is a directory where a file belongs: remove or rename it, or write elsewhere"
    elif code == errno.ENOTDIR:
        fix = "a file stands where a directory belongs on its path: remove or rename it"
    else:
        fix = "choose a directory you can write to"
    reason = error.strerror or type(error).__name__
    return RunError(
        f"{what} {path} cannot be written ({reason}); {fix}." + (f" {note}" if note else "")
    )


@contextlib.contextmanager
def writing(what: str, path: str | os.PathLike, note: str = "") -> Iterator[None]:
    """Within this block, an OSError becomes :func:`cannot_write`'s RunError for ``path``."""
    try:
        yield
    except OSError as error:
        raise cannot_write(what, path, error, note) from None


class DirectoryLock:
    """One writing process at a time in a directory: an advisory lock on ``<dir>/.lock``.

    The holder (process, host, command, time) is written into the lock file, so that a
    second process is refused with a message naming it; the operating system releases the
    lock when the holder ends, killed or not. The lock file stays (deleting it while held
    would let two processes hold it). Re-entrant within a process: it keeps processes apart,
    not threads. A context manager, or :meth:`acquire` and :meth:`release`; ``what`` names
    the directory in messages.
    """

    def __init__(self, directory: str | os.PathLike, what: str = "The directory") -> None:
        self.directory = Path(directory)
        self.what = what
        self._key: Path | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._key is not None

    def acquire(self) -> DirectoryLock:
        """Take the lock (again, if this process holds it), creating the directory if needed.

        Raises:
            RunError: Another process holds it, or the directory cannot be written.
        """
        if self._key is not None:
            return self
        handle = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            key = self.directory.resolve()
            if key in _HELD:
                _HELD[key][1] += 1
                self._key = key
                return self
            handle = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            if _try_lock(handle, self.directory):
                me = {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "command": " ".join(sys.argv) or sys.executable,
                    "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                }
                os.ftruncate(handle, 0)
                os.lseek(handle, 0, os.SEEK_SET)
                os.write(handle, json.dumps(me).encode())  # a full disk fails here
                _HELD[key] = [handle, 1]
                self._key = key
                return self
            holder = _read_holder(handle)
        except OSError as error:
            if handle is not None:
                os.close(handle)
            raise cannot_write(self.what, self.directory, error) from None
        os.close(handle)
        raise RunError(
            f"{self.what} {self.directory} is in use by another process ({holder}): two runs "
            "writing into one directory would delete each other's files. Wait for it to finish "
            "or stop it, or choose another directory."
        )

    def release(self) -> None:
        """Release the lock (nothing happens if this object does not hold it)."""
        if self._key is None:
            return
        key, self._key = self._key, None
        held = _HELD[key]
        held[1] -= 1
        if held[1] == 0:
            del _HELD[key]
            os.close(held[0])  # closing the file releases the lock

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *error: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _try_lock(handle: int, directory: Path) -> bool:
    """Take an exclusive lock on an open file without waiting; False if another holds it."""
    try:
        if sys.platform == "win32":
            import msvcrt

            os.lseek(handle, 0, os.SEEK_SET)
            msvcrt.locking(handle, msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:  # BlockingIOError (EAGAIN) included
        if error.errno in (errno.EACCES, errno.EAGAIN, errno.EDEADLK):
            return False
        # A filesystem without locks (some network mounts): say so, and go on unlocked.
        warnings.warn(
            f"{directory} is on a filesystem that cannot lock files ({error}); nothing stops a "
            "second process from writing into it at the same time.",
            RuntimeWarning,
            stacklevel=3,
        )
    return True


def _read_holder(handle: int) -> str:
    """Who holds a lock, from what it wrote into the lock file."""
    try:
        os.lseek(handle, 0, os.SEEK_SET)
        holder = json.loads(os.read(handle, 4096).decode() or "{}")
        return (
            f"pid {holder['pid']} on {holder['host']}, running `{holder['command']}` since "
            f"{holder['since']}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"


def write_once(path: str | os.PathLike, content: bytes) -> bytes:
    """Write ``content`` to ``path`` unless the file exists; return what the file holds.

    A complete sibling is hard-linked into place, which fails if the path exists: of two
    writers the first wins. Without hard links it is renamed, if the path is still absent.
    """
    path = Path(path)
    with _complete_sibling(path, content) as temporary:
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
        except OSError:
            if not path.exists():
                os.replace(temporary, path)
    return path.read_bytes()
