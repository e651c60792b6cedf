"""Dynamic weight grafting: run the base model with other checkpoints' weights per position.

What a graft computes
---------------------
A :class:`~grafting_lens.GraftMask` says, for every component, layer and token
position, which checkpoint's weights compute that position. The paper runs this
literally: one forward pass per token, the weights of every component swapped to
the ones the mask names for that token, and a KV cache so later tokens attend over
keys and values each earlier token computed under *its own* weights (a
mixed-origin cache). :func:`graft_forward_reference` does exactly that. It is slow
and obviously correct, and it is the oracle the fast path is tested against.

Why one pass gives the same logits
----------------------------------
In a decoder-only transformer only attention mixes positions, and it does so
without weights: ``softmax(q k^T) v`` over the queries, keys and values the
projections produced. Everything with weights (embeddings, norms, the Q/K/V/O
projections, the MLP matrices, the unembedding) acts on each position alone. So
computing, in one ordinary causal forward pass, every weighted component's output
at position ``t`` with the weights the mask names for ``t`` yields the same keys
and values at every position as the token-by-token run, hence the same attention,
hence the same logits. :func:`graft_forward` does this, batched over examples and
configurations (one mask row each).

How it is done
--------------
TransformerLens's ``TransformerBridge`` wraps each component in a bridge module
whose ``original_component`` does the arithmetic (the bridge splits fused QKV
projections into separate Q, K and V modules). Inside :func:`grafting`, each slot
of each grafted component (see :mod:`grafting_lens.models.components`: a bridge
component, or a plain module inside one such as a mixture-of-experts block's
``experts``) is given a dispatcher through the bridge's public
``set_original_component``. The dispatcher finds the window's positions in what
it receives (``[batch, pos, ...]``, ``[batch, heads, pos, d_head]`` where the
bridge declares it, or flattened ``[batch * pos, ...]``), gathers the positions
assigned to each source from the input and every argument laid out the same way,
runs that source's module on them (linear layers through oneDNN on CPUs,
where it measured faster: see :mod:`grafting_lens.engine.kernels`), and scatters
the results back; anything it cannot route is refused with the module named. The
bridge's hooks fire as usual, so ``run_with_cache``, hooks and every
TransformerLens tool see the grafted run. On exit (also after an exception) the
base is restored.

Each source is asked for its module for a slot (:meth:`Source.module
<grafting_lens.models.sources.Source.module>`), and only where the mask uses that source:
a checkpoint in memory answers with the module in its own tree, a LoRA adapter
with the base's module plus its factors, a lazily loaded donor with a module it
reads from disk on that first request and keeps (see :mod:`grafting_lens.models.sources`).
A mask that takes a pair from a donor outside what :func:`~grafting_lens.load_models`
was told would be grafted (``components=`` / ``layers=``) is refused before
anything runs or loads.

The components' *modules* are swapped, not their parameter values, which is why
tied embeddings stay untied under a graft: grafting ``embed`` runs the donor's
embedding module at those positions and never touches the unembedding. (The
paper's released code copies parameter values instead, so on a tied model a
position whose embedding it grafts is also decoded by the donor's unembedding; a
mask says that by grafting ``unembed`` there too, which the experiments'
``REFERENCE`` semantics does: see :class:`grafting_lens.study.Semantics`.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import nn
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.model_bridge.generalized_components import NormalizationBridge
from transformers import DynamicCache

from grafting_lens.core.arguments import is_integer
from grafting_lens.core.compat import cache_visible, cached_forward_kwargs, check_cache_continuation
from grafting_lens.core.errors import ComponentError, GraftingError, GraftMaskError
from grafting_lens.engine.masks import GraftMask, Key, check_leftovers
from grafting_lens.engine.positions import check_padding, row_lengths
from grafting_lens.engine.routing import (
    PICKED,
    GraftState,
    Layout,
    Plan,
    call_module,
    declared_layout,
    input_shape,
    position_shape,
    take_rows,
)
from grafting_lens.models.components import COMPONENTS, Slot
from grafting_lens.models.model_set import ModelSet, token_ids

# Bridge options under which attention code reads projection weights directly,
# per head, instead of calling the projection module: a per-position dispatcher
# cannot serve those reads.
_UNSUPPORTED_BRIDGE_FLAGS = ("use_attn_result", "use_split_qkv_input", "use_attn_in")


class SourceDispatch(nn.Module):
    """Stands in for one slot of the base and routes each position to its source.

    The source modules are held in a plain list, not registered as submodules, so
    no donor parameter is adopted into the base's module tree. The price: while a
    graft is installed, ``models.base.parameters()`` lacks the grafted components'
    parameters (they are back on exit).

    A module's input may carry the window's positions on a grid (``[batch, pos,
    ...]``, or ``[batch, heads, pos, d_head]`` for a query/key norm that TransformerLens
    marks with ``pos_dim=2``) or flattened (``[batch * pos, ...]``). Every tensor
    argument laid out the same way is split with the input (a mixture-of-experts
    block's routing indices and weights); any other tensor argument, or an input
    without the window's positions, is refused with the module named, since no
    routing of it could be known to be right.
    """

    def __init__(
        self,
        key: Key,
        path: str,
        sources: list[nn.Module],
        state: GraftState,
        pos_dim: int | None = None,
        reads_any_tensor: bool = False,
    ) -> None:
        super().__init__()
        self._key = key
        self._path = path
        self._sources = sources
        self._state = state
        # None: nobody declared where positions are; dimension 1, with a check.
        self._pos_dim = pos_dim
        # A norm bridge computes with its module's scale and bias, whatever their rank
        # (Cohere's per-head norms hold [heads, d_head]); other bridges read vectors
        # such as a bias, and matrices only for their dtype and shape.
        self._reads_any_tensor = reads_any_tensor
        self._picked = key[0] in PICKED
        # The shape of the bridge's input in its current call: norm bridges read the
        # scale themselves, and the per-position scale must broadcast against it.
        self._reading: torch.Size | None = None
        # Per-position vectors, built once per window: norm bridges read them
        # several times per forward.
        self._vectors: dict[tuple, torch.Tensor] = {}

    def forward(self, *args, **kwargs):
        plan = self._state.plan(self._key)
        if plan.single is not None:
            return call_module(self._sources[plan.single], args, kwargs)
        if self._picked:
            return self._pick(plan, args, kwargs)
        batch, length = plan.window.shape
        primary = next(
            (x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.dim()), None
        )
        layout = None if primary is None else self._layout(primary.shape, batch, length)
        if layout is None:
            raise self._refusal(
                "an input of shape "
                + (str(list(primary.shape)) if primary is not None else "(no tensor)")
                + " that does not carry the window's positions"
            )
        for x in (*args, *kwargs.values()):
            if isinstance(x, torch.Tensor) and x.dim() and not layout.fits(x.shape):
                raise self._refusal(
                    f"an argument of shape {list(x.shape)} laid out unlike its input "
                    f"{list(primary.shape)}, so its rows cannot be routed with the input's"
                )
        pieces = []
        # Indices on the device of the activation they index: on a layer-split model
        # (accelerate's device_map) each layer's activations are on its own device.
        for source, index in plan.parts_on(primary.device):
            taken_args = tuple(take_rows(layout, x, index) for x in args)
            taken_kwargs = {name: take_rows(layout, x, index) for name, x in kwargs.items()}
            pieces.append((index, call_module(self._sources[source], taken_args, taken_kwargs)))
        return self._merge(layout, pieces)

    def _merge(self, layout: Layout, pieces: list[tuple[torch.Tensor, Any]]):
        """Scatter each source's outputs (a tensor, or a tuple of them) back into place."""
        first = pieces[0][1]
        single = not isinstance(first, tuple)
        parts: list[tuple[torch.Tensor, tuple[Any, ...]]] = [
            (index, (output,) if single else output) for index, output in pieces
        ]
        merged: list[Any] = []
        for position, value in enumerate(parts[0][1]):
            if value is None or not isinstance(value, torch.Tensor):
                if any(output[position] is not value for _, output in parts):
                    raise self._refusal(f"outputs whose element {position} is not a tensor")
                merged.append(value)
                continue
            rows: torch.Tensor | None = None
            grid = None
            for index, output in parts:
                found = layout.untake(output[position], len(index))
                if found is None or (grid is not None and found[1] != grid):
                    raise self._refusal(
                        f"an output of shape {list(output[position].shape)} without one row per "
                        "position it was given"
                    )
                piece, grid = found
                if rows is None:
                    rows = piece.new_empty((layout.batch * layout.length, *piece.shape[1:]))
                rows.index_copy_(0, index, piece)
            assert rows is not None  # parts is never empty
            merged.append(layout.restore(rows, bool(grid)))
        return merged[0] if single else tuple(merged)

    def _pick(self, plan: Plan, args: tuple, kwargs: dict) -> torch.Tensor:
        """Every used source computes every position; each position takes its source's row."""
        batch, length = plan.window.shape
        rows: torch.Tensor | None = None
        layout: Layout | None = None
        for source, _ in plan.parts:
            output = call_module(self._sources[source], args, kwargs)
            if not isinstance(output, torch.Tensor):
                raise self._refusal(f"a {type(output).__name__} output where a tensor was expected")
            index = dict(plan.parts_on(output.device))[source]
            layout = layout or Layout.of(output.shape, batch, length, 1)
            if layout is None or not layout.fits(output.shape):
                raise self._refusal(
                    f"an output of shape {list(output.shape)} without the window's positions"
                )
            every = layout.rows(output)
            if rows is None:
                rows = every.new_empty(every.shape)
            rows.index_copy_(0, index, every.index_select(0, index))
        assert rows is not None and layout is not None  # plan.parts is never empty
        return layout.restore(rows, grid=True)

    def _layout(self, shape: torch.Size, batch: int, length: int) -> Layout | None:
        """The layout of the module's input: positions where declared, else on dimension 1."""
        return declared_layout(shape, batch, length, self._pos_dim, self._refusal)

    def _refusal(self, cause: str) -> GraftingError:
        component, layer = self._key
        where = component if layer is None else f"{component} at layer {layer}"
        batch, length = self._state.shape[0], self._state.window[1]
        module = type(self._sources[0]).__name__
        return GraftingError(
            f"The graft of {where} cannot route positions through {self._path} ({module}): it "
            f"received {cause} (the window is [batch={batch}, pos={length}]). Grafting needs each "
            "position's rows; graft the components around this one instead, and if no hook of "
            "yours reshaped its input, please report the architecture."
        )

    def record_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook on the bridge: remember its input's shape for scale reads."""
        self._reading = input_shape(args, kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        sources = self.__dict__["_sources"]
        value = getattr(sources[0], name)
        if not isinstance(value, torch.Tensor):
            return value  # configuration (eps, in_features...), shared by aligned sources
        plan = self.__dict__["_state"].plan(self.__dict__["_key"])
        if plan.single is not None:
            return getattr(sources[plan.single], name)
        if value.dim() == 0 or (value.dim() > 1 and not self.__dict__["_reads_any_tensor"]):
            # A bridge other than a norm reads matrices (outside the options refused
            # in _check_mask) only for metadata (dtype, shape), which every aligned
            # source shares.
            return value
        # Norm bridges may apply scale and bias themselves (x * weight + bias): a
        # tensor holding each position's own copy, shaped to broadcast against the
        # bridge's input, does the same arithmetic per position.
        reading = self.__dict__["_reading"]
        vectors = self.__dict__["_vectors"]
        cache_key = (id(plan), name, reading)
        if cache_key in vectors:
            return vectors[cache_key]
        batch, length = plan.window.shape
        stacked = torch.stack([getattr(source, name) for source in sources])
        rows = stacked[plan.window_on(stacked.device).reshape(-1)]
        layout = None if reading is None else self._layout(reading, batch, length)
        per_position = rows.reshape(position_shape(layout, reading, value.shape, batch, length))
        if not torch.is_grad_enabled():
            # With autograd on, each forward needs its own graph, so nothing is kept.
            vectors[cache_key] = per_position
        return per_position


@contextmanager
def _installed(models: ModelSet, mask: GraftMask) -> Iterator[GraftState]:
    """Install dispatchers for every pair the mask grafts; restore the base on exit."""
    _check_mask(models, mask)
    _check_not_grafting(models)
    used = _used_sources(mask)
    state = GraftState(mask)
    swapped: list[tuple[Slot, nn.Module]] = []
    embed = models.slots("embed", None)[0].holder(models.base)
    handles = [embed.register_forward_pre_hook(lambda module, args: _check_window(state, args))]
    setattr(models.base, _ACTIVE, True)
    try:
        for key in mask.keys():
            for slot in models.slots(*key):
                original = slot.module(models.base)
                # A source the mask never uses here is never asked: a lazily loaded
                # donor reads nothing for it. Its place holds the base's module,
                # which no position routes to.
                sources = [original] + [
                    models.sources[index].module(slot) if index in used[key] else original
                    for index in range(1, len(models))
                ]
                for index in used[key] - {0}:
                    _check_placement(models, key, original, sources[index], index)
                holder = slot.holder(models.base)
                # TransformerLens marks the position axis of a norm applied to
                # [batch, heads, pos, d_head]; plain modules inside a block get rows.
                bridged = slot.attribute is None
                pos_dim = getattr(holder.hook_in, "pos_dim", None) if bridged else None
                norm = bridged and isinstance(holder, NormalizationBridge)
                dispatch = SourceDispatch(key, slot.path, sources, state, pos_dim, norm)
                slot.replace(models.base, dispatch)
                swapped.append((slot, original))
                if slot.attribute is None:
                    handles.append(
                        holder.register_forward_pre_hook(dispatch.record_input, with_kwargs=True)
                    )
        yield state
    finally:
        for slot, original in reversed(swapped):
            slot.replace(models.base, original)
        for handle in handles:
            handle.remove()
        setattr(models.base, _ACTIVE, False)


_ACTIVE = "_grafting_lens_grafting"  # set on the base bridge while a graft is installed


def _check_placement(
    models: ModelSet, key: Key, base: nn.Module, module: nn.Module, index: int
) -> None:
    """Refuse a source's module whose weights no longer share the base's dtype or device.

    :func:`~grafting_lens.load_models` checks every source on load; a model cast or moved
    afterwards (``models.base.half()``, ``models[1].to("cuda")``) would fail deep inside
    torch on the first grafted matrix product, naming neither. The base's parameters of
    the slot and the source's of the same name are compared; every tensor a source adds
    (a LoRA adapter's factors, which it casts itself) must be on the base's device.
    """
    mine = dict(_named_tensors(base))
    if not mine:
        return
    reference = next(iter(mine.values()))
    for name, tensor in _named_tensors(module):
        expected = mine.get(name, reference)
        same_dtype = name not in mine or tensor.dtype == expected.dtype
        if tensor.device == reference.device and same_dtype:
            continue
        component, layer = key
        where = component if layer is None else f"{component} at layer {layer}"
        raise GraftingError(
            f"Source {index} ({models.names[index]})'s {where} is {tensor.dtype} on "
            f"{tensor.device}, the base's is {expected.dtype} on {reference.device}: a graft "
            "runs every source's modules inside the base's forward pass, so they must share a "
            "dtype and a device. One model was cast or moved after load_models "
            "(models.base.half(), models[1].to('cuda')...). Load the model set with "
            "load_models(..., dtype=..., device=...) instead, which places every source alike, "
            "or cast and move every source the same way."
        )


def _check_sources_placed(models: ModelSet, mask: GraftMask) -> None:
    """:func:`_check_placement` for every module the mask takes from a donor."""
    for key, sources in _used_sources(mask).items():
        for slot in models.slots(*key):
            original = slot.module(models.base)
            for index in sources - {0}:
                _check_placement(models, key, original, models.sources[index].module(slot), index)


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's floating parameters and buffers, by name."""
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        if tensor.is_floating_point():
            yield name, tensor


def _used_sources(mask: GraftMask) -> dict[Key, frozenset[int]]:
    """The sources each pair of the mask uses at some position."""
    distinct: dict[int, frozenset[int]] = {}
    used = {}
    for key in mask.keys():
        values = mask[key]
        if id(values) not in distinct:
            distinct[id(values)] = frozenset(int(v) for v in torch.unique(values).tolist())
        used[key] = distinct[id(values)]
    return used


def _check_not_grafting(models: ModelSet) -> None:
    if getattr(models.base, _ACTIVE, False):
        raise GraftingError(
            "This model set is already inside a grafting(...) block; grafts do not nest. "
            "Combine the masks with GraftMask.union, or run this after the block."
        )


def _check_window(state: GraftState, args: tuple) -> None:
    """Refuse token ids whose shape is not the window the mask describes."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].is_floating_point():
        return
    batch, length = state.shape[0], state.window[1]
    if tuple(args[0].shape[:2]) != (batch, length):
        raise GraftingError(
            f"The grafted model was run on tokens of shape {list(args[0].shape)}, but the mask "
            f"is for [batch={batch}, pos={length}]. Run it on the tokens the mask was built "
            "for (same batch size and length), or build a mask for these tokens."
        )


@contextmanager
def grafting(models: ModelSet, mask: GraftMask) -> Iterator[TransformerBridge]:
    """Run the base model with the weights the mask names, for any TransformerLens tool.

    Inside the block, ``models.base`` (also what the block yields) computes every
    grafted component at every position with the weights of the source the mask
    names. Hooks, ``run_with_cache`` and ``run_with_hooks`` work as usual. The
    model must be run on tokens of the mask's shape ``[batch, pos]``, with the
    attention mask the mask was built for (none for unpadded tokens). The base is
    restored on exit, also when the body raises.

    Args:
        models: The aligned checkpoints.
        mask: Which source computes each component, layer and position.

    Raises:
        GraftMaskError: The mask was built for another number of sources; inside the
            block, a run on padded tokens without their attention mask, or with an
            attention mask the mask was not built for (see :meth:`GraftMask.check_rows`).
        GraftingError: The block is nested in another grafting block, the bridge has
            an option the single pass cannot serve, or the model is run on tokens of
            another shape.

    Examples:
        >>> with grafting(models, mask) as model:
        ...     logits, cache = model.run_with_cache(tokens)
    """
    with _installed(models, mask):
        # The user calls the model, so the attention mask is checked where every call
        # style (plain call, run_with_cache, run_with_hooks) passes it: the HF model.
        check_run = models.base.original_model.register_forward_pre_hook(
            lambda module, args, kwargs: _check_run(models, mask, args, kwargs), with_kwargs=True
        )
        try:
            yield models.base
        finally:
            check_run.remove()


def _check_run(models: ModelSet, mask: GraftMask, args: tuple, kwargs: dict) -> None:
    """Inside ``grafting``: the run's padding must be the one the mask was built for."""
    tokens = args[0] if args else kwargs.get("input_ids")
    attention_mask = kwargs.get("attention_mask")
    if isinstance(tokens, torch.Tensor) and tuple(tokens.shape[:2]) == mask.shape:
        check_padding(tokens, attention_mask, models.tokenizer)
        mask.check_rows(attention_mask)


def graft_forward(
    models: ModelSet,
    tokens: Int[torch.Tensor, "batch pos"],
    mask: GraftMask,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    *,
    last_only: bool = False,
    grad: bool = False,
) -> Float[torch.Tensor, "batch pos d_vocab"]:
    """Logits of the grafted model, in a single forward pass.

    Equal (to float rounding) to :func:`graft_forward_reference`, the paper's
    token-by-token procedure; see the module docstring for why.

    With ``last_only=True`` the unembedding runs only at each row's last real token
    (transformers' ``logits_to_keep``, given the distinct last positions) and the
    result is ``[batch, 1, d_vocab]``: with a 49k-token vocabulary the logits of every
    position are most of a scoring pass's memory and much of its time.

    No autograd graph is kept unless ``grad=True``: a graph holds every layer's
    activations until the logits are freed, which an evaluation never uses. For
    gradients through a grafted run pass ``grad=True``, or run the model inside
    :func:`grafting`.

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` token ids. Each row may be a different prompt or a
            different configuration of the same prompt.
        mask: Source indices of shape ``[batch, pos]`` per component and layer.
        attention_mask: ``[batch, pos]``, ones then zeros (right padding). Logits at
            padding positions are meaningless. Required when rows end in the pad
            token; it must be the one the mask was built with (see
            :meth:`GraftMask.check_rows`).
        last_only: Return only each row's last real token's logits.
        grad: Keep the autograd graph (with autograd enabled), so that the logits
            can be differentiated.

    Returns:
        Logits ``[batch, pos, d_vocab]`` (``[batch, 1, d_vocab]`` with ``last_only``).

    Raises:
        GraftMaskError: The mask does not fit the tokens, the model set or the
            attention mask; padded tokens without an attention mask; an attention
            mask holding values other than 0 and 1.
    """
    if not isinstance(grad, bool) or not isinstance(last_only, bool):
        raise GraftingError(
            f"last_only and grad must be True or False, got {last_only!r} and {grad!r}."
        )
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        return _graft_logits(models, tokens, mask, attention_mask, last_only)


def _graft_logits(
    models: ModelSet,
    tokens: torch.Tensor,
    mask: GraftMask,
    attention_mask: torch.Tensor | None,
    last_only: bool,
) -> torch.Tensor:
    """:func:`graft_forward`'s pass, under the autograd mode it set."""
    tokens, attention_mask = _check_tokens(models, tokens, mask, attention_mask)
    # A grafted unembedding routes every position of the window to its source, so it
    # needs every position's stream: then the full logits are computed and picked from.
    grafts_unembed = any(
        component == "unembed" and bool(mask[(component, layer)].any())
        for component, layer in mask.keys()
    )
    if not last_only or grafts_unembed:
        with _installed(models, mask):
            logits = models.base(tokens, attention_mask=attention_mask, return_type="logits")
        if not last_only:
            return logits
        rows = torch.arange(tokens.shape[0], device=logits.device)
        return logits[rows, _last_positions(tokens, attention_mask).to(logits.device)][:, None]
    last = _last_positions(tokens, attention_mask)
    kept, column = torch.unique(last, return_inverse=True)
    with _installed(models, mask):
        logits = models.base(
            tokens, attention_mask=attention_mask, return_type="logits", logits_to_keep=kept
        )
    return logits[torch.arange(len(last), device=logits.device), column.to(logits.device)][:, None]


def _last_positions(
    tokens: torch.Tensor, attention_mask: torch.Tensor | None
) -> Int[torch.Tensor, " batch"]:
    """Each row's last real token (right padding)."""
    if attention_mask is None:
        return torch.full((tokens.shape[0],), tokens.shape[1] - 1, device=tokens.device)
    return attention_mask.sum(dim=1) - 1


@torch.no_grad()
def graft_forward_reference(
    models: ModelSet,
    tokens: Int[torch.Tensor, "batch pos"],
    mask: GraftMask,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Float[torch.Tensor, "batch pos d_vocab"]:
    """The paper's procedure, literally: one token at a time, weights swapped per token.

    For every row and every position ``t``, every component of the base is set to
    the module of the source the mask names at ``t``; the single token ``t`` is run
    with a KV cache holding the keys and values earlier tokens computed under their
    own weights. Slow (one forward per token, per row) and kept as the oracle.

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` token ids.
        mask: Source indices per component, layer and position.
        attention_mask: ``[batch, pos]`` right padding.

    Returns:
        Logits ``[batch, pos, d_vocab]``; padding positions are NaN.
    """
    tokens, attention_mask = _check_tokens(models, tokens, mask, attention_mask)
    _check_mask(models, mask)
    _check_not_grafting(models)
    lengths = row_lengths(mask.shape, None if attention_mask is None else attention_mask.cpu())
    # Every slot of every pair, with the module of each source the mask uses there.
    slots = [(pair, slot) for pair in models.pairs for slot in models.slots(*pair)]
    used = _used_sources(mask)
    modules = [
        {index: models.sources[index].module(slot) for index in {0} | used.get(pair, frozenset())}
        for pair, slot in slots
    ]
    for (pair, _), choices in zip(slots, modules):
        for index, module in choices.items():
            if index:
                _check_placement(models, pair, choices[0], module, index)
    check_cache_continuation(models.base, "the token-by-token reference", GraftingError)
    logits = None
    try:
        for row in range(mask.shape[0]):
            cache = DynamicCache()
            for position in range(int(lengths[row])):
                for (pair, slot), choices in zip(slots, modules):
                    slot.replace(models.base, choices[int(mask[pair][row, position])])
                with cache_visible(models.base):
                    step = models.base(
                        tokens[row : row + 1, position : position + 1],
                        return_type="logits",
                        **cached_forward_kwargs(models.base, cache),
                    )
                if logits is None:
                    logits = torch.full(
                        (*mask.shape, step.shape[-1]), float("nan"), dtype=step.dtype
                    )
                logits[row, position] = step[0, -1].cpu()
    finally:
        for (_, slot), choices in zip(slots, modules):
            slot.replace(models.base, choices[0])
    assert logits is not None  # every row has at least one real token
    return logits.to(tokens.device)


@torch.no_grad()
def graft_generate(
    models: ModelSet,
    tokens: Int[torch.Tensor, "batch pos"],
    mask: GraftMask,
    max_new_tokens: int = 10,
    new_token_sources: str | int = "last",
) -> Int[torch.Tensor, "batch new_pos"]:
    """Greedy generation after a grafted prompt, over the mixed-origin KV cache.

    The prompt runs once under ``mask``; each new token is then computed one at a
    time, attending over the cached keys and values of the prompt (each computed
    under its own position's weights) and of earlier new tokens.

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` prompts of equal length (no padding).
        mask: The prompt's graft mask, ``[batch, pos]``.
        max_new_tokens: Number of tokens to generate; the prompt and the new
            tokens must fit the model's context (``models.base.cfg.n_ctx``).
        new_token_sources: Which weights compute the new tokens: ``"last"`` (each
            component and layer keeps the source it had at the row's last prompt
            token, the paper's setting) or a source index for every component.

    Returns:
        ``[batch, pos + max_new_tokens]``: the prompts followed by the new tokens.

    Raises:
        GraftingError: ``max_new_tokens`` not a positive int or past the model's
            context, a bad ``new_token_sources``, or padded prompts.
        GraftMaskError: The mask does not fit the tokens or the model set.
    """
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise GraftingError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    max_new_tokens = int(max_new_tokens)
    # It takes no attention mask, so the usual fix (pass one) would not be true here.
    tokens, _ = _check_tokens(
        models,
        tokens,
        mask,
        None,
        padding_fix="graft_generate takes no attention_mask: it continues every row after its "
        "last column, so it needs prompts without padding. Generate for prompts of one length "
        "(e.g. one prompt at a time, its padding cut off).",
    )
    prompt_length = tokens.shape[1]
    if mask.lengths is not None and bool((mask.lengths < prompt_length).any()):
        raise GraftingError(
            "graft_generate continues every row after its last column, but the mask was built "
            "for padded prompts. Generate for prompts of one length (e.g. one prompt at a time)."
        )
    context = int(getattr(models.base.cfg, "n_ctx", 0) or 0)
    if context and prompt_length >= context:
        raise GraftingError(
            f"The prompt alone ({prompt_length} tokens) fills the model's context of {context} "
            "positions, leaving no room for a new token. Shorten the prompt to at most "
            f"{context - 1} tokens."
        )
    if context and prompt_length + max_new_tokens > context:
        # Also the bound on memory: the cache and mask grow with every new token.
        raise GraftingError(
            f"The prompt ({prompt_length} tokens) and max_new_tokens={max_new_tokens} make "
            f"{prompt_length + max_new_tokens} positions, past the model's context of {context}. "
            f"Ask for at most {context - prompt_length} new tokens."
        )
    if new_token_sources == "last":
        full = mask.extend(max_new_tokens)
    elif is_integer(new_token_sources) and 0 <= int(new_token_sources) < len(models):
        batch = mask.shape[0]
        new = torch.full((batch, max_new_tokens), int(new_token_sources), dtype=torch.long)
        full = GraftMask(
            {pair: torch.cat([mask[pair], new], dim=1) for pair in models.pairs},
            (batch, prompt_length + max_new_tokens),
            mask.n_sources,
        )
    else:
        raise GraftingError(
            f"new_token_sources must be 'last' or a source index 0..{len(models) - 1}, "
            f"got {new_token_sources!r}."
        )
    _check_mask(models, full)
    _check_not_grafting(models)
    _check_sources_placed(models, full)  # before the canary's forward passes
    check_cache_continuation(models.base, "graft_generate", GraftingError)
    generated = [tokens]
    with _installed(models, full) as state, cache_visible(models.base):
        cache = DynamicCache()
        continuing = cached_forward_kwargs(models.base, cache)
        state.window = (0, prompt_length)
        logits = models.base(tokens, return_type="logits", **continuing)
        for step in range(max_new_tokens):
            # Logits come back on the unembedding's device; tokens go to the embedding's.
            next_token = logits[:, -1].argmax(dim=-1, keepdim=True).to(tokens.device)
            generated.append(next_token)
            if step == max_new_tokens - 1:
                break
            state.window = (prompt_length + step, 1)
            logits = models.base(next_token, return_type="logits", **continuing)
    return torch.cat(generated, dim=1)


def _check_mask_type(mask: object) -> None:
    if not isinstance(mask, GraftMask):
        raise GraftMaskError(
            f"Expected a GraftMask, got {type(mask).__name__}. Build one with "
            "GraftMask.build(...) or GraftMask.from_dict(models, {...})."
        )


def _check_mask(models: ModelSet, mask: GraftMask) -> None:
    _check_mask_type(mask)
    if mask.n_sources != len(models):
        raise GraftMaskError(
            f"The mask was built for {mask.n_sources} sources, the model set has {len(models)}."
        )
    for component, layer in mask.keys():
        if (component, layer) not in models.layout.slots:
            where = "" if layer is None else f" at layer {layer}"
            raise ComponentError(f"{models.architecture} has no {component!r} component{where}.")
    check_leftovers(models, mask.keys())
    check_declared(models, mask)
    for flag in _UNSUPPORTED_BRIDGE_FLAGS:
        if getattr(models.base.cfg, flag, False):
            raise GraftingError(
                f"The base bridge has {flag}=True, under which attention reads projection "
                f"weights per head instead of calling the projection, so a graft cannot route "
                f"positions. Call models.base.set_{flag}(False) before grafting."
            )


def check_declared(models: ModelSet, mask: GraftMask) -> None:
    """Refuse a donor at a pair :func:`load_models` was told would not be grafted."""
    if models.graftable is None:
        return
    for (component, layer), sources in _used_sources(mask).items():
        donors = sorted(source for source in sources if source)
        if donors and (component, layer) not in models.graftable:
            where = component if layer is None else f"{component} at layer {layer}"
            declared = sorted({c for c, _ in models.graftable}, key=COMPONENTS.index)
            at = sorted({at for c, at in models.graftable if at is not None and c == component})
            raise GraftMaskError(
                f"The mask grafts {where} from source {donors[0]} "
                f"({models.names[donors[0]]}), but load_models was told that grafts take only "
                f"{'+'.join(declared)}"
                + (f" ({component} at layers {at})" if at else "")
                + " from donors (components= / layers=). Load the model set with a "
                "declaration that includes it, or graft only what was declared."
            )


def _check_tokens(
    models: ModelSet,
    tokens: torch.Tensor,
    mask: GraftMask,
    attention_mask: torch.Tensor | None,
    padding_fix: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_mask_type(mask)
    models.check_tokens(tokens)
    if tuple(tokens.shape) != mask.shape:
        raise GraftMaskError(
            f"The mask is for [batch, pos] = {list(mask.shape)}, the tokens have "
            f"{list(tokens.shape)}. Build the mask from these tokens."
        )
    # One notion of each row's real tokens for the mask and the run: padded tokens
    # need their attention mask, and the mask must have been built for it.
    check_padding(tokens, attention_mask, models.tokenizer, fix=padding_fix)
    mask.check_rows(attention_mask)
    if attention_mask is not None:
        attention_mask = attention_mask.to(models.device)
    return token_ids(tokens).to(models.device), attention_mask
