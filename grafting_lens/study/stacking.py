"""Configurations as one graft mask: checked against a model set, stacked along the batch.

The configurations of the same examples run as blocks of rows of one forward pass (rows
``i * batch .. (i + 1) * batch - 1`` are configuration ``i``). :func:`resolve_configs`
checks every graft against a model set and says what a
:class:`~grafting_lens.study.semantics.Semantics` makes of it there (so the graft engine
needs no switch), :func:`check_conflicts` refuses two sources for one cell, and
:func:`stacked_mask` builds the one mask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import torch
from jaxtyping import Int

from grafting_lens.core.errors import GraftingLensError, GraftMaskError
from grafting_lens.engine.masks import GraftMask, Key
from grafting_lens.engine.positions import (
    PositionFunction,
    Spans,
    parse_span_expression,
    select_positions,
)
from grafting_lens.models.components import GLOBAL_COMPONENTS
from grafting_lens.models.layers import resolve_layers
from grafting_lens.models.model_set import ModelSet
from grafting_lens.study.configs import (
    HYBRID,
    HYBRID_TARGETS,
    RELATION,
    TASK,
    Graft,
    GraftConfig,
    resolve_components,
)
from grafting_lens.study.semantics import Semantics, semantics_or_default
from grafting_lens.study.specs import get_configs

__all__ = ["ResolvedGraft", "check_conflicts", "config_masks", "resolve_configs", "stacked_mask"]


@dataclass(frozen=True)
class ResolvedGraft:
    """A graft checked against one model set: the components and layers it takes there."""

    config: int
    positions: Union[str, PositionFunction]
    components: tuple[str, ...]
    layers: tuple[int, ...]
    source: int


def resolve_configs(
    configs: Sequence[GraftConfig],
    label: str,
    models: ModelSet,
    *,
    semantics: Semantics | str | None = None,
) -> list[list[ResolvedGraft]]:
    """Check every graft against one model set, and say what it takes there under ``semantics``
    (default :data:`~grafting_lens.study.semantics.DEFAULT_SEMANTICS`): its components
    (:func:`~grafting_lens.study.configs.resolve_components`) and layers, and the grafts the
    semantics adds or changes:

    * ``sft="donor"``: a whole-donor graft (``all`` at ``ALL`` over ``all`` layers) takes
      every component, the unembedding and final norm included: the donor itself;
    * ``unembed="follow_embed"``, on a model whose embedding and unembedding share their
      weight: wherever a graft takes ``embed``, the unembedding from the same source;
    * ``lm_head="always"``: the unembedding of the configuration's donor (its first
      graft's source) at the last token, unless every graft is a whole donor or there
      is none;
    * a graft from :data:`~grafting_lens.study.configs.HYBRID` becomes grafts from the task
      model and, for O, FFN-up and FFN-down from layer ``n // 2`` on, the relation model.

    Raises:
        GraftingLensError: The first problem, of its own class, with the configuration
            and the model set named.
    """
    semantics = semantics_or_default(semantics)
    n_layers = models.n_layers
    tied = semantics.unembed == "follow_embed" and models.layout.shares_parameter(
        "embed", "unembed"
    )
    resolved = []
    for index, config in enumerate(configs):
        grafts: list[ResolvedGraft] = []
        whole = [semantics.sft == "donor" and _is_whole_donor(graft) for graft in config.grafts]
        for graft, is_whole in zip(config.grafts, whole):
            try:
                _check_source(graft, models)
                if is_whole:
                    components = models.components
                    layers = tuple(range(n_layers))
                else:
                    components = resolve_components(graft.components, models, semantics=semantics)
                    layers = resolve_layers(graft.layers, n_layers, arithmetic=semantics.layers)
            except GraftingLensError as error:
                raise type(error)(
                    f"Configuration {config.name!r} on model set {label!r} "
                    f"({models.architecture}, {n_layers} layers): {error}"
                ) from error
            if graft.source == HYBRID:
                grafts += _hybrid_grafts(index, graft.positions, components, layers, n_layers)
            else:
                grafts.append(
                    ResolvedGraft(index, graft.positions, components, layers, int(graft.source))
                )
            if tied and not is_whole and "embed" in components:
                # The code loads the donor's values into a parameter the unembedding shares.
                source = TASK if graft.source == HYBRID else int(graft.source)
                grafts.append(ResolvedGraft(index, graft.positions, ("unembed",), (), source))
        if semantics.lm_head == "always" and config.grafts and not all(whole):
            first = config.grafts[0].source
            donor = TASK if first == HYBRID else int(first)  # the hybrid model's head is the task's
            grafts.append(ResolvedGraft(index, "LT", ("unembed",), (), donor))
        resolved.append(grafts)
    return resolved


def _is_whole_donor(graft: Graft) -> bool:
    """Whether a graft takes every component at every position over every layer."""
    return (
        isinstance(graft.positions, str)
        and parse_span_expression(graft.positions) == ("all",)
        and isinstance(graft.components, str)
        and graft.components.strip().lower() == "all"
        and graft.layers in ("all", None)
    )


def _check_source(graft: Graft, models: ModelSet) -> None:
    """Refuse a source the model set does not have, naming those there are."""
    needed = RELATION if graft.source == HYBRID else int(graft.source)
    if needed < len(models):
        return
    hybrid = needed == 2
    raise GraftMaskError(
        f"the graft takes source {graft.source}, but the model set has "
        f"{len(models)} sources (0..{len(models) - 1})"
        + (": the hybrid graft needs (pretrained, task, relation)" if hybrid else "")
    )


def _hybrid_grafts(
    config: int,
    positions: Union[str, PositionFunction],
    components: tuple[str, ...],
    layers: tuple[int, ...],
    n_layers: int,
) -> list[ResolvedGraft]:
    """A graft from the code's hybrid model, as grafts from the task and relation models."""
    split = n_layers // 2  # the code's range(n // 2, n)
    moved = tuple(c for c in components if c in HYBRID_TARGETS)
    kept = tuple(c for c in components if c not in HYBRID_TARGETS)
    lower = tuple(layer for layer in layers if layer < split)
    upper = tuple(layer for layer in layers if layer >= split)
    grafts = []
    if kept:
        grafts.append(ResolvedGraft(config, positions, kept, layers, TASK))
    if moved and lower:
        grafts.append(ResolvedGraft(config, positions, moved, lower, TASK))
    if moved and upper:
        grafts.append(ResolvedGraft(config, positions, moved, upper, RELATION))
    return grafts


