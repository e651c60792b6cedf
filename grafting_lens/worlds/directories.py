"""The models every world holds, one ``save_pretrained`` directory each, and its relations.

How those directories are written (complete or absent, never over what the library did not
write) is :mod:`grafting_lens.core.directories`.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grafting_lens.core.errors import GraftingLensError, did_you_mean
from grafting_lens.worlds import data

__all__ = ["ModelDirectories", "read_relations", "split_relations"]


@dataclass
class ModelDirectories:
    """The models every world holds, one ``save_pretrained`` directory each below ``root``:
    the pretrained base, the finetune on all relations (SFT) and the task/relation split's;
    the world's configuration, relations (all, then the split's) and manifest."""

    root: Path
    config: Any
    relations: list[Any] = field(repr=False)
    task_relations: list[Any] = field(repr=False)
    relation_relations: list[Any] = field(repr=False)
    manifest: dict[str, Any] = field(repr=False)

    @classmethod
    def read(cls, root: Path, config: Any) -> Any:
        """The built world at ``root``: its ``manifest.json`` and :func:`read_relations`, with
        ``config``."""
        manifest = json.loads((root / "manifest.json").read_text())
        return cls(root, config, *read_relations(root), manifest=manifest)

    @property
    def base_dir(self) -> Path:
        return self.root / "base"

    @property
    def sft_dir(self) -> Path:
        return self.root / "sft"

    @property
    def task_dir(self) -> Path:
        return self.root / "task"

    @property
    def relation_dir(self) -> Path:
        return self.root / "relation"

    def model_dir(self, name: str) -> Path:
        """Directory of one checkpoint by name (one of ``config.model_names``)."""
        names = self.config.model_names
        if name not in names:
            raise GraftingLensError(
                f"This world has no model {name!r}: choose one of {names}."
                f"{did_you_mean(name, names)}"
            )
        return self.root / name


def split_relations(relations: list[Any], seed: int, fix: str) -> dict[str, Any]:
    """What a world's ``relations.json`` holds: the relations, and their task/relation split
    (:func:`~grafting_lens.worlds.data.split_task_relation`) by id. The relations whose actors
    straddle the split are dropped without a warning: the ids say which.

    Raises:
        GraftingLensError: A side of the split is empty; ``fix`` says what to change.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="split_task_relation dropped")
        task, relation = data.split_task_relation(relations, seed=seed)
    if not task or not relation:
        raise GraftingLensError(
            f"The task/relation split of {len(relations)} relations left {len(task)} task and "
            f"{len(relation)} relation relations: {fix}"
        )
    return {
        "relations": [dataclasses.asdict(r) for r in relations],
        "task_ids": [r.id for r in task],
        "relation_ids": [r.id for r in relation],
    }


def read_relations(root: Path) -> tuple[list[Any], list[Any], list[Any]]:
    """All relations of the world at ``root``, then its task and relation splits."""
    stored = json.loads((root / "relations.json").read_text())
    relations = [data.Relation(**fields) for fields in stored["relations"]]
    by_id = {relation.id: relation for relation in relations}
    task, relation = ([by_id[i] for i in stored[side]] for side in ("task_ids", "relation_ids"))
    return relations, task, relation
