"""Graft configurations as data, and the registries that name the paper's.

A configuration is a :class:`GraftConfig`: a name as in the paper's figures and a
tuple of :class:`Graft` s, each "take ``components`` over ``layers`` at ``positions``
from ``source``". Positions are span expressions
(:func:`grafting_lens.positions.select_positions`: ``FE``, ``LT``, ``FE+LT``,
``(FE+LT)^C``...); components use the paper's names (``ATTN``, ``O``, ``FFN``,
``FFN-up``, ``FFN-down``, see :func:`resolve_components`) or any component or group
of :mod:`grafting_lens.components`; layers are layer ranges
(:func:`grafting_lens.layers.resolve_layers`).

The registries hold the paper's configurations: :data:`POSITION_CONFIGS` (figures 2
and 3a) with :data:`MOVIE_CONFIGS`, :data:`COMPONENT_CONFIGS` (figure 4 and its
baselines) and :data:`HYBRID_CONFIGS` (figure 5), all reachable by name through
:data:`REGISTRIES`. :func:`register_config` is the one door for more;
:func:`get_configs` looks names up.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from jaxtyping import Bool, Int

from grafting_lens.components import COMPONENT_GROUPS, COMPONENTS, expand_components
from grafting_lens.errors import ComponentError, ExperimentError, SelectionError, did_you_mean
from grafting_lens.layers import LayerSpec
from grafting_lens.models import ModelSet
from grafting_lens.positions import (
    PositionFunction,
    Spans,
    callable_name,
    parse_span_expression,
    select_positions,
)

__all__ = [
    "COMPONENT_CONFIGS",
    "COMPONENT_LAYER_RANGES",
    "COMPONENT_SETS",
    "HYBRID_CONFIGS",
    "HYBRID_FIRST_ENTITY",
    "MOVIE_CONFIGS",
    "PAPER_COMPONENTS",
    "PAPER_POSITION_CONFIGS",
    "POSITION_CONFIGS",
    "REGISTRIES",
    "RELATION",
    "TASK",
    "Graft",
    "GraftConfig",
    "get_configs",
    "register_config",
    "resolve_components",
    "retarget",
]

# ---------------------------------------------------------------------- components

PAPER_COMPONENTS: dict[str, tuple[str, ...]] = {
    "attn": COMPONENT_GROUPS["attn"],
    "ffn": COMPONENT_GROUPS["ffn"],
    "ffn-up": ("mlp_in", "mlp_gate"),
    "ffn-down": ("mlp_out",),
}
"""The paper's names for sets of matrices: ATTN (Q, K, V), FFN (every MLP matrix), FFN-up
(the up projection, and the gate where there is one) and FFN-down (the down projection).
``O`` is the component ``o``. Each expands to the members an architecture has."""

_EMBEDDINGS = ("embed", "pos_embed")


def resolve_components(
    spec: str | Iterable[str],
    models: ModelSet,
    *,
    include_unembed: bool = False,
    include_embeddings: bool = True,
) -> tuple[str, ...]:
    """The components a graft names, for this architecture, in :data:`~grafting_lens.COMPONENTS` order.

    Args:
        spec: A ``+``-joined string (``"O+FFN"``, ``"ATTN+O+FFN-up"``, ``"all"``) or names.
            Case does not matter. Paper names: see :data:`PAPER_COMPONENTS`; otherwise the
            components and groups of :mod:`grafting_lens.components`.
        models: The model set (what its architecture has).
        include_unembed: Whether a group (``all``) brings the unembedding along.
        include_embeddings: Whether a group brings the token and position embeddings along.

    Raises:
        ComponentError: An unknown name, a single component the architecture lacks, or
            nothing left to graft.
    """
    parts = [part.strip() for part in spec.split("+")] if isinstance(spec, str) else list(spec)
    available = set(models.components)
    chosen: set[str] = set()
    for part in parts:
        name = str(part).lower()
        if name in PAPER_COMPONENTS:
            members = [m for m in PAPER_COMPONENTS[name] if m in available]
            if not members:
                raise ComponentError(
                    f"{models.architecture} has none of {name.upper()}'s components "
                    f"({', '.join(PAPER_COMPONENTS[name])})."
                )
            chosen.update(members)
        elif name in COMPONENT_GROUPS:
            group = set(expand_components(name, available, models.architecture))
            if not include_unembed:
                group.discard("unembed")
            if not include_embeddings:
                group.difference_update(_EMBEDDINGS)
            chosen.update(group)
        else:
            if name not in COMPONENTS:
                paper = [n.upper() for n in PAPER_COMPONENTS]
                known = (*COMPONENTS, *COMPONENT_GROUPS, *paper, "O")
                raise ComponentError(
                    f"Unknown component {part!r}.{did_you_mean(str(part), known)} Known: "
                    f"{', '.join(paper)}, O; the components {', '.join(COMPONENTS)}; the groups "
                    f"{', '.join(COMPONENT_GROUPS)}."
                )
            chosen.update(expand_components([name], available, models.architecture))
    if not chosen:
        raise ComponentError(
            f"{spec!r} selects no component (the unembedding and embeddings are left out of "
            "groups unless include_unembed / include_embeddings)."
        )
    return tuple(c for c in COMPONENTS if c in chosen)


# --------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Graft:
    """Take ``components`` over ``layers`` at ``positions`` from checkpoint ``source``.

    Attributes:
        positions: A span expression (``"FE"``, ``"LT"``, ``"FE+LT"``, ``"(FE+LT)^C"``,
            ``"ALL"``; see :func:`grafting_lens.positions.select_positions`) or a function
            ``(spans, attention_mask) -> [batch, pos]`` boolean tensor.
        components: See :func:`resolve_components`; ``"all"`` by default (what position
            grafting takes).
        layers: See :func:`grafting_lens.resolve_layers`: ``"all"``, ``"last_half"``,
            ``"first_quarter"``.. ``"last_quarter"``, an int, a list, a range. Global
            components (embeddings, final norm, unembedding) ignore it.
        source: Index of the checkpoint in the model set (0 is the base).

    Raises:
        SelectionError: Positions that are neither a span expression nor a function, or
            a span expression that does not parse.
        ExperimentError: A source that is not an int >= 0.
    """

    positions: Union[str, PositionFunction] = "ALL"
    components: Union[str, tuple[str, ...]] = "all"
    layers: LayerSpec = "all"
    source: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.positions, str):
            parse_span_expression(self.positions)
        elif not callable(self.positions):
            raise SelectionError(
                f"Graft positions must be a span expression such as 'FE+LT' or a function "
                f"(spans, attention_mask) -> tensor, got {self.positions!r}."
            )
        if not isinstance(self.components, str):
            object.__setattr__(self, "components", tuple(self.components))
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))
        if not isinstance(self.source, int) or isinstance(self.source, bool) or self.source < 0:
            raise ExperimentError(f"Graft source must be an int >= 0, got {self.source!r}.")

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description (what a run's fingerprint records)."""
        positions = (
            self.positions
            if isinstance(self.positions, str)
            else f"<function {callable_name(self.positions)}>"
        )
        layers: Any = self.layers
        if isinstance(layers, range):
            layers = f"range({layers.start}, {layers.stop}, {layers.step})"
        elif isinstance(layers, slice):
            layers = f"slice({layers.start}, {layers.stop}, {layers.step})"
        elif isinstance(layers, tuple):
            layers = list(layers)
        components = self.components if isinstance(self.components, str) else list(self.components)
        return {
            "positions": positions,
            "components": components,
            "layers": layers,
            "source": self.source,
        }


