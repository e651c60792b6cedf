"""Architecture-neutral names for the weights a graft can swap.

A graft names *components* (``q``, ``mlp_out``, ``ln_final``...), not the
parameter names of one model family: GPT-2 fuses Q, K and V into ``c_attn``,
NeoX interleaves them per head in ``query_key_value``, Llama keeps ``q_proj``,
``k_proj`` and ``v_proj`` apart. TransformerLens's ``TransformerBridge`` already
maps every supported family onto one tree of bridge components (``blocks.3.attn.q``,
``blocks.3.mlp.out``...), and splits fused projections into separate Q, K and V
modules, so a component here is simply a path in that tree.

Components come in two kinds:

* per-layer components (``ln1``, ``q``, ``k``, ``v``, ``o``, ``ln2``, ``mlp_in``,
  ``mlp_gate``, ``mlp_out``), addressed as ``(component, layer)``;
* global components (``embed``, ``pos_embed``, ``ln_final``, ``unembed``), addressed
  as ``(component, None)``.

Groups name the sets the paper talks about: ``attn`` (Q, K, V), ``ffn`` (every MLP
matrix, the gate included where there is one), ``block`` (every per-layer
component) and ``all``. A group expands to the members the architecture has;
naming a single component the architecture lacks (``mlp_gate`` on GPT-2,
``pos_embed`` on a rotary model) is an error.

The map from component to bridge path is a small registry, like SAELens's
``register_sae_class``: an architecture whose bridge tree differs registers its own
paths with :func:`register_component_paths`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

from grafting_lens.errors import ComponentError, did_you_mean

LAYER_COMPONENTS: tuple[str, ...] = (
    "ln1",
    "q",
    "k",
    "v",
    "o",
    "ln2",
    "mlp_in",
    "mlp_gate",
    "mlp_out",
)
"""Components that exist once per layer, addressed as ``(component, layer)``."""

GLOBAL_COMPONENTS: tuple[str, ...] = ("embed", "pos_embed", "ln_final", "unembed")
"""Components that exist once per model, addressed as ``(component, None)``."""

COMPONENTS: tuple[str, ...] = (
    "embed",
    "pos_embed",
    *LAYER_COMPONENTS,
    "ln_final",
    "unembed",
)
"""Every component, in the order the residual stream meets them."""

COMPONENT_GROUPS: dict[str, tuple[str, ...]] = {
    "attn": ("q", "k", "v"),
    "ffn": ("mlp_gate", "mlp_in", "mlp_out"),
    "block": LAYER_COMPONENTS,
    "all": COMPONENTS,
}
"""Named sets of components; each expands to the members an architecture has."""

DEFAULT_COMPONENT_PATHS: dict[str, str] = {
    "embed": "embed",
    "pos_embed": "pos_embed",
    "ln1": "blocks.{layer}.ln1",
    "q": "blocks.{layer}.attn.q",
    "k": "blocks.{layer}.attn.k",
    "v": "blocks.{layer}.attn.v",
    "o": "blocks.{layer}.attn.o",
    "ln2": "blocks.{layer}.ln2",
    "mlp_in": "blocks.{layer}.mlp.in",
    "mlp_gate": "blocks.{layer}.mlp.gate",
    "mlp_out": "blocks.{layer}.mlp.out",
    "ln_final": "ln_final",
    "unembed": "unembed",
}
"""Bridge paths of each component in TransformerLens 4.x's shared component tree."""

_ARCHITECTURE_PATHS: dict[str, dict[str, str]] = {}


def register_component_paths(architecture: str, paths: Mapping[str, str]) -> None:
    """Register bridge paths for an architecture whose tree differs from the default.

    Args:
        architecture: The HF architecture name as the bridge reports it in
            ``bridge.cfg.architecture`` (e.g. ``"GPT2LMHeadModel"``).
        paths: Component name to bridge path; per-layer paths contain ``{layer}``.
            Components not given keep their default path.

    Raises:
        ComponentError: A key is not a component name, or a per-layer path lacks
            ``{layer}``.
    """
    for component, path in paths.items():
        _check_name(component)
        if component in LAYER_COMPONENTS and "{layer}" not in path:
            raise ComponentError(
                f"The path for per-layer component {component!r} must contain '{{layer}}', "
                f"got {path!r}."
            )
    _ARCHITECTURE_PATHS[architecture] = {**DEFAULT_COMPONENT_PATHS, **paths}


def component_path(architecture: str, component: str, layer: int | None) -> str:
    """The bridge path of ``component`` (at ``layer``) for ``architecture``."""
    path = _ARCHITECTURE_PATHS.get(architecture, DEFAULT_COMPONENT_PATHS)[component]
    return path.format(layer=layer)


def bridge_component(bridge: nn.Module, component: str, layer: int | None) -> nn.Module | None:
    """The bridge module computing ``component`` at ``layer``, or None if it has none.

    A component exists when its bridge module exists and wraps a real module (the
    bridge keeps placeholders for optional parts).
    """
    architecture = getattr(bridge.cfg, "architecture", "")
    try:
        module = bridge.get_submodule(component_path(architecture, component, layer))
    except AttributeError:
        return None
    if module._modules.get("_original_component") is None:
        return None
    return module


def available_components(bridge: nn.Module) -> tuple[str, ...]:
    """The components ``bridge``'s architecture has, in :data:`COMPONENTS` order."""
    return tuple(
        name
        for name in COMPONENTS
        if bridge_component(bridge, name, 0 if name in LAYER_COMPONENTS else None) is not None
    )


def expand_components(
    names: str | Iterable[str], available: Iterable[str], architecture: str = "this model"
) -> tuple[str, ...]:
    """Expand component names and groups into the components an architecture has.

    Args:
        names: One name or group (``"attn"``), a ``+``-joined string
            (``"o+ffn"``), or an iterable of names and groups.
        available: The components the architecture has.
        architecture: Used in error messages.

    Returns:
        The distinct components, in :data:`COMPONENTS` order. A group contributes
        the members the architecture has; a single component it lacks is an error.

    Raises:
        ComponentError: An unknown name (with the nearest known one), or a
            component the architecture lacks.
    """
    if isinstance(names, str):
        names = [part.strip() for part in names.split("+")]
    available = set(available)
    chosen: set[str] = set()
    for name in names:
        name = name.lower()
        _check_name(name)
        if name in COMPONENT_GROUPS:
            chosen.update(member for member in COMPONENT_GROUPS[name] if member in available)
        elif name not in available:
            raise ComponentError(
                f"{architecture} has no {name!r} component. Its components are: "
                f"{', '.join(c for c in COMPONENTS if c in available)}."
            )
        else:
            chosen.add(name)
    if not chosen:
        raise ComponentError(f"No component selected from {list(names)!r}.")
    return tuple(c for c in COMPONENTS if c in chosen)


def _check_name(name: str) -> None:
    known = (*COMPONENTS, *COMPONENT_GROUPS)
    if name not in known:
        raise ComponentError(
            f"Unknown component {name!r}.{did_you_mean(name, known)} Known components: "
            f"{', '.join(COMPONENTS)}; groups: {', '.join(COMPONENT_GROUPS)}."
        )
