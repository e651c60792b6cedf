"""Graft configurations as data, and the registries that name the paper's.

A :class:`GraftConfig` is a name as in the paper's figures and :class:`Graft` s, each "take
``components`` over ``layers`` at ``positions`` from ``source``". The paper's are data here
(:data:`POSITION_CONFIGS`, :data:`MOVIE_CONFIGS`, :data:`COMPONENT_CONFIGS`,
:data:`HYBRID_CONFIGS`); what a name means depends on a
:class:`~grafting_lens.study.semantics.Semantics`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch
from jaxtyping import Bool, Int

from grafting_lens.core.arguments import as_list, is_integer, plain, shown
from grafting_lens.core.errors import (
    ArgumentTypeError,
    ComponentError,
    ExperimentError,
    SelectionError,
    check_known,
)
from grafting_lens.engine.positions import (
    PositionFunction,
    Spans,
    callable_name,
    parse_span_expression,
    select_positions,
)
from grafting_lens.models.components import (
    COMPONENT_GROUPS,
    COMPONENTS,
    canonical_component_name,
    expand_components,
)
from grafting_lens.models.layers import LayerSpec
from grafting_lens.models.model_set import ModelSet
from grafting_lens.study.semantics import Semantics, semantics_or_default

__all__ = [
    "COMPONENT_CONFIGS",
    "COMPONENT_LAYER_RANGES",
    "COMPONENT_SETS",
    "HYBRID",
    "HYBRID_CONFIGS",
    "HYBRID_FIRST_ENTITY",
    "MOVIE_CONFIGS",
    "PAPER_COMPONENTS",
    "PAPER_POSITION_CONFIGS",
    "POSITION_CONFIGS",
    "RELATION",
    "TASK",
    "Graft",
    "GraftConfig",
    "code_hybrid_configs",
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
(the up projection, and the gate unless ``ffn_up_gate=False``) and FFN-down (the down
projection); ``O`` is the component ``o``. Each expands to the members an architecture has."""

_GROUP_SWITCHES = (("embed", "embed"), ("pos_embed", "pos_embed"), ("ln_final", "final_norm"))


def resolve_components(
    spec: str | Iterable[str], models: ModelSet, *, semantics: Semantics | str | None = None
) -> tuple[str, ...]:
    """The components a graft names, for this architecture, in
    :data:`~grafting_lens.models.components.COMPONENTS` order. Which members a group brings
    is the semantics' to say; a component named on its own is always taken.

    Args:
        spec: A ``+``-joined string (``"O+FFN"``, ``"all"``) or names, in any case: the
            :data:`PAPER_COMPONENTS`, or components and groups of the lens's.
        models: The model set (what its architecture has).
        semantics: A :class:`~grafting_lens.study.semantics.Semantics` or its label (default
            :data:`~grafting_lens.study.semantics.DEFAULT_SEMANTICS`).

    Raises:
        ComponentError: An unknown name, a single component the architecture lacks, or
            nothing left to graft.
    """
    semantics = semantics_or_default(semantics)
    parts = [part.strip() for part in spec.split("+")] if isinstance(spec, str) else list(spec)
    available = set(models.components)
    chosen: set[str] = set()
    for part in parts:
        # The paper's labels in any spelling ("FFN-up", "ffn_up"), as the lens reads them.
        name = canonical_component_name(part).replace("_", "-")
        if name in PAPER_COMPONENTS:
            members = [m for m in PAPER_COMPONENTS[name] if m in available]
            if name == "ffn-up" and not semantics.ffn_up_gate:
                members = [m for m in members if m != "mlp_gate"]
            if not members:
                raise ComponentError(
                    f"{models.architecture} has none of {name.upper()}'s components "
                    f"({', '.join(PAPER_COMPONENTS[name])})."
                )
            chosen.update(members)
        elif canonical_component_name(part) in COMPONENT_GROUPS:
            group = set(expand_components(part, available, models.architecture))
            if semantics.unembed != "donor":
                group.discard("unembed")
            for component, switch in _GROUP_SWITCHES:
                if not getattr(semantics, switch):
                    group.discard(component)
            chosen.update(group)
        else:
            # A single component or another label; an unknown name is refused there, with
            # the nearest known name spelled as the paper or the library spells it.
            chosen.update(expand_components([part], available, models.architecture))
    if semantics.fused_qkv == "as_code" and models.layout.shares_parameter("q", "k", "v"):
        # The code's q target is the fused module itself; its k and v name no module.
        if "q" in chosen:
            chosen.update(("k", "v"))
        else:
            chosen.difference_update(("k", "v"))
    if not chosen:
        raise ComponentError(
            f"{spec!r} selects no component under the semantics {semantics.label!r} (groups "
            "leave out what its unembed, embed, pos_embed and final_norm switches leave out; "
            "with fused_qkv='as_code', k and v without q are nothing on a fused QKV matrix)."
        )
    return tuple(c for c in COMPONENTS if c in chosen)


