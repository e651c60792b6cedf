"""Activation patching between the checkpoints of a model set.

What it is
----------
Activation patching runs a model and, at one place in the network (a layer, a
token position, perhaps one attention head), replaces the activation it computed
with the activation another run computed there, then watches what happens to the
output. TransformerLens's ``patching`` module does this between two *prompts* on
one model (a clean and a corrupted run). Here the two runs are two *checkpoints*
of a :class:`~grafting_lens.ModelSet` on the same tokens: the pretrained base and
the finetuned donor. The question becomes "where does the finetuned model's
residual stream (or attention output, or one head) carry what makes it answer
differently?".

Two directions
--------------
* ``direction="sufficiency"`` (*denoising*, in Heimersheim and Nanda's words): run the
  ``target`` (by default the base, source 0) and patch in the ``source``'s
  activations (by default the donor, source 1). A high metric says the source's
  activation at that place is *enough* to make the base behave like the donor.
* ``direction="necessity"`` (*noising*): run the ``source`` and patch in the
  ``target``'s activations. A large drop says the donor *needs* its own activation
  there.

``source`` and ``target`` keep their meaning in both directions (the checkpoint
under study and the reference); only which one runs changes.

Patching against grafting
-------------------------
A patch replaces a whole vector. A residual-stream vector at layer ``l`` and
token ``t`` is the sum of everything computed before it, so patching it imports
every earlier computation of the other model at that position too, and deletes
the running model's own. That is the limit the paper (Nief et al., ICLR 2026)
starts from: activation patching says *where information sits*, not *which
weights put it there*. A graft (:mod:`grafting_lens.engine.graft`) swaps the weights of
a component instead, so the vector added to the stream is what the donor's
component computes *from the base's own stream*; nothing upstream is replaced.
Patching ``attn_out``, ``mlp_out`` or a head's ``z`` sits in between: the
donor's component output, but computed from the donor's stream. Running the
same positions and layers through both tools separates "the donor's stream
carries the answer there" (patching recovers it, grafting may not) from "the
donor's weights compute it from what the base already has" (grafting recovers
it too).

Sites and where they are hooked
-------------------------------
``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_out`` and ``mlp_out`` are
``[batch, pos, d_model]`` vectors (``blocks.{l}.hook_*`` on the bridge); ``z``
is each head's attention-weighted value, ``[batch, pos, head, d_head]``
(``blocks.{l}.attn.hook_z``). Parallel-attention blocks (GPT-NeoX, Pythia) have
no ``resid_mid``: attention and MLP read the same residual. On the 4.x bridge the
``hook_resid_mid`` alias is the input of ``ln2``, not the residual itself:
editing it changes what the MLP reads but not what is added to the MLP output.
So a ``resid_mid`` patch here rewrites the attention output that is added to the
stream (``attn_out := patched - resid_pre``) so that both the MLP and the
residual see the patched vector, as a patch of the residual stream must.

Sweeps, batched
---------------
:func:`resid_patch_sweep` patches every (layer, position) cell and
:func:`head_patch_sweep` every (layer, head) or (layer, position, head) cell,
one at a time, like TransformerLens's ``get_act_patch_*`` functions and with the
same values. Instead of one forward pass per cell, each cell becomes a block of
rows of one large batch (the prompts repeated once per cell, each block hooked
at its own layer, position and head), ``chunk_size`` rows per forward. Rows do
not interact, so the values are those of the cell-by-cell loop. And since a
patch at position ``t`` of layer ``l`` cannot change anything before ``t`` nor
anything below ``l``, a pass starts at the first position and the first layer
its cells patch: it attends over the keys and values the unpatched run cached
for the earlier positions and enters its first block with the unpatched run's
residual stream. Cells that start alike share a pass. A (layer, position)
sweep computes about half of what a cell-by-cell loop does, in a dozen passes.

The metric
----------
A metric maps the logits of one cell, ``[batch, pos, d_vocab]`` for the prompts
in their original order, to one value per prompt (``[batch]``) or to a single
scalar. It is called once per cell, so a metric that indexes per-prompt answers
works unchanged. A per-prompt metric is averaged over the prompts
(``reduce="mean"``) or kept (``reduce="none"``); a scalar one is taken as the
cell's value, which is what TransformerLens's functions expect. To reproduce
``transformer_lens.patching.get_act_patch_resid_pre(models.base, tokens,
donor_cache, m)`` pass a scalar ``m`` as is, or give TransformerLens
``lambda logits: per_prompt(logits).mean()`` for a per-prompt ``per_prompt``.

    >>> from grafting_lens.patching.patch import resid_patch_sweep
    >>> def answer_logit(logits):
    ...     return logits[:, -1, answer_id]
    >>> values, frame = resid_patch_sweep(models, tokens, answer_logit, layers="last_half")
    >>> frame.pivot(index="layer", columns="pos", values="value")
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Union

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from tqdm.auto import tqdm

from grafting_lens.core.arguments import is_integer
from grafting_lens.core.console import show_progress
from grafting_lens.core.errors import (
    AlignmentError,
    PatchingError,
    SelectionError,
    TokenError,
    did_you_mean,
)
from grafting_lens.engine.positions import (
    PositionSpec,
    check_padding,
    resolve_positions,
    row_lengths,
)
from grafting_lens.models.layers import LayerSpec, resolve_layers
from grafting_lens.models.model_set import ModelSet, token_ids
from grafting_lens.patching.passes import (
    HOOKS,
    Entries,
    PatchRun,
    first_position,
    plan_passes,
)

__all__ = [
    "DIRECTIONS",
    "LAYER_POSITION_SITES",
    "SITES",
    "Metric",
    "PatchSweep",
    "PatchingError",
    "SweepPositions",
    "available_sites",
    "head_patch_sweep",
    "patch_forward",
    "resid_patch_sweep",
]

SITES: tuple[str, ...] = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z")
"""Every activation site, in the order a block computes them (``z`` is per head)."""

LAYER_POSITION_SITES: tuple[str, ...] = SITES[:-1]
"""Sites holding one ``d_model`` vector per position: what :func:`resid_patch_sweep` sweeps."""

DIRECTIONS: dict[str, str] = {
    "sufficiency": "sufficiency",
    "denoising": "sufficiency",
    "necessity": "necessity",
    "noising": "necessity",
}
"""Accepted directions, TransformerLens's names mapped to the causal question they answer."""

