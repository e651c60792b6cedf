"""Architecture-neutral names for the weights a graft can swap, and where each one lives.

A component (``q``, ``mlp_out``, ``experts``...) names places (*slots*) in the bridge's tree,
per layer as ``(component, layer)``, global ones as ``(component, None)``;
:func:`component_layout` finds them in a loaded model. See docs/developing/adding-a-component.md.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from transformer_lens.model_bridge.generalized_components import (
    JointGateUpMLPBridge,
    JointQKVAttentionBridge,
    MoEBridge,
    MoERouterBridge,
)
from transformer_lens.model_bridge.generalized_components.base import GeneralizedComponent

from grafting_lens.core.errors import ArgumentTypeError, ComponentError

_ATTENTION = ("q", "k", "v", "q_norm", "k_norm", "attn_gate")
_FEED_FORWARD = (
    "mlp_gate",
    "mlp_in",
    "mlp_out",
    "router",
    "experts",
    "shared_expert",
    "shared_expert_gate",
)

LAYER_COMPONENTS: tuple[str, ...] = (
    "ln1",
    *_ATTENTION,
    "o",
    "ln1_post",
    "ln2",
    *_FEED_FORWARD,
    "ln2_post",
)
"""Components that exist once per layer, addressed as ``(component, layer)``."""

GLOBAL_COMPONENTS: tuple[str, ...] = ("embed", "pos_embed", "embed_ln", "ln_final", "unembed")
"""Components that exist once per model, addressed as ``(component, None)``."""

COMPONENTS: tuple[str, ...] = (
    "embed",
    "pos_embed",
    "embed_ln",
    *LAYER_COMPONENTS,
    "ln_final",
    "unembed",
)
"""Every component, in the order the residual stream meets them."""

COMPONENT_GROUPS: dict[str, tuple[str, ...]] = {
    "attn": _ATTENTION,
    "ffn": _FEED_FORWARD,
    "block": LAYER_COMPONENTS,
    "all": COMPONENTS,
}
"""Named sets of components; each expands to the members an architecture has."""

COMPONENT_LABELS: dict[str, tuple[str, ...]] = {
    "ffn_up": ("mlp_gate", "mlp_in"),
    "ffn_down": ("mlp_out",),
    "ffn_gate": ("mlp_gate",),
}
"""The paper's labels for parts of the feed-forward block (``FFN-up``: the up projection and,
gated, its gate), in any case, with ``-`` or ``_``; like a group, a label takes the members an
architecture has. The paper's ``ATTN``, ``O`` and ``FFN`` are ``attn``, ``o`` and ``ffn``."""

_LABEL_SPELLINGS = {"ffn_up": "FFN-up", "ffn_down": "FFN-down", "ffn_gate": "FFN-gate"}


