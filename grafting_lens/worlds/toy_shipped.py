"""The toy world shipped inside the package: the same checkpoints on every machine, in seconds.

Training is not bit-reproducible across CPUs, so the default world is built once and ships under
``grafting_lens/toy_world/`` (float16 weights, exactly the build's values); :func:`materialize`
writes it into the toy-world cache as float32. A shipped file that is missing or fails its
checksum is a :class:`~grafting_lens.core.errors.ToyWorldError` naming the repair. What ships
and why: the docs page "Data, batches, worlds, finetuning", section "The shipped toy world".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from grafting_lens.core.directories import (
    MARKER,
    check_replaceable,
    make_directory,
    replace_directory,
    seal,
    sibling,
)
from grafting_lens.core.errors import ToyWorldError

__all__ = ["SHIPPED_MODELS", "check_shipped", "export_world", "materialize", "shipped_manifest"]

SHIPPED_MODELS = ("base", "sft", "task", "relation", "both")
"""The checkpoints that ship; ``a2b`` is written as a copy of ``sft`` (the same training run)."""

_MODEL_FILES = ("config.json", "generation_config.json")
_WEIGHTS = "model.safetensors"


def shipped_root() -> Path:
    """The shipped world's directory inside the installed package."""
    return Path(str(resources.files("grafting_lens.worlds").joinpath("toy_world")))


def shipped_manifest() -> dict[str, Any]:
    """The shipped world's ``manifest.json`` (recipe, key, evaluation, targets, checksums).

    Raises:
        ToyWorldError: The package holds no readable manifest (a broken installation).
    """
    return _read_manifest(shipped_root())


def check_shipped(root: Path | None = None) -> dict[str, Any]:
    """Verify every shipped file against the manifest; return the manifest.

    Args:
        root: The shipped directory (default: the installed package's).

    Raises:
        ToyWorldError: A file is missing or does not match its checksum (the message
            names it and the repair).
    """
    root = shipped_root() if root is None else Path(root)
    manifest = _read_manifest(root)
    problem = damaged_file(root, manifest["package_files"])
    if problem is not None:
        raise ToyWorldError(f"The shipped toy world is damaged: {problem} (in {root}). {_REPAIR}")
    return manifest


def damaged_file(root: Path, digests: Mapping[str, str]) -> str | None:
    """The first file of ``digests`` (relative path to SHA-256) that is missing under ``root``
    or does not match its checksum, and how; ``None`` when every file checks out."""
    for relative, expected in digests.items():
        try:
            actual = sha256_file(root / relative)
        except OSError:
            return f"{relative} is missing or unreadable"
        if actual != expected:
            return f"{relative} does not match its checksum"
    return None


def materialize(destination: Path, root: Path | None = None) -> dict[str, Any]:
    """Write the shipped world as a toy-world cache entry (float32 ``save_pretrained`` layout).

    ``destination`` is new, or an empty directory the caller made; the caller renames it
    into place. The manifest written there is the shipped one with ``files`` (the
    checksums of what was written, which the cache checks) and ``source: "shipped"``.

    Args:
        destination: A new or empty directory.
        root: The shipped directory (default: the installed package's).

    Returns:
        The manifest written.

    Raises:
        ToyWorldError: The shipped world is damaged (see :func:`check_shipped`).
    """
    root = shipped_root() if root is None else Path(root)
    manifest = check_shipped(root)
    destination.mkdir(parents=True, exist_ok=True)
    _copy_layout(root, destination, torch.float32, tokenizers=True)
    shutil.copytree(destination / "sft", destination / "a2b")
    written = dict(manifest, source="shipped", files=file_digests(destination))
    (destination / "manifest.json").write_text(json.dumps(written, indent=1))
    return written


