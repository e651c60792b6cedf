"""Checkpoints and what they are made of: architectures, components and layers, sources of
weights (in memory, read lazily, LoRA adapters), loading, alignment, and the model set.
"""

from grafting_lens.core.lazy import submodules

__getattr__ = submodules(__name__)
