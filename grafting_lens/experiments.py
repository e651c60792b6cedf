"""The paper's experiments: graft configurations as data, and one resumable runner for all of them.

Every experiment in the paper asks the same question of many prompts: *if these weights, at
these token positions, came from that checkpoint, would the model still name the right actor?*
Only the "these weights, these positions, that checkpoint" part changes between figures:

* **position grafting** (figures 2 and 3a) takes every weight of the finetuned model (SFT) at
  some positions (the first entity FE, the last token LT, both, their complements) and the
  pretrained model (PRE) elsewhere;
* **component grafting** (figure 4 and its baselines) takes only some matrices (ATTN, O, FFN,
  the FFN's up or down projection) at the last token, over a range of layers, from a model
  that knows the tested relations into one that knows only the task;
* the **reversal** variant grafts from a model finetuned on both directions of each relation
  into one finetuned on one direction, and asks the reversed question;
* the **hybrid** graft (figure 5) mixes three checkpoints: the task model's attention at FE
  and LT, the relation model's O and FFN at LT over the last half of the layers, plus several
  choices of task weights at FE.

So a configuration is data, a :class:`GraftConfig`: a name as in the paper's figures and a
tuple of :class:`Graft` s, each "take ``components`` over ``layers`` at ``positions`` from
``source``". Positions are *span expressions* over the spans every tokenized batch carries
(:func:`select_positions`): ``FE``, ``LT``, ``M`` (movie title), ``REL`` (relation words),
``ALL``, joined with ``+`` and complemented with ``^C``, as in ``(FE+LT)^C``. Components use
the paper's names (``ATTN``, ``O``, ``FFN``, ``FFN-up``, ``FFN-down``) or any component or
group of :mod:`grafting_lens.components`. The registries (:data:`POSITION_CONFIGS`,
:data:`MOVIE_CONFIGS`, :data:`COMPONENT_CONFIGS`, :data:`HYBRID_CONFIGS`) hold the paper's
configurations; :func:`register_config` adds more.

:func:`run_experiment` runs a grid, model sets x test sets x configurations, and returns a
tidy DataFrame with one row per example and configuration. Rows are independent, so the
configurations of the same examples are stacked as rows of one forward pass (one graft mask
block per configuration). With ``out=``, results are written in chunks as they come, each
file complete or absent, next to a manifest holding a fingerprint of the run: a killed run
started again with the same arguments resumes where it stopped, recomputing nothing, and a
directory holding a different run is refused. Everything a run is given is checked before
the first forward pass.

Two defaults follow the paper ("we use the finetuned embeddings for all grafted token
positions and use the original model's unembeddings"): a graft naming a *group* that
contains the embeddings (``all``) takes the donor's embeddings (``include_embeddings``), and
the unembedding stays the base's everywhere (``include_unembed``). A component named on its
own is always grafted.

The named experiments (:data:`EXPERIMENTS`: ``position``, ``component``,
``component_baseline``, ``reversal``, ``hybrid``) bundle model roles, tested relations,
prompts and configurations, for the scripts in ``experiments/`` and for notebooks:

Examples:
    >>> from grafting_lens import experiments
    >>> models, relations, info = experiments.toy_setup("hybrid")  # builds the toy world once
    >>> results = experiments.run_named_experiment("hybrid", models, relations)
    >>> metrics.summarize(results, by=("config", "prompt"))

    A grid of your own:

    >>> config = GraftConfig("O+FFN@last_half", (Graft("LT", "O+FFN", "last_half"),))
    >>> test_sets = make_test_sets(relations, prompts=("headline", "qa"))
    >>> results = run_experiment(models, test_sets, ["PRE", "LT", config], out="runs/mine")
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import warnings
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Int
from tqdm.auto import tqdm

from grafting_lens import data, metrics
from grafting_lens.components import (
    COMPONENT_GROUPS,
    COMPONENTS,
    GLOBAL_COMPONENTS,
    expand_components,
)
from grafting_lens.errors import ComponentError, GraftingLensError, GraftMaskError, did_you_mean
from grafting_lens.files import atomic_write
from grafting_lens.graft import graft_forward
from grafting_lens.masks import GraftMask, LayerSpec, resolve_layers
from grafting_lens.models import ModelSet, resolve_placement
from grafting_lens.positions import resolve_positions

__all__ = [
    "COMPONENT_CONFIGS",
    "COMPONENT_LAYER_RANGES",
    "COMPONENT_SETS",
    "EXPERIMENTS",
    "HYBRID_CONFIGS",
    "MOVIE_CONFIGS",
    "MOVIE_PROMPTS",
    "PAPER_NUMBERS",
    "PAPER_POSITION_CONFIGS",
    "POSITION_CONFIGS",
    "REGISTRIES",
    "RunError",
    "ChunkInfo",
    "ExperimentSpec",
    "Graft",
    "GraftConfig",
    "TestSet",
    "add_script_arguments",
    "checkpoint_setup",
    "config_masks",
    "get_configs",
    "make_test_sets",
    "register_config",
    "resolve_components",
    "run_experiment",
    "run_named_experiment",
    "run_options",
    "select_positions",
    "setup_from_arguments",
    "span_names",
    "summary_markdown",
    "toy_setup",
    "write_report",
    "write_table",
]

Spans = Mapping[str, Bool[torch.Tensor, "batch pos"]]
"""Named ``[batch, pos]`` token spans of a batch, e.g. ``TokenizedExamples.spans``."""

PositionFunction = Callable[[Spans, Int[torch.Tensor, "batch pos"]], Bool[torch.Tensor, "batch pos"]]
"""``(spans, attention_mask) -> grafted positions``, for positions no span expression says."""

RUN_FORMAT = 1
"""Version of the run-directory layout; part of every fingerprint."""


class RunError(GraftingLensError):
    """A run directory cannot be used: it holds another run, or is not a run directory."""


# ------------------------------------------------------------------ span expressions

SPAN_ALIASES: dict[str, str] = {
    "FE": "first_entity",
    "LT": "last_token",
    "M": "movie",
    "REL": "relation",
}
"""The paper's labels for the spans :func:`grafting_lens.data.tokenize_examples` marks."""

_TOKEN = re.compile(r"\s*(\^[Cc]|\(|\)|\+|[A-Za-z_][A-Za-z_0-9]*)")


def _parse(expression: str) -> Any:
    """Parse a span expression into nested tuples; raise GraftMaskError on bad syntax.

    Grammar: ``expr := term ('+' term)*``, ``term := atom '^C'*``,
    ``atom := NAME | '(' expr ')'``. ``^C`` binds tighter than ``+``.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise GraftMaskError(f"A span expression must be a non-empty string, got {expression!r}.")
    tokens: list[str] = []
    position = 0
    text = expression.rstrip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise GraftMaskError(
                f"Cannot read the span expression {expression!r} at {text[position:]!r}: use span "
                f"names ({', '.join(SPAN_ALIASES)}, ALL or a span's own name), '+', '^C' and "
                "parentheses, e.g. '(FE+LT)^C'."
            )
        tokens.append(match.group(1))
        position = match.end()
    tokens_iter = iter(tokens + [""])
    current = [next(tokens_iter)]

    def advance() -> str:
        token = current[0]
        current[0] = next(tokens_iter, "")
        return token

    def parse_expr() -> Any:
        terms = [parse_term()]
        while current[0] == "+":
            advance()
            terms.append(parse_term())
        return terms[0] if len(terms) == 1 else ("union", tuple(terms))

    def parse_term() -> Any:
        node = parse_atom()
        while current[0].upper() == "^C":
            advance()
            node = ("complement", node)
        return node

    def parse_atom() -> Any:
        token = advance()
        if token == "(":
            node = parse_expr()
            if advance() != ")":
                raise GraftMaskError(f"Unbalanced parentheses in the span expression {expression!r}.")
            return node
        if not token or not (token[0].isalpha() or token[0] == "_"):
            raise GraftMaskError(
                f"The span expression {expression!r} has {token or 'nothing'!r} where a span name "
                "or '(' belongs."
            )
        if token.upper() == "ALL":
            return ("all",)
        return ("span", SPAN_ALIASES.get(token, token))

    tree = parse_expr()
    if current[0]:
        raise GraftMaskError(f"Unexpected {current[0]!r} in the span expression {expression!r}.")
    return tree


def span_names(expression: str) -> set[str]:
    """The spans a span expression reads, e.g. ``{"first_entity", "last_token"}`` for ``FE+LT``."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if node[0] == "span":
            names.add(node[1])
        elif node[0] == "union":
            for child in node[1]:
                walk(child)
        elif node[0] == "complement":
            walk(node[1])

    walk(_parse(expression))
    return names