def export_world(
    world_root: Path, destination: Path, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Write a built world (a cache entry) in the shipped layout, float16 weights.

    Used by ``experiments/toy_world.py --ship``; refuses weights that float16 would change
    (a world not built by the current recipe, which rounds them).

    Args:
        world_root: The built world's directory.
        destination: The shipped directory to (re)write, e.g. ``grafting_lens/toy_world``.
        extra: More manifest fields (the measured targets).

    Returns:
        The manifest written.

    Raises:
        ToyWorldError: A weight is not exactly representable in float16.
        WorldCacheError: ``destination`` holds files that are not an earlier export's.
    """
    manifest = json.loads((world_root / "manifest.json").read_text())
    manifest.pop("files", None)
    manifest.pop("source", None)
    destination = Path(destination)
    previous = _is_export(destination)
    if not previous:
        check_replaceable(destination, "The destination")
    final, destination = destination, make_directory(sibling(destination))
    try:
        _export(world_root, destination, manifest, extra)
        seal(destination)
        if previous:  # an earlier export, every file of it listed in its manifest: ours
            stale = sibling(final, "stale")
            os.replace(final, stale)
            os.replace(destination, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            replace_directory(destination, final, "The destination")
    except BaseException:
        shutil.rmtree(destination, ignore_errors=True)
        raise
    return manifest


def _is_export(directory: Path) -> bool:
    """Whether ``directory`` is an earlier export: exactly the files its manifest lists."""
    try:
        listed = json.loads((directory / "manifest.json").read_text())["package_files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    present = {
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
        if path.is_file() and path.name not in ("manifest.json", MARKER)
    }
    return isinstance(listed, dict) and present == set(listed)


def _export(
    world_root: Path, destination: Path, manifest: dict[str, Any], extra: Mapping[str, Any] | None
) -> None:
    """Write the shipped layout of ``world_root`` into the empty ``destination``."""
    _copy_layout(world_root, destination, torch.float16, tokenizers=False)
    manifest.update(extra or {})
    manifest["weights_dtype"] = "float16"
    manifest["package_files"] = file_digests(destination)
    (destination / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def _copy_layout(source: Path, destination: Path, dtype: torch.dtype, *, tokenizers: bool) -> None:
    """Copy the tokenizer, the relations and every shipped model, its weights cast to ``dtype``
    (refused where the cast would change one), the tokenizer in each model's when ``tokenizers``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source / "tokenizer", destination / "tokenizer")
    shutil.copy2(source / "relations.json", destination / "relations.json")
    for name in SHIPPED_MODELS:
        target = destination / name
        if tokenizers:
            shutil.copytree(source / "tokenizer", target)
        else:
            target.mkdir()
        for file_name in _MODEL_FILES:
            shutil.copy2(source / name / file_name, target / file_name)
        weights = load_file(str(source / name / _WEIGHTS))
        cast = {key: tensor.to(dtype) for key, tensor in weights.items()}
        for key, tensor in weights.items():
            if not torch.equal(cast[key].to(tensor.dtype), tensor):
                raise ToyWorldError(
                    f"{name}/{key} is not exactly representable in float16: only a world "
                    "built by the current recipe (which rounds its weights) can ship."
                )
        save_file(cast, str(target / _WEIGHTS), metadata={"format": "pt"})


def file_digests(directory: Path) -> dict[str, str]:
    """SHA-256 of every file under ``directory`` except ``manifest.json`` and the library's
    marker, by relative path."""
    return {
        path.relative_to(directory).as_posix(): sha256_file(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name not in ("manifest.json", MARKER)
    }


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


_REPAIR = (
    "Reinstall grafting-lens, or build the world instead with "
    "grafting_lens.worlds.toy.build_toy_world(force=True) (5 to 15 minutes on one core)."
)


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ToyWorldError(
            f"The shipped toy world has no readable manifest ({path}: {error}). {_REPAIR}"
        ) from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("package_files"), dict):
        raise ToyWorldError(f"The shipped toy world's manifest {path} lists no files. {_REPAIR}")
    return manifest