def canonical_component_name(name: str) -> str:
    """A component, group or label as this module spells it (``"FFN-up"`` -> ``"ffn_up"``).

    Raises:
        TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"A component name is a string, got {type(name).__name__}: {name!r}."
        )
    return name.strip().lower().replace("-", "_")


# Where each component sits in TransformerLens 4.x's bridge tree, by the bridge's own
# keys: inside a block (``blocks.{layer}.<key>``), or at the top of the tree. A slot
# whose path starts with one of these keys (``mlp.shared_expert.in``) belongs to it.
_BLOCK_KEYS: dict[str, str] = {
    "ln1": "ln1",
    "ln1_post": "ln1_post",
    "ln2": "ln2",
    "ln2_post": "ln2_post",
    "attn.q": "q",
    "attn.k": "k",
    "attn.v": "v",
    "attn.o": "o",
    "attn.q_norm": "q_norm",
    "attn.k_norm": "k_norm",
    "attn.gate": "attn_gate",
    "mlp.gate": "mlp_gate",
    "mlp.in": "mlp_in",
    "mlp.out": "mlp_out",
    # The dense layers of a stack that interleaves dense and mixture-of-experts blocks.
    "mlp.dense_gate": "mlp_gate",
    "mlp.dense_in": "mlp_in",
    "mlp.dense_out": "mlp_out",
    "mlp.experts": "experts",
    "mlp.shared_expert": "shared_expert",
    "mlp.shared_experts": "shared_expert",
    "mlp.shared_mlp": "shared_expert",
    "mlp.shared_expert_gate": "shared_expert_gate",
}
_GLOBAL_KEYS: dict[str, str] = {name: name for name in GLOBAL_COMPONENTS}

_ARCHITECTURE_PATHS: dict[str, dict[str, tuple[str, ...]]] = {}


def register_component_paths(architecture: str, paths: Mapping[str, str | Sequence[str]]) -> None:
    """Name the bridge paths of components for an architecture whose tree differs.

    They take precedence over TransformerLens's keys in model sets loaded afterwards; a
    second call for the same architecture replaces the first.

    Args:
        architecture: The architecture as ``bridge.cfg.architecture`` names it.
        paths: Component to bridge path (or paths) of a bridge component or a plain module
            inside one, and everything under it; ``{layer}`` in per-layer ones.

    Raises:
        ComponentError: A key is not a component, or a per-layer path lacks ``{layer}``.

    Examples:
        >>> register_component_paths("MyModelForCausalLM", {"q": "blocks.{layer}.attn.q"})
    """
    checked: dict[str, tuple[str, ...]] = {}
    for component, given in paths.items():
        _check_name(component)
        checked[component] = (given,) if isinstance(given, str) else tuple(given)
        per_layer = component in LAYER_COMPONENTS
        if (not per_layer and component not in GLOBAL_COMPONENTS) or any(
            per_layer and "{layer}" not in path for path in checked[component]
        ):
            raise ComponentError(
                f"Cannot register {component!r} at {given!r}: register the members of a group, "
                "with '{layer}' in the path of a per-layer component ('blocks.{layer}.attn.q')."
            )
    _ARCHITECTURE_PATHS[architecture] = checked


@dataclass(frozen=True)
class Slot:
    """One place in the bridge tree a graft swaps: a bridge component, or a plain module in one.

    Attributes:
        path: The dotted path shown to users (``"blocks.0.attn.q"``).
        owner: Path of the bridge component that holds the slot.
        attribute: ``None`` for the bridge component itself, else the dotted attribute of a
            plain module in its wrapped module (a mixture-of-experts block's ``experts``).
    """

    path: str
    owner: str
    attribute: str | None = None

    def holder(self, bridge: nn.Module) -> GeneralizedComponent:
        """The bridge component that holds this slot in ``bridge``."""
        holder = bridge.get_submodule(self.owner)
        assert isinstance(holder, GeneralizedComponent)
        return holder

    def module(self, bridge: nn.Module) -> nn.Module:
        """The module that computes this slot in ``bridge`` now."""
        wrapped = self.holder(bridge).original_component
        assert wrapped is not None, f"{self.owner} wraps no module"
        return wrapped.get_submodule(self.attribute or "")

    def replace(self, bridge: nn.Module, module: nn.Module) -> None:
        """Put ``module`` in this slot of ``bridge`` (TransformerLens's public API for bridges)."""
        holder = self.holder(bridge)
        if self.attribute is None:
            holder.set_original_component(module)
            return
        parent_path, _, name = self.attribute.rpartition(".")
        parent = holder.original_component
        assert parent is not None, f"{self.owner} wraps no module"
        setattr(parent.get_submodule(parent_path), name, module)


@dataclass(frozen=True)
class ParameterRecord:
    """Where one checkpoint parameter lives and which components graft it (several for a
    shared weight: tied embeddings, a fused QKV matrix; none when uncovered)."""

    name: str
    shape: tuple[int, ...]
    components: tuple[str, ...]
    layer: int | None
    path: str | None

    @property
    def covered(self) -> bool:
        """Whether some component grafts this parameter."""
        return bool(self.components)

    @property
    def region(self) -> str:
        """The group whose graft this parameter belongs to: attn, ffn, block or all."""
        if self.layer is None or self.path is None:
            return "all"
        within = self.path.split(".", 2)[2] if self.path.count(".") >= 2 else ""
        if within.startswith("attn"):
            return "attn"
        if within.startswith("mlp"):
            return "ffn"
        return "block"


Key = tuple[str, "int | None"]


@dataclass(frozen=True)
class ComponentLayout:
    """Every component of a loaded architecture, its slots, and where each parameter went.

    Attributes:
        slots: ``(component, layer)`` to the slots it swaps, for every pair the architecture
            has (interleaved layers: ``mlp_in`` at some, ``experts`` at others).
        parameters: One record per checkpoint parameter.
    """

    slots: Mapping[Key, tuple[Slot, ...]]
    parameters: tuple[ParameterRecord, ...]

    @property
    def components(self) -> tuple[str, ...]:
        """The components present at some layer, in :data:`COMPONENTS` order."""
        present = {component for component, _ in self.slots}
        return tuple(c for c in COMPONENTS if c in present)

    @property
    def uncovered(self) -> tuple[ParameterRecord, ...]:
        """The parameters no component grafts."""
        return tuple(record for record in self.parameters if not record.covered)

    def shares_parameter(self, *components: str) -> bool:
        """Whether one checkpoint parameter is held by every one of ``components`` (tied
        embeddings, a fused QKV matrix): a graft keeps them apart, a copy by value does not."""
        return any(set(components) <= set(record.components) for record in self.parameters)


def component_layout(bridge: nn.Module) -> ComponentLayout:
    """Walk ``bridge``'s tree: the slots of every component, and which parameters they hold.

    A bridge component without bridge components inside is one slot; one with some gives each
    plain module it wraps that holds parameters (a block's ``experts``) a slot of its own.
    Parameters it holds itself stay uncovered, as does a slot no key names.
    """
    registered = _ARCHITECTURE_PATHS.get(str(getattr(bridge.cfg, "architecture", "")), {})
    slots: dict[Key, list[Slot]] = {}
    owners: dict[int, tuple[tuple[str, ...], int | None, str | None]] = {}

    def claim(
        parameters: Iterable[nn.Parameter], names: tuple[str, ...], layer: int | None, path: str
    ) -> None:
        for parameter in parameters:
            if id(parameter) in owners:
                # The same tensor in two slots: tied weights (GPT-2's wte and lm_head).
                earlier, first_layer, first_path = owners[id(parameter)]
                joined = tuple(c for c in COMPONENTS if c in {*earlier, *names})
                owners[id(parameter)] = (joined, first_layer, first_path)
            else:
                owners[id(parameter)] = (names, layer, path)

    nodes = list(_bridge_nodes(bridge))
    # Modules a bridge component wraps belong to that component, wherever else they
    # hang in the HF tree (GPT-2's c_proj is the attention's child and the bridge's o).
    bridged = {id(node.original_component) for _, node, _ in nodes}
    for path, node, parent in nodes:
        wrapped = node.original_component
        if wrapped is None:
            continue  # a placeholder for a part this model does not have
        layer, _ = _split_layer(path)
        # A place is (path, attribute, parameters, module, its holder, its key under it).
        places: list[tuple[str, str | None, list, nn.Module | None, nn.Module | None, str]]
        if any(True for _ in _bridge_children(node)):
            split = _split_projection(node, path, registered)
            places = [
                (f"{path}.{attribute}", attribute, parameters, child, node, attribute)
                for attribute, parameters, child in _plain_children(wrapped, bridged)
            ]
        else:
            parent_path, _, key = path.rpartition(".")
            split = None if parent is None else _split_projection(parent, parent_path, registered)
            places = [(path, None, list(wrapped.parameters()), node, parent, key)]
        for place, attribute, parameters, module, holder, key in places:
            if module is None:
                # Held by the wrapper itself: not swappable without its bridge children.
                claim(parameters, (), layer, path)
            elif split is not None and key == split[0]:
                claim(parameters, split[1], layer, place)
            else:
                name = _name_slot(place, (module, holder), registered)
                if name is not None:
                    slots.setdefault((name, layer), []).append(Slot(place, path, attribute))
                claim(parameters, (name,) if name else (), layer, place)

    original = bridge.original_model
    assert isinstance(original, nn.Module)
    records = tuple(
        ParameterRecord(name, tuple(p.shape), *owners.get(id(p), ((), None, None)))
        for name, p in checkpoint_parameters(original)
    )
    ordered = {
        key: tuple(slots[key])
        for key in sorted(
            slots, key=lambda k: (COMPONENTS.index(k[0]), -1 if k[1] is None else k[1])
        )
    }
    return ComponentLayout(ordered, records)


def leftover_parameters(layout: ComponentLayout, grafted: Iterable[Key]) -> list[ParameterRecord]:
    """Uncovered parameters that a graft of every component around them would leave behind:
    every member of ``attn`` or ``ffn`` (or every component) at their layer, or every pair of
    the model for weights outside the blocks; ``grafted`` are the pairs a mask grafts."""
    uncovered = layout.uncovered
    if not uncovered:
        return []
    grafted = set(grafted)
    present: dict[int | None, set[str]] = {}
    for component, layer in layout.slots:
        present.setdefault(layer, set()).add(component)

    def whole(layer: int | None, members: Iterable[str]) -> bool:
        wanted = present.get(layer, set()) & set(members)
        return bool(wanted) and all((component, layer) in grafted for component in wanted)

    everything = set(layout.slots) <= grafted
    return [
        record
        for record in uncovered
        if everything
        or (record.region != "all" and whole(record.layer, LAYER_COMPONENTS))
        or (
            record.region in ("attn", "ffn")
            and whole(record.layer, COMPONENT_GROUPS[record.region])
        )
    ]


def _bridge_children(node: nn.Module) -> Iterator[tuple[str, GeneralizedComponent]]:
    """The bridge components directly below ``node`` in the bridge tree, with their keys."""
    for key, child in node._modules.items():
        if key == "_original_component":
            continue
        if isinstance(child, GeneralizedComponent):
            yield key, child
        elif isinstance(child, nn.ModuleList):
            for index, item in enumerate(child):
                if isinstance(item, GeneralizedComponent):
                    yield f"{key}.{index}", item


def _bridge_nodes(
    root: nn.Module, prefix: str = "", parent: nn.Module | None = None
) -> Iterator[tuple[str, GeneralizedComponent, nn.Module | None]]:
    """Every bridge component below ``root``, depth first, with its path and parent."""
    for key, child in _bridge_children(root):
        path = f"{prefix}.{key}" if prefix else key
        yield path, child, parent
        yield from _bridge_nodes(child, path, child)


def _split_projection(
    node: nn.Module, path: str, registered: Mapping[str, tuple[str, ...]]
) -> tuple[str, tuple[str, ...]] | None:
    """The fused module's key under ``node`` and the components of the children the bridge
    splits it into (GPT-2's ``c_attn`` into ``q``, ``k``, ``v``), or None."""
    keys: tuple[str, ...]
    if isinstance(node, JointQKVAttentionBridge):
        fused, keys = "qkv", ("q", "k", "v")
    elif isinstance(node, JointGateUpMLPBridge):
        fused, keys = str(node.fused_attr), ("gate", "in")
    else:
        return None
    names = {
        _name_slot(f"{path}.{key}", (child, node), registered)
        for key in keys
        if (child := node._modules.get(key)) is not None
    }
    return fused, tuple(c for c in COMPONENTS if c in names)


def _plain_children(
    wrapped: nn.Module, bridged: set[int], prefix: str = ""
) -> Iterator[tuple[str, list[nn.Parameter], nn.Module | None]]:
    """``(attribute, parameters, module)`` for each plain module holding parameters in a bridge
    component's wrapped module (``module=None``: parameters beside bridge children)."""
    direct = [p for p in wrapped._parameters.values() if p is not None]
    if direct:
        yield prefix.rstrip("."), direct, None
    for name, child in wrapped._modules.items():
        if child is None or isinstance(child, GeneralizedComponent) or id(child) in bridged:
            continue
        if any(isinstance(m, GeneralizedComponent) or id(m) in bridged for m in child.modules()):
            yield from _plain_children(child, bridged, f"{prefix}{name}.")
        elif any(True for _ in child.parameters()):
            yield f"{prefix}{name}", list(child.parameters()), child


def _split_layer(path: str) -> tuple[int | None, str]:
    match = re.match(r"^blocks\.(\d+)\.(.+)$", path)
    return (None, path) if match is None else (int(match[1]), match[2])


def _name_slot(
    path: str,
    node_and_parent: tuple[nn.Module, nn.Module | None] | None,
    registered: Mapping[str, tuple[str, ...]],
) -> str | None:
    """The component a slot at ``path`` belongs to, or None."""
    layer, relative = _split_layer(path)
    for component, templates in registered.items():
        for template in templates:
            target = template.format(layer=layer)
            if path == target or path.startswith(target + "."):
                return component
    if layer is None:
        return _longest_prefix(relative, _GLOBAL_KEYS)
    if node_and_parent is not None:
        node, parent = node_and_parent
        # The bridge reuses the key "gate" for a mixture-of-experts block's router.
        if isinstance(node, MoERouterBridge) or (
            isinstance(parent, MoEBridge) and relative.rsplit(".", 1)[-1] in ("gate", "router")
        ):
            return "router"
    return _longest_prefix(relative, _BLOCK_KEYS)


def _longest_prefix(relative: str, table: Mapping[str, str]) -> str | None:
    keys = [key for key in table if relative == key or relative.startswith(key + ".")]
    return table[max(keys, key=len)] if keys else None


def checkpoint_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The HF model's own ``(name, parameter)``, named as in its checkpoint, tied ones once;
    through a bridge's wrappers (``bridge.original_model``) to the modules they wrap."""
    seen: set[int] = set()
    for prefix, module in checkpoint_modules(model):
        for name, parameter in module._parameters.items():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                yield prefix + name, parameter


def checkpoint_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The HF model's own ``(prefix, module)``, depth first, as :func:`checkpoint_parameters`
    walks: the prefix is the module's name and a dot (``""`` for the model itself)."""

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        if isinstance(module, GeneralizedComponent):
            wrapped = module.original_component
            if wrapped is not None:
                yield from walk(wrapped, prefix)
            return
        yield prefix, module
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{prefix}{name}.")

    yield from walk(model, "")


@dataclass(frozen=True)
class FusedProjection:
    """A fused projection the bridge splits into per-component modules when a model loads.

    GPT-2's ``c_attn``, NeoX's ``query_key_value``: a donor's own fused matrix must be cut as
    the base's was, by the bridge's own split function (:meth:`split`).

    Attributes:
        node: Bridge path of the splitting component (``"blocks.0.attn"``).
        attribute: The fused module's name in the module that component wraps.
        children: Bridge keys of the split modules, in the split's order.
    """

    node: str
    attribute: str
    children: tuple[str, ...]

    def fused(self, bridge: nn.Module) -> nn.Module:
        """The fused module itself (unwrapped) in ``bridge``'s tree."""
        wrapped = bridge.get_submodule(self.node).original_component
        assert wrapped is not None, f"{self.node} wraps no module"
        module = getattr(wrapped, self.attribute)
        if isinstance(module, GeneralizedComponent):
            module = module.original_component
        assert isinstance(module, nn.Module)
        return module

    def split(self, bridge: nn.Module, fused: nn.Module) -> dict[str, nn.Module]:
        """The modules ``bridge``'s split function cuts out of ``fused`` (a module like
        :meth:`fused` holding other values), by child key; ``bridge`` is not changed."""
        node = bridge.get_submodule(self.node)
        wrapped = node.original_component
        assert isinstance(wrapped, nn.Module), f"{self.node} wraps no module"
        # A stand-in for the wrapped module that differs only in the fused module: a
        # split function may read anything else of it (head counts, settings).
        stand_in = copy.copy(wrapped)
        stand_in._modules = dict(wrapped._modules)
        stand_in._modules[self.attribute] = fused
        if isinstance(node, JointQKVAttentionBridge):
            parts = node.split_qkv_matrix(stand_in)
        else:
            assert isinstance(node, JointGateUpMLPBridge)
            parts = node.split_gate_up_matrix(stand_in)
        return dict(zip(self.children, parts))


def fused_projections(bridge: nn.Module) -> tuple[FusedProjection, ...]:
    """Every fused projection the bridge split when ``bridge`` loaded (see :class:`FusedProjection`)."""
    found = []
    for path, node, _ in _bridge_nodes(bridge):
        attribute, keys = None, ("gate", "in")  # type: tuple[str | None, tuple[str, ...]]
        if isinstance(node, JointQKVAttentionBridge):
            qkv = node.submodules.get("qkv")
            attribute, keys = (None if qkv is None else qkv.name), ("q", "k", "v")
        elif isinstance(node, JointGateUpMLPBridge):
            attribute = str(node.fused_attr)
        if attribute is not None and hasattr(node.original_component, attribute):
            found.append(FusedProjection(path, attribute, keys))
    return tuple(found)


def expand_components(
    names: str | Iterable[str], available: Iterable[str], architecture: str = "this model"
) -> tuple[str, ...]:
    """Expand component names, groups and labels into the components an architecture has.

    Args:
        names: A name, group (``"attn"``) or label (``"FFN-up"``), a ``+``-joined string
            (``"O+FFN-down"``), or an iterable of them, in any case.
        available: The components the architecture has.
        architecture: Used in error messages.

    Returns:
        The distinct components, in :data:`COMPONENTS` order.

    Raises:
        ComponentError: An unknown name, a component the architecture lacks, or a label
            none of whose members it has.
        TypeError: ``names`` is not a string or an iterable of strings.
    """
    if isinstance(names, str):
        names = [part.strip() for part in names.split("+")]
    # A 0-d tensor is Iterable to Python but has no items.
    if isinstance(names, Iterable) and not isinstance(names, (bytes, Mapping)):
        names = list(names) if getattr(names, "ndim", 1) != 0 else names
    if not isinstance(names, list) or not all(isinstance(given, str) for given in names):
        raise ArgumentTypeError(
            "components must be a component name, a '+'-joined string such as 'o+ffn' or a "
            f"list of names, got {names!r:.80}."
        )
    available = set(available)
    chosen: set[str] = set()
    missing = None
    for given in names:
        name = canonical_component_name(given)
        _check_name(name, given)
        members = COMPONENT_GROUPS.get(name) or COMPONENT_LABELS.get(name) or (name,)
        found = [member for member in members if member in available]
        if not found and name in COMPONENT_LABELS:
            missing = f"none of {_LABEL_SPELLINGS[name]}'s components ({', '.join(members)})"
        elif not found and name not in COMPONENT_GROUPS:
            missing = f"no {name!r} component"
        chosen.update(found)
    if missing is not None or not chosen:
        what = (
            f"{architecture} has {missing}" if missing else f"No component selected from {names!r}"
        )
        raise ComponentError(
            f"{what}. Its components are: {', '.join(c for c in COMPONENTS if c in available)}."
        )
    return tuple(c for c in COMPONENTS if c in chosen)


def _check_name(name: str, given: str | None = None) -> None:
    """Refuse an unknown name; the suggestion is compared and spelled as the caller wrote it."""
    spelled = {**{known: known for known in (*COMPONENTS, *COMPONENT_GROUPS)}, **_LABEL_SPELLINGS}
    if name not in spelled:
        close = difflib.get_close_matches(name, list(spelled), n=1, cutoff=0.5)
        hint = f" Did you mean {spelled[close[0]]!r}?" if close else ""  # as it is spelled
        raise ComponentError(
            f"Unknown component {given if given is not None else name!r}.{hint} Known "
            f"components: {', '.join(COMPONENTS)}; groups: {', '.join(COMPONENT_GROUPS)}; the "
            f"paper's labels: ATTN, O, FFN, {', '.join(_LABEL_SPELLINGS.values())}."
        )