def select_positions(
    expression: str | PositionFunction,
    spans: Spans,
    attention_mask: Int[torch.Tensor, "batch pos"],
) -> Bool[torch.Tensor, "batch pos"]:
    """The positions a span expression (or a position function) selects in each row.

    Span names: ``FE`` (first_entity), ``LT`` (last_token), ``M`` (movie), ``REL``
    (relation), ``ALL`` (every real token) or any span's own name. ``A+B`` is the union,
    ``A^C`` the complement among the row's real tokens (padding is never selected).

    Args:
        expression: A span expression such as ``"(FE+LT)^C"``, or a function
            ``(spans, attention_mask) -> [batch, pos]`` boolean tensor.
        spans: Named ``[batch, pos]`` boolean spans. ``last_token`` may be absent: it
            follows from the padding.
        attention_mask: ``[batch, pos]`` right padding.

    Raises:
        GraftMaskError: Bad syntax, a function that returns something other than a
            boolean ``[batch, pos]`` tensor, or positions on padding.
        GraftingLensError: A span the batch lacks (the message lists the ones it has).

    Examples:
        >>> select_positions("FE+LT", batch.spans, batch.attention_mask)
    """
    attention_mask = torch.as_tensor(attention_mask).cpu()
    shape = tuple(attention_mask.shape)
    real = resolve_positions("all", shape, attention_mask)
    if callable(expression):
        selected = expression(spans, attention_mask)
        if not isinstance(selected, torch.Tensor) or selected.dtype != torch.bool:
            described = (
                f"a tensor of {selected.dtype}" if isinstance(selected, torch.Tensor)
                else type(selected).__name__
            )  # fmt: skip
            raise GraftMaskError(
                f"The position function {_callable_name(expression)} returned {described}; it "
                "must return a boolean [batch, pos] tensor."
            )
        return resolve_positions(selected.cpu(), shape, attention_mask)

    def evaluate(node: Any) -> torch.Tensor:
        kind = node[0]
        if kind == "all":
            return real
        if kind == "span":
            return _span(spans, node[1], attention_mask)
        if kind == "union":
            result = torch.zeros(shape, dtype=torch.bool)
            for child in node[1]:
                result = result | evaluate(child)
            return result
        return real & ~evaluate(node[1])

    return resolve_positions(evaluate(_parse(expression)), shape, attention_mask)


def _span(spans: Spans, name: str, attention_mask: torch.Tensor) -> torch.Tensor:
    if name in spans:
        value = torch.as_tensor(spans[name]).cpu()
        if tuple(value.shape) != tuple(attention_mask.shape):
            raise GraftMaskError(
                f"The span {name!r} has shape {tuple(value.shape)}, the batch has "
                f"{tuple(attention_mask.shape)}."
            )
        return value.bool()
    if name == "last_token":
        # The last real token follows from the padding; a batch built by hand need not mark it.
        return resolve_positions("last", tuple(attention_mask.shape), attention_mask)
    raise GraftingLensError(
        f"This configuration needs the {name!r} span, but the batch has only {sorted(spans)}. "
        + (
            "Use a prompt that names the movie (see grafting_lens.experiments.MOVIE_PROMPTS)."
            if name == "movie"
            else "Tokenize with grafting_lens.data.tokenize_examples, which marks it."
        )
    )


