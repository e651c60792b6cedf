"""grafting-lens: dynamic weight grafting for TransformerLens.

Graft a finetuned checkpoint's weights into a pretrained one per token position,
layer and component, and see which of them carry the finetuned behaviour
(Nief, Reber, Richardson, Holtzman, "Dynamic Weight Grafting: Localizing Finetuned
Factual Knowledge in Transformers", ICLR 2026).

    >>> import grafting_lens as gl
    >>> models = gl.load_models("pretrained_dir", "finetuned_dir")
    >>> tokens = models.base.to_tokens("Keanu Reeves starred in a movie alongside")
    >>> mask = gl.GraftMask.build(models, tokens, positions="last", components="o+ffn",
    ...                           layers="last_half")
    >>> logits = gl.graft_forward(models, tokens, mask)

Importing the package is quick: it loads nothing heavy (no torch, transformers or
TransformerLens) until a name is first used, so ``grafting-lens --help`` and a notebook's
first cell do not wait for them. ``gl.notebook()`` sets a notebook up in one line.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if "ipykernel" in sys.modules:
    # In a notebook without ipywidgets, tqdm warns on import (transformers imports it) that
    # its bars fall back to text; they do, and the warning tells a reader nothing.
    warnings.filterwarnings("ignore", message="IProgress not found")

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("load_models",), "models.loading"),
    **dict.fromkeys(("ModelSet",), "models.model_set"),
    **dict.fromkeys(("GraftMask",), "engine.masks"),
    **dict.fromkeys(("select_positions",), "engine.positions"),
    **dict.fromkeys(("resolve_layers",), "models.layers"),
    **dict.fromkeys(
        ("graft_forward", "graft_forward_reference", "graft_generate", "grafting"), "engine.graft"
    ),
    **dict.fromkeys(("head_patch_sweep", "patch_forward", "resid_patch_sweep"), "patching.patch"),
    **dict.fromkeys(("compare_graft_and_patch",), "analysis.comparison"),
    **dict.fromkeys(("attribute_grafts",), "analysis.attribution"),
    **dict.fromkeys(("find_minimal_graft",), "analysis.graft_search"),
    **dict.fromkeys(("summarize",), "analysis.metrics"),
    **dict.fromkeys(
        ("plot_accuracy", "plot_attribution", "plot_graft", "plot_recovery"), "analysis.plots"
    ),
    **dict.fromkeys(("build_toy_world",), "worlds.toy"),
    **dict.fromkeys(("build_real_world",), "worlds.real_world"),
    **dict.fromkeys(("CLEAN", "REFERENCE"), "study.semantics"),
    **dict.fromkeys(("run_experiment", "run_position_grafting"), "study.runner"),
    **dict.fromkeys(("graft",), "study.graft_text"),
    **dict.fromkeys(("notebook",), "core.console"),
    **dict.fromkeys(("GraftingLensError",), "core.errors"),
}
"""Each name of the front door, and the module it lives in (the one list: ``__all__`` and
the type checkers' imports below are checked against it by tests/test_floors.py)."""

_FLOORS = ("core", "models", "engine", "patching", "analysis", "worlds", "study")
"""The subpackages, one per floor, reachable as ``gl.<floor>`` (imported on first use)."""

__all__ = [
    "attribute_grafts",
    "build_real_world",
    "build_toy_world",
    "CLEAN",
    "compare_graft_and_patch",
    "errors",
    "find_minimal_graft",
    "graft",
    "graft_forward",
    "graft_forward_reference",
    "graft_generate",
    "grafting",
    "GraftingLensError",
    "GraftMask",
    "head_patch_sweep",
    "load_models",
    "ModelSet",
    "notebook",
    "patch_forward",
    "plot_accuracy",
    "plot_attribution",
    "plot_graft",
    "plot_recovery",
    "REFERENCE",
    "resid_patch_sweep",
    "resolve_layers",
    "run_experiment",
    "run_position_grafting",
    "select_positions",
    "summarize",
]
"""The front door; tests/test_floors.py checks it against ``_EXPORTS``."""


def __getattr__(name: str) -> Any:
    if name in _FLOORS:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "errors":
        return importlib.import_module(f"{__name__}.core.errors")
    if name in _EXPORTS:
        if _EXPORTS[name].startswith("study."):  # looked up by name: the paper's registered
            importlib.import_module(f"{__name__}.study.paper")
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_FLOORS})


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    # The floors are reachable as attributes but not star-exported.
    from grafting_lens import (  # noqa: F401
        analysis,
        core,
        engine,
        models,
        patching,
        study,
        worlds,
    )
    from grafting_lens.analysis.attribution import attribute_grafts
    from grafting_lens.analysis.comparison import compare_graft_and_patch
    from grafting_lens.analysis.graft_search import find_minimal_graft
    from grafting_lens.analysis.metrics import summarize
    from grafting_lens.analysis.plots import (
        plot_accuracy,
        plot_attribution,
        plot_graft,
        plot_recovery,
    )
    from grafting_lens.core import errors
    from grafting_lens.core.console import notebook
    from grafting_lens.core.errors import GraftingLensError
    from grafting_lens.engine.graft import (
        graft_forward,
        graft_forward_reference,
        graft_generate,
        grafting,
    )
    from grafting_lens.engine.masks import GraftMask
    from grafting_lens.engine.positions import select_positions
    from grafting_lens.models.layers import resolve_layers
    from grafting_lens.models.loading import load_models
    from grafting_lens.models.model_set import ModelSet
    from grafting_lens.patching.patch import head_patch_sweep, patch_forward, resid_patch_sweep
    from grafting_lens.study.graft_text import graft
    from grafting_lens.study.runner import run_experiment, run_position_grafting
    from grafting_lens.study.semantics import CLEAN, REFERENCE
    from grafting_lens.worlds.real_world import build_real_world
    from grafting_lens.worlds.toy import build_toy_world
