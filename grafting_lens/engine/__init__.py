"""The graft itself: position selection, the graft mask, routing, the single-pass graft
with its token-by-token oracle, and the relaxed (differentiable) graft.
"""

from grafting_lens.core.lazy import submodules

__getattr__ = submodules(__name__)
