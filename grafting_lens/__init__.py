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

from grafting_lens import positions
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
)
from grafting_lens.graft import graft_forward, graft_forward_reference, graft_generate, grafting
from grafting_lens.masks import LAYER_FRACTIONS, GraftMask, resolve_layers
from grafting_lens.models import ModelSet, load_models

__version__ = "0.1.0"

__all__ = [
    "COMPONENTS",
    "COMPONENT_GROUPS",
    "GLOBAL_COMPONENTS",
    "LAYER_COMPONENTS",
    "LAYER_FRACTIONS",
    "AlignmentError",
    "ComponentError",
    "GraftMask",
    "GraftMaskError",
    "GraftingError",
    "GraftingLensError",
    "ModelSet",
    "graft_forward",
    "graft_forward_reference",
    "graft_generate",
    "grafting",
    "load_models",
    "positions",
    "register_component_paths",
    "resolve_layers",
]
