"""Scores and what is made of them: metrics and intervals, the tokenized batch, the scorer,
grafting beside patching, graft attribution, the minimal graft, and figures.
"""

from grafting_lens.core.lazy import submodules

__getattr__ = submodules(__name__)
