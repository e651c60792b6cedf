"""How a patch or a sweep runs: hooks, resumed passes, and cells planned into passes.

Internal to :mod:`grafting_lens.patching.patch`, which checks every argument and hands this
module a :class:`PatchRun`: the *running* checkpoint, the *giving* one whose activations are
patched in, and the tokens. How a sweep is batched and resumed: the how-to "Run a sweep".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Union

import torch
from jaxtyping import Bool
from transformers import DynamicCache

from grafting_lens.core.compat import cache_visible, cached_forward_kwargs, check_cache_continuation
from grafting_lens.core.errors import PatchingError
from grafting_lens.engine.positions import row_lengths
from grafting_lens.models.model_set import ModelSet

HOOKS = {
    "resid_pre": "blocks.{layer}.hook_resid_pre",
    "resid_mid": "blocks.{layer}.hook_resid_mid",
    "resid_post": "blocks.{layer}.hook_resid_post",
    "attn_out": "blocks.{layer}.hook_attn_out",
    "mlp_out": "blocks.{layer}.hook_mlp_out",
    "z": "blocks.{layer}.attn.hook_z",
}
"""The bridge's hook of each site, per layer."""

# Per layer: row, position and head (or None) of every patched entry, and the prompt
# (row of the activations patched in) each one takes its value from.
Entries = dict[int, tuple[torch.Tensor, torch.Tensor, Union[torch.Tensor, None], torch.Tensor]]


class UnpatchedPrefix(NamedTuple):
    """The unpatched run: its logits, keys and values, and each block's residual input."""

    logits: torch.Tensor
    cache: DynamicCache
    residuals: list[torch.Tensor]


# Whether a bridge reproduces its own run when resumed mid-model (see
# PatchRun.can_skip_layers); a property of the architecture, checked once per bridge.
_RESUMABLE: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


