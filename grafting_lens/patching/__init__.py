"""Activation patching on the same model sets: the passes, and the API and sweeps built on them."""

from grafting_lens.core.lazy import submodules

__getattr__ = submodules(__name__)
