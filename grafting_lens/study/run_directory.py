"""Resumable run directories: a manifest that says which run lives here, and one file per chunk.

With ``out=``, :func:`~grafting_lens.study.runner.run_experiment` keeps its run in a directory
(a lock, ``manifest.json`` with the run's fingerprint, ``chunks/<id>.json``); started again it
reads back its finished chunks, each checked against the fingerprint and its own hash, so a
resumed table is the table an uninterrupted run gives. The layout and every check: the docs page
"Experiments", section "Run directories".
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grafting_lens.analysis.batch import TokenizedExamples
from grafting_lens.core import ranks
from grafting_lens.core.errors import RunError, kind
from grafting_lens.core.files import DirectoryLock, atomic_write, writing
from grafting_lens.models.model_set import ModelSet
from grafting_lens.study.configs import GraftConfig
from grafting_lens.study.testsets import TestSet

__all__ = [
    "RUN_FORMAT",
    "RunDirectory",
    "batch_digest",
    "describe_differences",
    "describe_run",
    "weights_digests",
]

RUN_FORMAT = 4
"""Version of the run-directory layout; part of every fingerprint (4: rows carry the layers
each configuration grafted)."""

Rows = list[list[Any]]
"""A chunk's rows, one list of values per row, in the run's column order."""


def describe_run(
    *,
    model_sets: Sequence[tuple[str, ModelSet]],
    test_sets: Sequence[TestSet],
    examples: Sequence[int],
    test_digests: Mapping[tuple[int, int], str],
    configs: Sequence[GraftConfig],
    options: Mapping[str, Any],
    columns: Sequence[str],
    chunk_ids: Sequence[str],
) -> dict[str, Any]:
    """Everything that makes a run this run, JSON-ready; its hash is the fingerprint.

    ``examples`` counts each test set's rows, ``test_digests`` holds :func:`batch_digest`
    per ``(model set, test set)``, ``options`` is
    :meth:`~grafting_lens.study.runner.RunOptions.fingerprint`.
    """
    return {
        "format": RUN_FORMAT,
        "models": [
            {
                "label": label,
                "names": list(models.names),
                "architecture": models.architecture,
                "n_layers": models.n_layers,
                "weights": weights_digests(models),
            }
            for label, models in model_sets
        ],
        "test_sets": [
            {
                "dataset": test_set.dataset,
                "prompt": test_set.prompt,
                "seed": test_set.seed,
                "examples": int(examples[index]),
                "digest": [test_digests[(m, index)] for m in range(len(model_sets))],
            }
            for index, test_set in enumerate(test_sets)
        ],
        "configs": [config.describe() for config in configs],
        "options": dict(options),
        "columns": list(columns),
        "chunks": list(chunk_ids),
    }


# ------------------------------------------------------------------------ weights


def weights_digests(models: ModelSet) -> list[str]:
    """A digest of every source of a model set, base first: every value of its weights.

    Each is :meth:`Source.content_digest <grafting_lens.models.sources.Source.content_digest>`
    (every byte of every tensor, read one at a time) with the models' configuration, so a
    changed ``rope_theta`` counts too. Exact, not sampled: an ablation of one weight between
    two runs into one ``out`` is a different run.
    """
    config = _config_text(models.base.original_model)
    return [
        hashlib.sha256(f"{config}\n{source.content_digest()}".encode()).hexdigest()[:32]
        for source in models.sources
    ]


def _config_text(model: torch.nn.Module) -> str:
    """A model's configuration as canonical JSON, without fields that do not change it (the
    base's stands for every source's: load_models refuses sources whose forward differs)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return ""
    fields = {
        key: value
        for key, value in config.to_dict().items()
        if not key.startswith("_") and key not in ("name_or_path", "transformers_version")
    }
    return json.dumps(fields, sort_keys=True, default=lambda value: type(value).__name__)


# ------------------------------------------------------------------------ test sets