Metric = Callable[[Float[torch.Tensor, "batch pos d_vocab"]], torch.Tensor]
"""Logits of one cell's prompts to ``[batch]`` values or one scalar (see the module docstring)."""

SweepPositions = Union[str, Sequence[int], Mapping[str, PositionSpec], PositionSpec]
"""The position axis of a sweep: ``"each"``, indices, labelled selections, or one selection."""


class PatchSweep(NamedTuple):
    """A sweep's values and the cell each one belongs to.

    Unpacks like TransformerLens's ``(tensor, index_df)``:
    ``values, frame = resid_patch_sweep(...)``.

    Attributes:
        values: ``[layer, pos]``, ``[layer, head]`` or ``[layer, pos, head]``, with a
            trailing ``batch`` axis when the sweep ran with ``reduce="none"``. Axes
            follow the order of the requested layers, positions and heads.
        frame: One row per cell (and prompt, with ``reduce="none"``), in the order
            of ``values.flatten()``: columns ``site``, ``direction``, ``layer``,
            ``pos`` and/or ``head`` for the swept axes, ``example`` when
            per-prompt, and ``value``.
    """

    values: torch.Tensor
    frame: pd.DataFrame


# --------------------------------------------------------------------------- public


def available_sites(models: ModelSet) -> tuple[str, ...]:
    """The sites the model set's architecture has (no ``resid_mid`` on parallel blocks)."""
    hooks = models.base.hook_dict
    return tuple(site for site in SITES if HOOKS[site].format(layer=0) in hooks)


