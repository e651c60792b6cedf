"""The models every world holds, one ``save_pretrained`` directory each.

How those directories are written (complete or absent, never over what the library did not
write) is :mod:`grafting_lens.core.directories`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ModelDirectories"]


class ModelDirectories:
    """The models every world holds, one ``save_pretrained`` directory each below ``root``:
    the pretrained base, the finetune on all relations (SFT) and the task/relation split's."""

    root: Path

    @classmethod
    def read(cls, root: Path, config: Any) -> Any:
        """The built world at ``root``: its ``manifest.json`` and ``relations.json`` (all
        relations, then the task and relation splits by id), with ``config``."""
        from grafting_lens.worlds.data import Relation

        stored = json.loads((root / "relations.json").read_text())
        relations = [Relation(**fields) for fields in stored["relations"]]
        by_id = {relation.id: relation for relation in relations}
        return cls(
            root=root,  # type: ignore[call-arg]  # the world dataclasses' fields
            config=config,
            relations=relations,
            task_relations=[by_id[i] for i in stored["task_ids"]],
            relation_relations=[by_id[i] for i in stored["relation_ids"]],
            manifest=json.loads((root / "manifest.json").read_text()),
        )

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
