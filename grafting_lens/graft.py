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
projections into separate Q, K and V modules). Inside :func:`grafting`, each
grafted component's ``original_component`` in the base is replaced by a
dispatcher that gathers the positions assigned to each source, runs that source's
own module on them (linear layers through oneDNN on CPUs, where it is the faster
kernel: see :mod:`grafting_lens.kernels`), and scatters the results back. The
bridge's hooks fire as usual, so ``run_with_cache``, hooks and every
TransformerLens tool see the grafted run. On exit (also after an exception) the
base is restored.

The components' *modules* are swapped, not their parameter values, which is why
tied embeddings stay untied under a graft: grafting ``embed`` runs the donor's
embedding module at those positions and never touches the unembedding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from jaxtyping import Float, Int
from torch import nn
from transformer_lens.model_bridge import TransformerBridge
from transformers import DynamicCache

from grafting_lens.components import bridge_component
from grafting_lens.errors import ComponentError, GraftingError, GraftMaskError
from grafting_lens.kernels import run_module
from grafting_lens.masks import GraftMask, Key
from grafting_lens.models import ModelSet
from grafting_lens.positions import check_padding, row_lengths

# Bridge options under which attention code reads projection weights directly,
# per head, instead of calling the projection module: a per-position dispatcher
# cannot serve those reads.
_UNSUPPORTED_BRIDGE_FLAGS = ("use_attn_result", "use_split_qkv_input", "use_attn_in")


@dataclass
class _Plan:
    """How one (component, layer) splits the positions of the current window."""

    window: Int[torch.Tensor, "batch pos"]
    single: int | None
    parts: list[tuple[int, Int[torch.Tensor, " n"]]] = field(default_factory=list)


class _GraftState:
    """The mask of one grafted run and the window of positions being computed.

    A full pass computes positions ``0..pos-1`` at once; generation computes one
    new position per step. Every dispatcher reads the same window.
    """

    def __init__(self, mask: GraftMask, device: torch.device) -> None:
        self.shape = mask.shape
        self.n_sources = mask.n_sources
        self.window = (0, mask.shape[1])
        # Many pairs share one tensor (GraftMask.build); keep the sharing on the
        # device so each distinct tensor is split into index lists once.
        moved: dict[int, torch.Tensor] = {}
        self.masks = {key: moved.setdefault(id(mask[key]), mask[key].to(device)) for key in mask.keys()}
        self._plans: dict[tuple[int, int, int], _Plan] = {}

    def plan(self, key: Key) -> _Plan:
        values = self.masks[key]
        offset, length = self.window
        cache_key = (id(values), offset, length)
        plan = self._plans.get(cache_key)
        if plan is None:
            window = values[:, offset : offset + length]
            flat = window.reshape(-1)
            counts = torch.bincount(flat, minlength=self.n_sources).tolist()
            used = [source for source, count in enumerate(counts) if count]
            if len(used) == 1:
                plan = _Plan(window, used[0])
            else:
                parts = [(source, (flat == source).nonzero().squeeze(1)) for source in used]
                plan = _Plan(window, None, parts)
            self._plans[cache_key] = plan
        return plan


