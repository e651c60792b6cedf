"""Where grafting-lens keeps files (:func:`cache_root`), written complete, one writer at a time.

Runs get killed, and a file written in place would be left half-written yet look finished: each
goes to a temporary sibling renamed (:func:`atomic_write`) or linked (:func:`write_once`) into
place. A results directory is held by one process at a time (:class:`DirectoryLock`), and one
that cannot be written is found before any work (:func:`check_writable`).
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
from typing import Any, Literal

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

_HELD: dict[Path, list[Any]] = {}  # held directories: [lock file, holders, directories made]


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


# A full disk, a used-up quota, a file-size limit: the one failure that comes in the middle of
# a long run's writing, after everything before it was kept.
_NO_ROOM = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}

RESUMES = "Nothing written before it is lost: run the same command again to carry on."


@contextlib.contextmanager
def _complete_sibling(path: Path, content: bytes, *, durable: bool = False) -> Iterator[str]:
    """A temporary file beside ``path`` holding all of ``content``, removed afterwards unless
    the block moved it into place; no room for it (:data:`_NO_ROOM`) is a RunError."""
    handle: int | None = None
    temporary = ""
    try:
        handle, temporary = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.", suffix=".partial"
        )
        with os.fdopen(handle, "wb") as file:
            handle = None  # the file object closes it
            file.write(content)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.chmod(temporary, 0o644)  # mkstemp makes it private; results are meant to be shared
    except OSError as error:
        if handle is not None:
            os.close(handle)
        if temporary and os.path.exists(temporary):
            os.unlink(temporary)
        no_room = error.errno in _NO_ROOM
        raise (cannot_write("The file", path, error, RESUMES) if no_room else error) from None
    try:
        yield temporary
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def check_writable(
    path: str | os.PathLike,
    what: str = "The output directory",
    refusal: type[GraftingLensError] = GraftingLensError,
    fix: str = "",
) -> Path:
    """Check, creating nothing, that files can be written in the directory ``path`` (or its
    nearest existing parent); return it, ``~`` expanded.

    Raises:
        GraftingLensError: ``refusal``: ``path`` is empty, is a file or lies under one, or cannot
            be written; ``what`` names it in the message, ``fix`` ends it.
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
        raise refusal(f"{what} {problem}." + (f" {fix}" if fix else ""))
    return target


def cannot_write(what: str, path: str | os.PathLike, error: OSError, note: str = "") -> RunError:
    """The :class:`RunError` for ``path`` that could not be written: the cause as the fix
    depends on it (a full disk, a read-only filesystem...), the fix, then ``note``."""
    path = Path(path)
    code = error.errno
    reason = error.strerror or type(error).__name__
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        fix = "its disk is full (or your quota is used up): free some space there, or choose a "
        fix += "directory on another disk"
    elif code == errno.EFBIG:
        fix = "it is larger than this process may write (a file-size limit, `ulimit -f`): "
        fix += "raise the limit (`ulimit -f unlimited`)"
    elif code == errno.EROFS:
        fix = "its filesystem is read-only: choose a directory on a writable one"
    elif code == errno.EISDIR:
        fix = f"{path} is a directory where a file belongs: remove or rename it, or write elsewhere"
    elif code in (errno.ENOTDIR, errno.EEXIST) and (file := _file_in_the_way(error, path)):
        reason = os.strerror(errno.ENOTDIR)  # "File exists" would say nothing of the cause
        fix = f"{file} is a file where a directory must be: move or rename it, or write elsewhere"
    else:
        fix = "choose a directory you can write to"
    return RunError(
        f"{what} {path} cannot be written ({reason}); {fix}." + (f" {note}" if note else "")
    )


def _file_in_the_way(error: OSError, path: Path) -> Path | None:
    """The file standing where ``error`` (or else ``path``) needs a directory, if any."""
    wanted = Path(os.fsdecode(error.filename)) if error.filename else path
    return next((p for p in (wanted, *wanted.parents) if p.exists() and not p.is_dir()), None)


@contextlib.contextmanager
def writing(what: str, path: str | os.PathLike, note: str = "") -> Iterator[None]:
    """Within this block, an OSError becomes :func:`cannot_write`'s RunError for ``path``."""
    try:
        yield
    except OSError as error:
        raise cannot_write(what, path, error, note) from None