@dataclass(frozen=True)
class GraftConfig:
    """One configuration: a name as in the paper's figures and the grafts it applies.

    No grafts is the base model (the paper's PRE). Grafts may overlap where they agree
    on the source; two grafts giving one cell different sources are refused.

    Attributes:
        name: The label in tables and figures (``"FE+LT"``, ``"O+FFN@last_quarter"``).
        grafts: What to take from where.
        tags: Extra columns for the results table, e.g.
            ``{"component_set": "O+FFN", "layer_range": "last_quarter"}``.
        description: One line for humans.

    Raises:
        ExperimentError: An empty name, or grafts that are not :class:`Graft` s.
    """

    name: str
    grafts: tuple[Graft, ...] = ()
    tags: Mapping[str, str] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ExperimentError(f"A configuration needs a non-empty name, got {self.name!r}.")
        grafts = (self.grafts,) if isinstance(self.grafts, Graft) else tuple(self.grafts)
        for graft in grafts:
            if not isinstance(graft, Graft):
                raise ExperimentError(
                    f"Configuration {self.name!r}: grafts must be Graft objects, got {graft!r}."
                )
        object.__setattr__(self, "grafts", grafts)
        object.__setattr__(self, "tags", dict(self.tags))

    def grafted_positions(
        self, spans: Spans, attention_mask: Int[torch.Tensor, "batch pos"]
    ) -> Bool[torch.Tensor, "batch pos"]:
        """The positions any of its grafts selects in each row of a batch.

        Raises:
            SelectionError: A span the batch lacks, or positions on padding.
        """
        attention_mask = torch.as_tensor(attention_mask).cpu()
        selected = torch.zeros(tuple(attention_mask.shape), dtype=torch.bool)
        for graft in self.grafts:
            selected |= select_positions(graft.positions, spans, attention_mask)
        return selected

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description (what a run's fingerprint records)."""
        return {
            "name": self.name,
            "grafts": [graft.describe() for graft in self.grafts],
            "tags": dict(self.tags),
        }


def retarget(
    configs: Iterable[GraftConfig],
    components: str | Iterable[str] | None = None,
    source: int = 1,
) -> list[GraftConfig]:
    """The configurations with every graft taking ``components`` (if given) from ``source``.

    Position grafting asks "these positions, every weight, from the donor"; this asks
    the same positions for other weights or of another checkpoint.
    """
    configs = list(configs)
    if components is None and source == 1:
        return configs
    chosen = components if components is None or isinstance(components, str) else tuple(components)
    return [
        GraftConfig(
            config.name,
            tuple(
                Graft(
                    graft.positions,
                    graft.components if chosen is None else chosen,
                    graft.layers,
                    source,
                )
                for graft in config.grafts
            ),
            config.tags,
            config.description,
        )
        for config in configs
    ]


# ------------------------------------------------------------------------ registries


def _registry(configs: Iterable[GraftConfig]) -> dict[str, GraftConfig]:
    return {config.name: config for config in configs}


def _position(name: str, positions: str | None, description: str) -> GraftConfig:
    grafts = () if positions is None else (Graft(positions),)
    return GraftConfig(name, grafts, description=description)


POSITION_CONFIGS: dict[str, GraftConfig] = _registry(
    [
        _position("PRE", None, "nothing grafted: the pretrained model"),
        _position("SFT", "ALL", "every position grafted: the finetuned model"),
        _position("FE", "FE", "the first entity's tokens"),
        _position("LT", "LT", "the last token"),
        _position("FE+LT", "FE+LT", "the first entity and the last token"),
        _position("(FE+LT)^C", "(FE+LT)^C", "every position but the first entity and last token"),
        _position("FE^C", "FE^C", "every position but the first entity"),
        _position("LT^C", "LT^C", "every position but the last token"),
    ]
)
"""Position grafting (figures 2 and 3a): every weight of the donor at some positions."""

PAPER_POSITION_CONFIGS: tuple[str, ...] = tuple(POSITION_CONFIGS)
"""The paper's eight position configurations, in the order of its figures."""

MOVIE_CONFIGS: dict[str, GraftConfig] = _registry(
    [
        _position("M", "M", "the movie title's tokens"),
        _position("FE+M", "FE+M", "the first entity and the movie title"),
        _position("M+LT", "M+LT", "the movie title and the last token"),
        _position("FE+M+LT", "FE+M+LT", "first entity, movie title and last token"),
    ]
)
"""Position grafting at the movie title; needs prompts that name it
(:data:`~grafting_lens.experiments.MOVIE_PROMPTS`)."""

COMPONENT_SETS: dict[str, str] = {
    "ATTN+O+FFN": "ATTN+O+FFN",
    "ATTN+O": "ATTN+O",
    "O+FFN": "O+FFN",
    "ATTN+FFN": "ATTN+FFN",
    "O": "O",
    "FFN": "FFN",
    "O+FFN-up": "O+FFN-up",
    "O+FFN-down": "O+FFN-down",
}
"""Figure 4's component sets at the last token, label -> components."""

COMPONENT_LAYER_RANGES: tuple[str, ...] = (
    "all",
    "first_quarter",
    "second_quarter",
    "third_quarter",
    "last_quarter",
    "last_half",
)
"""The layer ranges each component set is grafted over (names of
:data:`grafting_lens.LAYER_FRACTIONS`)."""


def _component_configs() -> dict[str, GraftConfig]:
    configs = [
        GraftConfig("BASE", (), {"component_set": "BASE", "layer_range": "-"}, "nothing grafted"),
        GraftConfig(
            "DONOR",
            (Graft("ALL", "all", "all"),),
            {"component_set": "DONOR", "layer_range": "-"},
            "every weight of the donor at every position",
        ),
    ]
    for layers in COMPONENT_LAYER_RANGES:
        for label, components in COMPONENT_SETS.items():
            configs.append(
                GraftConfig(
                    f"{label}@{layers}",
                    (Graft("LT", components, layers),),
                    {"component_set": label, "layer_range": layers},
                    f"the donor's {label} at the last token, layers: {layers}",
                )
            )
    return _registry(configs)


COMPONENT_CONFIGS: dict[str, GraftConfig] = _component_configs()
"""Component grafting at the last token (figure 4, its baselines and the reversal variant):
``"<set>@<layer range>"`` for every set of :data:`COMPONENT_SETS` and range of
:data:`COMPONENT_LAYER_RANGES`, plus ``BASE`` (nothing grafted) and ``DONOR`` (the donor
everywhere). Source 1 is the donor."""

TASK, RELATION = 1, 2
"""Sources of the hybrid model set: 0 pretrained, 1 task model, 2 relation model."""

_HYBRID_LAST_TOKEN = (
    Graft("LT", "ATTN", "all", TASK),
    Graft("LT", "O+FFN", "last_half", RELATION),
)
HYBRID_FIRST_ENTITY: dict[str, str | None] = {
    "none": None,
    "ATTN": "ATTN",
    "ATTN+O": "ATTN+O",
    "FFN": "FFN",
    "O+FFN": "O+FFN",
    "ALL": "all",
}
"""Figure 5's choices of task-model weights at the first entity (all layers)."""


def _hybrid_configs() -> dict[str, GraftConfig]:
    everywhere = {"first_entity": "-"}
    configs = [
        GraftConfig("PRE", (), everywhere, "the pretrained model"),
        GraftConfig(
            "TASK", (Graft("ALL", "all", "all", TASK),), everywhere, "the task model everywhere"
        ),
        GraftConfig(
            "RELATION",
            (Graft("ALL", "all", "all", RELATION),),
            everywhere,
            "the relation model everywhere",
        ),
    ]
    for label, components in HYBRID_FIRST_ENTITY.items():
        first_entity = () if components is None else (Graft("FE", components, "all", TASK),)
        configs.append(
            GraftConfig(
                "LT" if components is None else f"LT+FE:{label}",
                _HYBRID_LAST_TOKEN + first_entity,
                {"first_entity": label},
                "task ATTN at LT, relation O+FFN at LT over the last half"
                + ("" if components is None else f", task {label} at FE"),
            )
        )
    return _registry(configs)


HYBRID_CONFIGS: dict[str, GraftConfig] = _hybrid_configs()
"""The hybrid graft (figure 5) over a pretrained (0), task (1) and relation (2) model set:
``LT`` is the task model's ATTN at the last token (all layers) with the relation model's
O+FFN there over the last half of the layers; ``LT+FE:<x>`` adds the task model's ``x`` at
the first entity over all layers. ``PRE``, ``TASK`` and ``RELATION`` are the baselines."""


class ChainedRegistry(ChainMap):
    """Several registries read as one, listed in the order they are given (a ChainMap
    lists the last first); additions go to the first."""

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(name for mapping in self.maps for name in mapping))


