"""Resumable run directories: a manifest that says which run lives here, and one file per chunk.

A long run is cut into chunks (a few dozen examples of one model set and test set).
With ``out=``, :func:`~grafting_lens.experiments.run_experiment` keeps its run in a
directory::

    manifest.json         {"fingerprint": ..., "created": ..., "spec": <describe_run>}
    chunks/<id>.json      {"chunk": <id>, "columns": [...], "rows": [[...], ...]}

Every file is written to a temporary sibling and renamed (``grafting_lens.files``),
so a chunk file is complete or absent. Started again with the same arguments, a run
reads its finished chunks back instead of computing them. The fingerprint is a hash of
:func:`describe_run`: the model sets (names, architecture, a sample of every weight),
the tokenized test sets and the positions each configuration selects, the
configurations, the options that change a row, the columns and the chunking. A
directory holding a different run, or files that are not a run's, is refused with a
:class:`~grafting_lens.errors.RunError` saying what differs.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grafting_lens.batch import TokenizedExamples
from grafting_lens.errors import RunError
from grafting_lens.experiments.configs import GraftConfig
from grafting_lens.experiments.testsets import TestSet
from grafting_lens.files import atomic_write
from grafting_lens.models import ModelSet

__all__ = ["RUN_FORMAT", "RunDirectory", "describe_run", "batch_digest", "weights_digest"]

RUN_FORMAT = 1
"""Version of the run-directory layout; part of every fingerprint."""

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

    Args:
        model_sets: ``(label, model set)`` pairs.
        test_sets: The test sets.
        examples: Rows of each test set's batch.
        test_digests: :func:`batch_digest` per ``(model set, test set)``.
        configs: The configurations.
        options: The options that change a row (see
            :meth:`~grafting_lens.experiments.runner.RunOptions.fingerprint`).
        columns: The results' columns.
        chunk_ids: Every chunk of the run, in order.
    """
    return {
        "format": RUN_FORMAT,
        "models": [
            {
                "label": label,
                "names": list(models.names),
                "architecture": models.architecture,
                "n_layers": models.n_layers,
                "weights": weights_digest(models),
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


def weights_digest(models: ModelSet) -> str:
    """A cheap hash of every source: names, shapes and a strided sample of every parameter."""
    digest = hashlib.sha256()
    for bridge in models:
        for name, parameter in bridge.original_model.named_parameters():
            flat = parameter.detach().reshape(-1)
            step = max(1, flat.numel() // 64)
            sample = flat[::step][:64].float().cpu().numpy()
            digest.update(f"{name}{tuple(parameter.shape)}".encode())
            digest.update(sample.tobytes())
    return digest.hexdigest()[:16]


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


class RunDirectory:
    """A directory holding one run: its manifest and its finished chunks.

    Open one with :meth:`open`, which creates it or checks that it holds this very run.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @classmethod
    def open(cls, path: str | Path, spec: Mapping[str, Any]) -> RunDirectory:
        """Create the run directory, or check that it holds the run ``spec`` describes.

        Raises:
            RunError: The path is a file, the directory holds another run (the message
                says what differs), or it holds files but no manifest.
        """
        run_dir = Path(path)
        fingerprint = _fingerprint(spec)
        manifest_path = run_dir / "manifest.json"
        if run_dir.exists() and not run_dir.is_dir():
            raise RunError(f"{run_dir} is a file; a run needs a directory.")
        if manifest_path.is_file():
            try:
                manifest = json.loads(manifest_path.read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise RunError(
                    f"{manifest_path} cannot be read ({error}); it is not a run this version "
                    "wrote. Use another directory."
                ) from error
            if manifest.get("fingerprint") != fingerprint:
                differences = _differences(manifest.get("spec", {}), spec)
                raise RunError(
                    f"{run_dir} holds a different run (fingerprint {manifest.get('fingerprint')}, "
                    f"this one is {fingerprint}); it differs in {differences}. Resuming would mix "
                    "two runs: pass another output directory, or delete this one to start over."
                )
            return cls(run_dir)
        if run_dir.is_dir() and any(not p.name.startswith(".") for p in run_dir.iterdir()):
            raise RunError(
                f"{run_dir} is not empty and has no manifest.json, so it is not a run directory; "
                "refusing to write into it. Pass a new or empty directory."
            )
        (run_dir / "chunks").mkdir(parents=True, exist_ok=True)
        manifest = {
            "fingerprint": fingerprint,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "spec": dict(spec),
        }
        atomic_write(manifest_path, json.dumps(manifest, indent=1).encode())
        return cls(run_dir)

    def chunk_path(self, chunk_id: str) -> Path:
        """Where the chunk ``chunk_id`` is kept."""
        return self.path / "chunks" / f"{chunk_id}.json"

    def finished(self, chunk_ids: Sequence[str], columns: Sequence[str]) -> dict[str, Rows]:
        """The rows of every chunk already written, by chunk id.

        Leftovers of a write that was killed before its rename are deleted.

        Raises:
            RunError: A chunk file that cannot be read or belongs to another run.
        """
        for leftover in (self.path / "chunks").glob(".*.partial"):
            leftover.unlink(missing_ok=True)
        done = {}
        for chunk_id in chunk_ids:
            path = self.chunk_path(chunk_id)
            if not path.is_file():
                continue
            try:
                content = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise RunError(
                    f"The chunk {path} cannot be read ({error}); delete it to recompute it."
                ) from error
            if content.get("columns") != list(columns) or content.get("chunk") != chunk_id:
                raise RunError(
                    f"The chunk {path} does not belong to this run; delete it to recompute it."
                )
            done[chunk_id] = content["rows"]
        return done

    def write(self, chunk_id: str, columns: Sequence[str], rows: Rows) -> Path:
        """Write one finished chunk, complete or not at all."""
        path = self.chunk_path(chunk_id)
        payload = {"chunk": chunk_id, "columns": list(columns), "rows": rows}
        atomic_write(path, json.dumps(payload, separators=(",", ":")).encode())
        return path


def _fingerprint(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    changed = [key for key in keys if old.get(key) != new.get(key)]
    parts = []
    for key in changed:
        if key == "configs":
            before = [c.get("name") for c in old.get(key, [])]
            after = [c.get("name") for c in new.get(key, [])]
            same_names = before == after
            parts.append(
                "configs (definitions)" if same_names else f"configs ({before} vs {after})"
            )
        elif key == "options":
            old_options, new_options = old.get(key, {}), new.get(key, {})
            inner = sorted(
                option
                for option in set(old_options) | set(new_options)
                if old_options.get(option) != new_options.get(option)
            )
            parts.append(f"options ({', '.join(inner)})")
        else:
            parts.append(key)
    return ", ".join(parts) or "its description"
