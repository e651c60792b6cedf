"""Dynamic weight grafting: run the base model with other checkpoints' weights per position.

A :class:`~grafting_lens.GraftMask` names, per component, layer and token position, the
checkpoint whose weights compute that position. :func:`graft_forward_reference` runs the
paper's procedure literally (one token at a time over a mixed-origin KV cache): slow,
obviously correct, the oracle. :func:`graft_forward` computes the same logits in one batched
causal pass, because only attention mixes positions and it has no weights (the argument:
docs/concepts/equivalence.md). Inside :func:`grafting` each grafted slot of the bridge tree
holds a dispatcher (``set_original_component``) that runs each source's module on the
positions assigned to it and puts the results back, so every TransformerLens hook and tool
sees the grafted run; the base is restored on exit. Sources answer for their modules
(:mod:`grafting_lens.models.sources`); modules are swapped, not parameter values, so tied
embeddings stay untied under a graft (docs/concepts/grafts.md, "Tied embeddings").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import nn
from transformer_lens.model_bridge import TransformerBridge
from transformers import DynamicCache

from grafting_lens.core.arguments import is_integer, is_number
from grafting_lens.core.compat import cache_visible, cached_forward_kwargs, check_cache_continuation
from grafting_lens.core.errors import (
    ArgumentTypeError,
    GraftingError,
    GraftMaskError,
    NonFiniteLogitsError,
    kind,
)
from grafting_lens.engine import products
from grafting_lens.engine.masks import GraftMask, Key, check_component, check_leftovers
from grafting_lens.engine.positions import check_padding
from grafting_lens.engine.routing import (
    PICKED,
    Dispatch,
    GraftState,
    Layout,
    Plan,
    as_columns,
    installed,
    position_shape,
)
from grafting_lens.models.components import COMPONENTS, Slot
from grafting_lens.models.lora_source import LoraLinear
from grafting_lens.models.model_set import ModelSet, check_model_set, token_ids

# Bridge options under which attention reads projection weights per head instead of
# calling the projection module: a per-position dispatcher cannot serve those reads.
_UNSUPPORTED_BRIDGE_FLAGS = ("use_attn_result", "use_split_qkv_input", "use_attn_in")

_ACTIVE = "_grafting_lens_grafting"  # set on the base bridge while a graft is installed


class SourceDispatch(Dispatch):
    """Stands in for one slot of the base and routes each position to its source.

    ``sources[i]`` computes the positions the mask gives source ``i``. Every tensor argument
    laid out like the input is split with it (a mixture-of-experts block's routing indices and
    weights); any other is refused with the module named: no routing of it is known right.
    """

    error = GraftingError
    verb = "graft"
    _state: GraftState
    _vectors: dict[tuple, torch.Tensor]

    def __init__(
        self,
        key: Key,
        path: str,
        sources: tuple[nn.Module, ...],
        state: GraftState,
        pos_dim: int | None = None,
        norm: bool = False,
    ) -> None:
        super().__init__(key, path, sources, pos_dim, norm)
        # Per-position vectors, built once per window: norm bridges read them often.
        self.__dict__.update(_state=state, _vectors={})

    def window(self) -> tuple[int, int]:
        batch, length = self._state.plan(self.key).window.shape
        return int(batch), int(length)

    def forward(self, *args, **kwargs):
        plan = self._state.plan(self.key)
        if plan.single is not None:
            return self.sources[plan.single](*args, **kwargs)
        if self.key[0] in PICKED:
            return self._pick(plan, args, kwargs)
        base = self.sources[0]
        if (  # every source is the base's linear layer plus a low-rank update: one product
            len(args) == 1
            and not kwargs
            and not torch.is_grad_enabled()
            and all(
                m is base or (isinstance(m, LoraLinear) and m._modules["base_layer"] is base)
                for m in (self.sources[source] for source, _ in plan.parts)
            )
            and (layout := self.layout(args[0])) is not None
        ):
            return self._updated(plan, layout, args[0])
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.dim()]
        layout = self.layout(tensors[0] if tensors else None)
        for other in tensors[1:]:  # routed with the input's rows: laid out as the input
            self.layout(other, like=layout)
        assert layout is not None  # required: refused otherwise
        # Each source computes its rows (slices where the mask's positions form runs, else
        # gathered by index on the activation's device: a layer-split model's own).
        outputs = []
        for part, (source, _) in enumerate(plan.parts):
            taken_args = [layout.take(x, plan, part) for x in args]
            taken_kwargs = {name: layout.take(x, plan, part) for name, x in kwargs.items()}
            # A linear part through oneDNN on a CPU: two products on half the rows cost less there.
            outputs.append(products.call(self.sources[source], taken_args, taken_kwargs))
        return self._merge(plan, layout, outputs)

    def _updated(self, plan: Plan, layout: Layout, x: torch.Tensor) -> torch.Tensor:
        """The base's product on every row, each source's low-rank update added on its rows:
        a rank-k graft costs the plain forward plus ``k (d_in + d_out)`` per grafted row."""
        output = products.call(self.sources[0], [x], {})  # a split slot's kernel (products.py)
        rows, inputs = layout.rows(output), layout.rows(x)
        for part, (source, index) in enumerate(plan.parts_on(rows.device)):
            module = self.sources[source]
            if isinstance(module, LoraLinear):
                update = module.update(plan.take(inputs, part))
                rows = rows.index_add(0, index, update.to(rows.dtype))
        return layout.restore(rows, layout.pos_dim is not None)

    def _merge(self, plan: Plan, layout: Layout, outputs: list[Any]):
        """Put each source's outputs (a tensor, or a tuple of them) back into place."""
        single = not isinstance(outputs[0], tuple)
        parts = [(output,) if single else output for output in outputs]
        merged = [self._merge_one(plan, layout, list(at)) for at in zip(*parts, strict=True)]
        return merged[0] if single else tuple(merged)

    def _merge_one(self, plan: Plan, layout: Layout, values: list[Any]) -> Any:
        """One element of the sources' outputs, each source's rows put back in place."""
        first = values[0]
        if not isinstance(first, torch.Tensor):
            if all(value is first for value in values):
                return first  # the same non-tensor (None, a cache) from every source
        else:
            found = [
                layout.untake(value, len(index))
                for (_, index), value in zip(plan.parts, values)
                if isinstance(value, torch.Tensor)
            ]
            pieces = [piece for piece in found if piece is not None]
            if len(pieces) == len(values) and len({grid for _, grid in pieces}) == 1:
                rows = plan.put([piece for piece, _ in pieces])
                return layout.restore(rows, pieces[0][1])
        shown = [list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values]
        self.refuse(f"outputs {shown} that cannot be put back one row per position")

    def _pick(self, plan: Plan, args: tuple, kwargs: dict) -> torch.Tensor:
        """Every used source computes every position; each position takes its source's row."""
        pieces, layout = [], None
        for part, (source, _) in enumerate(plan.parts):
            output = self.sources[source](*args, **kwargs)
            layout = self.layout(output)
            assert layout is not None  # required: refused otherwise
            pieces.append(plan.take(layout.rows(output), part))
        assert layout is not None  # plan.parts is never empty
        return layout.restore(plan.put(pieces), grid=True)

    def per_position(self, name: str, value: torch.Tensor) -> torch.Tensor:
        plan = self._state.plan(self.key)
        if plan.single is not None:
            return getattr(self.sources[plan.single], name)
        if value.dim() == 0 or (value.dim() > 1 and not self._reads_any_tensor):
            # A bridge other than a norm reads matrices only for their dtype and shape,
            # which every aligned source shares.
            return value
        cache_key = (id(plan), name, self._reading)
        if cache_key in self._vectors:
            return self._vectors[cache_key]
        batch, length = plan.window.shape
        stacked = torch.stack([getattr(source, name) for source in self.sources])
        rows = stacked.index_select(0, plan.window_on(stacked.device).reshape(-1))
        layout = None if self._reading is None else self.layout(self._reading, required=False)
        shape = position_shape(layout, self._reading, value.shape, batch, length)
        per_position = rows.reshape(shape)
        if not torch.is_grad_enabled():
            # With autograd on, each forward needs its own graph, so nothing is kept.
            self._vectors[cache_key] = per_position
        return per_position


