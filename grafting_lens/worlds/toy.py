"""A toy world: every checkpoint the paper needs, shipped with the package and rebuildable.

A miniature of the paper's setup, made offline and saved as ``save_pretrained`` directories, so
every part of grafting-lens loads it as it loads a hub model. :func:`build_toy_world` unpacks
the shipped world (:mod:`grafting_lens.worlds.toy_shipped`) into the cache in seconds, or with
``force=True`` rebuilds it from the seeded recipe (:mod:`grafting_lens.worlds.toy_recipe`; 5 to
15 minutes on one core). A world lives in ``<cache_dir>/<key>`` (``key`` hashes the
configuration, its data and the recipe's version), complete or absent, and is rebuilt with a
warning when its files do not check out. The checkpoints, the recipe and why each choice was
made: ``docs/results.md``, "The toy world's recipe".

Examples:
    >>> from grafting_lens.worlds.toy import build_toy_world
    >>> world = build_toy_world()  # doctest: +SKIP
    >>> world.sft_dir, world.manifest["evaluation"]["sft"]  # doctest: +SKIP
    >>> import grafting_lens as gl
    >>> models = gl.load_models(world.base_dir, world.sft_dir)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from grafting_lens.core.arguments import is_integer
from grafting_lens.core.console import threads_beyond_cores
from grafting_lens.core.directories import (
    cache_location,
    check_cache_dir,
    check_replaceable,
    make_directory,
    remove_directory,
    replace_directory,
    seal,
    sibling,
    waiting_lock,
)
from grafting_lens.core.errors import ArgumentTypeError, GraftingLensError
from grafting_lens.core.files import cache_root
from grafting_lens.worlds import data
from grafting_lens.worlds.directories import ModelDirectories
from grafting_lens.worlds.documents import training_documents
from grafting_lens.worlds.toy_corpus import prepare_for_transformer_lens
from grafting_lens.worlds.toy_recipe import (
    BUILD_VERSION,
    ToyWorldConfig,
    _build,
    finetune_templates,
)
from grafting_lens.worlds.toy_recipe import MODEL_NAMES as MODEL_NAMES  # re-exported
from grafting_lens.worlds.toy_shipped import damaged_file, materialize, shipped_manifest


@dataclass
class ToyWorld(ModelDirectories):
    """A built toy world: where its checkpoints are, and what went into them.

    Attributes:
        root: The cache entry holding everything below.
        tokenizer_dir: The tokenizer alone (every model directory has a copy too).
        base_dir: The pretrained model (PRE).
        sft_dir: Finetuned on all relations, A2B (SFT).
        task_dir: Finetuned on the task split's relations.
        relation_dir: Finetuned on the relation split's relations.
        a2b_dir: Finetuned on one direction (same run as ``sft``).
        both_dir: Finetuned on both directions.
        relations: All relations, in :func:`grafting_lens.worlds.data.make_relations` order.
        task_relations: The task split.
        relation_relations: The relation split (disjoint from the task split).
        config: The configuration it was built from.
        manifest: ``manifest.json``: the configuration, file checksums, build
            times, finetuning losses and top-5 accuracy of each model.
    """

    config: ToyWorldConfig

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def a2b_dir(self) -> Path:
        return self.root / "a2b"

    @property
    def both_dir(self) -> Path:
        return self.root / "both"

    def load_tokenizer(self) -> Any:
        """The toy tokenizer, ready for TransformerLens (see :func:`load_tokenizer`)."""
        return load_tokenizer(self.tokenizer_dir)

    def load_model(self, name: str) -> Any:
        """One checkpoint as a plain Hugging Face model, in eval mode."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_dir(name)).eval()


def default_cache_dir() -> Path:
    """Where toy worlds live: ``$GRAFTING_LENS_CACHE/toy``, else ``~/.cache/grafting_lens/toy``."""
    return cache_root() / "toy"


