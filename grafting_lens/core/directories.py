"""The directories grafting-lens writes: complete or absent, and never anyone else's files.

Each is written into a temporary sibling and renamed into place; only directories carrying a
:data:`MARKER` that accounts for their content are ever replaced or deleted. Every refusal is
a :class:`~grafting_lens.core.errors.WorldCacheError` naming the path and the fix. Why: the
docs page "Data, batches, worlds, finetuning", section "Directories the library writes".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional, Union

from grafting_lens.core.errors import WorldCacheError
from grafting_lens.core.files import atomic_write, cannot_write, check_writable

__all__ = [
    "cache_location",
    "MARKER",
    "cache_errors",
    "check_apart",
    "check_cache_dir",
    "check_replaceable",
    "is_sealed",
    "make_directory",
    "remove_abandoned",
    "remove_directory",
    "replace_directory",
    "replace_problem",
    "seal",
    "sibling",
    "waiting_lock",
]

MARKER = ".grafting-lens-made"
"""The file that marks a directory grafting-lens made (JSON: ``{"files": null | [...]}``)."""

_FIX = "Choose another directory, or move that one away yourself."

PathLike = Union[str, os.PathLike]


def make_directory(path: PathLike) -> Path:
    """Make a new working directory (its parents as needed) and mark it as the library's.

    Raises:
        WorldCacheError: ``path`` exists, or cannot be made (a file on its path, no permission).
    """
    path = Path(path)
    with cache_errors("The directory", path):
        path.mkdir(parents=True)
        atomic_write(path / MARKER, json.dumps({"files": None}).encode())
    return path


def sibling(target: PathLike, kind: str = "partial") -> Path:
    """A fresh hidden name beside ``target`` for a working directory (not created)."""
    target = Path(target)
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def seal(directory: PathLike) -> None:
    """Record in the marker every file now in ``directory``: it is finished, and these are ours."""
    directory = Path(directory)
    atomic_write(directory / MARKER, json.dumps({"files": _files(directory)}, indent=1).encode())


def is_sealed(directory: PathLike) -> bool:
    """Whether ``directory`` is a finished one the library made, with every file it recorded."""
    directory = Path(directory)
    try:
        files = json.loads((directory / MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return False  # no readable marker
    return isinstance(files, list) and all((directory / str(name)).is_file() for name in files)


def replace_problem(target: PathLike) -> Optional[str]:
    """Why ``target`` may not be replaced or deleted, or ``None`` when it may: when it does not
    exist, is empty, or is a directory the library made whose content the marker accounts for."""
    target = Path(target)
    if target.is_symlink():
        return "is a symbolic link"
    if not target.exists():
        return None
    if not target.is_dir():
        return "is a file"
    if not any(target.iterdir()):
        return None
    if not (target / MARKER).is_file():
        return f"holds files grafting-lens did not write (it has no {MARKER} marker)"
    try:
        files = json.loads((target / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"has an unreadable {MARKER} marker"
    if files is None:
        return None  # a working directory: everything in it is the library's
    foreign = sorted(set(_files(target)) - set(files))
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        return f"holds files grafting-lens did not write ({', '.join(foreign[:3])}{more})"
    return None


def check_replaceable(target: PathLike, what: str) -> None:
    """Refuse a ``target`` that :func:`replace_problem` objects to.

    Raises:
        WorldCacheError: Naming ``what``, the path and the fix.
    """
    problem = replace_problem(target)
    if problem is not None:
        raise WorldCacheError(
            f"{what} {target} {problem}; grafting-lens replaces only directories it made. {_FIX}"
        )


def replace_directory(partial: PathLike, target: PathLike, what: str = "The target") -> None:
    """Rename the finished ``partial`` to ``target``; an old ``target`` is deleted only if ours.

    Raises:
        WorldCacheError: ``target`` holds what the library did not write (nothing is moved).
    """
    partial, target = Path(partial), Path(target)
    check_replaceable(target, what)
    stale = None
    with cache_errors(what, target):
        if target.exists():
            stale = sibling(target, "stale")
            os.replace(target, stale)
        os.replace(partial, target)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def remove_abandoned(target: PathLike) -> None:
    """Delete the working siblings of ``target`` (:func:`sibling`) that a killed writer left.
    Call it holding the lock every writer of ``target`` holds (without ``flock``: nothing goes)."""
    target = Path(target)
    if os.name == "posix":
        for kind in ("partial", "stale"):
            for path in target.parent.glob(f".{target.name}.{kind}-*"):
                remove_directory(path)


def remove_directory(path: PathLike) -> bool:
    """Delete ``path`` if the library made it and nothing foreign is in it; whether it did."""
    path = Path(path)
    if replace_problem(path) is not None or not path.exists():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def check_apart(source: PathLike, target: PathLike, what: str = "The target") -> None:
    """Refuse a ``target`` that is, contains or lies inside ``source`` (a file or directory).

    Raises:
        WorldCacheError: Writing ``target`` would replace or mix with the source.
    """
    source_path, target_path = Path(source).expanduser(), Path(target).expanduser()
    if not source_path.exists():
        return  # a hub id: nothing on this disk to overwrite
    here, there = source_path.resolve(), target_path.resolve()
    if here == there:
        relation = "is the source itself"
    elif here.is_relative_to(there):
        relation = f"contains the source {source_path}"
    elif there.is_relative_to(here):
        relation = f"lies inside the source {source_path}"
    else:
        return
    raise WorldCacheError(
        f"{what} {target_path} {relation}: writing it would replace the source's files. "
        "Choose a directory outside the source (a new one)."
    )


def cache_location(cache_dir: Optional[PathLike], default: Callable[[], Path]) -> Path:
    """``cache_dir`` with ``~`` expanded, or ``default()`` for None.

    Raises:
        WorldCacheError: An empty or blank ``cache_dir`` (``Path`` reads it as the working dir).
    """
    if cache_dir is None:
        return default()
    if isinstance(cache_dir, str) and not cache_dir.strip():
        raise WorldCacheError(
            f"cache_dir={cache_dir!r} is an empty path, which would be the working directory: "
            "name a directory, or pass None for the default cache."
        )
    return Path(cache_dir).expanduser()


def check_cache_dir(path: PathLike, what: str = "The cache directory") -> Path:
    """``path`` if files can be made in it (it need not exist yet).

    Raises:
        WorldCacheError: It is a file, lies under one, or cannot be written.
    """
    fix = "Pass --cache-dir (cache_dir=) or set GRAFTING_LENS_CACHE to another one."
    return check_writable(path, what, WorldCacheError, fix)


@contextlib.contextmanager
def cache_errors(what: str, path: PathLike) -> Iterator[None]:
    """Within this block, an OSError becomes a :class:`WorldCacheError` naming ``path`` and the fix."""
    try:
        yield
    except OSError as error:
        exists = isinstance(error, FileExistsError) and Path(error.filename or path).is_dir()
        raise WorldCacheError(
            f"{what} {path} exists already; grafting-lens makes it new. {_FIX}"
            if exists
            else str(cannot_write(what, path, error))
        ) from None


@contextlib.contextmanager
def waiting_lock(path: PathLike) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path``, waiting for another process to release it
    (two processes making one cache entry: the second waits, then finds it made)."""
    path = Path(path)
    with cache_errors("The lock file", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.name == "posix":
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield
    finally:
        os.close(handle)


def _files(directory: Path) -> list[str]:
    return sorted(
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
        if (path.is_file() or path.is_symlink()) and path.name != MARKER
    )