@contextmanager
def _installed(
    models: ModelSet, mask: GraftMask, last: torch.Tensor | None = None
) -> Iterator[GraftState]:
    """Install dispatchers for every pair the (checked) mask grafts, the unembedding on each
    row's position ``state.last`` alone while it is set; restore the base on exit."""
    state = GraftState(mask, last)

    def dispatch(key: Key, slot: Slot, original: nn.Module, pos_dim: int | None, norm: bool):
        # A source the mask never uses here is never asked: a lazily loaded donor reads
        # nothing for it. Its place holds the base's module, which no position routes to.
        sources = [original] + [
            models.sources[index].module(slot) if index in state.used[key] else original
            for index in range(1, len(models))
        ]
        return SourceDispatch(key, slot.path, tuple(sources), state, pos_dim, norm)

    def keep_last(module: nn.Module, args: tuple) -> tuple | None:
        if state.last is None:
            return None
        hidden = args[0]
        rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
        return (hidden[rows, as_columns(state.last).to(hidden.device)], *args[1:])

    unembed = models.slots("unembed", None)[0].holder(models.base)
    handle = unembed.register_forward_pre_hook(keep_last)
    try:
        with installed(
            models,
            mask.keys(),
            dispatch,
            lambda: (state.shape[0], state.window[1]),
            GraftingError,
            _ACTIVE,
        ):
            yield state
    finally:
        handle.remove()


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