def load_tokenizer(path: Union[str, os.PathLike]) -> Any:
    """Load a saved toy tokenizer and apply TransformerLens 4.3's requirements.

    The bridge reads ``init_kwargs["name_or_path"]`` (else it fails or asks the
    hub) and ``init_kwargs["add_bos_token"]`` (else it reloads the tokenizer from
    that name); both are set here.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return prepare_for_transformer_lens(tokenizer, str(path))


def build_toy_world(
    config: Optional[ToyWorldConfig] = None,
    cache_dir: Union[str, os.PathLike, None] = None,
    force: bool = False,
    progress: bool = True,
    threads: Optional[int] = 1,
) -> ToyWorld:
    """Build the toy world, or return the cached one.

    Args:
        config: What to build; ``ToyWorldConfig()`` by default.
        cache_dir: Directory holding toy worlds, one sub-directory per configuration; by
            default :func:`default_cache_dir`.
        force: Rebuild even when a valid cached world exists.
        progress: Show progress bars.
        threads: Torch CPU threads during the build (restored afterwards). One is the default:
            models this small gain little from a second thread and lose several-fold when the
            cores are shared; ``None`` keeps torch's setting.

    Returns:
        The :class:`ToyWorld`; its ``manifest["evaluation"]`` holds the top-5 accuracy of
        every model on the test prompts.

    Raises:
        GraftingLensError: The configuration is invalid (raised by :class:`ToyWorldConfig`),
            ``threads`` is not between 1 and the cores this process may use, or the cache
            directory cannot be written.

    Warns:
        UserWarning: A cached world was incomplete or corrupt and is rebuilt.
    """
    config = config if config is not None else ToyWorldConfig()
    flags = isinstance(force, bool) and isinstance(progress, bool)
    path = isinstance(cache_dir, (str, os.PathLike, type(None)))
    if not (flags and path and isinstance(config, ToyWorldConfig)):
        raise ArgumentTypeError(
            f"config is a {type(config).__name__} (pass a ToyWorldConfig), force={force!r}, "
            f"progress={progress!r} (True or False each), cache_dir={cache_dir!r} (a path or "
            "None): one is of another type."
        )
    check_threads(threads)
    cache_root = cache_location(cache_dir, default_cache_dir)
    relations = data.make_relations(config.dataset, n=config.n_relations, seed=config.seed)
    key = _world_key(config, relations)

    def make(partial: Path) -> None:
        # The package ships the default world: unpacking it takes seconds and gives every
        # machine the same checkpoints; force=True runs the recipe instead.
        if not force and _ships(config, key):
            materialize(partial)
        else:
            _build(partial, key, config, relations, progress)

    root = cached_entry(cache_root, key, make, what="toy world", force=force, threads=threads)
    return _open_world(root, config)


def check_threads(threads: Optional[int]) -> None:
    """Refuse a ``threads`` that is not ``None`` or between 1 and this process's cores.

    Raises:
        GraftingLensError: Naming the fix.
    """
    if threads is not None and (not is_integer(threads) or threads < 1):
        raise (GraftingLensError if isinstance(threads, (int, float)) else ArgumentTypeError)(
            f"threads={threads!r}: pass an integer >= 1, or None for torch's setting."
        )
    too_many = None if threads is None else threads_beyond_cores(threads)
    if too_many:
        raise GraftingLensError(too_many)


def cached_entry(
    cache_root: Path,
    key: str,
    make: Callable[[Path], None],
    *,
    what: str,
    force: bool,
    threads: Optional[int],
) -> Path:
    """The toy cache's entry ``cache_root/key``, made by ``make`` unless it is intact.

    An entry is intact when its ``manifest.json`` names ``key`` and every file it lists
    matches its checksum. ``make(partial)`` writes the whole entry, manifest last, into a
    fresh sibling directory renamed into place only once complete; one process makes the
    entry while another asking for it waits. Torch runs on ``threads`` threads meanwhile
    (``None``: its setting), restored afterwards.

    Warns:
        UserWarning: An entry was incomplete or corrupt and is rebuilt.
    """
    root = cache_root / key
    if root.exists() and not force and _check_world(root, key) is None:
        return root
    check_cache_dir(cache_root, "The toy-world cache")
    with waiting_lock(cache_root / f".{key}.lock"):
        if root.exists() and not force:
            problem = _check_world(root, key)
            if problem is None:
                return root
            warnings.warn(
                f"The cached {what} at {root} is unusable ({problem}); rebuilding it. "
                "Nothing to do on your side, but if this repeats, delete the directory.",
                stacklevel=3,
            )
        check_replaceable(root, f"The cached {what}")
        _remove_abandoned_builds(cache_root, key)
        partial = make_directory(sibling(root))
        previous_threads = torch.get_num_threads()
        try:
            if threads is not None:
                torch.set_num_threads(threads)
            make(partial)
            seal(partial)
            replace_directory(partial, root, f"The cached {what}")
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        finally:
            torch.set_num_threads(previous_threads)
    return root


def _ships(config: ToyWorldConfig, key: str) -> bool:
    """Whether the package ships the world of ``config`` (only the default one does); a
    broken installation's unreadable manifest is a ToyWorldError, not silently rebuilt."""
    if config != ToyWorldConfig():
        return False
    shipped = shipped_manifest().get("key")
    if shipped != key:
        warnings.warn(
            f"The toy world shipped with grafting-lens (key {shipped}) was built by another "
            f"recipe than this one (key {key}); building it from the recipe instead (5 to 15 "
            "minutes on one core). Re-ship it with experiments/toy_world.py --ship.",
            stacklevel=5,  # the caller of build_toy_world
        )
        return False
    return True


# --------------------------------------------------------------------- cache


def _world_key(config: ToyWorldConfig, relations: list[Any]) -> str:
    """Hash of the configuration, the data it builds from (so that a change to
    :mod:`grafting_lens.worlds.data` yields a new world) and the recipe version."""
    documents = training_documents(
        relations, direction="both", templates=finetune_templates(config), seed=config.seed
    )
    payload = json.dumps(
        {
            "build_version": BUILD_VERSION,
            "config": dataclasses.asdict(config),
            "relations": [dataclasses.asdict(r) for r in relations],
            "documents": documents,
            "actors": list(data.REAL_ACTORS),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _check_world(root: Path, key: str) -> Optional[str]:
    """``None`` when ``root`` is a complete, intact world for ``key``, else what is wrong."""
    manifest_path = root / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        return "no manifest.json: the build never finished"
    except (OSError, ValueError) as error:
        return f"manifest.json is unreadable: {error}"
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return f"manifest.json is for key {manifest.get('key') if isinstance(manifest, dict) else None!r}, not {key!r}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest.json lists no files"
    return damaged_file(root, files)


def _open_world(root: Path, config: ToyWorldConfig) -> ToyWorld:
    return ToyWorld.read(root, config)


def _remove_abandoned_builds(cache_root: Path, key: str) -> None:
    """Delete the working directories the library made for ``key`` whose process is gone."""
    if os.name != "posix":
        return
    for path in cache_root.glob(f".{key}.partial-*"):
        try:
            pid = int(path.name.split("partial-")[1].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            remove_directory(path)
        except (ValueError, IndexError, PermissionError, OSError):
            continue
    for path in cache_root.glob(f".{key}.stale-*"):
        remove_directory(path)
