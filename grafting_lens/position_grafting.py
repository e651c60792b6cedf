"""Deprecated: position grafting now lives with the other experiments.

What this module held moved where it belongs:

* the configurations (``POSITION_CONFIGS``, ``PAPER_CONFIGS``) and the runner
  (``run_position_grafting``) to ``grafting_lens.experiments``
  (``POSITION_CONFIGS``, ``PAPER_POSITION_CONFIGS``, ``run_position_grafting``);
* registering a configuration to ``grafting_lens.experiments.register_config``
  (``register_config(GraftConfig(name, (Graft(positions),)))``);
* span expressions (``"FE+LT"``, ``"(FE+LT)^C"``) to
  ``grafting_lens.positions.select_positions``.

Importing this module warns; its names keep working.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Sequence

import torch
from jaxtyping import Bool, Int

from grafting_lens.errors import ExperimentError
from grafting_lens.experiments import (
    CLEAN,
    PAPER_POSITION_CONFIGS,
    POSITION_GRAFTING_COLUMNS,
    Graft,
    GraftConfig,
    config_masks,
    get_configs,
    resolve_components,
    retarget,
    run_position_grafting,
)
from grafting_lens.experiments import POSITION_CONFIGS as _POSITION_CONFIGS
from grafting_lens.masks import GraftMask
from grafting_lens.models import ModelSet
from grafting_lens.positions import PositionFunction, Spans

warnings.warn(
    "grafting_lens.position_grafting is deprecated: use grafting_lens.experiments "
    "(POSITION_CONFIGS, run_position_grafting, register_config) and "
    "grafting_lens.positions.select_positions.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "PAPER_CONFIGS",
    "POSITION_CONFIGS",
    "PositionConfig",
    "config_positions",
    "position_grafting_components",
    "position_grafting_masks",
    "register_position_config",
    "run_position_grafting",
]

PositionConfig = PositionFunction
"""Deprecated: :data:`grafting_lens.positions.PositionFunction`."""

RESULT_COLUMNS = POSITION_GRAFTING_COLUMNS
"""Deprecated: :data:`grafting_lens.experiments.POSITION_GRAFTING_COLUMNS`."""

POSITION_CONFIGS = _POSITION_CONFIGS
"""Deprecated: :data:`grafting_lens.experiments.POSITION_CONFIGS` (the same registry)."""

PAPER_CONFIGS: tuple[str, ...] = PAPER_POSITION_CONFIGS
"""Deprecated: :data:`grafting_lens.experiments.PAPER_POSITION_CONFIGS`."""


def register_position_config(
    name: str, positions: str | PositionFunction, overwrite: bool = False
) -> None:
    """Deprecated: ``experiments.register_config(GraftConfig(name, (Graft(positions),)))``.

    Raises:
        GraftingLensError: The name is taken (and ``overwrite`` is False), or
            ``positions`` is neither a span expression nor callable.
    """
    config = GraftConfig(name, (Graft(positions),))
    if name in POSITION_CONFIGS and not overwrite:
        raise ExperimentError(
            f"A position configuration named {name!r} exists; pass overwrite=True to replace it."
        )
    POSITION_CONFIGS[name] = config


def config_positions(
    name: str, spans: Spans, attention_mask: Int[torch.Tensor, "batch pos"]
) -> Bool[torch.Tensor, "batch pos"]:
    """Deprecated: ``POSITION_CONFIGS[name].grafted_positions(spans, attention_mask)``.

    Raises:
        GraftingLensError: An unknown name, a span the batch lacks, or positions on
            padding.
    """
    (config,) = get_configs([name], POSITION_CONFIGS, kind="position-grafting")
    return config.grafted_positions(spans, attention_mask)


def position_grafting_components(
    models: ModelSet, include_unembed: bool = False, include_embeddings: bool = True
) -> tuple[str, ...]:
    """Deprecated: ``experiments.resolve_components("all", models, semantics=...)``."""
    semantics = dataclasses.replace(
        CLEAN,
        unembed="donor" if include_unembed else "base",
        embed=include_embeddings,
        pos_embed=include_embeddings,
    )
    return resolve_components("all", models, semantics=semantics)


def position_grafting_masks(
    models: ModelSet,
    spans: Spans,
    attention_mask: Int[torch.Tensor, "batch pos"],
    configs: Sequence[str] = PAPER_CONFIGS,
    components: str | Iterable[str] | None = None,
    source: int = 1,
) -> GraftMask:
    """Deprecated: :func:`grafting_lens.experiments.config_masks` of the configurations,
    with ``semantics="clean"``, the library's reading, which is what this function always
    grafted (``config_masks`` defaults to the paper's released code)."""
    chosen = retarget(
        get_configs(configs, POSITION_CONFIGS, kind="position-grafting"), components, source
    )
    return config_masks(models, chosen, spans, attention_mask, semantics=CLEAN)