def _check_mask(models: ModelSet, mask: object) -> None:
    """Refuse what is not a graft mask for this model set (a dict, a mask for other sources)."""
    check_model_set(models)
    if not isinstance(mask, GraftMask) or mask.n_sources != len(models):
        got = mask.n_sources if isinstance(mask, GraftMask) else type(mask).__name__
        raise kind(mask, GraftMask, GraftMaskError)(
            f"mask must be a GraftMask for the model set's {len(models)} sources, got "
            + (f"one built for {got}" if isinstance(got, int) else f"a {got}")
            + ".\nBuild one with GraftMask.build(models, ...) or GraftMask.from_dict(models, {...})."
        )


def _check_graft(models: ModelSet, mask: GraftMask) -> None:
    """The door's checks of a mask against the model set, before anything runs or loads."""
    for component, layer in mask.keys():
        check_component(models, component, (layer,))
    check_leftovers(models, mask.keys())
    check_declared(models, mask)
    flags = [flag for flag in _UNSUPPORTED_BRIDGE_FLAGS if getattr(models.base.cfg, flag, False)]
    nested = getattr(models.base, _ACTIVE, False)
    if nested or flags:
        raise GraftingError(
            "This model set is already inside a grafting(...) block; grafts do not nest.\n"
            "Combine the masks with GraftMask.union, or run this after the block."
            if nested
            else f"The base bridge has {flags[0]}=True: attention then reads projection weights "
            "per head instead of calling the projection, so a graft cannot route positions.\n"
            f"Call models.base.set_{flags[0]}(False) before grafting."
        )
    # The one placement check of every module the mask takes from a donor: a model cast or
    # moved after load_models fails here, named.
    for key, indices in _used_sources(mask).items():
        models.check_placement(indices, "This graft", pairs=[key])


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
                f"The mask grafts {where} from source {donors[0]} ({models.names[donors[0]]}), "
                f"but load_models was told that donors give only {'+'.join(declared)}"
                + (f" ({component} at layers {at})" if at else "")
                + " (components= / layers=).\nLoad the model set with a declaration that "
                "includes it, or graft only what was declared."
            )