@torch.no_grad()
def patch_forward(
    models: ModelSet,
    tokens: Int[torch.Tensor, "batch pos"],
    site: str,
    layers: LayerSpec = "all",
    positions: PositionSpec = "all",
    source: int = 1,
    target: int = 0,
    heads: int | Sequence[int] | None = None,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    *,
    direction: str = "sufficiency",
    patch_tokens: Int[torch.Tensor, "batch pos"] | None = None,
) -> Float[torch.Tensor, "batch pos d_vocab"]:
    """Logits of one checkpoint run with another's activations patched in at one site.

    Every selected layer is patched in the same forward pass, at each row's own
    selected positions.

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` token ids.
        site: One of :data:`SITES` that the architecture has (see :func:`available_sites`).
        layers: Which layers to patch, as for grafts (see :func:`~grafting_lens.resolve_layers`):
            ``"all"``, an int, a list, ``"last_half"``, ``(0.5, 1.0)``...
        positions: Where to patch in each row (see
            :func:`~grafting_lens.engine.positions.resolve_positions`): ``"all"``, ``"last"``,
            indices, per-row lists, or a ``[batch, pos]`` boolean tensor such as a
            first-entity span or a complement.
        source: The checkpoint under study (the donor).
        target: The reference checkpoint (the base).
        heads: For ``site="z"`` only: the heads to patch (default every head).
        attention_mask: ``[batch, pos]`` right padding, used by both runs.
        direction: ``"sufficiency"`` (run ``target``, patch in ``source``'s
            activations; alias ``"denoising"``) or ``"necessity"`` (run ``source``,
            patch in ``target``'s; alias ``"noising"``).
        patch_tokens: Tokens for the run the activations come from, when it should
            see other tokens than the patched run (classic clean/corrupted patching;
            then ``source`` may equal ``target``). Same shape as ``tokens``.

    Returns:
        Logits ``[batch, pos, d_vocab]`` of the patched run.

    Raises:
        PatchingError: An unknown site or one the architecture lacks, a layer or
            head out of range, positions that do not fit the tokens, tokens of the
            wrong shape or vocabulary, or a bad source, target or direction. All
            checked before any forward pass.

    Examples:
        >>> fe = gl.engine.positions.span_positions(tokens.shape, starts=1, ends=3)
        >>> logits = patch_forward(models, tokens, "resid_pre", layers=range(0, 6), positions=fe)
    """
    run, _ = _patch_run(
        models,
        tokens,
        site=site,
        source=source,
        target=target,
        direction=direction,
        attention_mask=attention_mask,
        patch_tokens=patch_tokens,
    )
    layer_list = _layers(layers, models.n_layers)
    run.check_layers(layer_list)
    selected = _positions(positions, run.shape, run.cpu_attention_mask)
    head_list = _heads(heads, site, models)
    given = run.given_activations(layer_list)
    rows, pos = selected.nonzero(as_tuple=True)
    entry: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]
    if head_list is None:
        entry = (rows, pos, None, rows)
    else:  # every selected (row, position) once per head
        n_heads = len(head_list)
        rows, pos = rows.repeat_interleave(n_heads), pos.repeat_interleave(n_heads)
        entry = (rows, pos, torch.tensor(head_list).repeat(len(rows) // n_heads), rows)
    entries: Entries = {layer: entry for layer in layer_list}
    return run.run(1, entries, given)


def resid_patch_sweep(
    models: ModelSet,
    tokens: Int[torch.Tensor, "batch pos"],
    metric: Metric,
    site: str = "resid_pre",
    layers: LayerSpec = "all",
    positions: SweepPositions = "each",
    *,
    source: int = 1,
    target: int = 0,
    direction: str = "sufficiency",
    patch_tokens: Int[torch.Tensor, "batch pos"] | None = None,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    reduce: str = "mean",
    chunk_size: int = 64,
    reuse_prefix: bool = True,
    progress: bool | None = None,
    logits: str = "all",
) -> PatchSweep:
    """Patch each (layer, position) cell of a per-position site alone, batched.

    With the defaults, ``values`` equals TransformerLens's
    ``get_act_patch_resid_pre(models.base, tokens, donor_cache, metric)`` with
    ``_, donor_cache = models[1].run_with_cache(tokens)`` (likewise ``attn_out``,
    ``mlp_out``; TransformerLens has no ``resid_post`` sweep, and its
    ``resid_mid`` sweep on the bridge patches only the MLP input, see the module
    docstring), in ``ceil(cells * batch / chunk_size)`` forward passes (plus one
    of the donor and one unpatched) instead of one per cell.

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` prompts; every cell runs all of them.
        metric: Logits ``[batch, pos, d_vocab]`` of one cell to ``[batch]`` values or
            a scalar (see the module docstring).
        site: One of :data:`LAYER_POSITION_SITES`; heads are swept by
            :func:`head_patch_sweep`.
        layers: The layers to sweep, as for grafts (``"all"``, ``"last_half"``, a list...).
        positions: The position axis. ``"each"``: every index ``0..pos-1`` alone
            (rows shorter than an index stay unpatched in that cell); a list of
            ints: those indices (negative ones count from each row's last real
            token); a mapping ``{label: selection}``: one cell per labelled
            selection, e.g. ``{"FE": fe_mask, "LT": "last", "rest": rest_mask}``;
            anything else (``"all"``, ``"last"``, a boolean tensor): one selection
            and no position axis.
        source: The checkpoint under study (the donor).
        target: The reference checkpoint (the base).
        direction: ``"sufficiency"`` (run ``target``, patch in ``source``) or
            ``"necessity"`` (run ``source``, patch in ``target``).
        patch_tokens: Tokens for the run the activations come from (default ``tokens``).
        attention_mask: ``[batch, pos]`` right padding.
        reduce: ``"mean"`` (average a per-prompt metric over the prompts) or
            ``"none"`` (keep a trailing ``batch`` axis; needs a per-prompt metric).
        chunk_size: Rows per forward pass; each cell takes ``batch`` rows (at
            least one cell per pass). Memory grows with it (the logits alone are
            ``chunk_size * pos * d_vocab`` floats).
        reuse_prefix: Compute each pass only from its first patched position and
            layer on, resuming the unpatched run's cached keys and values and its
            residual stream (one extra forward pass, and half of one to check that
            resuming mid-model reproduces it; about twice as fast for a
            (layer, ``"each"``) sweep). ``False`` recomputes every position and
            layer, for bridges whose model cannot take a ``DynamicCache``.
        progress: Show a progress bar over forward passes (default: when standard
            error is a terminal or in a notebook, see
            :func:`~grafting_lens.core.console.show_progress`).
        logits: ``"all"``: the metric gets the logits of every position, as
            TransformerLens's functions give them. ``"last"``: only each row's
            last real token, as ``[batch, 1, d_vocab]`` (``logits[:, -1]`` still
            reads it): the unembedding then runs on one position per row, which
            on GPT-2 saves about a third of the compute and, with a large
            vocabulary, most of the memory.

    Returns:
        A :class:`PatchSweep`: ``values`` ``[layer, pos]`` (``[layer]`` for a single
        selection) and the tidy ``frame``.

    Raises:
        PatchingError: Bad site, layers, positions, tokens, source, target,
            direction, ``reduce`` or ``chunk_size`` (before any forward pass), or a
            metric returning another shape than ``[batch]`` or a scalar.
    """
    if site == "z":
        raise PatchingError(
            "resid_patch_sweep sweeps per-position sites; sweep attention heads with "
            "head_patch_sweep(models, tokens, metric, ...)."
        )
    return _sweep(
        models,
        tokens,
        metric,
        site=site,
        layers=layers,
        positions=positions,
        head_list=None,
        source=source,
        target=target,
        direction=direction,
        patch_tokens=patch_tokens,
        attention_mask=attention_mask,
        reduce=reduce,
        chunk_size=chunk_size,
        reuse_prefix=reuse_prefix,
        progress=progress,
        logits=logits,
    )


def head_patch_sweep(
    models: ModelSet,
    tokens: Int[torch.Tensor, "batch pos"],
    metric: Metric,
    layers: LayerSpec = "all",
    heads: int | Sequence[int] | None = None,
    positions: SweepPositions = "all",
    *,
    source: int = 1,
    target: int = 0,
    direction: str = "sufficiency",
    patch_tokens: Int[torch.Tensor, "batch pos"] | None = None,
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    reduce: str = "mean",
    chunk_size: int = 64,
    reuse_prefix: bool = True,
    progress: bool | None = None,
    logits: str = "all",
) -> PatchSweep:
    """Patch each attention head's output (``z``) alone, per layer, batched.

    With ``positions="all"`` (the default) every head is patched at every
    position: ``values`` is ``[layer, head]`` and equals TransformerLens's
    ``get_act_patch_attn_head_out_all_pos``. With ``positions="each"`` the
    head is patched one position at a time: ``[layer, pos, head]``, equal to
    ``get_act_patch_attn_head_out_by_pos``.

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` prompts.
        metric: Logits of one cell to ``[batch]`` values or a scalar.
        layers: The layers to sweep.
        heads: The heads to sweep (default every head, ``0..n_heads-1``; query
            heads on grouped-query models).
        positions: A single selection (``"all"``, ``"last"``, a boolean tensor...)
            patched for every head, or a position axis as in
            :func:`resid_patch_sweep` (``"each"``, indices, labelled selections).
        source: As in :func:`resid_patch_sweep`.
        target: As in :func:`resid_patch_sweep`.
        direction: As in :func:`resid_patch_sweep`.
        patch_tokens: As in :func:`resid_patch_sweep`.
        attention_mask: As in :func:`resid_patch_sweep`.
        reduce: As in :func:`resid_patch_sweep`.
        chunk_size: As in :func:`resid_patch_sweep`.
        reuse_prefix: As in :func:`resid_patch_sweep`.
        progress: As in :func:`resid_patch_sweep`.
        logits: As in :func:`resid_patch_sweep`.

    Returns:
        A :class:`PatchSweep` with ``values`` ``[layer, head]`` or ``[layer, pos, head]``.

    Raises:
        PatchingError: As :func:`resid_patch_sweep`, and a head index out of range.
    """
    all_heads = range(int(models.base.cfg.n_heads)) if heads is None else heads
    head_list = _heads(all_heads, "z", models)
    return _sweep(
        models,
        tokens,
        metric,
        site="z",
        layers=layers,
        positions=positions,
        head_list=head_list,
        source=source,
        target=target,
        direction=direction,
        patch_tokens=patch_tokens,
        attention_mask=attention_mask,
        reduce=reduce,
        chunk_size=chunk_size,
        reuse_prefix=reuse_prefix,
        progress=progress,
        logits=logits,
    )


@torch.no_grad()
def _sweep(
    models: ModelSet,
    tokens: torch.Tensor,
    metric: Metric,
    *,
    site: str,
    layers: LayerSpec,
    positions: SweepPositions,
    head_list: list[int] | None,
    source: int,
    target: int,
    direction: str,
    patch_tokens: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    reduce: str,
    chunk_size: int,
    reuse_prefix: bool,
    progress: bool | None,
    logits: str,
) -> PatchSweep:
    """The engine behind both sweeps: every (layer, position[, head]) cell patched alone."""
    run, direction = _patch_run(
        models,
        tokens,
        site=site,
        source=source,
        target=target,
        direction=direction,
        attention_mask=attention_mask,
        patch_tokens=patch_tokens,
    )
    if logits not in ("all", "last"):
        raise PatchingError(
            f"logits must be 'all' (every position) or 'last' (each row's last real token), "
            f"got {logits!r}."
        )
    last_only = logits == "last"
    if site not in LAYER_POSITION_SITES and head_list is None:
        raise PatchingError(f"Site {site!r} is not a per-position site.")
    if reduce not in ("mean", "none"):
        raise PatchingError(f"reduce must be 'mean' or 'none', got {reduce!r}.")
    if not is_integer(chunk_size) or chunk_size < 1:
        raise PatchingError(f"chunk_size must be a positive number of rows, got {chunk_size!r}.")
    chunk_size = int(chunk_size)
    if not callable(metric):
        raise PatchingError(
            f"metric must be a function of the logits, got {type(metric).__name__}."
        )
    layer_list = _layers(layers, models.n_layers)
    run.check_layers(layer_list)
    position_labels, selections = _position_axis(positions, run.shape, run.cpu_attention_mask)

    axes: list[tuple[str, list]] = [("layer", list(layer_list))]
    if position_labels is not None:
        axes.append(("pos", position_labels))
    if head_list is not None:
        axes.append(("head", head_list))
    cells = list(
        itertools.product(
            layer_list,
            range(len(selections)),
            [None] if head_list is None else head_list,
        )
    )

    given = run.given_activations(layer_list)
    batch, length = run.shape
    # Where each position cell's first patch is; positions before it need no compute.
    first = [first_position(selection, length) for selection in selections]
    prefix, skip_layers = None, False
    if reuse_prefix and (max(first) > 0 or max(layer_list) > 0):
        prefix = run.unpatched_prefix()
        skip_layers = run.can_skip_layers(prefix)
    starts = [
        (first[position] if prefix is not None else 0, layer if skip_layers else 0)
        for layer, position, _ in cells
    ]
    per_pass = max(1, chunk_size // batch)
    chunks = plan_passes(starts, per_pass, batch, length, run.pass_costs(last_only))
    nonzero = [selection.nonzero(as_tuple=True) for selection in selections]
    results: list[torch.Tensor] = [torch.empty(0)] * len(cells)
    for chunk in tqdm(
        chunks, desc=f"{site} sweep", disable=not show_progress(progress) or len(chunks) <= 1
    ):
        grouped: dict[
            int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]]
        ]
        grouped = {}
        for slot, cell in enumerate(chunk):
            layer, position, head = cells[cell]
            prompts, pos = nonzero[position]
            heads = None if head is None else torch.full_like(pos, head)
            grouped.setdefault(layer, []).append((prompts + slot * batch, pos, heads, prompts))
        entries: Entries = {
            layer: (
                torch.cat([part[0] for part in parts]),
                torch.cat([part[1] for part in parts]),
                None
                if parts[0][2] is None
                else torch.cat([heads for _, _, heads, _ in parts if heads is not None]),
                torch.cat([part[3] for part in parts]),
            )
            for layer, parts in grouped.items()
        }
        start = min(starts[cell][0] for cell in chunk)
        first_layer = min(starts[cell][1] for cell in chunk)
        pass_logits = run.run(
            len(chunk),
            entries,
            given,
            start=start,
            prefix=prefix,
            first_layer=first_layer,
            last_only=last_only,
        )
        for slot, cell in enumerate(chunk):
            cell_logits = pass_logits[slot * batch : (slot + 1) * batch]
            results[cell] = _evaluate(metric, cell_logits, batch, reduce)

    shape = [len(values) for _, values in axes]
    values = torch.stack(results).float().cpu()
    values = values.reshape(*shape, batch) if reduce == "none" else values.reshape(shape)
    return PatchSweep(values, _frame(axes, values, site=site, direction=direction, reduce=reduce))


# ------------------------------------------------------------------- validation


def _patch_run(
    models: ModelSet,
    tokens: torch.Tensor,
    *,
    site: str,
    source: int,
    target: int,
    direction: str,
    attention_mask: torch.Tensor | None,
    patch_tokens: torch.Tensor | None,
) -> tuple[PatchRun, str]:
    """Check what every patch and sweep is given; the run, and the direction's name."""
    if not isinstance(models, ModelSet):
        raise PatchingError(
            f"Expected a ModelSet, got {type(models).__name__}. Load the checkpoints with "
            "grafting_lens.load_models(base, donor, ...)."
        )
    site = _check_site(site, models)
    direction = _check_direction(direction)
    for name, index in (("source", source), ("target", target)):
        if not is_integer(index) or not 0 <= index < len(models):
            raise PatchingError(
                f"{name}={index!r}, but the model set has {len(models)} sources "
                f"(0..{len(models) - 1})."
            )
    source, target = int(source), int(target)
    if source == target and patch_tokens is None:
        raise PatchingError(
            f"source and target are both {source}: patching a run with its own activations "
            "changes nothing. Pick two checkpoints, or pass patch_tokens to patch in the "
            "same checkpoint's activations on other tokens."
        )
    shape = _check_tokens(models, tokens, "tokens")
    if patch_tokens is not None:
        patch_shape = _check_tokens(models, patch_tokens, "patch_tokens")
        if patch_shape != shape:
            raise PatchingError(
                f"patch_tokens have shape {list(patch_shape)}, tokens have "
                f"{list(shape)}: the patched-in activations must line up position "
                "by position with the run they are patched into."
            )
    try:
        # Padded rows need their attention mask, or "last" is a padding column.
        for checked in (tokens, patch_tokens):
            if checked is not None:
                check_padding(checked, attention_mask, models.tokenizer)
        if attention_mask is not None:
            row_lengths(shape, attention_mask)
    except SelectionError as error:
        raise PatchingError(str(error)) from error
    # The checkpoint under study (source) and the reference (target) keep their meaning
    # in both directions; only which of them runs changes.
    running, giving = (target, source) if direction == "sufficiency" else (source, target)
    try:
        models.check_placement({running, giving}, "This patch")
    except AlignmentError as error:
        raise PatchingError(str(error)) from error
    run = PatchRun(
        models,
        site=site,
        running=running,
        giving=giving,
        tokens=token_ids(tokens),
        patch_tokens=None if patch_tokens is None else token_ids(patch_tokens),
        attention_mask=attention_mask,
    )
    return run, direction


def _check_tokens(models: ModelSet, tokens: object, name: str) -> tuple[int, int]:
    try:
        return models.check_tokens(tokens, name)
    except TokenError as error:
        raise PatchingError(str(error)) from error


def _check_site(site: object, models: ModelSet) -> str:
    if site not in SITES:
        raise PatchingError(
            f"Unknown site {site!r}.{did_you_mean(str(site), SITES)} Sites: {', '.join(SITES)}."
        )
    available = available_sites(models)
    if site not in available:
        why = ""
        if site == "resid_mid" and getattr(models.base.cfg, "parallel_attn_mlp", False):
            why = (
                " (its blocks run attention and the MLP in parallel on the same residual, so "
                "there is no residual between them)"
            )
        raise PatchingError(
            f"{models.architecture} has no {site!r} site{why}. Its sites are: "
            f"{', '.join(available)}."
        )
    return str(site)


def _check_direction(direction: object) -> str:
    if direction not in DIRECTIONS:
        raise PatchingError(
            f"Unknown direction {direction!r}.{did_you_mean(str(direction), DIRECTIONS)} Use "
            "'sufficiency' (run the target, patch in the source's activations; 'denoising') "
            "or 'necessity' (run the source, patch in the target's; 'noising')."
        )
    return DIRECTIONS[str(direction)]


def _layers(spec: LayerSpec, n_layers: int) -> tuple[int, ...]:
    try:
        return resolve_layers(spec, n_layers)
    except SelectionError as error:
        raise PatchingError(str(error)) from error


def _positions(
    spec: PositionSpec, shape: tuple[int, int], attention_mask: torch.Tensor | None
) -> Bool[torch.Tensor, "batch pos"]:
    try:
        return resolve_positions(spec, shape, attention_mask)
    except SelectionError as error:
        raise PatchingError(str(error)) from error


def _heads(heads: int | Sequence[int] | None, site: str, models: ModelSet) -> list[int] | None:
    if heads is None:
        return None if site != "z" else list(range(int(models.base.cfg.n_heads)))
    if site != "z":
        raise PatchingError(
            f"heads applies to the per-head site 'z' only, not {site!r}; drop heads=... or "
            "use site='z'."
        )
    n_heads = int(models.base.cfg.n_heads)
    head_list = [heads] if is_integer(heads) else list(heads)  # type: ignore[arg-type]
    if not head_list:
        raise PatchingError("heads selects no head.")
    for head in head_list:
        if not is_integer(head):
            raise PatchingError(f"Head indices must be ints, got {head!r}.")
        if not 0 <= head < n_heads:
            raise PatchingError(
                f"Head {head} is out of range: {models.architecture} has {n_heads} heads per "
                f"layer (0..{n_heads - 1})."
            )
    if len(set(head_list)) != len(head_list):
        raise PatchingError(f"heads lists a head twice: {head_list}.")
    return [int(head) for head in head_list]


def _position_axis(
    spec: SweepPositions, shape: tuple[int, int], attention_mask: torch.Tensor | None
) -> tuple[list | None, list[torch.Tensor]]:
    """Labels and ``[batch, pos]`` selections of a sweep's position cells.

    Returns ``(None, [selection])`` for a single selection (no position axis).
    """
    batch, length = shape
    if isinstance(spec, str) and spec == "each":
        lengths = row_lengths(shape, attention_mask)
        selections = []
        for index in range(length):
            selection = torch.zeros(shape, dtype=torch.bool)
            selection[:, index] = lengths > index  # shorter rows stay unpatched
            selections.append(selection)
        return list(range(length)), selections
    if isinstance(spec, Mapping):
        if not spec:
            raise PatchingError("The mapping of position selections is empty.")
        labels = list(spec)
        return labels, [_positions(spec[label], shape, attention_mask) for label in labels]
    if isinstance(spec, torch.Tensor) and spec.dim() == 1 and not spec.is_floating_point():
        spec = spec.tolist()
    if isinstance(spec, range):
        spec = list(spec)
    if isinstance(spec, (list, tuple)) and spec and all(is_integer(index) for index in spec):
        return [int(index) for index in spec], [
            _positions(index, shape, attention_mask) for index in spec
        ]
    return None, [_positions(spec, shape, attention_mask)]


_NUMERIC_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _evaluate(metric: Metric, logits: torch.Tensor, batch: int, reduce: str) -> torch.Tensor:
    """One cell's value: the per-prompt values (``reduce="none"``) or their mean."""
    returned = metric(logits)
    try:
        value = torch.as_tensor(returned).detach()
    except (TypeError, ValueError, RuntimeError):
        value = None
    if value is None or not (value.is_floating_point() or value.dtype in _NUMERIC_DTYPES):
        raise PatchingError(
            f"The metric returned {type(returned).__name__} {returned!r:.60}; it must return "
            f"numbers: a tensor of one value per prompt ([{batch}]) or a single scalar."
        )
    if value.dim() == 1 and value.shape[0] == batch:
        return value.float() if reduce == "none" else value.float().mean()
    if value.dim() == 0:
        if reduce == "none":
            if batch == 1:
                return value.float().reshape(1)
            raise PatchingError(
                "reduce='none' keeps one value per prompt, but the metric returned a scalar. "
                f"Return a [batch] tensor ({batch} values), or use reduce='mean'."
            )
        return value.float()
    raise PatchingError(
        f"The metric returned shape {list(value.shape)}; it must return one value per prompt "
        f"([{batch}]) or a single scalar, from logits of shape {list(logits.shape)}."
    )


def _frame(
    axes: list[tuple[str, list]], values: torch.Tensor, *, site: str, direction: str, reduce: str
) -> pd.DataFrame:
    names = [name for name, _ in axes]
    labels = [labels for _, labels in axes]
    if reduce == "none":
        names.append("example")
        labels.append(list(range(values.shape[-1])))
    frame = pd.DataFrame(list(itertools.product(*labels)), columns=names)
    frame.insert(0, "direction", direction)
    frame.insert(0, "site", site)
    frame["value"] = values.flatten().numpy()
    return frame