def batch_digest(batch: TokenizedExamples, positions: Sequence[Sequence[torch.Tensor]]) -> str:
    """A hash of a tokenized test set and of the positions each configuration grafts in it."""
    digest = hashlib.sha256()
    for tensor in (batch.tokens, batch.attention_mask, batch.target_ids):
        digest.update(tensor.numpy().tobytes())
    if batch.examples is not None:
        for example in batch.examples:
            digest.update(
                f"{getattr(example, 'relation_id', None)}|{getattr(example, 'direction', None)}|"
                f"{getattr(example, 'text', None)}|{getattr(example, 'target', None)}\n".encode()
            )
    for selected in positions:
        for tensor in selected:
            digest.update(np.packbits(tensor.numpy()).tobytes())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------ the directory


class RunDirectory:
    """A directory holding one run: its manifest and its finished chunks, held by one process
    (or the ranks of one job) from :meth:`open` to :meth:`close` (or a ``with`` block's end).

    Attributes:
        path: The directory.
        fingerprint: The run's fingerprint.
    """

    def __init__(self, path: Path, fingerprint: str, lock: DirectoryLock) -> None:
        self.path = Path(path)
        self.fingerprint = fingerprint
        self._lock = lock

    @classmethod
    def open(cls, path: str | os.PathLike, spec: Mapping[str, Any]) -> RunDirectory:
        """Create the run directory, or check that it holds the run ``spec`` describes.

        Raises:
            RunError: An empty path or a file; another process writing into it; ranks of a
                job describing different runs; another run (saying what differs), files that
                are not a run's, or an unreadable manifest beside chunks.
        """
        if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
            raise kind(path, (str, os.PathLike), RunError)(
                f"The run directory (out={path!r}) is not a path, or an empty one (it would be "
                "the working directory); name a directory."
            )
        run_dir = Path(path).expanduser()
        fingerprint = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
        if run_dir.exists() and not run_dir.is_dir():
            raise RunError(f"{run_dir} is a file; a run needs a directory.")
        lock = DirectoryLock(run_dir, "The run directory", shared=True)

        def claim() -> None:
            _check_is_run_directory(run_dir)  # before the lock: no lock file in a stranger's folder
            lock.acquire()
            if ranks.first():  # the others wait until the manifest is there
                _check_is_run_directory(run_dir)
                _claim(run_dir, fingerprint, spec)

        try:
            ranks.agree(claim)
        except BaseException:
            lock.release()
            raise
        return cls(run_dir, fingerprint, lock)

    def close(self) -> None:
        """Release the directory for other processes."""
        self._lock.release()

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *error: object) -> None:
        self.close()

    def chunk_path(self, chunk_id: str) -> Path:
        """Where the chunk ``chunk_id`` is kept."""
        return self.path / "chunks" / f"{chunk_id}.json"

    def finished(
        self,
        expected: Mapping[str, Sequence[tuple[Any, ...]]],
        columns: Sequence[str],
        key_columns: Sequence[str],
    ) -> dict[str, Rows]:
        """The rows of every chunk already written, by chunk id, each checked.

        Args:
            expected: For every chunk of the run, the key of each row it must hold.
            columns: The run's columns.
            key_columns: The columns that make a row's key.

        Raises:
            RunError: Chunks that cannot be read, belong to another run, hold other
                columns or rows, or were changed after they were written (the message
                lists the files; deleting them makes the run recompute them).
        """
        positions = [list(columns).index(column) for column in key_columns]
        done: dict[str, Rows] = {}
        problems = []
        for chunk_id, keys in expected.items():
            path = self.chunk_path(chunk_id)
            if not path.exists():
                continue
            if not path.is_file():
                problems.append(f"{path} is not a file")
                continue
            try:
                payload = json.loads(path.read_text())
            except (OSError, ValueError) as error:
                problems.append(f"{path} cannot be read ({error})")
                continue
            problem = self._chunk_problem(payload, chunk_id, columns, positions, keys)
            if problem is None:
                done[chunk_id] = payload["rows"]
            else:
                problems.append(f"{path} {problem}")
        if problems:
            shown = "\n  ".join(problems[:8])
            more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
            raise RunError(
                f"{len(problems)} chunk file(s) in {self.path} cannot be trusted:\n  "
                f"{shown}{more}\nDelete them and run again: only those chunks are recomputed."
            )
        return done

    def _chunk_problem(
        self,
        payload: Any,
        chunk_id: str,
        columns: Sequence[str],
        positions: Sequence[int],
        keys: Sequence[tuple[Any, ...]],
    ) -> str | None:
        """What is wrong with one chunk file's content, or ``None``."""
        if not isinstance(payload, dict) or not isinstance(payload.get("rows"), list):
            return "is not a chunk of a run"
        if payload.get("run") != self.fingerprint:
            return (
                f"belongs to another run (fingerprint {payload.get('run')}; this directory's "
                f"run is {self.fingerprint}): it was copied from another run directory"
            )
        if payload.get("chunk") != chunk_id:
            return f"holds the chunk {payload.get('chunk')!r}, not {chunk_id!r}"
        if payload.get("columns") != list(columns):
            return "holds other columns than this run's"
        if payload.get("sha256") != _content_hash(payload):
            return "was changed after it was written (its content no longer matches its hash)"
        rows = payload["rows"]
        plain = (str, int, float, bool, type(None))  # a JSON value a row's key can hold
        if not all(
            isinstance(row, list)
            and len(row) == len(columns)
            and all(isinstance(row[i], plain) for i in positions)
            for row in rows
        ):
            return "holds a row that is not a list of this run's columns"
        found = Counter(tuple(row[i] for i in positions) for row in rows)
        wanted = Counter(tuple(key) for key in keys)
        if found == wanted:
            return None
        missing, extra = sum((wanted - found).values()), sum((found - wanted).values())
        return (
            f"does not hold this chunk's rows ({len(rows)} rows where the run has "
            f"{len(keys)}: {missing} missing, {extra} duplicated or from elsewhere)"
        )

    def write(self, chunk_id: str, columns: Sequence[str], rows: Rows) -> Path:
        """Write one finished chunk, complete or not at all."""
        path = self.chunk_path(chunk_id)
        payload: dict[str, Any] = {
            "format": RUN_FORMAT,
            "run": self.fingerprint,
            "chunk": chunk_id,
            "columns": list(columns),
            "rows": rows,
        }
        payload["sha256"] = _content_hash(payload)
        kept = "The chunks written so far are kept: run again once it can be, to resume."
        with writing(f"A chunk of the run in {self.path},", path, kept):
            path.parent.mkdir(exist_ok=True)
            atomic_write(path, json.dumps(payload, separators=(",", ":")).encode())
        return path


