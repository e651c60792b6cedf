"""The house: each folder of the package is a floor, imports run only downward, the lens
never imports the study, no room imports itself in a circle, no room outgrows ~900 lines,
and the front door holds the names it says it holds.

docs/developing/index.md draws the same floors; this test keeps the drawing true. A new
folder goes on a floor here, in the same change that adds it.
"""

from __future__ import annotations

import ast
import collections
import importlib
from collections.abc import Mapping
from pathlib import Path

import pytest

import grafting_lens

PACKAGE = Path(__file__).resolve().parents[1] / "grafting_lens"

FLOORS: tuple[str, ...] = (
    "core",  # errors, numbers, files and the cache root, the console, release differences
    "models",  # architectures, components, layers, sources, adapters, loading, the model set
    "engine",  # positions, the mask, the graft and its oracle, the relaxed graft
    "patching",  # activation patching: the passes, the API and sweeps
    "analysis",  # metrics, the batch, the scorer, comparison, attribution, search, figures
    # The study of the paper: built on the lens, never imported by it.
    "worlds",  # relation data, finetuning, the toy world, the real-model world
    "study",  # semantics, configurations, the runner, run directories, reports, the command
)
"""Floors from the bottom up; a module may import modules on its own floor or below."""

LENS = set(FLOORS[:5])
STUDY = set(FLOORS[5:])
FLOOR = {folder: index for index, folder in enumerate(FLOORS)}
FRONT_DOOR = len(FLOORS)  # grafting_lens/__init__.py stands above every floor

LONGEST_ROOM = 900
"""Lines; a module past it holds more than one idea (docs/developing says how to split)."""

MODULES = sorted(PACKAGE.rglob("*.py"))

FLOOR_BUDGETS: dict[str, tuple[int, float]] = {
    **{folder: (6000, 16.0) for folder in FLOORS},
    "study": (7000, 15.0),
}
"""Lines a floor may hold, and ``raise`` statements per 1,000 of them (the lens floors hold
about 13, as TransformerLens's bridge and SAELens do: checks at the door, trust inside)."""

PACKAGE_BUDGET = 27_500
"""Lines the whole package may hold (issues 49 and 50 set it): a new idea pays for its
lines by simplifying what it touches."""