def _callable_name(function: Callable) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


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
            members = set(expand_components(name, available, models.architecture))
            if not include_unembed:
                members.discard("unembed")
            if not include_embeddings:
                members.difference_update(_EMBEDDINGS)
            chosen.update(members)
        else:
            if name not in COMPONENTS:
                known = (*COMPONENTS, *COMPONENT_GROUPS, *(n.upper() for n in PAPER_COMPONENTS), "O")
                raise ComponentError(
                    f"Unknown component {part!r}.{did_you_mean(str(part), known)} Known: "
                    f"{', '.join(n.upper() for n in PAPER_COMPONENTS)}, O; the components "
                    f"{', '.join(COMPONENTS)}; the groups {', '.join(COMPONENT_GROUPS)}."
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
            ``"ALL"``; see :func:`select_positions`) or a function
            ``(spans, attention_mask) -> [batch, pos]`` boolean tensor.
        components: See :func:`resolve_components`; ``"all"`` by default (what position
            grafting takes).
        layers: See :func:`grafting_lens.resolve_layers`: ``"all"``, ``"last_half"``,
            ``"first_quarter"``.. ``"last_quarter"``, an int, a list, a range. Global
            components (embeddings, final norm, unembedding) ignore it.
        source: Index of the checkpoint in the model set (0 is the base).
    """

    positions: Union[str, PositionFunction] = "ALL"
    components: Union[str, tuple[str, ...]] = "all"
    layers: LayerSpec = "all"
    source: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.positions, str):
            _parse(self.positions)
        elif not callable(self.positions):
            raise GraftMaskError(
                f"Graft positions must be a span expression such as 'FE+LT' or a function "
                f"(spans, attention_mask) -> tensor, got {self.positions!r}."
            )
        if not isinstance(self.components, str):
            object.__setattr__(self, "components", tuple(self.components))
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))
        if not isinstance(self.source, int) or isinstance(self.source, bool) or self.source < 0:
            raise GraftMaskError(f"Graft source must be an int >= 0, got {self.source!r}.")

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description (what a run's fingerprint records)."""
        positions = (
            self.positions if isinstance(self.positions, str)
            else f"<function {_callable_name(self.positions)}>"
        )  # fmt: skip
        layers = self.layers
        if isinstance(layers, range):
            layers = f"range({layers.start}, {layers.stop}, {layers.step})"
        elif isinstance(layers, slice):
            layers = f"slice({layers.start}, {layers.stop}, {layers.step})"
        elif isinstance(layers, tuple):
            layers = list(layers)
        return {
            "positions": positions,
            "components": self.components if isinstance(self.components, str) else list(self.components),
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
    """

    name: str
    grafts: tuple[Graft, ...] = ()
    tags: Mapping[str, str] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise GraftingLensError(f"A configuration needs a non-empty name, got {self.name!r}.")
        grafts = (self.grafts,) if isinstance(self.grafts, Graft) else tuple(self.grafts)
        for graft in grafts:
            if not isinstance(graft, Graft):
                raise GraftingLensError(
                    f"Configuration {self.name!r}: grafts must be Graft objects, got {graft!r}."
                )
        object.__setattr__(self, "grafts", grafts)
        object.__setattr__(self, "tags", dict(self.tags))

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description (what a run's fingerprint records)."""
        return {
            "name": self.name,
            "grafts": [graft.describe() for graft in self.grafts],
            "tags": dict(self.tags),
        }


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
"""Position grafting at the movie title; needs prompts that name it (:data:`MOVIE_PROMPTS`)."""

MOVIE_PROMPTS: dict[str, tuple[str, str]] = {
    "headline_movie": ("{first_actor} starred in {movie_title} alongside", "starred in"),
    "qa_movie": ("Q: Who starred in {movie_title} with {first_actor}? A:", "starred in"),
}
"""Test prompts naming the movie: ``name -> (template, relation words)``. The headline one
is the first article template cut before the answer; the QA one is the second QA template's."""

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
"""The layer ranges each component set is grafted over (names of :data:`grafting_lens.LAYER_FRACTIONS`)."""


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
    configs = [
        GraftConfig("PRE", (), {"first_entity": "-"}, "the pretrained model"),
        GraftConfig("TASK", (Graft("ALL", "all", "all", TASK),), {"first_entity": "-"},
                    "the task model everywhere"),  # fmt: skip
        GraftConfig("RELATION", (Graft("ALL", "all", "all", RELATION),), {"first_entity": "-"},
                    "the relation model everywhere"),  # fmt: skip
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

class _Registry(ChainMap):
    """Several registries read as one, listed in the order they are given (ChainMap lists
    the last first); additions go to the first."""

    def __iter__(self):
        return iter(dict.fromkeys(name for mapping in self.maps for name in mapping))


REGISTRIES: dict[str, Mapping[str, GraftConfig]] = {
    "position": _Registry(POSITION_CONFIGS, MOVIE_CONFIGS),
    "component": COMPONENT_CONFIGS,
    "hybrid": HYBRID_CONFIGS,
}
"""Configurations by experiment; names passed to :func:`run_experiment` are looked up here."""


def register_config(config: GraftConfig, registry: str = "position", overwrite: bool = False) -> None:
    """Add a configuration to a registry so runs can name it.

    Args:
        config: The configuration.
        registry: ``"position"`` (added next to the paper's eight), ``"component"`` or
            ``"hybrid"``.
        overwrite: Allow replacing a configuration of the same name.

    Raises:
        GraftingLensError: An unknown registry, or a name that is taken.
    """
    if not isinstance(config, GraftConfig):
        raise GraftingLensError(f"register_config needs a GraftConfig, got {type(config).__name__}.")
    target = _registry_named(registry)
    if isinstance(target, ChainMap):
        target = target.maps[0]
    if config.name in target and not overwrite:
        raise GraftingLensError(
            f"A {registry} configuration named {config.name!r} exists; pass overwrite=True to "
            "replace it."
        )
    target[config.name] = config  # type: ignore[index]


def _registry_named(name: str) -> Mapping[str, GraftConfig]:
    if name not in REGISTRIES:
        raise GraftingLensError(
            f"Unknown registry {name!r}.{did_you_mean(name, REGISTRIES)} Known: {', '.join(REGISTRIES)}."
        )
    return REGISTRIES[name]


def get_configs(
    configs: str | GraftConfig | Iterable[str | GraftConfig],
    registry: str | Mapping[str, GraftConfig] = "position",
    kind: str | None = None,
) -> list[GraftConfig]:
    """Look configuration names up in a registry; GraftConfig objects pass through.

    Raises:
        GraftingLensError: No configuration, an unknown name (the message lists the
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
            raise GraftingLensError(
                f"Unknown {kind} configuration {item!r}.{did_you_mean(str(item), registry)} "
                f"Known: {', '.join(registry)}."
            )
    if not resolved:
        raise GraftingLensError(f"No configuration given; choose from {', '.join(registry)}.")
    names = [config.name for config in resolved]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise GraftingLensError(f"Configurations are listed twice: {repeated}.")
    return resolved


# ------------------------------------------------------------------------- test sets


@dataclass(frozen=True)
class TestSet:
    """The examples of one dataset asked with one prompt.

    Attributes:
        examples: :class:`grafting_lens.data.Example` s (tokenized by the runner with each
            model set's tokenizer), or an already tokenized batch (used as is).
        dataset: Label of the dataset (a column of the results).
        prompt: Label of the prompt (default: the examples' ``prompt_name``).
        seed: Seed the relations were made with (the ``data_seed`` column).
    """

    __test__ = False  # not a pytest class

    examples: Any
    dataset: str = "custom"
    prompt: str | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.examples, data.TokenizedExamples) or hasattr(self.examples, "tokens"):
            n = int(torch.as_tensor(self.examples.tokens).shape[0])
            first = (getattr(self.examples, "examples", None) or [None])[0]
        else:
            try:
                object.__setattr__(self, "examples", tuple(self.examples))
            except TypeError:
                raise GraftingLensError(
                    f"A test set holds examples (grafting_lens.data.make_examples) or a tokenized "
                    f"batch with tokens, attention_mask, target_ids and spans (build one with "
                    f"grafting_lens.data.tokenize_examples); got {type(self.examples).__name__}."
                ) from None
            n = len(self.examples)
            first = self.examples[0] if n else None
        if n == 0:
            raise GraftingLensError(
                f"The test set {self.dataset!r}/{self.prompt!r} has no examples: there is nothing to run."
            )
        if self.prompt is None:
            object.__setattr__(self, "prompt", getattr(first, "prompt_name", None) or "custom")

    @property
    def label(self) -> str:
        return f"{self.dataset}/{self.prompt}"


def make_test_sets(
    relations: Sequence[data.Relation],
    prompts: Sequence[str] = ("headline", "qa"),
    direction: str = "A2B",
    dataset: str = "custom",
    seed: int | None = None,
) -> list[TestSet]:
    """One test set per prompt over ``relations``.

    Args:
        relations: The facts to ask about.
        prompts: Names in :data:`grafting_lens.data.TEST_TEMPLATES` or :data:`MOVIE_PROMPTS`.
        direction: ``"A2B"`` asks for the second actor, ``"B2A"`` for the first (reversal).
        dataset: Label of the relations (a column of the results).
        seed: Seed the relations were made with (recorded in the results).

    Raises:
        GraftingLensError: No relations, or an unknown prompt.
    """
    if not relations:
        raise GraftingLensError("No relations to test: the example set is empty.")
    test_sets = []
    for prompt in prompts:
        if prompt in MOVIE_PROMPTS:
            template, words = MOVIE_PROMPTS[prompt]
            examples = data.make_examples(
                relations, prompt=prompt, direction=direction, template=template, relation_words=words
            )
        elif prompt in data.TEST_TEMPLATES:
            examples = data.make_examples(relations, prompt=prompt, direction=direction)
        else:
            known = [*data.TEST_TEMPLATES, *MOVIE_PROMPTS]
            raise GraftingLensError(
                f"Unknown prompt {prompt!r}.{did_you_mean(prompt, known)} Known: {', '.join(known)}."
            )
        test_sets.append(TestSet(examples, dataset=dataset, prompt=prompt, seed=seed))
    return test_sets


# ---------------------------------------------------------------------- the runner


@dataclass(frozen=True)
class ChunkInfo:
    """What :func:`run_experiment` passes to ``on_chunk`` after each chunk is written.

    Attributes:
        index: Position of the chunk in the run (0-based).
        total: Number of chunks in the run.
        chunk_id: Its name, ``m<model set>-t<test set>-c<chunk>``.
        rows: Rows it holds.
        path: The file it was written to (None without ``out``).
    """

    index: int
    total: int
    chunk_id: str
    rows: int
    path: Path | None


@dataclass
class _Resolved:
    """A graft checked against one model set."""

    config: int
    positions: Union[str, PositionFunction]
    components: tuple[str, ...]
    layers: tuple[int, ...]
    source: int


@dataclass
class _Cell:
    """One (model set, test set) pair, tokenized and with every configuration's positions."""

    model_index: int
    test_index: int
    tokens: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    examples: list[Any] | None
    lengths: torch.Tensor
    # positions[config][graft] -> [n_examples, pos] bool
    positions: list[list[torch.Tensor]]


_BASE_COLUMNS = ("models", "dataset", "prompt", "direction", "example", "relation_id", "text", "config")
_SCORE_COLUMNS = (
    "target",
    "target_id",
    "target_rank",
    "target_prob",
    "top1",
    "top5",
    "topk_tokens",
    "topk_ids",
    "topk_probs",
    "data_seed",
)
_ORDER_COLUMNS = ("_m", "_t", "_c")


def run_experiment(
    models: ModelSet | Mapping[str, ModelSet],
    test_sets: TestSet | Sequence[TestSet],
    configs: str | GraftConfig | Sequence[str | GraftConfig],
    *,
    registry: str | Mapping[str, GraftConfig] = "position",
    out: str | os.PathLike | None = None,
    batch_size: int = 8,
    chunk_size: int = 64,
    include_unembed: bool = False,
    include_embeddings: bool = True,
    top_k: int = 10,
    seeds: Mapping[str, int] | None = None,
    progress: bool = True,
    on_chunk: Callable[[ChunkInfo], None] | None = None,
) -> pd.DataFrame:
    """Run every configuration on every example of every test set, for every model set.

    Work is cut into chunks of ``chunk_size`` examples of one (model set, test set);
    within a chunk, ``batch_size`` examples at a time go through one forward pass holding
    every configuration of them (``batch_size * len(configs)`` rows, logits of shape
    ``[rows, pos, d_vocab]``: lower ``batch_size`` for large vocabularies). Examples are
    taken in order of length so a forward pass carries little padding; rows are
    independent, so this changes no result.

    With ``out``, the run lives in that directory: ``manifest.json`` (the run's
    fingerprint and description) and ``chunks/<id>.json``, each written under a
    temporary name and renamed, so a chunk file is complete or absent. Calling again
    with the same arguments resumes: finished chunks are read, not recomputed. The
    fingerprint covers the model sets (names, architecture, a sample of every weight),
    the tokenized test sets, the configurations, ``chunk_size``, ``top_k``, the
    embedding options and ``seeds``, but not ``batch_size`` or ``progress``.

    Args:
        models: A model set, or ``{label: model set}`` to compare several (the
            ``models`` column; a lone model set is labelled by its names).
        test_sets: What to ask (see :func:`make_test_sets`).
        configs: Configuration names (looked up in ``registry``) or :class:`GraftConfig` s.
        registry: A key of :data:`REGISTRIES` or a mapping of configurations.
        out: Directory for resumable results (None: keep everything in memory).
        batch_size: Examples per forward pass.
        chunk_size: Examples per chunk (the unit that is saved and resumed).
        include_unembed: Let groups such as ``all`` graft the unembedding too.
        include_embeddings: Let groups graft the token and position embeddings.
        top_k: How many top tokens to list per row.
        seeds: Seeds to record with every row, as ``<name>_seed`` columns (e.g. the
            toy world's); each test set's own seed is the ``data_seed`` column.
        progress: Show a progress bar.
        on_chunk: Called with a :class:`ChunkInfo` after each chunk is computed (and
            written); an exception raised there stops the run, which can be resumed.

    Returns:
        One row per model set, test set, configuration and example, in that order, with
        columns ``models``, ``dataset``, ``prompt``, ``direction``, ``example`` (row of the
        test set), ``relation_id``, ``text``, ``config``, the configurations' tag columns,
        ``target``, ``target_id``, ``target_rank`` (0 = top-1), ``target_prob``, ``top1``,
        ``top5``, ``topk_tokens``, ``topk_ids``, ``topk_probs``, ``data_seed`` and one
        ``<name>_seed`` column per entry of ``seeds``.

    Raises:
        GraftingLensError: Before any forward pass: an unknown configuration, a layer range
            outside a model, a component an architecture lacks, a source a model set does
            not have, a span a test set lacks, grafts that disagree on a cell, an empty test
            set, bad sizes. RunError: ``out`` holds a different run, or files that are not a
            run's.
    """
    model_sets = _model_sets(models)
    test_list = [test_sets] if isinstance(test_sets, TestSet) else list(test_sets)
    if not test_list:
        raise GraftingLensError("No test set given: the example set is empty.")
    for test_set in test_list:
        if not isinstance(test_set, TestSet):
            raise GraftingLensError(
                f"test_sets must hold TestSet objects (see make_test_sets), got {type(test_set).__name__}."
            )
    config_list = get_configs(configs, registry)
    for name, value in (("batch_size", batch_size), ("chunk_size", chunk_size), ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GraftingLensError(f"{name} must be an integer >= 1, got {value!r}.")
    seeds = dict(seeds or {})
    for name, value in seeds.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*", str(name)):
            raise GraftingLensError(f"Seed names become columns; {name!r} is not a plain name.")

    resolved = [
        _resolve_configs(config_list, label, model_set, include_unembed, include_embeddings)
        for label, model_set in model_sets
    ]
    cells = _prepare_cells(model_sets, test_list, config_list, resolved, top_k)
    tag_columns = list(dict.fromkeys(key for config in config_list for key in config.tags))
    collisions = set(tag_columns) & set(_BASE_COLUMNS + _SCORE_COLUMNS)
    if collisions:
        raise GraftingLensError(f"Configuration tags may not reuse result columns: {sorted(collisions)}.")
    seed_columns = [f"{name}_seed" for name in seeds]
    columns = [*_ORDER_COLUMNS, *_BASE_COLUMNS, *tag_columns, *_SCORE_COLUMNS, *seed_columns]

    chunks = []
    for cell in cells:
        order = torch.argsort(cell.lengths, stable=True)
        for number, start in enumerate(range(0, len(order), chunk_size)):
            chunk_id = f"m{cell.model_index}-t{cell.test_index}-c{number}"
            chunks.append((chunk_id, cell, order[start : start + chunk_size]))

    run_dir = None
    done: dict[str, list[list[Any]]] = {}
    if out is not None:
        spec = _run_spec(
            model_sets, test_list, cells, config_list, chunk_size, top_k,
            include_unembed, include_embeddings, seeds, columns, [c[0] for c in chunks],
        )  # fmt: skip
        run_dir = _open_run(Path(out), spec)
        done = _read_done_chunks(run_dir, [c[0] for c in chunks], columns)

    rows_of = {chunk_id: len(index) * len(config_list) for chunk_id, _, index in chunks}
    bar = tqdm(
        total=sum(rows_of.values()),
        initial=sum(rows_of[chunk_id] for chunk_id in done),
        desc="grafting",
        unit="row",
        disable=not progress,
    )
    records: dict[str, list[list[Any]]] = dict(done)
    decoders: dict[int, Callable[[int], str]] = {}
    with bar, torch.inference_mode():
        for position, (chunk_id, cell, index) in enumerate(chunks):
            if chunk_id in done:
                continue
            label, model_set = model_sets[cell.model_index]
            tokenizer = model_set.tokenizer
            decode = decoders.setdefault(id(tokenizer), _decoder(tokenizer))
            rows: list[list[Any]] = []
            for start in range(0, len(index), batch_size):
                batch = index[start : start + batch_size]
                rows.extend(
                    _run_batch(
                        model_set, label, test_list[cell.test_index], cell, batch, config_list,
                        resolved[cell.model_index], tag_columns, top_k, decode, seeds,
                    )  # fmt: skip
                )
                bar.update(len(batch) * len(config_list))
            path = None
            if run_dir is not None:
                path = _write_chunk(run_dir, chunk_id, columns, rows)
            records[chunk_id] = rows
            if on_chunk is not None:
                on_chunk(ChunkInfo(position, len(chunks), chunk_id, len(rows), path))

    table = pd.DataFrame(
        [row for chunk_id, _, _ in chunks for row in records[chunk_id]], columns=columns
    )
    table = table.sort_values([*_ORDER_COLUMNS, "example"], kind="stable")
    return table.drop(columns=list(_ORDER_COLUMNS)).reset_index(drop=True)


def _model_sets(models: ModelSet | Mapping[str, ModelSet]) -> list[tuple[str, ModelSet]]:
    if isinstance(models, ModelSet):
        return [(",".join(models.names), models)]
    if isinstance(models, Mapping):
        if not models:
            raise GraftingLensError("No model set given.")
        for label, model_set in models.items():
            if not isinstance(model_set, ModelSet):
                raise GraftingLensError(
                    f"models[{label!r}] is a {type(model_set).__name__}; pass ModelSets from load_models."
                )
        return [(str(label), model_set) for label, model_set in models.items()]
    raise GraftingLensError(
        f"models must be a ModelSet (grafting_lens.load_models) or a mapping of them, got "
        f"{type(models).__name__}."
    )


def _resolve_configs(
    configs: list[GraftConfig],
    label: str,
    models: ModelSet,
    include_unembed: bool,
    include_embeddings: bool,
) -> list[list[_Resolved]]:
    """Check every graft against one model set: components, layers, source."""
    resolved = []
    for index, config in enumerate(configs):
        grafts = []
        for graft in config.grafts:
            try:
                if graft.source >= len(models):
                    raise GraftMaskError(
                        f"the graft takes source {graft.source}, but the model set has "
                        f"{len(models)} sources (0..{len(models) - 1})"
                        + (": the hybrid graft needs (pretrained, task, relation)"
                           if graft.source == 2 else "")  # fmt: skip
                    )
                components = resolve_components(
                    graft.components, models,
                    include_unembed=include_unembed, include_embeddings=include_embeddings,
                )  # fmt: skip
                layers = resolve_layers(graft.layers, models.n_layers)
            except GraftingLensError as error:
                raise type(error)(
                    f"Configuration {config.name!r} on model set {label!r} "
                    f"({models.architecture}, {models.n_layers} layers): {error}"
                ) from error
            grafts.append(_Resolved(index, graft.positions, components, layers, graft.source))
        resolved.append(grafts)
    return resolved


def _prepare_cells(
    model_sets: list[tuple[str, ModelSet]],
    test_sets: list[TestSet],
    configs: list[GraftConfig],
    resolved: list[list[list[_Resolved]]],
    top_k: int,
) -> list[_Cell]:
    """Tokenize each test set per model set and evaluate every configuration's positions."""
    tokenized_cache: dict[tuple[int, int], Any] = {}
    cells = []
    for model_index, (label, models) in enumerate(model_sets):
        vocab = int(models.base.cfg.d_vocab)
        if top_k > vocab:
            raise GraftingLensError(f"top_k={top_k} exceeds the vocabulary of {label!r} ({vocab}).")
        for test_index, test_set in enumerate(test_sets):
            key = (id(models.tokenizer), test_index)
            if key not in tokenized_cache:
                tokenized_cache[key] = _tokenize(test_set, models.tokenizer)
            tokens, attention_mask, target_ids, spans, examples = tokenized_cache[key]
            if int(tokens.max()) >= vocab or int(target_ids.max()) >= vocab:
                raise GraftingLensError(
                    f"Test set {test_set.label!r} has token ids beyond the vocabulary of {label!r} "
                    f"({vocab}): tokenize it with that model set's tokenizer."
                )
            positions = []
            for config, grafts in zip(configs, resolved[model_index]):
                try:
                    selected = [select_positions(g.positions, spans, attention_mask) for g in grafts]
                except GraftingLensError as error:
                    raise type(error)(
                        f"Configuration {config.name!r} on test set {test_set.label!r}: {error}"
                    ) from error
                _check_conflicts(config, grafts, selected, f"test set {test_set.label!r}")
                positions.append(selected)
            cells.append(
                _Cell(model_index, test_index, tokens, attention_mask, target_ids, examples,
                      attention_mask.sum(dim=1), positions)  # fmt: skip
            )
    return cells


def _tokenize(test_set: TestSet, tokenizer: Any):
    source = test_set.examples
    if not hasattr(source, "tokens"):
        with warnings.catch_warnings():
            # Drops are listed in TokenizedExamples.dropped; say it once, with the test set's name.
            warnings.simplefilter("ignore")
            source = data.tokenize_examples(list(source), tokenizer)
        if source.dropped:
            warnings.warn(
                f"Test set {test_set.label!r}: dropped {len(source.dropped)} of "
                f"{len(source.dropped) + len(source)} examples that cannot be tokenized cleanly "
                f"(first: {source.dropped[0][1]}).",
                stacklevel=4,
            )
    needed = ("tokens", "attention_mask", "target_ids", "spans")
    missing = [name for name in needed if not hasattr(source, name)]
    if missing:
        raise GraftingLensError(
            f"A tokenized test set needs tokens, attention_mask, target_ids and spans; "
            f"{type(source).__name__} lacks {missing}. Build one with "
            "grafting_lens.data.tokenize_examples(examples, models.tokenizer)."
        )
    tokens = torch.as_tensor(source.tokens).cpu().long()
    if tokens.dim() != 2 or tokens.shape[0] == 0:
        raise GraftingLensError(
            f"tokens must be a non-empty [batch, pos] tensor, got {tuple(tokens.shape)}."
        )
    shape = tuple(tokens.shape)
    attention_mask = (
        torch.ones(shape, dtype=torch.long)
        if source.attention_mask is None
        else torch.as_tensor(source.attention_mask).cpu().long()
    )
    if tuple(attention_mask.shape) != shape:
        raise GraftingLensError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, the tokens have {shape}."
        )
    resolve_positions("all", shape, attention_mask)  # right padding, no empty row
    target_ids = torch.as_tensor(source.target_ids).cpu().long()
    if tuple(target_ids.shape) != (shape[0],):
        raise GraftingLensError(
            f"target_ids has shape {tuple(target_ids.shape)}; expected one id per example, ({shape[0]},)."
        )
    spans = {name: torch.as_tensor(value).cpu() for name, value in dict(source.spans).items()}
    for name, value in spans.items():
        if tuple(value.shape) != shape:
            raise GraftingLensError(
                f"The span {name!r} has shape {tuple(value.shape)}, the tokens have {shape}."
            )
    examples = getattr(source, "examples", None)
    if examples is not None and len(examples) != shape[0]:
        raise GraftingLensError(f"The batch has {len(examples)} examples but {shape[0]} rows of tokens.")
    return tokens, attention_mask, target_ids, spans, (list(examples) if examples is not None else None)


def _check_conflicts(
    config: GraftConfig, grafts: list[_Resolved], selected: list[torch.Tensor], where: str
) -> None:
    """Refuse two grafts of one configuration giving one cell different sources."""
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


def _decoder(tokenizer: Any) -> Callable[[int], str]:
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = tokenizer.decode([token_id])
        return text

    return decode


def config_masks(
    models: ModelSet,
    configs: Sequence[str | GraftConfig],
    spans: Spans,
    attention_mask: Int[torch.Tensor, "batch pos"],
    *,
    registry: str | Mapping[str, GraftConfig] = "position",
    include_unembed: bool = False,
    include_embeddings: bool = True,
) -> GraftMask:
    """The graft mask of several configurations of one batch, stacked along the batch.

    Rows ``i * batch .. (i + 1) * batch - 1`` are configuration ``configs[i]``; run it
    on ``tokens.repeat(len(configs), 1)``. Equal to :meth:`GraftMask.cat` of one
    :meth:`GraftMask.union` per configuration, but grafts that take the same components,
    layers and source share one ``[rows, pos]`` tensor across all their
    ``(component, layer)`` pairs, which the graft splits into positions once per pass.

    Raises:
        GraftingLensError: As :func:`run_experiment` for bad configurations.
    """
    config_list = get_configs(configs, registry)
    attention_mask = torch.as_tensor(attention_mask).cpu()
    resolved = _resolve_configs(
        config_list, ",".join(models.names), models, include_unembed, include_embeddings
    )
    positions = []
    for config, grafts in zip(config_list, resolved):
        selected = [select_positions(g.positions, spans, attention_mask) for g in grafts]
        _check_conflicts(config, grafts, selected, "the batch")
        positions.append(selected)
    return _stacked_mask(models, resolved, positions, attention_mask.shape)


def _stacked_mask(
    models: ModelSet,
    resolved: list[list[_Resolved]],
    positions: list[list[torch.Tensor]],
    shape: tuple[int, int],
) -> GraftMask:
    batch, length = int(shape[0]), int(shape[1])
    n_configs = len(resolved)
    # Group grafts by what they take; each group is one [n_configs * batch, pos] tensor.
    kinds: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for config_index, grafts in enumerate(resolved):
        for graft, selected in zip(grafts, positions[config_index]):
            key = (graft.components, graft.layers, graft.source)
            kinds.setdefault(key, []).append((config_index, selected))
    entries: dict[tuple[str, int | None], torch.Tensor] = {}
    combined: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for (components, layers, source), members in kinds.items():
        blocks = torch.zeros((n_configs, batch, length), dtype=torch.bool)
        for config_index, selected in members:
            blocks[config_index] |= selected
        value = blocks.reshape(n_configs * batch, length).long() * source
        for component in components:
            for layer in (None,) if component in GLOBAL_COMPONENTS else layers:
                key = (component, layer)
                if key not in entries:
                    entries[key] = value
                    continue
                # Shared tensors stay shared: combine each distinct pair of tensors once.
                # The cache keeps both operands alive: an id() names an object only while
                # it lives, and a freed tensor's id is soon reused by a new one.
                pair = (id(entries[key]), id(value))
                if pair not in combined:
                    combined[pair] = (torch.where(value != 0, value, entries[key]), entries[key], value)
                entries[key] = combined[pair][0]
    return GraftMask(entries, (n_configs * batch, length), len(models))


def _run_batch(
    models: ModelSet,
    label: str,
    test_set: TestSet,
    cell: _Cell,
    batch: torch.Tensor,
    configs: list[GraftConfig],
    resolved: list[list[_Resolved]],
    tag_columns: list[str],
    top_k: int,
    decode: Callable[[int], str],
    seeds: Mapping[str, int],
) -> list[list[Any]]:
    """One forward pass: every configuration of the examples ``batch``, scored."""
    attention_mask = cell.attention_mask[batch]
    length = int(attention_mask.sum(dim=1).max())
    attention_mask = attention_mask[:, :length]
    tokens = cell.tokens[batch, :length]
    positions = [[p[batch, :length] for p in per_config] for per_config in cell.positions]
    mask = _stacked_mask(models, resolved, positions, tuple(attention_mask.shape))
    repeats = len(configs)
    stacked_attention = attention_mask.repeat(repeats, 1)
    logits = graft_forward(models, tokens.repeat(repeats, 1), mask, attention_mask=stacked_attention)
    final = metrics.last_token_logits(logits, stacked_attention.to(logits.device))
    targets = cell.target_ids[batch].repeat(repeats)
    ranks = metrics.target_rank(final, targets).cpu().tolist()
    probabilities = metrics.target_probability(final, targets).cpu().tolist()
    top = metrics.top_k_tokens(final, top_k)
    top_ids = top.ids.cpu().tolist()
    top_probabilities = top.probabilities.cpu().tolist()
    del logits, final

    examples = cell.examples
    seed_values = list(seeds.values())
    rows = []
    batch_list = batch.tolist()
    for config_index, config in enumerate(configs):
        tags = [config.tags.get(column) for column in tag_columns]
        for offset, example_index in enumerate(batch_list):
            row = config_index * len(batch_list) + offset
            example = examples[example_index] if examples is not None else None
            rank = int(ranks[row])
            ids = top_ids[row]
            rows.append(
                [
                    cell.model_index, cell.test_index, config_index,
                    label, test_set.dataset, test_set.prompt,
                    getattr(example, "direction", None), example_index,
                    getattr(example, "relation_id", None), getattr(example, "text", None),
                    config.name, *tags,
                    getattr(example, "target", None), int(cell.target_ids[example_index]),
                    rank, float(probabilities[row]), rank < 1, rank < 5,
                    [decode(i) for i in ids], ids, [round(p, 6) for p in top_probabilities[row]],
                    test_set.seed, *seed_values,
                ]  # fmt: skip
            )
    return rows


# --------------------------------------------------------------------- run directory


def _run_spec(
    model_sets, test_sets, cells, configs, chunk_size, top_k, include_unembed,
    include_embeddings, seeds, columns, chunk_ids,
) -> dict[str, Any]:  # fmt: skip
    """Everything that makes a run this run, JSON-ready; its hash is the fingerprint."""
    digests = {(cell.model_index, cell.test_index): _test_digest(cell) for cell in cells}
    return {
        "format": RUN_FORMAT,
        "models": [
            {
                "label": label,
                "names": list(models.names),
                "architecture": models.architecture,
                "n_layers": models.n_layers,
                "weights": _weights_digest(models),
            }
            for label, models in model_sets
        ],
        "test_sets": [
            {
                "dataset": test_set.dataset,
                "prompt": test_set.prompt,
                "seed": test_set.seed,
                "examples": int(cells[index].tokens.shape[0]),
                "digest": [digests[(m, index)] for m in range(len(model_sets))],
            }
            for index, test_set in enumerate(test_sets)
        ],
        "configs": [config.describe() for config in configs],
        "options": {
            "chunk_size": chunk_size,
            "top_k": top_k,
            "include_unembed": include_unembed,
            "include_embeddings": include_embeddings,
            "seeds": dict(seeds),
        },
        "columns": [c for c in columns if c not in _ORDER_COLUMNS],
        "chunks": chunk_ids,
    }


def _weights_digest(models: ModelSet) -> str:
    """A cheap hash of every source: names, shapes and a strided sample of every parameter."""
    digest = hashlib.sha256()
    for bridge in models:
        for name, parameter in bridge.original_model.named_parameters():
            flat = parameter.detach().reshape(-1)
            step = max(1, flat.numel() // 64)
            sample = flat[::step][:64].float().cpu().numpy()
            digest.update(f"{name}{tuple(parameter.shape)}".encode())
            digest.update(sample.tobytes())
    return digest.hexdigest()[:16]


def _test_digest(cell: _Cell) -> str:
    digest = hashlib.sha256()
    for tensor in (cell.tokens, cell.attention_mask, cell.target_ids):
        digest.update(tensor.numpy().tobytes())
    if cell.examples is not None:
        for example in cell.examples:
            digest.update(
                f"{getattr(example, 'relation_id', None)}|{getattr(example, 'direction', None)}|"
                f"{getattr(example, 'text', None)}|{getattr(example, 'target', None)}\n".encode()
            )
    for selected in cell.positions:
        for tensor in selected:
            digest.update(np.packbits(tensor.numpy()).tobytes())
    return digest.hexdigest()[:16]


def _fingerprint(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def _open_run(run_dir: Path, spec: dict[str, Any]) -> Path:
    """Create the run directory, or check that it holds this very run."""
    fingerprint = _fingerprint(spec)
    manifest_path = run_dir / "manifest.json"
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"{run_dir} is a file; a run needs a directory.")
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise RunError(
                f"{manifest_path} cannot be read ({error}); it is not a run this version wrote. "
                "Use another directory."
            ) from error
        if manifest.get("fingerprint") != fingerprint:
            differences = _differences(manifest.get("spec", {}), spec)
            raise RunError(
                f"{run_dir} holds a different run (fingerprint {manifest.get('fingerprint')}, "
                f"this one is {fingerprint}); it differs in {differences}. Resuming would mix two "
                "runs: pass another output directory, or delete this one to start over."
            )
        return run_dir
    if run_dir.is_dir() and any(not p.name.startswith(".") for p in run_dir.iterdir()):
        raise RunError(
            f"{run_dir} is not empty and has no manifest.json, so it is not a run directory; "
            "refusing to write into it. Pass a new or empty directory."
        )
    (run_dir / "chunks").mkdir(parents=True, exist_ok=True)
    manifest = {
        "fingerprint": fingerprint,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "spec": spec,
    }
    atomic_write(manifest_path, json.dumps(manifest, indent=1).encode())
    return run_dir


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    changed = [key for key in keys if old.get(key) != new.get(key)]
    parts = []
    for key in changed:
        if key == "configs":
            before = [c.get("name") for c in old.get(key, [])]
            after = [c.get("name") for c in new.get(key, [])]
            parts.append(f"configs ({before} vs {after})" if before != after else "configs (definitions)")
        elif key == "options":
            inner = sorted(
                k for k in set(old.get(key, {})) | set(new.get(key, {}))
                if old.get(key, {}).get(k) != new.get(key, {}).get(k)
            )  # fmt: skip
            parts.append(f"options ({', '.join(inner)})")
        else:
            parts.append(key)
    return ", ".join(parts) or "its description"


def _chunk_path(run_dir: Path, chunk_id: str) -> Path:
    return run_dir / "chunks" / f"{chunk_id}.json"


def _read_done_chunks(
    run_dir: Path, chunk_ids: list[str], columns: list[str]
) -> dict[str, list[list[Any]]]:
    for leftover in (run_dir / "chunks").glob(".*.partial"):
        leftover.unlink(missing_ok=True)  # a write that was killed before its rename
    done = {}
    for chunk_id in chunk_ids:
        path = _chunk_path(run_dir, chunk_id)
        if not path.is_file():
            continue
        try:
            content = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise RunError(f"The chunk {path} cannot be read ({error}); delete it to recompute it.") from error
        if content.get("columns") != columns or content.get("chunk") != chunk_id:
            raise RunError(f"The chunk {path} does not belong to this run; delete it to recompute it.")
        done[chunk_id] = content["rows"]
    return done


def _write_chunk(run_dir: Path, chunk_id: str, columns: list[str], rows: list[list[Any]]) -> Path:
    path = _chunk_path(run_dir, chunk_id)
    payload = {"chunk": chunk_id, "columns": columns, "rows": rows}
    atomic_write(path, json.dumps(payload, separators=(",", ":")).encode())
    return path




def write_table(frame: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Write a DataFrame as CSV under a temporary name, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, frame.to_csv(index=False).encode())
    return path


# ---------------------------------------------------------------- named experiments


@dataclass(frozen=True)
class ExperimentSpec:
    """One of the paper's experiments: which checkpoints, which questions, which grafts.

    Attributes:
        name: Key in :data:`EXPERIMENTS`.
        title: For figures and reports.
        roles: What each source of the model set is; in the toy world, the checkpoint
            names (:data:`grafting_lens.toy.MODEL_NAMES`), base first.
        relations: Which relations are asked about: ``"all"``, ``"task"`` or
            ``"relation"`` (the halves of :func:`grafting_lens.data.split_task_relation`).
        direction: ``"A2B"``, or ``"B2A"`` for the reversal.
        parts: ``(part name, prompts, configuration names)``: each part is one run
            (movie-title configurations need prompts naming the movie).
        registry: Where the names are looked up.
        quick: Configuration names of ``--quick`` runs, per part (None: all).
    """

    name: str
    title: str
    roles: tuple[str, ...]
    relations: str
    direction: str
    parts: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]
    registry: str
    quick: tuple[tuple[str, ...] | None, ...] = ()


def _component_names(layer_ranges: Sequence[str]) -> tuple[str, ...]:
    return ("BASE", "DONOR", *(f"{s}@{r}" for r in layer_ranges for s in COMPONENT_SETS))


_COMPONENT_PART = (("component", ("headline", "qa"), _component_names(COMPONENT_LAYER_RANGES)),)
_COMPONENT_QUICK = (_component_names(("all", "last_half")),)

EXPERIMENTS: dict[str, ExperimentSpec] = {
    "position": ExperimentSpec(
        "position",
        "Position grafting (PRE into SFT)",
        ("base", "sft"),
        "all",
        "A2B",
        (
            ("paper", ("headline", "qa"), PAPER_POSITION_CONFIGS),
            ("movie", tuple(MOVIE_PROMPTS), ("PRE", "SFT", "FE", "LT", "FE+LT", *MOVIE_CONFIGS)),
        ),
        "position",
        (None, ("PRE", "SFT", "M", "FE+M+LT")),
    ),
    "component": ExperimentSpec(
        "component",
        "Component grafting at the last token (relation model into task model)",
        ("task", "relation"),
        "relation",
        "A2B",
        _COMPONENT_PART,
        "component",
        _COMPONENT_QUICK,
    ),
    "component_baseline": ExperimentSpec(
        "component_baseline",
        "Component grafting at the last token (SFT into PRE, baseline)",
        ("base", "sft"),
        "all",
        "A2B",
        _COMPONENT_PART,
        "component",
        _COMPONENT_QUICK,
    ),
    "reversal": ExperimentSpec(
        "reversal",
        "Reversal: both-direction model into one-direction model, reversed prompts",
        ("a2b", "both"),
        "all",
        "B2A",
        _COMPONENT_PART,
        "component",
        _COMPONENT_QUICK,
    ),
    "hybrid": ExperimentSpec(
        "hybrid",
        "Hybrid graft (pretrained + task ATTN + relation O+FFN)",
        ("base", "task", "relation"),
        "relation",
        "A2B",
        (("hybrid", ("headline", "qa"), tuple(HYBRID_CONFIGS)),),
        "hybrid",
        (None,),
    ),
}
"""The paper's experiments as :class:`ExperimentSpec` s."""


def _experiment(name: str) -> ExperimentSpec:
    if name not in EXPERIMENTS:
        raise GraftingLensError(
            f"Unknown experiment {name!r}.{did_you_mean(name, EXPERIMENTS)} Known: {', '.join(EXPERIMENTS)}."
        )
    return EXPERIMENTS[name]


def toy_setup(
    experiment: str,
    config: Any = None,
    cache_dir: str | os.PathLike | None = None,
    device: str | None = None,
    progress: bool = True,
) -> tuple[ModelSet, list[data.Relation], dict[str, Any]]:
    """The toy world's checkpoints and relations for one experiment.

    Builds the toy world on first use (minutes; cached afterwards, see
    :func:`grafting_lens.toy.build_toy_world`).

    Returns:
        ``(models, relations, info)``: the model set in the experiment's roles, the
        relations to ask about, and ``info`` with the world's ``root``, ``seed``,
        ``dataset`` and its own ``evaluation`` of each checkpoint.
    """
    from grafting_lens.models import load_models
    from grafting_lens.toy import build_toy_world

    spec = _experiment(experiment)
    world = build_toy_world(config=config, cache_dir=cache_dir, progress=progress)
    models = load_models(
        *(world.model_dir(role) for role in spec.roles),
        tokenizer=world.load_tokenizer(),
        device=device,
        names=list(spec.roles),
    )
    relations = {
        "all": world.relations,
        "task": world.task_relations,
        "relation": world.relation_relations,
    }[spec.relations]
    info = {
        "root": str(world.root),
        "seed": world.config.seed,
        "dataset": world.config.dataset,
        "evaluation": world.manifest.get("evaluation", {}),
    }
    return models, list(relations), info


def checkpoint_setup(
    experiment: str,
    checkpoints: Sequence[str],
    dataset: str = "fake_movies_real_actors",
    n_relations: int = 1000,
    seed: int = 0,
    relations: str | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[ModelSet, list[data.Relation]]:
    """Real checkpoints in an experiment's roles, and the relations they were finetuned on.

    Args:
        experiment: A key of :data:`EXPERIMENTS`.
        checkpoints: Hub ids or directories, one per role (``EXPERIMENTS[experiment].roles``:
            e.g. pretrained then finetuned for ``position``; task then relation model for
            ``component``; pretrained, task, relation for ``hybrid``).
        dataset: The dataset the donors were finetuned on: the relations are
            ``make_relations(dataset, n_relations, seed)``.
        n_relations: How many relations, as in ``make_relations``.
        seed: The seed of ``make_relations``.
        relations: Which of them to ask about (``"all"``, ``"task"``, ``"relation"``;
            default: the experiment's).
        device: Passed to :func:`grafting_lens.load_models`.
        dtype: Passed to :func:`grafting_lens.load_models`.

    Raises:
        GraftingLensError: A wrong number of checkpoints or an unknown choice.
    """
    from grafting_lens.models import load_models

    spec = _experiment(experiment)
    if len(checkpoints) != len(spec.roles):
        raise GraftingLensError(
            f"The {experiment} experiment needs {len(spec.roles)} checkpoints ({', '.join(spec.roles)}), "
            f"got {len(checkpoints)}."
        )
    which = relations or spec.relations
    if which not in ("all", "task", "relation"):
        raise GraftingLensError(f"relations must be 'all', 'task' or 'relation', got {which!r}.")
    made = data.make_relations(dataset, n=n_relations, seed=seed)
    if which != "all":
        task, relation = data.split_task_relation(made, seed=seed)
        made = task if which == "task" else relation
    models = load_models(*checkpoints, device=device, dtype=dtype, names=list(spec.roles))
    return models, made


def run_named_experiment(
    experiment: str,
    models: ModelSet,
    relations: Sequence[data.Relation],
    *,
    out: str | os.PathLike | None = None,
    quick: bool = False,
    n_examples: int | None = None,
    dataset: str = "fake_movies_real_actors",
    seed: int | None = None,
    seeds: Mapping[str, int] | None = None,
    **options: Any,
) -> pd.DataFrame:
    """Run one of :data:`EXPERIMENTS` over ``relations``: every part, every prompt.

    Args:
        experiment: A key of :data:`EXPERIMENTS`.
        models: The model set in the experiment's roles (see :func:`toy_setup`).
        relations: What to ask about.
        out: A directory; each part runs (resumably) in ``out/<part>``.
        quick: Ask about the first 16 relations only, with the experiment's short list
            of configurations.
        n_examples: Ask about the first ``n_examples`` relations only.
        dataset: Label of the relations (the ``dataset`` column).
        seed: Seed the relations were made with (the ``data_seed`` column).
        seeds: Further seeds to record (see :func:`run_experiment`).
        **options: Passed to :func:`run_experiment` (``batch_size``, ``progress``...).

    Returns:
        The parts' tables, concatenated, with a ``part`` column after ``models``.
    """
    spec = _experiment(experiment)
    relations = list(relations)
    if n_examples is not None:
        relations = relations[:n_examples]
    if quick:
        relations = relations[:16]
    if not relations:
        raise GraftingLensError("No relations to ask about: the example set is empty.")
    # Check every part before running any of them.
    parts = []
    for index, (part, prompts, names) in enumerate(spec.parts):
        if quick and index < len(spec.quick) and spec.quick[index] is not None:
            names = spec.quick[index]
        configs = get_configs(list(names), spec.registry)
        test_sets = make_test_sets(relations, prompts, spec.direction, dataset=dataset, seed=seed)
        parts.append((part, test_sets, configs))
    tables = []
    for part, test_sets, configs in parts:
        table = run_experiment(
            models,
            test_sets,
            configs,
            out=None if out is None else Path(out) / part,
            seeds=seeds,
            **options,
        )
        table.insert(1, "part", part)
        tables.append(table)
    return pd.concat(tables, ignore_index=True)


# -------------------------------------------------------------------------- reporting

PAPER_NUMBERS: dict[str, list[str]] = {
    "position": [
        "FE+LT recovers full or nearly full SFT top-5 accuracy in all four models (figure 2).",
        "(FE+LT)^C stays near PRE (near-zero top-5) in all four models.",
        "LT alone: 53% top-5 for Gemma-1.1 (SFT 100%); FE alone: 28% for GPT2-XL.",
        "FE^C beats LT for every model except Gemma; LT^C is near zero except for GPT2-XL.",
    ],
    "component": [
        "O+FFN at the last token nearly matches ATTN+O+FFN (Gemma, Llama3); the last quarter "
        "of the layers carries most of it.",
        "Dropping O (FFN alone) costs 29% top-5 in Gemma and 41% in Llama3.",
        "O+FFN-up and O+FFN-down each recover some, both are needed.",
    ],
    "hybrid": [
        "Task ATTN at FE and LT plus relation O+FFN at LT: 63% top-5 (Gemma), 34% (Llama3).",
        "Task FFN at FE is about the same as grafting at LT only; task O with ATTN at FE helps.",
    ],
}
"""What the paper reports, per experiment, for the reports next to toy-world numbers."""
PAPER_NUMBERS["component_baseline"] = PAPER_NUMBERS["component"]
PAPER_NUMBERS["reversal"] = PAPER_NUMBERS["component"]


def summary_markdown(
    summary: pd.DataFrame,
    title: str,
    command: str | None = None,
    notes: Sequence[str] = (),
    paper: Sequence[str] = (),
) -> str:
    """A short markdown report: the summary table (top-1, top-5 with intervals, mean rank).

    Args:
        summary: From :func:`grafting_lens.metrics.summarize`.
        title: The heading.
        command: The command that made it, shown verbatim.
        notes: Lines to list under the table.
        paper: What the paper reports, listed for comparison.
    """
    group_columns = [
        c for c in summary.columns if c != "n" and not c.startswith(("top", "mean_rank"))
    ]
    header = [*group_columns, "n", "top-1", "top-5 [95% CI]", "mean rank"]
    lines = [f"# {title}", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, row in summary.iterrows():
        cells = [str(row[c]) for c in group_columns]
        cells += [
            str(int(row["n"])),
            f"{row['top1']:.0%}" if "top1" in row else "",
            f"{row['top5']:.0%} [{row['top5_low']:.0%}, {row['top5_high']:.0%}]" if "top5" in row else "",
            f"{row['mean_rank']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", *[f"- {note}" for note in notes]]
    if paper:
        lines += ["", "What the paper reports:", "", *[f"- {line}" for line in paper]]
    return "\n".join(lines) + "\n"



# --------------------------------------------------------------------- script support

_DONOR_OPTIONS: dict[str, dict[str, tuple[str, str]]] = {
    "position": {"sft": ("--donor", "the finetuned checkpoint (SFT) grafted into --model")},
    "component": {"relation": ("--donor", "the relation model grafted into --model (the task model)")},
    "component_baseline": {"sft": ("--donor", "the finetuned checkpoint grafted into --model")},
    "reversal": {"both": ("--donor", "the model finetuned on both directions, grafted into --model")},
    "hybrid": {
        "task": ("--task-model", "the model finetuned on the task split"),
        "relation": ("--relation-model", "the model finetuned on the relation split"),
    },
}


def add_script_arguments(parser: Any, experiment: str) -> Any:
    """The options every experiment script shares (``--out``, ``--model``, ``--quick``...).

    ``parser`` is an ``argparse.ArgumentParser``; returns it.
    """
    spec = _experiment(experiment)
    parser.add_argument("--out", required=True, help="Directory for tables, figures and the resumable runs.")
    parser.add_argument(
        "--model",
        help=f"A real checkpoint (hub id or directory) as {spec.roles[0]!r} instead of the toy world.",
    )
    for role, (option, text) in _DONOR_OPTIONS[experiment].items():
        parser.add_argument(option, help=f"With --model: {text}.")
    parser.add_argument("--quick", action="store_true",
                        help="A small subset (16 relations, fewer configurations).")  # fmt: skip
    parser.add_argument("--n-examples", type=int, help="Ask about the first N relations only.")
    parser.add_argument("--batch-size", type=int, default=8, help="Examples per forward pass (default 8).")
    parser.add_argument("--device", help="torch device, e.g. cuda (default: cpu).")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="Cast the models.")
    parser.add_argument(
        "--threads", type=int,
        help="torch CPU threads (default: 1 for the toy world, whose matrices are too small to "
        "gain from more, and more threads on a busy machine can be many times slower; torch's "
        "default for --model).",
    )  # fmt: skip
    parser.add_argument("--dataset", default="fake_movies_real_actors",
                        help="With --model: the dataset the donors were finetuned on.")  # fmt: skip
    parser.add_argument("--n-relations", type=int, default=1000,
                        help="With --model: make_relations(--dataset, n=this, seed=--seed) (default 1000).")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="With --model: the relations' seed.")
    parser.add_argument("--relations", choices=("all", "task", "relation"),
                        help=f"With --model: which relations to ask about (default {spec.relations}).")  # fmt: skip
    parser.add_argument("--include-unembed", action="store_true",
                        help="Groups graft the donor's unembedding too (default: the base's everywhere).")  # fmt: skip
    parser.add_argument("--base-embeddings", action="store_true",
                        help="Keep the base's embeddings at grafted positions (default: the donor's).")  # fmt: skip
    parser.add_argument("--cache-dir", help="Where toy worlds are cached.")
    parser.add_argument("--toy-config",
                        help="JSON of ToyWorldConfig fields, e.g. '{\"n_relations\": 16}'.")  # fmt: skip
    parser.add_argument("--no-png", action="store_true", help="Write HTML figures only.")
    parser.add_argument("--no-progress", action="store_true", help="Hide progress bars.")
    return parser


def setup_from_arguments(experiment: str, args: Any) -> dict[str, Any]:
    """Load what a script's arguments name; every check happens here, before any run.

    Returns:
        ``{"models", "relations", "label", "dataset", "data_seed", "seeds", "world"}``.

    Raises:
        GraftingLensError: Missing or extra donor options, bad sizes, a bad toy config.
    """
    spec = _experiment(experiment)
    if args.threads is not None and args.threads < 1:
        raise GraftingLensError(f"--threads must be >= 1, got {args.threads}.")
    resolve_placement(args.device, args.dtype)  # a typo fails now, not after loading
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif args.model is None:
        torch.set_num_threads(1)
    for name in ("batch_size", "n_examples", "n_relations"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise GraftingLensError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")
    options = {role: option for role, (option, _) in _DONOR_OPTIONS[experiment].items()}
    donors = {role: getattr(args, _dest(options[role]), None) for role in spec.roles[1:]}
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    if args.model is None:
        given = [options[role] for role, value in donors.items() if value is not None]
        if given:
            raise GraftingLensError(f"{', '.join(given)} need --model (the base they are grafted into).")
        config = None
        if args.toy_config:
            from grafting_lens.toy import ToyWorldConfig

            try:
                config = ToyWorldConfig(**json.loads(args.toy_config))
            except (json.JSONDecodeError, TypeError) as error:
                raise GraftingLensError(
                    f"--toy-config is not a JSON object of ToyWorldConfig fields: {error}"
                ) from error
        models, relations, world = toy_setup(
            experiment, config=config, cache_dir=args.cache_dir, device=args.device,
            progress=not args.no_progress,
        )  # fmt: skip
        if dtype is not None:
            for bridge in models:
                bridge.to(dtype=dtype)
        return {
            "models": models,
            "relations": relations,
            "label": f"toy world {Path(world['root']).name}",
            "dataset": world["dataset"],
            "data_seed": world["seed"],
            "seeds": {"world": world["seed"]},
            "world": world,
        }
    missing = [options[role] for role, value in donors.items() if value is None]
    if missing:
        raise GraftingLensError(
            f"With --model, the {experiment} experiment also needs {', '.join(missing)} "
            f"(roles: {', '.join(spec.roles)})."
        )
    checkpoints = [args.model, *(donors[role] for role in spec.roles[1:])]
    models, relations = checkpoint_setup(
        experiment, checkpoints, dataset=args.dataset, n_relations=args.n_relations, seed=args.seed,
        relations=args.relations, device=args.device, dtype=dtype,
    )  # fmt: skip
    return {
        "models": models,
        "relations": relations,
        "label": " <- ".join(Path(c).name if Path(c).is_dir() else c for c in checkpoints),
        "dataset": args.dataset,
        "data_seed": args.seed,
        "seeds": {},
        "world": None,
    }


def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def write_report(
    out: str | os.PathLike, results: pd.DataFrame, summary: pd.DataFrame, markdown: str
) -> list[Path]:
    """Write ``results.csv``, ``summary.csv`` and ``summary.md`` into ``out``, each atomically."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_table(results, out / "results.csv"), write_table(summary, out / "summary.csv")]
    path = out / "summary.md"
    atomic_write(path, markdown.encode())
    return [*written, path]


def run_options(args: Any) -> dict[str, Any]:
    """The :func:`run_experiment` options a script's arguments set."""
    return {
        "batch_size": args.batch_size,
        "progress": not args.no_progress,
        "include_unembed": args.include_unembed,
        "include_embeddings": not args.base_embeddings,
    }


def run_from_arguments(experiment: str, args: Any) -> tuple[dict[str, Any], pd.DataFrame, int, float]:
    """What every experiment script does first: set up, run (resuming), and time it.

    Results go to ``<args.out>/runs``, so a killed script picks up where it stopped.

    Returns:
        ``(setup, results, rows_computed, seconds)``: the :func:`setup_from_arguments`
        dict, the results table, how many rows this call computed (the others were
        read back) and how long the run took.

    Raises:
        GraftingLensError: Bad arguments or models, before any forward pass.
    """
    setup = setup_from_arguments(experiment, args)
    computed: list[int] = []
    started = time.perf_counter()
    results = run_named_experiment(
        experiment, setup["models"], setup["relations"], out=os.path.join(args.out, "runs"),
        quick=args.quick, n_examples=args.n_examples, dataset=setup["dataset"],
        seed=setup["data_seed"], seeds=setup["seeds"], on_chunk=lambda info: computed.append(info.rows),
        **run_options(args),
    )  # fmt: skip
    return setup, results, sum(computed), time.perf_counter() - started
