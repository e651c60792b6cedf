"""The worlds the paper's experiments run in: relation data, finetuning, the shipped toy world,
and the real-model world (SmolLM2-135M from a GGUF file). The study of the paper: built on the
lens, never imported by it.
"""

from grafting_lens.core.lazy import submodules

__getattr__ = submodules(__name__)