class PatchRun:
    """One checked patch or sweep: checkpoint ``running`` on ``tokens`` with ``giving``'s
    activations at ``site`` (from ``patch_tokens``, else ``tokens``) patched in."""

    def __init__(
        self,
        models: ModelSet,
        *,
        site: str,
        running: int,
        giving: int,
        tokens: torch.Tensor,
        patch_tokens: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> None:
        self.models = models
        self.site = site
        self.running_model, self.giving_model = models[running], models[giving]
        self.shape = (int(tokens.shape[0]), int(tokens.shape[1]))
        self.cpu_attention_mask = None if attention_mask is None else attention_mask.cpu()
        device = models.device
        self.tokens = tokens.to(device)
        self.patch_tokens = self.tokens if patch_tokens is None else patch_tokens.to(device)
        self.attention_mask = None if attention_mask is None else attention_mask.to(device)
        self.n_heads = int(models.base.cfg.n_heads)
        lengths = row_lengths(self.shape, self.cpu_attention_mask)
        self.last_positions = (lengths - 1).to(device)
        self._distinct_last_positions = torch.unique(self.last_positions)  # sorted

    def check_layers(self, layers: Sequence[int]) -> None:
        hooks = self.running_model.hook_dict
        for layer in layers:
            if HOOKS[self.site].format(layer=layer) not in hooks:
                raise PatchingError(
                    f"Layer {layer} of {self.models.architecture} has no {self.site!r} site."
                )

    def given_activations(self, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """The activations to patch in, from one forward pass of the giving checkpoint."""
        sites = (self.site, "resid_pre", "attn_out") if self.site == "resid_mid" else (self.site,)
        names = [HOOKS[site].format(layer=layer) for layer in layers for site in sites]
        stored: dict[str, torch.Tensor] = {}
        hooks = [(name, _keeper(stored, name)) for name in names]
        self.giving_model.run_with_hooks(
            self.patch_tokens, attention_mask=self.attention_mask, return_type=None, fwd_hooks=hooks
        )
        if self.site == "resid_mid":
            for layer in layers:
                check_resid_mid(self.models, layer, stored)
        given = {layer: stored[HOOKS[self.site].format(layer=layer)] for layer in layers}
        if self.site == "z":
            given = {layer: per_head(value, self.n_heads) for layer, value in given.items()}
        return given

    def unpatched_prefix(self) -> UnpatchedPrefix:
        """The run model's own logits, keys, values and residual stream, to resume from."""
        cache = DynamicCache()
        residuals: list[Any] = [None] * self.models.n_layers
        what = "patching with reuse_prefix=True (pass reuse_prefix=False)"
        check_cache_continuation(self.running_model, what, PatchingError)
        with cache_visible(self.running_model):
            logits = self.running_model.run_with_hooks(
                self.tokens,
                attention_mask=self.attention_mask,
                return_type="logits",
                fwd_hooks=[
                    (HOOKS["resid_pre"].format(layer=layer), _keeper(residuals, layer))
                    for layer in range(self.models.n_layers)
                ],
                **cached_forward_kwargs(self.running_model, cache),
            )
        return UnpatchedPrefix(logits, cache, residuals)

    def can_skip_layers(self, prefix: UnpatchedPrefix) -> bool:
        """Whether resuming from a later block reproduces the unpatched run (checked once
        per bridge: a forward that indexes per-layer settings by loop position would not)."""
        known = _RESUMABLE.get(self.running_model)
        if known is not None:
            return known
        if self._block_list() is None or self.models.n_layers < 2:
            return False
        start = 1 if self.shape[1] > 1 else 0
        middle = self.models.n_layers // 2
        logits = self.run(1, {}, {}, start=start, prefix=prefix, first_layer=middle)
        expected = prefix.logits
        scale = float(expected.abs().max()) + 1e-6
        _RESUMABLE[self.running_model] = bool((logits - expected).abs().max() <= 1e-3 * scale)
        return _RESUMABLE[self.running_model]

    def _last(
        self,
        computed: torch.Tensor,
        start: int,
        repeats: int,
        prefix: UnpatchedPrefix | None,
        kept: torch.Tensor,
    ) -> torch.Tensor:
        """Each row's last-token logits, ``[rows, 1, d_vocab]``, from ``computed`` (the logits
        of absolute positions ``kept``), or from the unpatched run for rows ending before it."""
        # The logits are on the unembedding's device, not necessarily the tokens'.
        device = computed.device
        last = self.last_positions.repeat(repeats).to(device)
        kept = kept.to(device)
        rows = torch.arange(len(last), device=device)
        if len(kept) == 0:
            return computed[rows % self.shape[0], last][:, None]
        column = torch.searchsorted(kept, last.clamp(min=start)).clamp(max=len(kept) - 1)
        logits = computed[rows, column]
        early = last < start
        if bool(early.any()):
            assert prefix is not None
            where = prefix.logits.device
            taken = prefix.logits[(rows[early] % self.shape[0]).to(where), last[early].to(where)]
            logits[early] = taken.to(device)
        return logits[:, None]

    def pass_costs(self, last_only: bool) -> tuple[int, float, float]:
        """What :func:`plan_passes` needs: layers, the unembedding's cost in blocks, and a
        pass's fixed cost in tokens (large on an accelerator, where launches dominate)."""
        block = sum(parameter.numel() for parameter in self.running_model.blocks[0].parameters())
        cfg = self.running_model.cfg
        unembed = cfg.d_vocab * cfg.d_model / max(block, 1)
        if last_only:
            unembed /= self.shape[1]  # one position per row instead of every one
        overhead = 64.0 if self.tokens.device.type == "cpu" else 1024.0
        return self.models.n_layers, unembed, overhead

    def _block_list(self) -> tuple[torch.nn.Module, str] | None:
        """The module and attribute name holding the Hugging Face model's decoder layers."""
        blocks = getattr(self.running_model, "blocks", None)
        if not blocks:
            return None
        for name, module in self.running_model.original_model.named_modules():
            if isinstance(module, torch.nn.ModuleList) and len(module) == len(blocks):
                if all(mine is theirs for mine, theirs in zip(module, blocks)):
                    parent, _, attribute = name.rpartition(".")
                    return self.running_model.original_model.get_submodule(parent), attribute
        return None

    def run(
        self,
        repeats: int,
        entries: Entries,
        given: dict[int, torch.Tensor],
        *,
        start: int = 0,
        prefix: UnpatchedPrefix | None = None,
        first_layer: int = 0,
        last_only: bool = False,
    ) -> torch.Tensor:
        """The patched run's logits, every entry written in one forward pass of the tokens
        repeated ``repeats`` times along the batch (entry positions are absolute).

        ``start > 0`` computes positions ``start..pos-1`` only, over ``prefix``'s keys and
        values; ``first_layer > 0`` enters that block with the unpatched residual stream;
        ``last_only`` gives each row's last real token alone, ``[rows, 1, d_vocab]``.
        """
        hooks = []
        for layer, (rows, pos, heads, prompts) in entries.items():
            if len(rows) == 0:
                continue
            # Taken where the giving run left them (its layer's device), written where the
            # running model computes that layer: on a layer-split model, neither the embedding's.
            source = given[layer]
            extra = () if heads is None else (heads,)
            values = source[tuple(part.to(source.device) for part in (prompts, pos, *extra))]
            index = (rows, pos - start, *extra)
            hooks.extend(site_hooks(self.site, layer, index, values, self.n_heads))
        entry = self.tokens.repeat(repeats, 1)[:, start:]
        mask = None if self.attention_mask is None else self.attention_mask.repeat(repeats, 1)
        options: dict[str, object] = {}
        if last_only:
            kept = self._distinct_last_positions
            kept = kept[kept >= start]
            if len(kept) == 0:  # no row reaches the computed window: nothing changes
                assert prefix is not None
                return self._last(prefix.logits, start, repeats, prefix, kept)
            options["logits_to_keep"] = kept - start
        if start > 0:
            assert prefix is not None
            past = DynamicCache()
            cached: Any  # a DynamicCache layer: keys and values [batch, heads, pos, d_head]
            for layer, cached in enumerate(prefix.cache.layers):
                past.update(
                    cached.keys[..., :start, :].repeat(repeats, 1, 1, 1),
                    cached.values[..., :start, :].repeat(repeats, 1, 1, 1),
                    layer,
                )
            options.update(cached_forward_kwargs(self.running_model, past))
        blocks = None
        if first_layer:  # enter that block with the unpatched residual, the blocks before it out
            assert prefix is not None
            entry = prefix.residuals[first_layer][:, start:].repeat(repeats, 1, 1)
            options["start_at_layer"] = first_layer
            parent, attribute = self._block_list()  # type: ignore[misc]
            blocks = (parent, attribute, getattr(parent, attribute))
            setattr(parent, attribute, torch.nn.ModuleList(list(blocks[2])[first_layer:]))
        try:
            with cache_visible(self.running_model):
                rest = self.running_model.run_with_hooks(
                    entry, attention_mask=mask, return_type="logits", fwd_hooks=hooks, **options
                )
        finally:
            if blocks is not None:
                setattr(*blocks)
        if last_only:
            return self._last(rest, start, repeats, prefix, kept)
        if start == 0:
            return rest
        assert prefix is not None  # start > 0 resumes from it
        logits = rest.new_empty((rest.shape[0], start + rest.shape[1], rest.shape[2]))
        per_cell = logits.view(repeats, -1, *logits.shape[1:])
        per_cell[:, :, :start] = prefix.logits[:, :start]  # the same for every cell
        logits[:, start:] = rest
        return logits


def _keeper(stored: dict | list, key: Any) -> Callable:
    """A hook keeping its activation, detached, in ``stored[key]`` (the name asked for)."""

    def hook(activation, hook):
        stored[key] = activation.detach()

    return hook


def site_hooks(
    site: str,
    layer: int,
    index: tuple[torch.Tensor, ...],
    values: torch.Tensor,
    n_heads: int,
) -> list[tuple[str, Callable]]:
    """Hooks that write ``values`` at ``index`` of ``site`` at ``layer`` (out of place), each
    on its activation's device (``index`` and ``values`` copied there once)."""
    placed: dict[torch.device, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}

    def on(device: torch.device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        if device not in placed:
            placed[device] = (tuple(part.to(device) for part in index), values.to(device))
        return placed[device]

    if site == "resid_mid":
        # The bridge's hook_resid_mid is ln2's input, not the residual the MLP output joins:
        # writing attn_out = patched - resid_pre puts the patched vector in both places.
        captured: dict[str, torch.Tensor] = {}

        def capture(activation, hook):
            captured["resid_pre"] = activation
            return activation

        def write_attention(activation, hook):
            where, value = on(activation.device)
            update = value.to(activation.dtype) - captured["resid_pre"][where]
            return activation.index_put(where, update)

        return [
            (HOOKS["resid_pre"].format(layer=layer), capture),
            (HOOKS["attn_out"].format(layer=layer), write_attention),
        ]

    def write(activation, hook):
        shaped = per_head(activation, n_heads) if site == "z" else activation
        where, value = on(activation.device)
        patched = shaped.index_put(where, value.to(activation.dtype))
        return patched.reshape(activation.shape)

    return [(HOOKS[site].format(layer=layer), write)]


def plan_passes(
    starts: list[tuple[int, int]],
    per_pass: int,
    rows_per_cell: int,
    length: int,
    costs: tuple[int, float, float],
) -> list[list[int]]:
    """Group cells into forward passes of at most ``per_pass`` cells: cell indices per pass.

    Cells are tiled over the grid of ``starts`` (each cell's first position and first layer)
    with every power-of-two tile shape; the tiling of lowest modelled cost wins, a pass
    costing ``(rows * tokens + overhead) * (blocks + unembedding)`` (``costs``:
    :meth:`PatchRun.pass_costs`), each cell adding ``rows_per_cell`` rows of ``length``.
    """
    n_layers, unembed, overhead = costs
    position_index = {value: i for i, value in enumerate(sorted({p for p, _ in starts}))}
    layer_index = {value: i for i, value in enumerate(sorted({layer for _, layer in starts}))}

    def cost(cells: list[int]) -> float:
        start = min(starts[cell][0] for cell in cells)
        layer = min(starts[cell][1] for cell in cells)
        tokens = len(cells) * rows_per_cell * (length - start)
        return (tokens + overhead) * (n_layers - layer + unembed)

    def tiling(tile_positions: int, tile_layers: int) -> list[list[int]]:
        tiles: dict[tuple[int, int], list[int]] = {}
        for cell, (start, layer) in enumerate(starts):
            key = (position_index[start] // tile_positions, layer_index[layer] // tile_layers)
            tiles.setdefault(key, []).append(cell)
        passes = []
        for key in sorted(tiles):
            members = sorted(tiles[key], key=lambda cell: starts[cell])
            passes += [members[i : i + per_pass] for i in range(0, len(members), per_pass)]
        return passes

    def sizes(n: int) -> list[int]:
        return sorted({min(2**power, n) for power in range(n.bit_length() + 1)})

    candidates = [
        tiling(tile_positions, tile_layers)
        for tile_positions in sizes(len(position_index))
        for tile_layers in sizes(len(layer_index))
    ]
    return min(candidates, key=lambda passes: sum(map(cost, passes)))


def first_position(selection: Bool[torch.Tensor, "batch pos"], length: int) -> int:
    """The first position a selection patches in any row (the last one if it patches none)."""
    columns = selection.any(dim=0).nonzero()
    return int(columns[0]) if len(columns) else length - 1


def per_head(activation: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``hook_z`` as ``[batch, pos, head, d_head]``, whether the bridge gives it flat or split."""
    return activation if activation.dim() == 4 else activation.unflatten(-1, (n_heads, -1))


def check_resid_mid(models: ModelSet, layer: int, stored: dict[str, torch.Tensor]) -> None:
    """Refuse blocks whose mid residual is not resid_pre + attn_out (scaled residuals)."""
    pre = stored[HOOKS["resid_pre"].format(layer=layer)]
    attention = stored[HOOKS["attn_out"].format(layer=layer)]
    mid = stored[HOOKS["resid_mid"].format(layer=layer)]
    scale = float(mid.abs().max()) + 1e-6
    if float((pre + attention - mid).abs().max()) > 1e-4 * scale:
        raise PatchingError(
            f"In {models.architecture}, blocks.{layer}.hook_resid_mid is not hook_resid_pre + "
            "hook_attn_out (the block scales or normalises attention before adding it), so the "
            "residual between attention and MLP cannot be patched. Patch 'attn_out' or "
            "'resid_pre' instead."
        )