def _content_hash(payload: Mapping[str, Any]) -> str:
    """SHA-256 of a chunk's canonical JSON, without its hash."""
    content = {key: value for key, value in payload.items() if key != "sha256"}
    return hashlib.sha256(
        json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def _check_is_run_directory(run_dir: Path) -> None:
    """Refuse a directory with files but no manifest (read in one listing: rank 0 may be
    writing it); dot files and ``chunks/``, left by a run killed while starting, are a run's."""
    names = [p.name for p in run_dir.iterdir()] if run_dir.is_dir() else ["manifest.json"]
    others = [] if "manifest.json" in names else [n for n in names if not n.startswith(".")]
    if [name for name in others if not (name == "chunks" and (run_dir / name).is_dir())]:
        raise RunError(
            f"{run_dir} is not empty and has no manifest.json, so it is not a run directory "
            f"(it holds {', '.join(sorted(others)[:5])}); refusing to write into it. Pass a new "
            "or empty directory."
        )


def _claim(run_dir: Path, fingerprint: str, spec: Mapping[str, Any]) -> None:
    """Check the manifest of a locked run directory, or write it (the lock is held)."""
    chunks = run_dir / "chunks"
    # Leftovers of writes killed before their rename; no other process writes here now.
    for leftover in [*run_dir.glob(".*.partial"), *chunks.glob(".*.partial")]:
        leftover.unlink(missing_ok=True)
    manifest_path = run_dir / "manifest.json"
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
            problem = None if isinstance(manifest, dict) else "not a JSON object"
        except (OSError, ValueError) as error:
            problem = str(error)
        if problem is None:
            _check_manifest(run_dir, manifest, fingerprint, spec)
            return
        if any(chunks.glob("*.json")):  # without chunks nothing was computed: start afresh
            raise RunError(
                f"{manifest_path} cannot be read ({problem}) and the directory holds chunks, "
                "so which run they belong to is unknown. Delete the directory to start over."
            )
    elif manifest_path.exists():
        raise RunError(f"{manifest_path} is not a file; delete it or use another directory.")
    manifest = {
        "fingerprint": fingerprint,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "spec": dict(spec),
    }
    with writing("The run directory", run_dir):
        atomic_write(manifest_path, json.dumps(manifest, indent=1).encode(), durable=True)
        chunks.mkdir(exist_ok=True)


def _check_manifest(
    run_dir: Path, manifest: Mapping[str, Any], fingerprint: str, spec: Mapping[str, Any]
) -> None:
    if manifest.get("fingerprint") == fingerprint:
        return
    old = manifest.get("spec", {})
    old_format = old.get("format") if isinstance(old, dict) else None
    if old_format != spec.get("format"):
        raise RunError(
            f"{run_dir} holds a run written by another version of grafting-lens (run format "
            f"{old_format}, this version writes {spec.get('format')}); it cannot be resumed. "
            "Pass another output directory, or delete this one to start over."
        )
    differences = describe_differences(old if isinstance(old, dict) else {}, spec)
    raise RunError(
        f"{run_dir} holds a different run (fingerprint {manifest.get('fingerprint')}, "
        f"this one is {fingerprint}); it differs in {differences}. Resuming would mix "
        "two runs: pass another output directory, or delete this one to start over."
    )


def describe_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """The keys in which two run descriptions differ, with what differs inside them (the
    configurations' names, which model set, a mapping's keys)."""
    parts = []
    for key in sorted(set(old) | set(new)):
        before: Any = old.get(key)
        after: Any = new.get(key)
        if before == after:
            continue
        lists = isinstance(before, list) and isinstance(after, list)
        if key == "configs" and lists:
            names = [[config.get("name") for config in value] for value in (before, after)]
            same = names[0] == names[1]
            parts.append("configs (definitions)" if same else f"configs ({names[0]} vs {names[1]})")
        elif key == "models" and lists:
            parts.append(f"models ({_model_differences(before, after)})")
        elif isinstance(before, dict) and isinstance(after, dict):
            inner = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            parts.append(f"{key} ({', '.join(inner)})")
        else:
            parts.append(key)
    return ", ".join(parts) or "its description"


def _model_differences(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> str:
    """Which model set differs, and in what: names, architecture or which source's weights."""
    if len(old) != len(new):
        return f"{len(old)} model sets vs {len(new)}"
    found = []
    for before, after in zip(old, new):
        keys = ("label", "names", "architecture", "n_layers")
        fields = [key for key in keys if before.get(key) != after.get(key)]
        names = list(after.get("names", []))
        changed = [
            repr(names[i]) if i < len(names) else f"source {i}"
            for i, (old_digest, new_digest) in enumerate(
                itertools.zip_longest(before.get("weights", []), after.get("weights", []))
            )
            if old_digest != new_digest
        ]
        if changed:
            fields.append(f"the weights or configuration of {', '.join(changed)}")
        if fields:
            found.append(f"{after.get('label')}: {', '.join(fields)}")
    return "; ".join(found) or "their description"
