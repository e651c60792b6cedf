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

_SUBMODULES = (
    "adapters",
    "attribution",
    "batch",
    "comparison",
    "data",
    "experiments",
    "graft_search",
    "kernels",
    "layers",
    "metrics",
    "patching",
    "plots",
    "positions",
    "relaxation",
    "scoring",
    "sources",
    "toy",
)
"""Submodules reachable as ``gl.<name>``, imported on first use."""

_NAMES: dict[str, str] = {
    **dict.fromkeys(("VERIFIED_ARCHITECTURES",), "architectures"),
    **dict.fromkeys(
        (
            "COMPONENT_GROUPS",
            "COMPONENT_LABELS",
            "COMPONENTS",
            "GLOBAL_COMPONENTS",
            "LAYER_COMPONENTS",
            "register_component_paths",
        ),
        "components",
    ),
    **dict.fromkeys(
        (
            "AdapterError",
            "AlignmentError",
            "AttributionError",
            "BatchError",
            "ComponentError",
            "ExperimentError",
            "GraftingError",
            "GraftingLensError",
            "GraftMaskError",
            "KernelError",
            "LazyLoadWarning",
            "NonFiniteLogitsError",
            "PatchingError",
            "RunError",
            "SelectionError",
            "TokenError",
            "ToyWorldError",
            "UnsupportedArchitectureError",
            "UnverifiedArchitectureWarning",
            "WorldSourceError",
        ),
        "errors",
    ),
    **dict.fromkeys(
        ("CLEAN", "POSITION_CONFIGS", "REFERENCE", "Semantics", "run_position_grafting"),
        "experiments",
    ),
    **dict.fromkeys(
        ("graft_forward", "graft_forward_reference", "graft_generate", "grafting"), "graft"
    ),
    **dict.fromkeys(("GraftAttribution", "attribute_grafts"), "attribution"),
    **dict.fromkeys(("MinimalGraft", "find_minimal_graft"), "graft_search"),
    **dict.fromkeys(("relaxing",), "relaxation"),
    **dict.fromkeys(("LAYER_FRACTIONS", "resolve_layers"), "layers"),
    **dict.fromkeys(("GraftMask",), "masks"),
    **dict.fromkeys(("bootstrap_ci", "summarize"), "metrics"),
    **dict.fromkeys(("ModelSet", "load_models"), "models"),
    **dict.fromkeys(("notebook", "quiet_loading"), "console"),
    **dict.fromkeys(("head_patch_sweep", "patch_forward", "resid_patch_sweep"), "patching"),
    **dict.fromkeys(
        ("plot_accuracy", "plot_attribution", "plot_mean_rank", "plot_recovery", "save_figure"),
        "plots",
    ),
    **dict.fromkeys(("select_positions",), "positions"),
}
"""Each public name, and the module it lives in."""

__all__ = [
    "AdapterError",
    "adapters",
    "AlignmentError",
    "attribute_grafts",
    "attribution",
    "AttributionError",
    "batch",
    "BatchError",
    "bootstrap_ci",
    "CLEAN",
    "comparison",
    "COMPONENT_GROUPS",
    "COMPONENT_LABELS",
    "ComponentError",
    "COMPONENTS",
    "data",
    "ExperimentError",
    "experiments",
    "find_minimal_graft",
    "GLOBAL_COMPONENTS",
    "graft_forward",
    "graft_forward_reference",
    "graft_generate",
    "graft_search",
    "GraftAttribution",
    "grafting",
    "GraftingError",
    "GraftingLensError",
    "GraftMask",
    "GraftMaskError",
    "head_patch_sweep",
    "KernelError",
    "kernels",
    "LAYER_COMPONENTS",
    "LAYER_FRACTIONS",
    "layers",
    "LazyLoadWarning",
    "load_models",
    "metrics",
    "MinimalGraft",
    "ModelSet",
    "NonFiniteLogitsError",
    "notebook",
    "patch_forward",
    "patching",
    "PatchingError",
    "plot_accuracy",
    "plot_attribution",
    "plot_mean_rank",
    "plot_recovery",
    "plots",
    "POSITION_CONFIGS",
    "positions",
    "quiet_loading",
    "REFERENCE",
    "register_component_paths",
    "relaxation",
    "relaxing",
    "resid_patch_sweep",
    "resolve_layers",
    "run_position_grafting",
    "RunError",
    "save_figure",
    "scoring",
    "select_positions",
    "SelectionError",
    "Semantics",
    "sources",
    "summarize",
    "TokenError",
    "ToyWorldError",
    "toy",
    "UnsupportedArchitectureError",
    "UnverifiedArchitectureWarning",
    "VERIFIED_ARCHITECTURES",
    "WorldSourceError",
]


def __getattr__(name: str) -> Any:
    """Import a submodule, or the module a public name lives in, on first use (PEP 562)."""
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from grafting_lens import (
        adapters,
        attribution,
        batch,
        comparison,
        data,
        experiments,
        graft_search,
        kernels,
        layers,
        metrics,
        patching,
        plots,
        positions,
        relaxation,
        scoring,
        sources,
        toy,
    )
    from grafting_lens.architectures import VERIFIED_ARCHITECTURES
    from grafting_lens.attribution import GraftAttribution, attribute_grafts
    from grafting_lens.components import (
        COMPONENT_GROUPS,
        COMPONENT_LABELS,
        COMPONENTS,
        GLOBAL_COMPONENTS,
        LAYER_COMPONENTS,
        register_component_paths,
    )
    from grafting_lens.console import notebook, quiet_loading
    from grafting_lens.errors import (
        AdapterError,
        AlignmentError,
        AttributionError,
        BatchError,
        ComponentError,
        ExperimentError,
        GraftingError,
        GraftingLensError,
        GraftMaskError,
        KernelError,
        LazyLoadWarning,
        NonFiniteLogitsError,
        PatchingError,
        RunError,
        SelectionError,
        TokenError,
        ToyWorldError,
        UnsupportedArchitectureError,
        UnverifiedArchitectureWarning,
        WorldSourceError,
    )
    from grafting_lens.experiments import (
        CLEAN,
        POSITION_CONFIGS,
        REFERENCE,
        Semantics,
        run_position_grafting,
    )
    from grafting_lens.graft import graft_forward, graft_forward_reference, graft_generate, grafting
    from grafting_lens.graft_search import MinimalGraft, find_minimal_graft
    from grafting_lens.layers import LAYER_FRACTIONS, resolve_layers
    from grafting_lens.masks import GraftMask
    from grafting_lens.metrics import bootstrap_ci, summarize
    from grafting_lens.models import ModelSet, load_models
    from grafting_lens.patching import head_patch_sweep, patch_forward, resid_patch_sweep
    from grafting_lens.plots import (
        plot_accuracy,
        plot_attribution,
        plot_mean_rank,
        plot_recovery,
        save_figure,
    )
    from grafting_lens.positions import select_positions
    from grafting_lens.relaxation import relaxing