REGISTRIES: dict[str, Mapping[str, GraftConfig]] = {
    "position": ChainedRegistry(POSITION_CONFIGS, MOVIE_CONFIGS),
    "component": COMPONENT_CONFIGS,
    "hybrid": HYBRID_CONFIGS,
}
"""Configurations by experiment; names passed to a run are looked up here."""


def register_config(
    config: GraftConfig, registry: str = "position", overwrite: bool = False
) -> None:
    """Add a configuration to a registry so runs can name it.

    Args:
        config: The configuration.
        registry: ``"position"`` (added next to the paper's eight), ``"component"`` or
            ``"hybrid"``.
        overwrite: Allow replacing a configuration of the same name.

    Raises:
        ExperimentError: An unknown registry, or a name that is taken.
    """
    if not isinstance(config, GraftConfig):
        raise ExperimentError(f"register_config needs a GraftConfig, got {type(config).__name__}.")
    target = _registry_named(registry)
    if isinstance(target, ChainMap):
        target = target.maps[0]
    if config.name in target and not overwrite:
        raise ExperimentError(
            f"A {registry} configuration named {config.name!r} exists; pass overwrite=True to "
            "replace it."
        )
    target[config.name] = config  # type: ignore[index]


def _registry_named(name: str) -> Mapping[str, GraftConfig]:
    if name not in REGISTRIES:
        raise ExperimentError(
            f"Unknown registry {name!r}.{did_you_mean(name, REGISTRIES)} Known: "
            f"{', '.join(REGISTRIES)}."
        )
    return REGISTRIES[name]


