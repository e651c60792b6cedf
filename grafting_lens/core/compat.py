"""What differs between the releases this library runs on, and the checks that catch the next difference.

The cache is named as each model's ``forward`` declares it, and every path that continues a
pass over a cache checks it once per model against a plain forward
(:func:`check_cache_continuation`): a new release can make a run fail, never a number silently
wrong. Why: the docs page "Errors", section "Releases of the dependencies".
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from typing import Any
from weakref import WeakKeyDictionary

import torch
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge
from transformers import DynamicCache

from grafting_lens.core.errors import DependencyError, GraftingLensError

_CACHE_NAMES = ("cache", "past_key_values")  # of the key/value cache argument, newest first

_CONTINUATION_CHECKED: WeakKeyDictionary[torch.nn.Module, bool] = WeakKeyDictionary()


def installed_versions() -> str:
    """The releases a result depends on, for error messages and run reports."""
    return ", ".join(
        f"{name} {version(name)}" for name in ("transformers", "transformer-lens", "torch")
    )


def cache_argument(bridge: TransformerBridge, what: str, error: type[GraftingLensError]) -> str:
    """The name under which the bridge's HF model takes a key/value cache (from its signature).

    Raises:
        error: The model takes no cache (an architecture's limit; ``what`` needs it).
    """
    model = getattr(bridge, "original_model", None)
    forward = getattr(type(model), "forward", None)
    parameters = inspect.signature(forward).parameters if forward is not None else {}
    for name in _CACHE_NAMES:
        if name in parameters:
            return name
    # RWKV and its kin carry a recurrent state between calls instead: not "no cache".
    state = [name for name in ("state", "use_cache") if name in parameters]
    kept = (
        "keeps no key/value cache a pass can be continued over: it carries a state of its own "
        f"between calls instead (its forward takes {' and '.join(map(repr, state))}, but neither "
        "'cache' nor 'past_key_values'"
        if state
        else "kept no key/value cache for earlier tokens (its forward takes neither 'cache' nor "
        "'past_key_values'"
    )
    raise error(
        f"{type(model).__name__} {kept}; installed: {installed_versions()}), so {what} cannot "
        "continue a pass over earlier tokens on it. graft_forward runs the whole prompt at "
        "once and is unaffected."
    )


def cached_forward_kwargs(bridge: TransformerBridge, cache: Any) -> dict[str, Any]:
    """Keyword arguments that run ``bridge`` over ``cache`` and extend it (call
    :func:`check_cache_continuation` first: it also checks the model takes a cache)."""
    return {cache_argument(bridge, "this run", DependencyError): cache, "use_cache": True}


def _reading_cache(update: Any, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
    """``update`` reading ``cache`` as ``past_key_values`` (transformers >= 5.24 passes it so)."""
    if kwargs.get("past_key_values") is None and kwargs.get("cache") is not None:
        kwargs["past_key_values"] = kwargs["cache"]
    return update(k, v, **kwargs)


@contextmanager
def cache_visible(bridge: TransformerBridge) -> Iterator[None]:
    """Within this block, the bridge's attention components see the key/value cache: each gets
    an instance-level ``_update_kv_cache`` that reads ``cache`` as well as ``past_key_values``
    (a private method of TransformerLens: :func:`check_cache_continuation` catches a rename).
    """
    patched = []
    for module in bridge.modules():
        update = getattr(module, "_update_kv_cache", None)
        if isinstance(module, AttentionBridge) and update is not None:
            module.__dict__["_update_kv_cache"] = functools.partial(_reading_cache, update)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.__dict__.pop("_update_kv_cache", None)


def check_cache_continuation(
    bridge: TransformerBridge, what: str, error: type[GraftingLensError]
) -> None:
    """Check, once per model, that a pass continued over a cache equals a plain pass: six
    tokens at once against three, then three more over their cache. Call it with the model
    unmodified (no graft, no hooks): it checks the libraries.

    Raises:
        error: The model takes no cache, or keeps its own kind (recurrent layers, a short
            sliding window) that a continued pass does not reproduce; ``what`` needs it.
        DependencyError: The installed releases no longer keep or read the cache as used here.
    """
    model = bridge.original_model
    if _CONTINUATION_CHECKED.get(model):
        return
    cache_argument(bridge, what, error)
    vocabulary = int(bridge.cfg.d_vocab)
    device = next(bridge.parameters()).device
    tokens = ((torch.arange(_CHECKED_TOKENS, device=device) * 7919 + 11) % vocabulary)[None]
    own = _own_cache(getattr(model, "config", None))
    try:
        with torch.no_grad(), cache_visible(bridge):
            plain = bridge(tokens, return_type="logits")
            cache = DynamicCache()
            options = cached_forward_kwargs(bridge, cache)
            bridge(tokens[:, :3], return_type="logits", **options)
            kept = int(cache.get_seq_length())
            continued = bridge(tokens[:, 3:], return_type="logits", **options)
    except (RuntimeError, ValueError, IndexError, TypeError, AttributeError) as failure:
        found: str | None = (
            f"the continued pass failed: {type(failure).__name__}: {_first_line(failure)}"
        )
    else:
        expected = plain[:, 3:].float()
        scale = float(expected.abs().max()) + 1e-6
        tolerance = (1e-4 if plain.dtype == torch.float32 else 1e-2) * scale
        difference = float((continued.float() - expected).abs().max())
        found = None
        if kept != 3:
            found = f"the cache holds {kept} positions after a 3-token prefix"
        elif not difference <= tolerance:
            found = f"its logits differ from a plain pass by {difference:.3g} (tolerance {tolerance:.3g})"
    if found is not None:
        # A model that keeps its own kind of cache is the architecture's limit; otherwise
        # the installed releases no longer keep or read the cache as this library uses it.
        refusal = error if own else DependencyError
        name = type(model).__name__
        message = (
            f"{name} keeps {own}, which a pass continued over a key/value cache given from "
            f"outside does not reproduce ({found}), so {what} cannot continue a pass on it. "
            "graft_forward runs the whole prompt at once and is unaffected."
            if own
            else f"{what} continues a pass over a key/value cache, and on {name} under the "
            f"installed releases ({installed_versions()}) {found}. Install the versions of the "
            "lock (README: 'Three commands'), or report them to grafting-lens."
        )
        raise refusal(message) from None
    _CONTINUATION_CHECKED[model] = True


_CHECKED_TOKENS = 6  # the continuation canary: a plain pass of 6, then 3 continued over 3
# Configuration fields that bound how many earlier tokens an attention layer sees, and words
# in a ``layer_types`` entry of a layer that keeps a state instead of keys and values.
_WINDOW_FIELDS = ("sliding_window", "attention_window_size", "window_size")
_RECURRENT_LAYERS = ("linear", "recurrent", "mamba", "conv", "rwkv")


def _own_cache(config: Any) -> str | None:
    """What a model keeps between calls that a cache given from outside may not reproduce
    (recurrent layers, a sliding window shorter than the canary), or None."""
    if config is None:
        return None
    layer_types = [str(kind) for kind in getattr(config, "layer_types", None) or ()]
    parts = []
    recurrent = sorted({kind for kind in layer_types if any(w in kind for w in _RECURRENT_LAYERS)})
    windows = [
        (field, value)
        for field in _WINDOW_FIELDS
        if isinstance(value := getattr(config, field, None), int) and value > 0
    ]
    if windows and (recurrent or windows[0][1] < _CHECKED_TOKENS):
        field, value = windows[0]
        parts.append(f"a sliding-window cache of {value} tokens (config.{field}={value})")
    if recurrent:
        parts.append(f"layers that keep a recurrent state of their own ({', '.join(recurrent)})")
    return " and ".join(parts) or None


def _first_line(failure: BaseException) -> str:
    return (str(failure).strip().splitlines() or [""])[0][:200]


def adapt_bridge(bridge: TransformerBridge) -> TransformerBridge:
    """Give TransformerLens 4.3's bridge what a newer transformers moved out of its reach.

    transformers 5.24 moved CodeGen's rotary table (``embed_positions``) to the model's
    ``rotary_emb`` and replaced the divisor ``scale_attn`` by its inverse; the CodeGen bridge
    reads both from each attention module, which gets them back as plain attributes.
    """
    model = getattr(bridge, "original_model", None)
    if model is None:
        return bridge
    tables = [
        module.embed_positions
        for name, module in model.named_modules()
        if name.endswith("rotary_emb")
        and isinstance(module.__dict__.get("_buffers"), dict)
        and "embed_positions" in module._buffers
    ]
    if len(tables) != 1:
        return bridge
    for module in model.modules():
        if type(module).__name__ == "CodeGenAttention" and not hasattr(module, "embed_positions"):
            object.__setattr__(module, "embed_positions", tables[0])
            # 5.24 also replaced the divisor sqrt(head_dim) by its inverse, `scaling`.
            divisor = torch.tensor(float(module.head_dim) ** 0.5, dtype=torch.float32)
            object.__setattr__(module, "scale_attn", divisor)
    return bridge
