"""Submodules reached as attributes of their package, imported on first use: ``import
grafting_lens`` stays quick, yet a notebook can write ``gl.analysis.metrics.top_k_hit``."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType


def submodules(package: str) -> Callable[[str], ModuleType]:
    """A module ``__getattr__`` for ``package`` (its ``__name__``) that imports
    ``package.<name>`` on first use; a name that is no submodule is an AttributeError."""

    def __getattr__(name: str) -> ModuleType:
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
