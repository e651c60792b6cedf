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
"""

from grafting_lens import (
    batch,
    comparison,
    data,
    experiments,
    layers,
    metrics,
    patching,
    plots,
    positions,
    scoring,
    toy,
)
from grafting_lens.architectures import VERIFIED_ARCHITECTURES
from grafting_lens.components import (
    COMPONENT_GROUPS,
    COMPONENTS,
    GLOBAL_COMPONENTS,
    LAYER_COMPONENTS,
    register_component_paths,
)
from grafting_lens.errors import (
    AlignmentError,
    BatchError,
    ComponentError,
    ExperimentError,
    GraftingError,
    GraftingLensError,
    GraftMaskError,
    NonFiniteLogitsError,
    PatchingError,
    RunError,
    SelectionError,
    TokenError,
    ToyWorldError,
    UnsupportedArchitectureError,
    UnverifiedArchitectureWarning,
)
from grafting_lens.experiments import (
    CLEAN,
    POSITION_CONFIGS,
    REFERENCE,
    Semantics,
    run_position_grafting,
)
from grafting_lens.graft import graft_forward, graft_forward_reference, graft_generate, grafting
from grafting_lens.layers import LAYER_FRACTIONS, resolve_layers
from grafting_lens.masks import GraftMask
from grafting_lens.metrics import bootstrap_ci, summarize
from grafting_lens.models import ModelSet, load_models
from grafting_lens.patching import head_patch_sweep, patch_forward, resid_patch_sweep
from grafting_lens.plots import plot_accuracy, save_figure
from grafting_lens.positions import select_positions

__version__ = "0.1.0"

__all__ = [
    "CLEAN",
    "COMPONENT_GROUPS",
    "COMPONENTS",
    "GLOBAL_COMPONENTS",
    "LAYER_COMPONENTS",
    "LAYER_FRACTIONS",
    "POSITION_CONFIGS",
    "REFERENCE",
    "AlignmentError",
    "batch",
    "BatchError",
    "bootstrap_ci",
    "comparison",
    "ComponentError",
    "data",
    "ExperimentError",
    "experiments",
    "graft_forward",
    "graft_forward_reference",
    "graft_generate",
    "grafting",
    "GraftingError",
    "GraftingLensError",
    "GraftMask",
    "GraftMaskError",
    "head_patch_sweep",
    "layers",
    "load_models",
    "metrics",
    "ModelSet",
    "NonFiniteLogitsError",
    "patch_forward",
    "patching",
    "PatchingError",
    "plot_accuracy",
    "plots",
    "positions",
    "register_component_paths",
    "resid_patch_sweep",
    "resolve_layers",
    "run_position_grafting",
    "RunError",
    "save_figure",
    "scoring",
    "select_positions",
    "SelectionError",
    "Semantics",
    "summarize",
    "TokenError",
    "ToyWorldError",
    "toy",
    "UnsupportedArchitectureError",
    "UnverifiedArchitectureWarning",
    "VERIFIED_ARCHITECTURES",
]