class DirectoryLock:
    """One writer at a time in a directory: an advisory lock on ``<dir>/.lock``.

    The holder (process, host, command, time) is written into the lock file, so a second
    process is refused by name; the operating system releases the lock when the holder ends,
    killed or not, and the last holder removes the file (and the directory, if the lock made it
    and it is empty). Re-entrant within a process. A context manager, or :meth:`acquire` and
    :meth:`release`; ``what`` names the directory in messages. ``shared``: the ranks of one job
    hold it together (across machines only where locks reach: docs/how-to/many-gpus.md).
    """

    def __init__(
        self, directory: str | os.PathLike, what: str = "The directory", *, shared: bool = False
    ) -> None:
        self.directory = Path(directory)
        self.what = what
        self.shared = shared
        self._key: Path | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._key is not None

    def acquire(self) -> DirectoryLock:
        """Take the lock (again, if this process holds it), creating the directory if needed.

        Raises:
            RunError: Another process (or job's rank) holds it, or the directory cannot be written.
        """
        if self._key is not None:
            return self
        from grafting_lens.core.ranks import current

        ranks = current() if self.shared else None
        with writing(self.what, self.directory):
            whole = self.directory.absolute()
            made = [d for d in (whole, *whole.parents) if not d.exists()]
            self.directory.mkdir(parents=True, exist_ok=True)
            key = self.directory.resolve()
            if key not in _HELD:
                _HELD[key] = [self._take(ranks, made), 0, made]
        _HELD[key][1] += 1
        self._key = key
        return self

    def _take(self, ranks: Any, made: list[Path]) -> int:
        """The open lock file, locked: exclusively, or shared with the ranks of this job."""
        path = self.directory / LOCK_NAME
        deadline = time.monotonic() + 2
        while True:
            handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            taken: Literal[True] | dict[str, Any] | None | Literal[False] = False
            try:
                taken = self._lock_file(handle, ranks, made)
            finally:
                if taken is not True:
                    os.close(handle)
            if taken is True:
                return handle
            # A rank of this job may be between taking the lock and opening it to the others.
            if taken is None or (ranks is not None and time.monotonic() < deadline):
                time.sleep(0 if taken is None else 0.02)
                continue
            raise RunError(
                f"{self.what} {self.directory} is in use by another process "
                f"({_describe_holder(taken)}): two runs writing into one directory would "
                "delete each other's files. Wait for it to finish or stop it, or choose "
                "another directory."
            )

    def _lock_file(
        self, handle: int, ranks: Any, made: list[Path]
    ) -> Literal[True] | dict[str, Any] | None:
        """Lock the open file ``handle``: True if taken; None if its last holder removed it
        meanwhile (open the new one); else what its holder wrote."""
        exclusive = _try_lock(handle, self.directory)
        shared = not exclusive and ranks is not None
        shared = shared and _try_lock(handle, self.directory, shared=True)
        holder = _read_holder(handle)
        if (exclusive or shared) and not _same_file(handle, self.directory / LOCK_NAME):
            return None
        if shared:  # beside the ranks of this job only
            return True if holder.get("job") == ranks.job else holder
        if not exclusive:
            return holder
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(sys.argv) or sys.executable,
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if ranks is not None:  # the job's last holder removes what its first made
            me |= {"job": ranks.job, "rank": ranks.rank, "world": ranks.world}
            me["made"] = [str(directory) for directory in made]
        os.ftruncate(handle, 0)
        os.lseek(handle, 0, os.SEEK_SET)
        os.write(handle, json.dumps(me).encode())  # a full disk fails here
        if ranks is not None:
            _try_lock(handle, self.directory, shared=True)  # let the job's ranks in
            _warn_if_networked(self.directory, ranks)
        return True

    def release(self) -> None:
        """Release the lock (nothing happens if this object does not hold it)."""
        if self._key is None:
            return
        key, self._key = self._key, None
        held = _HELD[key]
        held[1] -= 1
        if held[1] > 0:
            return
        del _HELD[key]
        handle, made = held[0], held[2]  # made: the directories the lock created, deepest first
        # The last holder (of the job, too) removes the file while holding it exclusively.
        if sys.platform != "win32" and _try_lock(handle, key):
            with contextlib.suppress(OSError):
                if _same_file(handle, key / LOCK_NAME):
                    made = made or [Path(d) for d in _read_holder(handle).get("made", [])]
                    os.unlink(key / LOCK_NAME)
                for directory in made:
                    directory.rmdir()  # only if empty: nothing was written into it
        os.close(handle)  # closing the file releases the lock

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *error: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _same_file(handle: int, path: Path) -> bool:
    """Whether ``path`` still names the open file ``handle`` (its holder may have removed it)."""
    try:
        return os.path.samestat(os.fstat(handle), os.stat(path))
    except FileNotFoundError:
        return False


NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "fuse")
"""Filesystem types (``/proc/mounts``) whose locks may not reach from one machine to another."""


def _warn_if_networked(directory: Path, ranks: Any) -> None:
    """Say once, for a job whose ranks span machines, that a network filesystem's locks may not
    refuse a second job on another machine."""
    if ranks.local_world >= ranks.world or not ranks.first:
        return
    kind, longest = None, ""
    with contextlib.suppress(OSError):
        where = str(directory.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and where.startswith(fields[1]) and len(fields[1]) > len(longest):
                kind, longest = fields[2], fields[1]
    if kind is not None and kind.split(".")[0] in NETWORK_FILESYSTEMS:
        warnings.warn(
            f"{directory} is on {kind} ({longest}), whose locks may not reach other machines: "
            "this job's ranks share it safely, but start no second job into it until this one ends.",
            RuntimeWarning,
            stacklevel=4,
        )


def _try_lock(handle: int, directory: Path, *, shared: bool = False) -> bool:
    """Lock an open file without waiting, exclusively or ``shared``; False if another holds it."""
    try:
        if sys.platform == "win32":  # no shared locks there: one process at a time
            import msvcrt

            os.lseek(handle, 0, os.SEEK_SET)
            msvcrt.locking(handle, msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
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


def _read_holder(handle: int) -> dict[str, Any]:
    """What the holder of a lock wrote into its file (``{}`` if nothing readable yet)."""
    try:
        os.lseek(handle, 0, os.SEEK_SET)
        holder = json.loads(os.read(handle, 4096).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe_holder(holder: dict[str, Any]) -> str:
    """Who holds a lock, in words."""
    try:
        said = (
            f"pid {holder['pid']} on {holder['host']}, running `{holder['command']}` since "
            f"{holder['since']}"
        )
    except KeyError:
        return "a process that has not said who it is yet"
    return said + (f", rank {holder['rank']} of {holder['world']}" if "world" in holder else "")


def write_once(path: str | os.PathLike, content: bytes) -> bytes:
    """Write ``content`` to ``path`` unless the file exists; return what the file holds (a
    complete sibling hard-linked into place: of two writers the first wins)."""
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