def _check_run(
    models: ModelSet,
    tokens: torch.Tensor,
    mask: GraftMask,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The door's checks of the tokens and attention mask against the mask: both on the
    models' device, and each row's length."""
    _check_mask(models, mask)
    models.check_tokens(tokens)
    # One notion of each row's real tokens for the mask and the run.
    check_padding(tokens, attention_mask, models.tokenizer)
    lengths = mask.check_rows(attention_mask, shape=tokens.shape)
    if attention_mask is not None:
        attention_mask = attention_mask.to(models.device)
    return token_ids(tokens).to(models.device), attention_mask, lengths


@contextmanager
def grafting(models: ModelSet, mask: GraftMask) -> Iterator[TransformerBridge]:
    """Run the base model with the weights the mask names, for any TransformerLens tool.

    Inside the block, ``models.base`` (what the block yields) computes every grafted
    component at every position with the weights of the source the mask names; hooks,
    ``run_with_cache`` and ``run_with_hooks`` work as usual. Run it on tokens of the mask's
    ``[batch, pos]``, with the attention mask the mask was built for (none for unpadded
    tokens). The base is restored on exit, also when the body raises.

    Raises:
        GraftMaskError: The mask was built for another model set; inside the block, a
            run on padded tokens without their attention mask, or with an attention mask
            the mask was not built for (see :meth:`GraftMask.check_rows`).
        GraftingError: A nested block, a bridge option the single pass cannot serve, or
            (inside) a run on tokens of another shape.

    Examples:
        >>> with grafting(models, mask) as model:
        ...     logits, cache = model.run_with_cache(tokens)
    """
    _check_mask(models, mask)
    _check_graft(models, mask)

    # The user calls the model, so the padding is checked where every call style (plain
    # call, run_with_cache, run_with_hooks) passes it: the HF model.
    def check_rows(module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = args[0] if args else kwargs.get("input_ids")
        if isinstance(tokens, torch.Tensor) and tuple(tokens.shape[:2]) == mask.shape:
            check_padding(tokens, kwargs.get("attention_mask"), models.tokenizer)
            mask.check_rows(kwargs.get("attention_mask"))

    with _installed(models, mask):
        handle = models.base.original_model.register_forward_pre_hook(check_rows, with_kwargs=True)
        try:
            yield models.base
        finally:
            handle.remove()


def graft_forward(
    models: ModelSet,
    tokens: Int[torch.Tensor, "batch pos"],
    mask: GraftMask,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    *,
    logits: str | torch.Tensor = "last",
    grad: bool = False,
) -> Float[torch.Tensor, "batch scored d_vocab"]:
    """Logits of the grafted model, in a single forward pass.

    Equal (to float rounding) to :func:`graft_forward_reference`, the paper's token-by-token
    procedure; see the module docstring for why. With ``logits="last"`` (the default) the
    unembedding runs on each row's last real token alone (or on the positions a tensor
    names): with a 262k-token vocabulary every position's logits are most of a pass's memory
    and much of its time. No autograd graph is kept (it would hold every layer's activations
    until the logits are freed): for gradients pass ``grad=True``, or run inside :func:`grafting`.

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` token ids. Each row may be a different prompt or a
            different configuration of the same prompt.
        mask: Source indices of shape ``[batch, pos]`` per component and layer.
        attention_mask: ``[batch, pos]``, ones then zeros (right padding); required when
            rows end in the pad token, and the one the mask was built with (see
            :meth:`GraftMask.check_rows`).
        logits: ``"last"``: each row's last real token, ``[batch, 1, d_vocab]``;
            ``"all"``: every position, ``[batch, pos, d_vocab]`` (meaningless at padding);
            a ``[batch, k]`` integer tensor: those positions of each row, ``[batch, k,
            d_vocab]`` (each a real token's).
        grad: Keep the autograd graph (with autograd enabled).

    Raises:
        GraftMaskError: The mask does not fit the tokens, the model set or the
            attention mask; padded tokens without an attention mask; an attention
            mask holding values other than 0 and 1.
        GraftingError: A bad ``logits`` or ``grad``, a nested graft.
    """
    named = isinstance(logits, str) and logits in ("last", "all")
    if not (named or _positions_of(logits, tokens)) or not isinstance(grad, bool):
        typed = isinstance(logits, (str, torch.Tensor)) and isinstance(grad, bool)
        raise (GraftingError if typed else ArgumentTypeError)(
            f"logits must be 'last', 'all' or a [batch, k] tensor of positions within "
            f"the tokens, and grad True or False, got {logits!r:.60} and {grad!r}."
        )
    tokens, attention_mask, lengths = _check_run(models, tokens, mask, attention_mask)
    _check_graft(models, mask)
    last = None if logits == "all" else lengths - 1
    if not named:
        last = torch.as_tensor(logits).to(lengths.device)
        if bool((last >= lengths[:, None]).any()):
            raise GraftingError("logits= names a position past a row's last real token.")
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()), _installed(models, mask, last):
        return models.base(tokens, attention_mask=attention_mask, return_type="logits")


def _positions_of(logits: Any, tokens: Any) -> bool:
    """Whether ``logits`` is a ``[batch, k]`` integer tensor of positions within ``tokens``."""
    return (
        isinstance(logits, torch.Tensor)
        and isinstance(tokens, torch.Tensor)
        and logits.dim() == 2
        and logits.shape[0] == tokens.shape[0]
        and not logits.dtype.is_floating_point
        and logits.dtype != torch.bool
        and bool((logits >= 0).all() and (logits < tokens.shape[-1]).all())
    )


@torch.no_grad()
def graft_forward_reference(
    models: ModelSet,
    tokens: Int[torch.Tensor, "batch pos"],
    mask: GraftMask,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Float[torch.Tensor, "batch pos d_vocab"]:
    """The paper's procedure, literally: one token at a time, weights swapped per token.

    For every row and position ``t``, every component of the base is set to the module of
    the source the mask names at ``t``; token ``t`` runs over a KV cache of the keys and
    values earlier tokens computed under their own weights. Slow, and kept as the oracle.

    Returns:
        Logits ``[batch, pos, d_vocab]``; padding positions are NaN.
    """
    tokens, attention_mask, lengths = _check_run(models, tokens, mask, attention_mask)
    _check_graft(models, mask)
    check_cache_continuation(models.base, "the token-by-token reference", GraftingError)
    # Every slot of every pair, with the module of each source the mask uses there.
    used = _used_sources(mask)
    slots = [(pair, slot) for pair in models.pairs for slot in models.slots(*pair)]
    modules = [
        {index: models.sources[index].module(slot) for index in {0} | used.get(pair, frozenset())}
        for pair, slot in slots
    ]
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
    *,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Int[torch.Tensor, "batch pos_and_new"]:
    """Greedy generation after a grafted prompt, over the mixed-origin KV cache.

    The prompt runs once under ``mask``; each new token then attends over the cached keys and
    values of the prompt (each computed under its own position's weights) and of earlier new
    tokens. Right-padded prompts of different lengths run as one batch per length, so every
    row generates what it would alone (no padding enters a pass).

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` prompts, right padded when their lengths differ.
        mask: The prompt's graft mask, ``[batch, pos]``, built with ``attention_mask``.
        max_new_tokens: Number of tokens to generate; each prompt and its new tokens
            must fit the model's context (``models.base.cfg.n_ctx``).
        new_token_sources: Which weights compute the new tokens: ``"last"`` (each
            component and layer keeps the source it had at the row's last prompt
            token, the paper's setting) or a source index for every component.
        attention_mask: ``[batch, pos]``, ones then zeros; ``None``: no padding.

    Returns:
        ``[batch, pos + max_new_tokens]``: each row's prompt, its new tokens, then its
        padding as given. Row ``i``'s new tokens are ``out[i, n:n + max_new_tokens]`` for
        its ``n = attention_mask[i].sum()`` real tokens; without padding, ``out[:, pos:]``.

    Raises:
        GraftingError: A bad ``max_new_tokens`` (not an int >= 1, past the context) or
            ``new_token_sources``.
        GraftMaskError: A mask that does not fit the tokens, the attention mask or the models.
        SelectionError: Padded prompts without their attention mask.
        NonFiniteLogitsError: NaN or infinite logits where a token is chosen.
    """
    tokens, _, lengths = _check_run(models, tokens, mask, attention_mask)
    prompt = int(lengths.max())
    # The context also bounds memory: the cache and mask grow with every new token.
    context = int(getattr(models.base.cfg, "n_ctx", 0) or 0)
    room = context - prompt if context else None
    problems = []
    if not is_integer(max_new_tokens) or not 1 <= max_new_tokens <= (
        max_new_tokens if room is None else room
    ):
        fits = f" that fits the model's context of {context} with the prompt's {prompt}"
        problems.append(
            f"max_new_tokens must be an int >= 1{fits if context else ''}, got {max_new_tokens!r}"
            + ("" if room is None else f": ask for 1..{room} new tokens" if room > 0 else "")
            + ("" if room is None or room > 0 else f": shorten the prompt to {context - 1} tokens")
        )
    if new_token_sources != "last" and not (
        is_integer(new_token_sources) and 0 <= new_token_sources < len(models)
    ):
        problems.append(
            f"new_token_sources must be 'last' or a source index 0..{len(models) - 1}, "
            f"got {new_token_sources!r}"
        )
    if problems:
        sources = isinstance(new_token_sources, str) or is_integer(new_token_sources)
        typed = is_number(max_new_tokens) and sources  # a bool counts nothing
        raise (GraftingError if typed else ArgumentTypeError)("; ".join(problems) + ".")
    new = int(max_new_tokens)
    groups = []  # (rows, their length, the mask of their prompts and new tokens): checked first
    for length in torch.unique(lengths).tolist():
        rows = (lengths == length).nonzero().squeeze(1)
        # Pairs that share a tensor keep sharing one: the dispatchers read each tensor once.
        cut = {id(mask[key]): mask[key][rows, :length] for key in mask.keys()}
        part = GraftMask(
            {k: cut[id(mask[k])] for k in mask.keys()}, (len(rows), length), len(models)
        )
        if new_token_sources == "last":
            full = part.extend(new)
        else:
            tail = torch.full((len(rows), new), int(new_token_sources), dtype=torch.long)
            entries = {pair: torch.cat([part[pair], tail], dim=1) for pair in models.pairs}
            full = GraftMask(entries, (len(rows), length + new), len(models))
        _check_graft(models, full)  # before the canary's forward passes
        groups.append((rows.to(tokens.device), length, full))
    check_cache_continuation(models.base, "graft_generate", GraftingError)
    out = tokens.new_empty((tokens.shape[0], tokens.shape[1] + new), dtype=torch.long)
    for rows, length, full in groups:
        generated = _generate(models, tokens[rows, :length], full)
        out[rows] = torch.cat([generated, tokens[rows, length:]], dim=1)  # padding moves on
    return out


def _generate(
    models: ModelSet, tokens: Int[torch.Tensor, "batch pos"], full: GraftMask
) -> Int[torch.Tensor, "batch pos_and_new"]:
    """Greedy new tokens after unpadded prompts, under ``full`` (prompt and new positions)."""
    (batch, prompt), new = tokens.shape, full.shape[1] - tokens.shape[1]
    generated = [tokens]
    with _installed(models, full) as state, cache_visible(models.base):
        continuing = cached_forward_kwargs(models.base, DynamicCache())
        state.window = (0, prompt)
        state.last = torch.full((batch,), prompt - 1)
        logits = models.base(tokens, return_type="logits", **continuing)
        state.last = None  # each new token is a window of one position
        for step in range(new):
            _check_finite(logits[:, -1], step)
            # Logits come back on the unembedding's device; tokens go to the embedding's.
            generated.append(logits[:, -1].argmax(dim=-1, keepdim=True).to(tokens.device))
            if step == new - 1:
                break
            state.window = (prompt + step, 1)
            logits = models.base(generated[-1], return_type="logits", **continuing)
    return torch.cat(generated, dim=1)


def _check_finite(logits: torch.Tensor, step: int) -> None:
    """Refuse choosing a token from NaN or infinite logits (argmax of NaN is token 0)."""
    finite = torch.isfinite(logits).all(dim=-1)
    if not bool(finite.all()):
        rows = (~finite).nonzero().squeeze(1).tolist()
        raise NonFiniteLogitsError(
            f"graft_generate: the logits of new token {step} hold NaN or infinite values in "
            f"rows {rows[:5]}, so no token can be chosen (the argmax of NaN is token 0).\n"
            "Usual causes: a NaN or infinite weight in a source, or float16 overflow."
        )
