"""Where grafting-lens keeps files; writing them complete, and one writer at a time.

Everything grafting-lens caches (toy worlds, the kernel decisions of this machine)
lives under one root, :func:`cache_root`.

Runs get killed (a notebook kernel restarted, a job out of time). A table or
figure written in place would then be left half-written yet look finished, and a
resumed run would trust it. Every file grafting-lens writes goes to a temporary
sibling first and is renamed into place, which is atomic on one filesystem
(:func:`atomic_write`). A file that records a decision (:func:`write_once`) is
linked into place instead, so that of two processes writing it at once the first
wins and both read the same.

Two processes writing into one directory would delete or overwrite each other's
files. A directory that grafting-lens writes results into is held by one process
at a time (:class:`DirectoryLock`): an advisory lock on a ``.lock`` file inside it,
which the operating system releases when the process ends, however it ends, so a
lock is never left behind by a killed run. And a directory that cannot be written
is found before any work is done (:func:`check_writable`), not when the results
are ready.
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
    """Write ``content`` to ``path`` through a temporary sibling and a rename.

    Args:
        path: The file to write; its directory must exist.
        content: The bytes.
        durable: Also flush the file to disk before the rename, so that it survives a
            power cut as well as a killed process (slower; for files that say what a
            directory is, such as a run's manifest).

    Returns:
        The path written.
    """
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
    """Check, without creating anything, that files can be written at ``path``.

    ``path`` need not exist: then its nearest existing parent must be a directory this
    process can create files in (it is tried, with a temporary file that is removed).

    Args:
        path: A directory, existing or to be created.
        what: How to name it in the message.

    Returns:
        ``path``, with ``~`` expanded.

    Raises:
        GraftingLensError: ``path`` is empty, is a file or lies under one, or cannot be
            written (read-only, no permission, a full or read-only filesystem).
    """
    if not str(path).strip():
        raise GraftingLensError(
            f"{what} is an empty path; name a directory (an empty path would write into the "
            "working directory)."
        )
    target = Path(path).expanduser()
    existing = next(p for p in (target, *target.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        where = "is an existing file" if existing == target else f"lies under the file {existing}"
        raise GraftingLensError(f"{what} {target} {where}; it must be a directory.")
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".grafting-lens-probe.")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        reason = error.strerror or str(error)
        made = "" if existing == target else f" (so {target} cannot be created)"
        raise GraftingLensError(
            f"{what} {target} cannot be written: {existing} refuses new files ({reason}){made}. "
            "Choose a directory you can write to."
        ) from None
    return target


def cannot_write(what: str, path: str | os.PathLike, error: OSError, note: str = "") -> RunError:
    """The :class:`RunError` for a file or directory ``path`` that could not be written.

    Names ``what`` and ``path``, the cause as the fix depends on it (a full disk, a
    read-only filesystem, no permission, a directory where a file belongs), and the fix,
    then ``note`` (what was kept, say). Raise it ``from None``: the OSError's traceback
    says nothing more.
    """
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
    """Within this block, an OSError becomes :func:`cannot_write`'s RunError for ``path``.

    For the files a run or a report writes (tables, chunks, manifests): a full disk or a
    directory standing where a table belongs is then an error that names the file and
    the fix, not a traceback.
    """
    try:
        yield
    except OSError as error:
        raise cannot_write(what, path, error, note) from None


class DirectoryLock:
    """One writing process at a time in a directory: an advisory lock on ``<dir>/.lock``.

    Taking the lock creates the directory if needed and writes the holder (process id,
    host, command, time) into the lock file, so that a second process is refused with
    a message saying who holds it. The operating system releases the lock when the
    holder ends, killed or not: a lock is never stale. The lock file itself stays (it
    is empty of meaning once released); deleting it while held would let two
    processes hold it. Within one process the lock is re-entrant (the command holds
    its output directory while the report writer takes it again), so it keeps
    processes apart, not threads.

    Use it as a context manager, or call :meth:`acquire` and :meth:`release`.

    Args:
        directory: The directory to hold.
        what: How to name the directory in messages ("The run directory").
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
        """Take the lock, creating the directory if needed.

        A process that holds the lock already (through another ``DirectoryLock``) takes
        it again: the lock keeps processes apart, not the parts of one.

        Raises:
            RunError: Another process holds it (the message names that process), or the
                directory cannot be created or written.
        """
        if self._key is not None:
            return self
        path = self.directory / LOCK_NAME
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            key = self.directory.resolve()
            if key in _HELD:
                _HELD[key][1] += 1
                self._key = key
                return self
            handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise cannot_write(self.what, self.directory, error) from None
        try:
            locked = _try_lock(handle)
        except OSError as error:
            # A filesystem without locks (some network mounts): say so, and go on unlocked.
            warnings.warn(
                f"{self.directory} is on a filesystem that cannot lock files ({error}); "
                "nothing stops a second process from writing into it at the same time.",
                RuntimeWarning,
                stacklevel=2,
            )
            locked = True
        if not locked:
            holder = _read_holder(handle)
            os.close(handle)
            raise RunError(
                f"{self.what} {self.directory} is in use by another process ({holder}). Two "
                "runs writing into one directory would delete each other's files: wait for it "
                "to finish or stop it, or choose another directory. (A process that has ended "
                "holds no lock, so this is a live one.)"
            )
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(sys.argv) or sys.executable,
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        try:
            os.ftruncate(handle, 0)
            os.lseek(handle, 0, os.SEEK_SET)
            os.write(handle, json.dumps(me).encode())
        except OSError as error:
            # A full disk: the lock file exists, but who holds it cannot be written.
            os.close(handle)
            raise cannot_write(self.what, self.directory, error) from None
        _HELD[key] = [handle, 1]
        self._key = key
        return self

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


def _try_lock(handle: int) -> bool:
    """Take an exclusive lock on an open file without waiting; False if another holds it."""
    if sys.platform == "win32":
        import msvcrt

        os.lseek(handle, 0, os.SEEK_SET)
        try:
            msvcrt.locking(handle, msvcrt.LK_NBLCK, 1)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EDEADLK):
                return False
            raise
        return True
    import fcntl

    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise
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

    A complete temporary sibling is hard-linked into place, which fails if the path
    exists: of two processes writing at once, the first to link wins and both read
    its content. Where a file system has no hard links, the sibling is renamed into
    place if the path is still absent (two writers can then race in the gap).
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