# --------------------------------------------------------------------- configurations

TASK, RELATION = 1, 2
"""Sources of the hybrid model set: 0 pretrained, 1 task model, 2 relation model."""

HYBRID = "hybrid"
"""A graft source naming the paper's code's *hybrid model* over a (pretrained, task,
relation) model set: the task model, with the relation model's :data:`HYBRID_TARGETS` in
layers ``n // 2`` onwards."""

HYBRID_TARGETS: tuple[str, ...] = ("o", "mlp_in", "mlp_out")
"""What the code's hybrid model takes from the relation model, in its last half."""


@dataclass(frozen=True)
class Graft:
    """Take ``components`` over ``layers`` at ``positions`` from checkpoint ``source``.

    Attributes:
        positions: A span expression (``"FE+LT"``, ``"(FE+LT)^C"``, ``"ALL"``; see
            :func:`grafting_lens.engine.positions.select_positions`) or a function
            ``(spans, attention_mask) -> [batch, pos]`` boolean tensor.
        components: See :func:`resolve_components` (default ``"all"``).
        layers: See :func:`grafting_lens.resolve_layers` (``"all"``, ``"last_half"``, an int,
            a list, a range); global components ignore it.
        source: Index of the checkpoint in the model set (0 is the base), or :data:`HYBRID`.

    Raises:
        SelectionError: Positions that are neither a span expression that parses nor a
            function.
        ExperimentError: A source that is neither an int >= 0 nor :data:`HYBRID`.
    """

    positions: Union[str, PositionFunction] = "ALL"
    components: Union[str, tuple[str, ...]] = "all"
    layers: LayerSpec = "all"
    source: Union[int, str] = 1

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
        if self.source != HYBRID and (not is_integer(self.source) or self.source < 0):
            raise ExperimentError(
                f"Graft source must be an int >= 0 (or HYBRID, the code's hybrid model), got "
                f"{self.source!r}."
            )
        # A numpy integer is kept as Python's: a configuration's description is JSON.
        object.__setattr__(self, "source", plain(self.source))

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description (what a run's fingerprint records)."""
        positions = (
            self.positions
            if isinstance(self.positions, str)
            else f"<function {callable_name(self.positions)}>"
        )
        layers: Any = self.layers
        if isinstance(layers, (range, slice)):
            layers = f"{type(layers).__name__}({layers.start}, {layers.stop}, {layers.step})"
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
    """One configuration: a name as in the paper's figures and the grafts it applies (none:
    the base model, the paper's PRE; two grafts giving one cell different sources are refused).

    Attributes:
        name: The label in tables and figures (``"FE+LT"``, ``"O+FFN@last_quarter"``).
        grafts: What to take from where.
        tags: Extra columns for the results table, e.g. ``{"layer_range": "last_quarter"}``.
        description: One line for humans.

    Raises:
        ExperimentError: An empty name, or grafts that are not :class:`Graft` s.
    """

    name: str
    grafts: tuple[Graft, ...] = ()
    tags: Mapping[str, str] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        grafts = (self.grafts,) if isinstance(self.grafts, Graft) else tuple(self.grafts)
        bad = [graft for graft in grafts if not isinstance(graft, Graft)]
        if not isinstance(self.name, str) or not self.name or bad:
            raise ExperimentError(
                f"Configuration {self.name!r}: grafts must be Graft objects, got {bad[0]!r}."
                if bad
                else f"A configuration needs a non-empty name, got {self.name!r}."
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
    source: int | str = 1,
) -> list[GraftConfig]:
    """The configurations with every graft taking ``components`` (if given) from ``source``:
    the same positions for other weights, or of another checkpoint."""
    configs = list(configs)
    if not (is_integer(source) or isinstance(source, str)):
        raise ArgumentTypeError(f"source={shown(source)}: give the donor's index or name.")
    if components is None and is_integer(source) and source == 1:
        return configs
    forms = "a component's name, an 'o+ffn' string or a list of names"
    chosen = (
        components
        if components is None or isinstance(components, str)
        else tuple(as_list(components, "components", forms, ExperimentError))
    )
    return [
        replace(
            config,
            grafts=tuple(
                replace(
                    graft, components=graft.components if chosen is None else chosen, source=source
                )
                for graft in config.grafts
            ),
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
(:data:`~grafting_lens.study.testsets.MOVIE_PROMPTS`)."""

COMPONENT_SETS: dict[str, str] = {
    label: label
    for label in ("ATTN+O+FFN", "ATTN+O", "O+FFN", "ATTN+FFN", "O", "FFN", "O+FFN-up", "O+FFN-down")
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
:data:`grafting_lens.models.layers.LAYER_FRACTIONS`)."""


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
"""Component grafting at the last token (figure 4): ``"<set>@<layer range>"`` for every set
of :data:`COMPONENT_SETS` and range of :data:`COMPONENT_LAYER_RANGES`, with ``BASE``
(nothing grafted) and ``DONOR`` (the donor, source 1, everywhere)."""

HYBRID_FIRST_ENTITY: dict[str, str | None] = {
    "none": None,
    "ATTN": "ATTN",
    "ATTN+O": "ATTN+O",
    "FFN": "FFN",
    "O+FFN": "O+FFN",
    "ALL": "all",
}
"""Figure 5's choices of task-model weights at the first entity (all layers)."""


def _last_token_configs(last_token: tuple[Graft, ...], description: str) -> list[GraftConfig]:
    """``LT``, the hybrid's ``last_token`` grafts, and ``LT+FE:<x>`` for each choice of
    :data:`HYBRID_FIRST_ENTITY`."""
    configs = []
    for label, components in HYBRID_FIRST_ENTITY.items():
        first_entity = () if components is None else (Graft("FE", components, "all", TASK),)
        configs.append(
            GraftConfig(
                "LT" if components is None else f"LT+FE:{label}",
                last_token + first_entity,
                {"first_entity": label},
                description + ("" if components is None else f", task {label} at FE"),
            )
        )
    return configs


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
        *_last_token_configs(
            (Graft("LT", "ATTN", "all", TASK), Graft("LT", "O+FFN", "last_half", RELATION)),
            "task ATTN at LT, relation O+FFN at LT over the last half",
        ),
    ]
    return _registry(configs)


HYBRID_CONFIGS: dict[str, GraftConfig] = _hybrid_configs()
"""The hybrid graft (figure 5) over a pretrained (0), task (1) and relation (2) model set,
as the library reads it (:func:`code_hybrid_configs` is the code's): ``LT`` is the task
model's ATTN at the last token with the relation model's O+FFN there over the last half;
``LT+FE:<x>`` adds the task model's ``x`` at the first entity. ``PRE``, ``TASK`` and
``RELATION`` are the baselines."""


def code_hybrid_configs(last_token_layers: str = "last_half") -> dict[str, GraftConfig]:
    """The hybrid graft as the paper's released code runs it, under the names of
    :data:`HYBRID_CONFIGS`: ``LT`` takes every ATTN, O and FFN weight of the code's hybrid
    model (:data:`HYBRID`) at the last token; the rest is as in :data:`HYBRID_CONFIGS`.

    Args:
        last_token_layers: ``"last_half"`` (as the authors' sweep set them) or ``"all"``
            (the released code's configuration file is not public).

    Raises:
        ExperimentError: Another value of ``last_token_layers``.
    """
    check_known(last_token_layers, ("last_half", "all"), "last_token_layers", ExperimentError)
    configs = [HYBRID_CONFIGS[name] for name in ("PRE", "TASK", "RELATION")]
    configs += _last_token_configs(
        (Graft("LT", "ATTN+O+FFN", last_token_layers, HYBRID),),
        f"the code's hybrid model's ATTN+O+FFN at LT ({last_token_layers} layers)",
    )
    return _registry(configs)