class _SourceDispatch(nn.Module):
    """Stands in for one component of the base and routes each position to its source.

    The source modules are held in a plain list, not registered as submodules, so
    no donor parameter is adopted into the base's module tree. The price: while a
    graft is installed, ``models.base.parameters()`` lacks the grafted components'
    parameters (they are back on exit).
    """

    def __init__(self, key: Key, sources: list[nn.Module], state: _GraftState) -> None:
        super().__init__()
        self._key = key
        self._sources = sources
        self._state = state
        # Per-position vectors, built once per window: norm bridges read them
        # several times per forward.
        self._vectors: dict[tuple[int, str], torch.Tensor] = {}

    def forward(self, input: torch.Tensor, *args, **kwargs):  # noqa: A002 (torch's name)
        plan = self._state.plan(self._key)
        if plan.single is not None:
            return run_module(self._sources[plan.single], input, *args, **kwargs)
        batch, length = plan.window.shape
        x = self._match_window(input, batch, length)
        flat = x.reshape(batch * length, *x.shape[2:])
        output = None
        for source, index in plan.parts:
            y = run_module(self._sources[source], flat.index_select(0, index), *args, **kwargs)
            if output is None:
                output = y.new_empty((batch * length, *y.shape[1:]))
            output.index_copy_(0, index, y)
        return output.reshape(batch, length, *output.shape[1:])

    def _match_window(self, x: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        if x.dim() >= 2 and tuple(x.shape[:2]) == (batch, length):
            return x
        if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == length:
            return x.expand(batch, *x.shape[1:])  # shared position ids, e.g. GPT-2's wpe
        raise GraftingError(
            f"The grafted run reached {self._key} with an input of shape {tuple(x.shape)}, but "
            f"the mask is for [batch={batch}, pos={length}]. Run the model on the tokens the "
            "mask was built for (same batch size and length)."
        )

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
        if value.dim() != 1:
            # Matrices cannot be served per position. The bridge reads them outside
            # the options refused in _check_mask only for metadata (dtype, shape),
            # which every aligned source shares.
            return value
        # Norm bridges may apply scale and bias themselves (x * weight + bias):
        # a [batch, pos, d] tensor of each position's own vector does the same
        # arithmetic per position.
        vectors = self.__dict__["_vectors"]
        cache_key = (id(plan), name)
        if cache_key in vectors:
            return vectors[cache_key]
        per_position = torch.stack([getattr(source, name) for source in sources])[plan.window]
        if not torch.is_grad_enabled():
            # With autograd on, each forward needs its own graph, so nothing is kept.
            vectors[cache_key] = per_position
        return per_position


@contextmanager
def _installed(models: ModelSet, mask: GraftMask) -> Iterator[_GraftState]:
    """Install dispatchers for every pair the mask grafts; restore the base on exit."""
    _check_mask(models, mask)
    _check_not_grafting(models)
    state = _GraftState(mask, models.device)
    swapped: list[tuple[nn.Module, nn.Module]] = []
    embed = bridge_component(models.base, "embed", None)
    check_tokens = embed.register_forward_pre_hook(lambda module, args: _check_window(state, args))
    setattr(models.base, _ACTIVE, True)
    try:
        for component, layer in mask.keys():
            module = bridge_component(models.base, component, layer)
            original = module._modules["_original_component"]
            sources = [original] + [
                bridge_component(model, component, layer)._modules["_original_component"]
                for model in models[1:]
            ]
            module._modules["_original_component"] = _SourceDispatch(
                (component, layer), sources, state
            )
            swapped.append((module, original))
        yield state
    finally:
        for module, original in reversed(swapped):
            module._modules["_original_component"] = original
        check_tokens.remove()
        setattr(models.base, _ACTIVE, False)


_ACTIVE = "_grafting_lens_grafting"  # set on the base bridge while a graft is installed


def _check_not_grafting(models: ModelSet) -> None:
    if getattr(models.base, _ACTIVE, False):
        raise GraftingError(
            "This model set is already inside a grafting(...) block; grafts do not nest. "
            "Combine the masks with GraftMask.union, or run this after the block."
        )


def _check_window(state: _GraftState, args: tuple) -> None:
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
) -> Float[torch.Tensor, "batch pos d_vocab"]:
    """Logits of the grafted model, in a single forward pass.

    Equal (to float rounding) to :func:`graft_forward_reference`, the paper's
    token-by-token procedure; see the module docstring for why.

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` token ids. Each row may be a different prompt or a
            different configuration of the same prompt.
        mask: Source indices of shape ``[batch, pos]`` per component and layer.
        attention_mask: ``[batch, pos]``, ones then zeros (right padding). Logits at
            padding positions are meaningless. Required when rows end in the pad
            token; it must be the one the mask was built with (see
            :meth:`GraftMask.check_rows`).

    Returns:
        Logits ``[batch, pos, d_vocab]``.

    Raises:
        GraftMaskError: The mask does not fit the tokens, the model set or the
            attention mask; padded tokens without an attention mask; an attention
            mask holding values other than 0 and 1.
    """
    tokens, attention_mask = _check_tokens(models, tokens, mask, attention_mask)
    with _installed(models, mask):
        return models.base(tokens, attention_mask=attention_mask, return_type="logits")


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
    pairs = models.pairs
    modules = {
        pair: [bridge_component(model, *pair)._modules["_original_component"] for model in models]
        for pair in pairs
    }
    holders = {pair: bridge_component(models.base, *pair) for pair in pairs}
    logits = None
    try:
        for row in range(mask.shape[0]):
            cache = DynamicCache()
            for position in range(int(lengths[row])):
                for pair in pairs:
                    source = int(mask[pair][row, position])
                    holders[pair]._modules["_original_component"] = modules[pair][source]
                step = models.base(
                    tokens[row : row + 1, position : position + 1],
                    past_key_values=cache,
                    use_cache=True,
                    return_type="logits",
                )
                if logits is None:
                    logits = torch.full(
                        (*mask.shape, step.shape[-1]), float("nan"), dtype=step.dtype
                    )
                logits[row, position] = step[0, -1].cpu()
    finally:
        for pair in pairs:
            holders[pair]._modules["_original_component"] = modules[pair][0]
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
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise GraftingError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    tokens, _ = _check_tokens(models, tokens, mask, None)
    prompt_length = tokens.shape[1]
    if mask.lengths is not None and bool((mask.lengths < prompt_length).any()):
        raise GraftingError(
            "graft_generate continues every row after its last column, but the mask was built "
            "for padded prompts. Generate for prompts of one length (e.g. one prompt at a time)."
        )
    context = int(getattr(models.base.cfg, "n_ctx", 0) or 0)
    if context and prompt_length + max_new_tokens > context:
        # Also the bound on memory: the cache and mask grow with every new token.
        raise GraftingError(
            f"The prompt ({prompt_length} tokens) and max_new_tokens={max_new_tokens} make "
            f"{prompt_length + max_new_tokens} positions, past the model's context of {context}. "
            f"Ask for at most {context - prompt_length} new tokens."
        )
    if new_token_sources == "last":
        full = mask.extend(max_new_tokens)
    elif (
        isinstance(new_token_sources, int)
        and not isinstance(new_token_sources, bool)
        and 0 <= new_token_sources < len(models)
    ):
        batch = mask.shape[0]
        new = torch.full((batch, max_new_tokens), new_token_sources, dtype=torch.long)
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
    generated = [tokens]
    with _installed(models, full) as state:
        cache = DynamicCache()
        state.window = (0, prompt_length)
        logits = models.base(tokens, past_key_values=cache, use_cache=True, return_type="logits")
        for step in range(max_new_tokens):
            next_token = logits[:, -1].argmax(dim=-1, keepdim=True)
            generated.append(next_token)
            if step == max_new_tokens - 1:
                break
            state.window = (prompt_length + step, 1)
            logits = models.base(
                next_token, past_key_values=cache, use_cache=True, return_type="logits"
            )
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
    for component, _ in mask.keys():
        if component not in models.components:
            raise ComponentError(f"{models.architecture} has no {component!r} component.")
    for flag in _UNSUPPORTED_BRIDGE_FLAGS:
        if getattr(models.base.cfg, flag, False):
            raise GraftingError(
                f"The base bridge has {flag}=True, under which attention reads projection "
                f"weights per head instead of calling the projection, so a graft cannot route "
                f"positions. Call models.base.set_{flag}(False) before grafting."
            )


def _check_tokens(
    models: ModelSet,
    tokens: torch.Tensor,
    mask: GraftMask,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_mask_type(mask)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise GraftMaskError(
            "tokens must be a [batch, pos] tensor of token ids (use models.base.to_tokens(...) "
            "or the tokenizer), got "
            + (f"shape {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__)
            + "."
        )
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise GraftMaskError(f"tokens must hold integer ids, got {tokens.dtype}.")
    if tuple(tokens.shape) != mask.shape:
        raise GraftMaskError(
            f"The mask is for [batch, pos] = {list(mask.shape)}, the tokens have "
            f"{list(tokens.shape)}. Build the mask from these tokens."
        )
    vocab = int(models.base.cfg.d_vocab)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise GraftMaskError(f"Token ids must lie in 0..{vocab - 1}, the model's vocabulary.")
    models.check_length(tokens.shape[1])
    # One notion of each row's real tokens for the mask and the run: padded tokens
    # need their attention mask, and the mask must have been built for it.
    check_padding(tokens, attention_mask, models.tokenizer)
    mask.check_rows(attention_mask)
    if attention_mask is not None:
        attention_mask = attention_mask.to(models.device)
    return tokens.to(models.device), attention_mask