def get_configs(
    configs: str | GraftConfig | Iterable[str | GraftConfig],
    registry: str | Mapping[str, GraftConfig] = "position",
    kind: str | None = None,
) -> list[GraftConfig]:
    """Look configuration names up in a registry; GraftConfig objects pass through.

    Args:
        configs: Names, :class:`GraftConfig` s, or a mix.
        registry: A key of :data:`REGISTRIES` or a mapping of configurations.
        kind: What to call the configurations in messages (default: the registry's
            name, e.g. ``"component-grafting"``).

    Raises:
        ExperimentError: No configuration, an unknown name (the message lists the
            known ones), or a name given twice.
    """
    if isinstance(registry, str):
        kind = kind or f"{registry}-grafting"
        registry = _registry_named(registry)
    kind = kind or "grafting"
    if isinstance(configs, (str, GraftConfig)):
        configs = [configs]
    resolved = []
    for item in configs:
        if isinstance(item, GraftConfig):
            resolved.append(item)
        elif isinstance(item, str) and item in registry:
            resolved.append(registry[item])
        else:
            raise ExperimentError(
                f"Unknown {kind} configuration {item!r}.{did_you_mean(str(item), registry)} "
                f"Known: {', '.join(registry)}."
            )
    if not resolved:
        raise ExperimentError(f"No configuration given; choose from {', '.join(registry)}.")
    names = [config.name for config in resolved]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ExperimentError(f"Configurations are listed twice: {repeated}.")
    return resolved
