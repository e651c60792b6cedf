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

from grafting_lens import comparison, data, experiments, metrics, patching, plots, positions, toy
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
    ComponentError,
    GraftingError,
    GraftingLensError,
    GraftMaskError,
    UnsupportedArchitectureError,
    UnverifiedArchitectureWarning,
)
from grafting_lens.graft import graft_forward, graft_forward_reference, graft_generate, grafting
from grafting_lens.masks import LAYER_FRACTIONS, GraftMask, resolve_layers
from grafting_lens.metrics import bootstrap_ci, summarize
from grafting_lens.models import ModelSet, load_models
from grafting_lens.patching import PatchingError, head_patch_sweep, patch_forward, resid_patch_sweep
from grafting_lens.plots import plot_accuracy, save_figure
from grafting_lens.position_grafting import POSITION_CONFIGS, run_position_grafting

__version__ = "0.1.0"

__all__ = [
    "COMPONENT_GROUPS",
    "COMPONENTS",
    "GLOBAL_COMPONENTS",
    "LAYER_COMPONENTS",
    "LAYER_FRACTIONS",
    "POSITION_CONFIGS",
    "AlignmentError",
    "bootstrap_ci",
    "comparison",
    "ComponentError",
    "data",
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
    "load_models",
    "metrics",
    "ModelSet",
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
    "save_figure",
    "summarize",
    "toy",
    "UnsupportedArchitectureError",
    "UnverifiedArchitectureWarning",
    "VERIFIED_ARCHITECTURES",
]