def check_conflicts(
    config: GraftConfig,
    grafts: Sequence[ResolvedGraft],
    selected: Sequence[torch.Tensor],
    where: str,
) -> None:
    """Refuse two grafts of one configuration giving one cell different sources.

    Raises:
        GraftMaskError: Naming the grafts, the component, the example and the position.
    """
    for i, first in enumerate(grafts):
        for j in range(i + 1, len(grafts)):
            second = grafts[j]
            if first.source == second.source:
                continue
            shared = set(first.components) & set(second.components)
            layers_overlap = bool(set(first.layers) & set(second.layers))
            clashing = sorted(c for c in shared if c in GLOBAL_COMPONENTS or layers_overlap)
            overlap = selected[i] & selected[j]
            if clashing and overlap.any():
                row, position = (int(v) for v in overlap.nonzero()[0])
                raise GraftMaskError(
                    f"Configuration {config.name!r}: grafts {i} and {j} both set {clashing[0]!r} "
                    f"at example {row}, position {position} of {where}, from sources "
                    f"{first.source} and {second.source}."
                )


def config_masks(
    models: ModelSet,
    configs: Sequence[str | GraftConfig],
    spans: Spans,
    attention_mask: Int[torch.Tensor, "batch pos"],
    *,
    registry: str | Mapping[str, GraftConfig] = "position",
    semantics: Semantics | str | None = None,
) -> GraftMask:
    """The graft mask of several configurations of one batch, stacked along the batch.

    Rows ``i * batch .. (i + 1) * batch - 1`` are configuration ``configs[i]``; run it
    on ``tokens.repeat(len(configs), 1)``. Equal to :meth:`GraftMask.cat` of one
    :meth:`GraftMask.union` per configuration, but grafts that take the same components,
    layers and source share one ``[rows, pos]`` tensor.

    Args:
        models: The model set.
        configs: Names in ``registry`` or :class:`GraftConfig` s.
        spans: The batch's spans.
        attention_mask: Its right padding.
        registry: Where names are looked up.
        semantics: What the configurations mean; see :func:`resolve_configs`.

    Raises:
        GraftingLensError: As :func:`~grafting_lens.study.runner.run_experiment`.
    """
    chosen = semantics_or_default(semantics)
    config_list = get_configs(configs, registry, semantics=chosen)
    attention_mask = torch.as_tensor(attention_mask).cpu()
    resolved = resolve_configs(config_list, ",".join(models.names), models, semantics=chosen)
    positions = []
    for config, grafts in zip(config_list, resolved):
        selected = [select_positions(g.positions, spans, attention_mask) for g in grafts]
        check_conflicts(config, grafts, selected, "the batch")
        positions.append(selected)
    batch, length = attention_mask.shape
    return stacked_mask(models, resolved, positions, (int(batch), int(length)))


def stacked_mask(
    models: ModelSet,
    resolved: Sequence[Sequence[ResolvedGraft]],
    positions: Sequence[Sequence[torch.Tensor]],
    shape: tuple[int, int],
) -> GraftMask:
    """One mask holding every configuration's grafts, a block of rows per configuration:
    per configuration, its ``resolved`` grafts and each one's ``[batch, pos]`` selection in
    ``positions``; ``shape`` is ``(batch, pos)`` of one block."""
    batch, length = int(shape[0]), int(shape[1])
    n_configs = len(resolved)
    # Group grafts by what they take; each group is one [n_configs * batch, pos] tensor.
    kinds: dict[tuple[tuple[str, ...], tuple[int, ...], int], list[tuple[int, torch.Tensor]]] = {}
    for config_index, grafts in enumerate(resolved):
        for graft, selected in zip(grafts, positions[config_index]):
            kind = (graft.components, graft.layers, graft.source)
            kinds.setdefault(kind, []).append((config_index, selected))
    entries: dict[Key, torch.Tensor] = {}
    combined: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for (components, layers, source), members in kinds.items():
        blocks = torch.zeros((n_configs, batch, length), dtype=torch.bool)
        for config_index, selected in members:
            blocks[config_index] |= selected
        value = blocks.reshape(n_configs * batch, length).long() * source
        for component in components:
            for layer in (None,) if component in GLOBAL_COMPONENTS else layers:
                key: Key = (component, layer)
                if key not in entries:
                    entries[key] = value
                    continue
                # Shared tensors stay shared: combine each distinct pair of tensors once.
                # The cache keeps both operands alive: an id() names an object only while
                # it lives, and a freed tensor's id is soon reused by a new one.
                pair = (id(entries[key]), id(value))
                if pair not in combined:
                    merged = torch.where(value != 0, value, entries[key])
                    combined[pair] = (merged, entries[key], value)
                entries[key] = combined[pair][0]
    return GraftMask(entries, (n_configs * batch, length), len(models))
