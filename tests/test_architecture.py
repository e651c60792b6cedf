"""The house's floors: every module on one, imports only downward, the lens never imports the study.

docs/developing/architecture.md explains the floors; this test keeps them true. A new
module goes on a floor here, in the same change that adds it.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grafting_lens"

FLOORS: list[tuple[str, tuple[str, ...]]] = [
    # compat: what differs between dependency releases, and the canaries that catch it.
    ("foundation", ("errors", "arguments", "files", "console", "compat")),
    # Layer ranges sit with the models: load_models takes them to declare what grafts take.
    ("architectures", ("architectures", "components", "layers", "sources", "adapters", "models")),
    ("selection", ("positions",)),
    ("grafts", ("masks", "kernels", "graft", "relaxation")),
    ("patching", ("patch_passes", "patching")),
    ("scores and batches", ("metrics", "batch", "scoring")),
    ("comparison and attribution", ("comparison", "attribution", "graft_search")),
    ("figures", ("plots",)),
    # The study of the paper: built on the lens, never imported by it.
    (
        "data and training",
        (
            "data",
            "finetune",
            "toy_corpus",
            "toy_shipped",
            "toy",
            "gguf_checkpoint",
            "smollm2_source",
            "smollm2",
        ),
    ),
    ("experiments", ("experiments", "position_grafting")),
    ("the command and the front door", ("cli", "__init__")),
]
"""Floors from the bottom up; a module may import modules on its own floor or below."""

LENS = {module for _, modules in FLOORS[:7] for module in modules}
"""The lens: everything up to the comparison of grafting and patching."""

STUDY = {module for _, modules in FLOORS[8:10] for module in modules}
"""The study of the paper: data, the toy world, finetuning, the experiments."""

FLOOR = {module: index for index, (_, modules) in enumerate(FLOORS) for module in modules}


def _room(path: Path) -> str:
    """A module's room: its top-level name inside the package (a subpackage is one room)."""
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, room)`` of every grafting_lens module a file imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "grafting_lens":
                continue
            rooms = [parts[1]] if len(parts) > 1 else [alias.name for alias in node.names]
            found += [(node.lineno, room) for room in rooms]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "grafting_lens":
                    found.append((node.lineno, parts[1] if len(parts) > 1 else "__init__"))
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_on_a_floor():
    unplaced = sorted({_room(path) for path in MODULES} - set(FLOOR))
    assert not unplaced, f"put {unplaced} on a floor in FLOORS (and in architecture.md)"


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_imports_run_downward(path):
    room = _room(path)
    upward = [
        f"line {line}: {target} ({FLOORS[FLOOR[target]][0]})"
        for line, target in _imports(path)
        if target in FLOOR and target != room and FLOOR[target] > FLOOR[room]
    ]
    assert not upward, f"{room} ({FLOORS[FLOOR[room]][0]}) imports upward: {upward}"


def test_the_lens_never_imports_the_study():
    crossings = [
        f"{path.relative_to(PACKAGE)}:{line} imports {target}"
        for path in MODULES
        if _room(path) in LENS
        for line, target in _imports(path)
        if target in STUDY
    ]
    assert not crossings


def test_rooms_on_one_floor_do_not_import_each_other_both_ways():
    edges = {
        (_room(path), target)
        for path in MODULES
        for _, target in _imports(path)
        if target in FLOOR and target != _room(path)
    }
    cycles = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert not cycles


def test_private_classes_have_distinct_names():
    homes = collections.defaultdict(list)
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.startswith("_"):
                homes[node.name].append(str(path.relative_to(PACKAGE)))
    assert not {name: where for name, where in homes.items() if len(where) > 1}