def _room(path: Path) -> str:
    """A module's dotted name inside the package: ``analysis.metrics``, ``__init__``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts)


def _floor(room: str) -> int:
    return FRONT_DOOR if room == "__init__" else FLOOR[room.split(".")[0]]


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, room)`` of every grafting_lens module a file imports, at any depth.

    ``from grafting_lens.analysis import metrics`` imports ``analysis.metrics``;
    ``from grafting_lens.analysis.metrics import x`` imports ``analysis.metrics``;
    ``importlib.import_module("grafting_lens.study.paper")`` imports ``study.paper``.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("grafting_lens.")
        ):
            found.append((node.lineno, node.args[0].value.removeprefix("grafting_lens.")))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "grafting_lens":
                continue
            inner = ".".join(parts[1:])
            for alias in node.names:
                candidate = f"{inner}.{alias.name}" if inner else alias.name
                module = PACKAGE / Path(*candidate.split("."))
                if module.with_suffix(".py").exists() or (module / "__init__.py").exists():
                    found.append((node.lineno, candidate))
                elif inner:
                    found.append((node.lineno, inner))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "grafting_lens" and len(parts) > 1:
                    found.append((node.lineno, ".".join(parts[1:])))
    return found


def _target_floor(target: str) -> int | None:
    top = target.split(".")[0]
    return FLOOR.get(top)


def test_every_module_is_on_a_floor():
    loose = [
        _room(path) for path in MODULES if "." not in _room(path) and _room(path) != "__init__"
    ]
    assert not loose, f"put {loose} in a floor's folder ({', '.join(FLOORS)})"
    folders = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert folders == set(FLOORS), f"folders that are no floor: {sorted(folders - set(FLOORS))}"


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_imports_run_downward(path):
    room = _room(path)
    upward = [
        f"line {line}: {target} ({FLOORS[_target_floor(target)]})"
        for line, target in _imports(path)
        if _target_floor(target) is not None and _target_floor(target) > _floor(room)
    ]
    assert not upward, f"{room} imports upward: {upward}"


def test_the_lens_never_imports_the_study():
    crossings = [
        f"{_room(path)}:{line} imports {target}"
        for path in MODULES
        if _room(path).split(".")[0] in LENS
        for line, target in _imports(path)
        if target.split(".")[0] in STUDY
    ]
    assert not crossings


def _circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one room (Tarjan): rooms each of which
    imports, at some remove, every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(room: str) -> None:
        index[room] = low[room] = len(index)
        stack.append(room)
        for target in sorted(graph.get(room, ())):
            if target not in index:
                visit(target)
                low[room] = min(low[room], low[target])
            elif target in stack:
                low[room] = min(low[room], index[target])
        if low[room] == index[room]:
            component = []
            while not component or component[-1] != room:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for room in sorted(graph):
        if room not in index:
            visit(room)
    return circles


def test_no_room_imports_itself_in_a_circle():
    # Imports at any depth, in functions and through importlib.import_module("grafting_lens...")
    # alike: a room that imports another on first use still needs it.
    graph = collections.defaultdict(set)
    for path in MODULES:
        room = _room(path)
        for _, target in _imports(path):
            if target != room and not target.endswith("__init__"):
                graph[room].add(target)
    # A folder's __init__ reached by ``from grafting_lens.study import x`` is the folder.
    circles = _circles(graph)
    assert not circles, f"rooms that import each other in a circle: {circles}"


def test_a_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _circles(graph) == [["a", "b", "c"]]


def floor_size(folder: str) -> tuple[int, int]:
    """``(lines, raise statements)`` of a floor's modules: every line as ``wc -l`` counts it,
    every ``raise`` the parser finds."""
    lines = raises = 0
    for path in sorted((PACKAGE / folder).glob("*.py")):
        text = path.read_text()
        lines += len(text.splitlines())
        raises += sum(isinstance(node, ast.Raise) for node in ast.walk(ast.parse(text)))
    return lines, raises


@pytest.mark.parametrize("folder", sorted(FLOOR_BUDGETS))
def test_no_floor_outgrows_its_budget(folder):
    most, density = FLOOR_BUDGETS[folder]
    lines, raises = floor_size(folder)
    assert lines <= most, f"{folder}/ has {lines} lines, past {most}: move an idea out or simplify"
    assert 1000 * raises / lines <= density, (
        f"{folder}/ has {raises} raise statements in {lines} lines, past {density} per 1,000: "
        "check at the door and trust inside"
    )


def test_the_package_stays_within_its_budget():
    lines = sum(len(path.read_text().splitlines()) for path in MODULES)
    assert lines <= PACKAGE_BUDGET, f"grafting_lens/ has {lines} lines, past {PACKAGE_BUDGET}"


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_room_outgrows_one_idea(path):
    lines = len(path.read_text().splitlines())
    assert lines <= LONGEST_ROOM, f"{_room(path)} has {lines} lines: split it by idea"


def test_floor_packages_import_nothing_when_imported():
    # gl.<floor>.<module> imports the module on first use (grafting_lens.core.lazy).
    for folder in FLOORS:
        tree = ast.parse((PACKAGE / folder / "__init__.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} - {
            "__future__",
            "grafting_lens.core.lazy",
        }
        if folder == "study":  # its public names, imported on first use and for type checkers
            imported = {m for m in imported if not m.startswith("grafting_lens.study.")} - {
                "typing"
            }
        assert not imported, f"grafting_lens/{folder}/__init__.py imports {imported}"


def test_private_classes_have_distinct_names():
    homes = collections.defaultdict(list)
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.startswith("_"):
                homes[node.name].append(_room(path))
    assert not {name: where for name, where in homes.items() if len(where) > 1}


# ------------------------------------------------------------------------ the front door


def test_the_front_door_is_small_and_says_what_it_holds():
    exports = grafting_lens._EXPORTS
    assert len(grafting_lens.__all__) <= 30
    assert grafting_lens.__all__ == sorted([*exports, "errors"], key=str.lower)
    for name, module in exports.items():
        assert getattr(grafting_lens, name) is getattr(
            importlib.import_module(f"grafting_lens.{module}"), name
        )
    assert grafting_lens.errors is importlib.import_module("grafting_lens.core.errors")


def test_the_type_checkers_see_the_names_the_front_door_serves():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    seen = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom) and statement.module != "grafting_lens":
                    for alias in statement.names:
                        seen[alias.name] = statement.module.removeprefix("grafting_lens.")
    seen.pop("errors")
    assert seen == grafting_lens._EXPORTS


@pytest.mark.parametrize("folder", FLOORS)
def test_every_floor_is_reachable_from_the_front_door(folder):
    module = getattr(grafting_lens, folder)
    assert module.__name__ == f"grafting_lens.{folder}"
    first = sorted(path.stem for path in (PACKAGE / folder).glob("[!_]*.py"))[0]
    assert getattr(module, first).__name__ == f"grafting_lens.{folder}.{first}"
    with pytest.raises(AttributeError, match="no attribute 'no_such_room'"):
        module.no_such_room  # noqa: B018


# ------------------------------------------------------------------------ the drawing

DEVELOPING = PACKAGE.parent / "docs" / "developing" / "index.md"
PLAN_WIDTH = 90
"""Columns of a line of the drawing (the docs' code block shows about 95)."""


def floor_plan() -> list[str]:
    """One line per floor, top floor first: its rooms in the order their imports allow
    (``a → b``: ``b`` imports from ``a``'s level or below; rooms at one level import none
    of each other)."""
    graph = collections.defaultdict(set)
    for path in MODULES:
        for _, target in _imports(path):
            graph[_room(path)].add(target)
    lines = []
    for folder in reversed(FLOORS):
        rooms = sorted(_room(path) for path in (PACKAGE / folder).glob("[!_]*.py"))
        level: dict[str, int] = {}

        def depth(room: str, rooms: list[str] = rooms, level: dict[str, int] = level) -> int:
            if room not in level:
                inside = [t for t in graph[room] if t in rooms and t != room]
                level[room] = 1 + max((depth(t) for t in inside), default=-1)
            return level[room]

        by_level = collections.defaultdict(list)
        for room in rooms:
            by_level[depth(room)].append(room.split(".", 1)[1])
        steps = [", ".join(sorted(by_level[k])) for k in sorted(by_level)]
        # Wrapped after an arrow at the width the docs' code block shows, so that no room
        # hides past the block's right edge.
        line = f"{folder + '/':11s} {steps[0]}"
        for step in steps[1:]:
            if len(f"{line} → {step}") > PLAN_WIDTH:
                lines.append(f"{line} →")
                line = " " * 12 + step
            else:
                line = f"{line} → {step}"
        lines.append(line)
    return lines


def test_the_developer_guide_draws_the_floors_the_code_has():
    text = DEVELOPING.read_text()
    drawn = text.split("<!-- floors -->\n```text\n")[1].split("```")[0].splitlines()
    assert drawn == floor_plan(), "redraw docs/developing/index.md's floors: " + "\n".join(
        floor_plan()
    )
