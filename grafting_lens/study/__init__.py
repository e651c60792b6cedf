"""The paper's experiments: graft configurations as data, and one resumable runner for all of them.

Every experiment in the paper asks one question of many prompts: *if these weights, at
these positions, came from that checkpoint, would the model still name the right actor?*
Position grafting (figures 2 and 3a), component grafting (figure 4), its reversal and the
hybrid graft (figure 5) differ only in the weights, positions and checkpoints:
:mod:`~grafting_lens.study.configs` holds them as data, :mod:`~grafting_lens.study.runner`
runs a grid of model sets x test sets x configurations into one tidy DataFrame, and
:mod:`~grafting_lens.study.specs` registers the named experiments (:data:`EXPERIMENTS`).
What a configuration means is a :class:`Semantics`: :data:`REFERENCE` (the authors' released
code, the default) or :data:`CLEAN` (see docs/concepts/paper-code-library.md).

Examples:
    >>> from grafting_lens import study
    >>> models, relations, info = study.toy_setup("hybrid")  # builds the toy world once
    >>> results = study.run_named_experiment("hybrid", models, relations)
    >>> metrics.summarize(results, by=("config", "prompt"))

    A grid of your own:

    >>> config = GraftConfig("O+FFN@last_half", (Graft("LT", "O+FFN", "last_half"),))
    >>> test_sets = make_test_sets(relations, prompts=("headline", "qa"))
    >>> results = run_experiment(models, test_sets, ["PRE", "LT", config], out="runs/mine")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from grafting_lens.core.lazy import submodules

# Imported on first use, as the package's front door: `grafting-lens --help` and a notebook's
# `from grafting_lens import study` load no TransformerLens until a name is used.
_EXPORTS = {
    **dict.fromkeys(
        ("CLEAN", "DEFAULT_SEMANTICS", "REFERENCE", "Semantics", "as_semantics"), "semantics"
    ),
    **dict.fromkeys(
        (
            "COMPONENT_CONFIGS",
            "COMPONENT_LAYER_RANGES",
            "COMPONENT_SETS",
            "HYBRID",
            "HYBRID_CONFIGS",
            "PAPER_POSITION_CONFIGS",
            "POSITION_CONFIGS",
            "RELATION",
            "TASK",
            "Graft",
            "GraftConfig",
            "resolve_components",
        ),
        "configs",
    ),
    **dict.fromkeys(("MOVIE_PROMPTS", "TestSet", "make_test_sets", "read_prompts"), "testsets"),
    **dict.fromkeys(("config_masks",), "stacking"),
    **dict.fromkeys(("RunOptions", "run_experiment", "run_position_grafting"), "runner"),
    **dict.fromkeys(
        (
            "EXPERIMENTS",
            "ExperimentSpec",
            "Figure",
            "Part",
            "get_configs",
            "get_experiment",
            "register_config",
            "register_experiment",
        ),
        "specs",
    ),
    **dict.fromkeys(
        ("checkpoint_setup", "run_named_experiment", "run_spec", "setup_experiment", "toy_setup"),
        "named",
    ),
    **dict.fromkeys(("summary_table", "write_experiment_report"), "report"),
}

__all__ = [
    "as_semantics",
    "checkpoint_setup",
    "CLEAN",
    "COMPONENT_CONFIGS",
    "COMPONENT_LAYER_RANGES",
    "COMPONENT_SETS",
    "config_masks",
    "DEFAULT_SEMANTICS",
    "EXPERIMENTS",
    "ExperimentSpec",
    "Figure",
    "get_configs",
    "get_experiment",
    "Graft",
    "GraftConfig",
    "HYBRID",
    "HYBRID_CONFIGS",
    "make_test_sets",
    "MOVIE_PROMPTS",
    "PAPER_POSITION_CONFIGS",
    "Part",
    "POSITION_CONFIGS",
    "read_prompts",
    "REFERENCE",
    "register_config",
    "register_experiment",
    "RELATION",
    "resolve_components",
    "run_experiment",
    "run_named_experiment",
    "run_position_grafting",
    "run_spec",
    "RunOptions",
    "Semantics",
    "setup_experiment",
    "summary_table",
    "TASK",
    "TestSet",
    "toy_setup",
    "write_experiment_report",
]
"""The public names; tests/test_floors.py checks them against ``_EXPORTS``."""

_submodule = submodules(__name__)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        # The package's names come with the paper's experiments registered, as their
        # lookups by name (get_experiment("position"), registry="component") expect.
        importlib.import_module("grafting_lens.study.paper")
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    return _submodule(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from grafting_lens.study.configs import (
        COMPONENT_CONFIGS,
        COMPONENT_LAYER_RANGES,
        COMPONENT_SETS,
        HYBRID,
        HYBRID_CONFIGS,
        PAPER_POSITION_CONFIGS,
        POSITION_CONFIGS,
        RELATION,
        TASK,
        Graft,
        GraftConfig,
        resolve_components,
    )
    from grafting_lens.study.named import (
        checkpoint_setup,
        run_named_experiment,
        run_spec,
        setup_experiment,
        toy_setup,
    )
    from grafting_lens.study.report import summary_table, write_experiment_report
    from grafting_lens.study.runner import RunOptions, run_experiment, run_position_grafting
    from grafting_lens.study.semantics import (
        CLEAN,
        DEFAULT_SEMANTICS,
        REFERENCE,
        Semantics,
        as_semantics,
    )
    from grafting_lens.study.specs import (
        EXPERIMENTS,
        ExperimentSpec,
        Figure,
        Part,
        get_configs,
        get_experiment,
        register_config,
        register_experiment,
    )
    from grafting_lens.study.stacking import config_masks
    from grafting_lens.study.testsets import MOVIE_PROMPTS, TestSet, make_test_sets, read_prompts
