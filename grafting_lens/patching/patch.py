"""Activation patching between the checkpoints of a model set.

TransformerLens's ``patching`` module patches between two *prompts* on one model; here between
two *checkpoints* of a :class:`~grafting_lens.ModelSet` on the same tokens: where does the
donor's residual stream (or attention output, or one head) carry what makes it answer
differently? ``"sufficiency"`` (``"denoising"``) runs ``target`` and patches in ``source``'s
activations, ``"necessity"`` (``"noising"``) the other way round. A patch imports the donor's
whole upstream computation, a graft only its weights (concept page "Grafting versus patching").

Sites: ``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_out`` and ``mlp_out`` are
``[batch, pos, d_model]``, ``z`` is ``[batch, pos, head, d_head]``; parallel blocks (GPT-NeoX,
Pythia) have no ``resid_mid``. The bridge's ``hook_resid_mid`` is ``ln2``'s input, so a
``resid_mid`` patch rewrites the attention output (``attn_out := patched - resid_pre``).

:func:`resid_patch_sweep` and :func:`head_patch_sweep` give TransformerLens's
``get_act_patch_*`` values, many cells per forward pass, each pass resumed from the first
position and layer its cells patch (how-to "Run a sweep", section "Patching sweeps").

    >>> values, frame = resid_patch_sweep(models, tokens, lambda logits: logits[:, -1, answer])
    >>> frame.pivot(index="layer", columns="pos", values="value")
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union, cast

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm

from grafting_lens.core.arguments import is_integer, shown
from grafting_lens.core.console import show_progress
from grafting_lens.core.errors import (
    ArgumentTypeError,
    GraftingLensError,
    PatchingError,
    check_known,
    did_you_mean,
)
from grafting_lens.engine.positions import (
    PositionSpec,
    check_padding,
    resolve_positions,
    row_lengths,
)
from grafting_lens.models.layers import LayerSpec, resolve_layers
from grafting_lens.models.model_set import ModelSet, check_model_set, token_ids
from grafting_lens.patching.passes import HOOKS, Entries, PatchRun, first_position, plan_passes

__all__ = [
    "DIRECTIONS",
    "LAYER_POSITION_SITES",
    "SITES",
    "Metric",
    "PatchSweep",
    "SweepPositions",
    "available_sites",
    "check_direction",
    "check_site",
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
"""Logits of one cell's prompts (each row's last token, or every position with
``logits="all"``) to ``[batch]`` values or one scalar."""

SweepPositions = Union[str, Sequence[int], Mapping[str, PositionSpec], PositionSpec]
"""The position axis of a sweep: ``"each"``, indices, labelled selections, or one selection."""


class PatchSweep(NamedTuple):
    """A sweep's values and their cells, unpacking like TransformerLens's ``(tensor, index_df)``.

    Attributes:
        values: ``[layer, pos]``, ``[layer, head]`` or ``[layer, pos, head]`` in the order
            asked for, with a trailing ``batch`` axis under ``reduce="none"``.
        frame: One row per cell (and prompt under ``reduce="none"``), in the order of
            ``values.flatten()``: ``site``, ``direction``, the swept axes (``layer``,
            ``pos``, ``head``), ``example`` when per-prompt, and ``value``.
    """

    values: torch.Tensor
    frame: pd.DataFrame


# --------------------------------------------------------------------------- checks


def available_sites(models: ModelSet) -> tuple[str, ...]:
    """The sites the model set's architecture has (no ``resid_mid`` on parallel blocks)."""
    hooks = models.base.hook_dict
    return tuple(site for site in SITES if HOOKS[site].format(layer=0) in hooks)


def check_direction(direction: object, error: type[GraftingLensError] = PatchingError) -> str:
    """The causal question a direction names (:data:`DIRECTIONS`), or ``error``."""
    known = (
        " ('sufficiency' runs the target and imports the source, 'denoising'; 'necessity' "
        "runs the source and imports the target, 'noising')"
    )
    return DIRECTIONS[check_known(direction, DIRECTIONS, "direction", error, known)]


def check_site(site: object, models: ModelSet | None, allowed: Sequence[str] = SITES) -> str:
    """``site`` if it is one of ``allowed`` that ``models`` has (``None``: any architecture)."""
    if site not in allowed:
        hint = (
            " Heads have their own sweep: head_patch_sweep(models, tokens, metric, ...)."
            if site == "z"
            else did_you_mean(str(site), allowed)
        )
        raise (PatchingError if isinstance(site, str) else ArgumentTypeError)(
            f"Unknown site {site!r}.{hint} Sites: {', '.join(allowed)}."
        )
    if models is not None and site not in available_sites(models):
        parallel = getattr(models.base.cfg, "parallel_attn_mlp", False) and site == "resid_mid"
        raise PatchingError(
            f"{models.architecture} has no {site!r} site"
            + (" (attention and MLP read one residual, in parallel)" if parallel else "")
            + f". Its sites are: {', '.join(available_sites(models))}."
        )
    return str(site)


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

    Every selected layer is patched in one forward pass, at each row's own positions.

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` token ids.
        site: One of :data:`SITES` that the architecture has (:func:`available_sites`).
        layers: Which layers to patch (see :func:`~grafting_lens.resolve_layers`).
        positions: ``"all"``, ``"last"``, indices, per-row lists or a ``[batch, pos]``
            boolean tensor (see :func:`~grafting_lens.engine.positions.resolve_positions`).
        source: The checkpoint under study (the donor).
        target: The reference checkpoint (the base).
        heads: For ``site="z"`` only: the heads to patch (default every head).
        attention_mask: ``[batch, pos]`` right padding, used by both runs.
        direction: ``"sufficiency"`` (run ``target``, patch in ``source``'s activations;
            ``"denoising"``) or ``"necessity"`` (the other way; ``"noising"``).
        patch_tokens: Tokens of the giving run, same shape as ``tokens``, for classic
            clean/corrupted patching (then ``source`` may equal ``target``).

    Returns:
        Logits ``[batch, pos, d_vocab]`` of the patched run.

    Raises:
        PatchingError: A site the architecture lacks, a bad head, source, target or
            direction. TokenError, SelectionError, AlignmentError: tokens, layers,
            positions or placements that do not fit. All before any forward pass.
    """
    run, _ = _patch_run(
        models, tokens, site, source, target, direction, attention_mask, patch_tokens
    )
    layer_list = resolve_layers(layers, models.n_layers)
    run.check_layers(layer_list)
    selected = resolve_positions(positions, run.shape, run.cpu_attention_mask)
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
    return run.run(1, {layer: entry for layer in layer_list}, given)


@dataclass(frozen=True)
class _SweepOptions:
    """How both sweeps run and reduce, checked once."""

    reduce: str
    chunk_size: int
    reuse_prefix: bool
    progress: bool | None
    logits: str

    def __post_init__(self) -> None:
        if (
            self.reduce not in ("mean", "none")
            or self.logits not in ("all", "last")
            or not isinstance(self.reuse_prefix, bool)
            or not is_integer(self.chunk_size)
            or self.chunk_size < 1
        ):
            typed = isinstance(self.reduce, str) and isinstance(self.logits, str)
            typed = typed and isinstance(self.reuse_prefix, bool) and is_integer(self.chunk_size)
            raise (PatchingError if typed else ArgumentTypeError)(
                f"A sweep takes reduce='mean' or 'none', logits='last' or 'all', reuse_prefix "
                f"True or False and a chunk_size >= 1 (rows per pass); got {self.reduce!r}, "
                f"{self.logits!r}, {shown(self.reuse_prefix)}, {self.chunk_size!r}."
            )


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
    logits: str = "last",
) -> PatchSweep:
    """Patch each (layer, position) cell of a per-position site alone, batched.

    ``values`` equals TransformerLens's ``get_act_patch_resid_pre`` (likewise ``attn_out``,
    ``mlp_out``; its ``resid_mid`` sweep on the bridge patches only the MLP input).
    ``source``, ``target``, ``direction``, ``patch_tokens`` and ``attention_mask`` are
    :func:`patch_forward`'s.

    Args:
        models: The aligned checkpoints.
        tokens: ``[batch, pos]`` prompts; every cell runs all of them.
        metric: Logits of one cell to ``[batch]`` values or a scalar (:data:`Metric`).
        site: One of :data:`LAYER_POSITION_SITES` (heads: :func:`head_patch_sweep`).
        layers: The layers to sweep (``"all"``, ``"last_half"``, a list...).
        positions: ``"each"``: every index alone (shorter rows stay unpatched in that
            cell); a list of ints (negative ones count from each row's last real token);
            a mapping ``{label: selection}``; anything else (``"all"``, ``"last"``, a
            boolean tensor): one selection and no position axis.
        reduce: ``"mean"`` over the prompts, or ``"none"`` (a trailing ``batch`` axis).
        chunk_size: Rows per forward pass (at least one cell of ``batch`` rows).
        reuse_prefix: Resume each pass from its first patched position and layer (``False``
            for models that take no ``DynamicCache``).
        progress: Show a progress bar over passes (default: where someone watches).
        logits: ``"last"`` (each row's last real token, ``[batch, 1, d_vocab]``, the
            unembedding run there only; the metric is probed on the unpatched run first)
            or ``"all"`` (every position, as TransformerLens).

    Returns:
        A :class:`PatchSweep`: ``values`` ``[layer, pos]`` (``[layer]`` for a single
        selection) and the tidy ``frame``.

    Raises:
        PatchingError: As :func:`patch_forward`, bad sweep options, a metric returning another
            shape than ``[batch]`` or a scalar, or raising (naming the cell); under
            ``logits="last"``, before any pass, a metric raising on the last token's logits
            or (rows unpadded) reading other positions (it needs ``logits="all"``).
    """
    site = check_site(site, None, LAYER_POSITION_SITES)
    options = _SweepOptions(reduce, chunk_size, reuse_prefix, progress, logits)
    run, direction = _patch_run(
        models, tokens, site, source, target, direction, attention_mask, patch_tokens
    )
    return _sweep(run, direction, metric, layers, positions, None, options)


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
    logits: str = "last",
) -> PatchSweep:
    """Patch each attention head's output (``z``) alone, per layer, batched.

    ``positions="all"`` (the default) patches every head at every position: ``values`` is
    ``[layer, head]``, TransformerLens's ``get_act_patch_attn_head_out_all_pos``;
    ``positions="each"`` one position at a time: ``[layer, pos, head]``, as
    ``get_act_patch_attn_head_out_by_pos``. The other arguments are
    :func:`resid_patch_sweep`'s; ``heads`` defaults to every (query) head.

    Raises:
        PatchingError: As :func:`resid_patch_sweep`, and a bad head.
    """
    options = _SweepOptions(reduce, chunk_size, reuse_prefix, progress, logits)
    run, direction = _patch_run(
        models, tokens, "z", source, target, direction, attention_mask, patch_tokens
    )
    return _sweep(run, direction, metric, layers, positions, _heads(heads, "z", models), options)


@torch.no_grad()
def _sweep(
    run: PatchRun,
    direction: str,
    metric: Metric,
    layers: LayerSpec,
    positions: SweepPositions,
    head_list: list[int] | None,
    options: _SweepOptions,
) -> PatchSweep:
    """The engine behind both sweeps: every (layer, position[, head]) cell patched alone."""
    models, site = run.models, run.site
    if not callable(metric):
        raise ArgumentTypeError(
            f"metric must be a function of the logits, got {type(metric).__name__}."
        )
    last_only = options.logits == "last"
    layer_list = resolve_layers(layers, models.n_layers)
    run.check_layers(layer_list)
    position_labels, selections = _position_axis(positions, run.shape, run.cpu_attention_mask)

    every_axis = [("layer", list(layer_list)), ("pos", position_labels), ("head", head_list)]
    axes: list[tuple[str, list]] = [(name, axis) for name, axis in every_axis if axis is not None]
    cells = list(itertools.product(layer_list, range(len(selections)), head_list or (None,)))

    given = run.given_activations(layer_list)
    batch, length = run.shape
    # Where each position cell's first patch is; positions before it need no compute.
    first = [first_position(selection, length) for selection in selections]
    prefix, skip_layers = None, False
    if options.reuse_prefix and (max(first) > 0 or max(layer_list) > 0):
        prefix = run.unpatched_prefix()
        skip_layers = run.can_skip_layers(prefix)
    starts = [
        (first[position] if prefix is not None else 0, layer if skip_layers else 0)
        for layer, position, _ in cells
    ]
    if last_only and not isinstance(metric, LastTokenMetric):
        # The unpatched logits: the prefix's when the sweep resumes from it, else one pass.
        unpatched = prefix.logits if prefix is not None else run.run(1, {}, given)
        _probe_metric(metric, unpatched, run, options.reduce)
    per_pass = max(1, options.chunk_size // batch)
    chunks = plan_passes(starts, per_pass, batch, length, run.pass_costs(last_only))
    nonzero = [selection.nonzero(as_tuple=True) for selection in selections]
    results: list[torch.Tensor] = [torch.empty(0)] * len(cells)
    bar = not show_progress(options.progress) or len(chunks) <= 1
    for chunk in tqdm(chunks, desc=f"{site} sweep", disable=bar):
        grouped: dict[int, list[tuple]] = {}
        for slot, cell in enumerate(chunk):
            layer, position, head = cells[cell]
            prompts, pos = nonzero[position]
            heads = None if head is None else torch.full_like(pos, head)
            grouped.setdefault(layer, []).append((prompts + slot * batch, pos, heads, prompts))
        # Per layer, the cells' rows, positions, heads (all None without heads) and prompts.
        entries = cast(
            Entries,
            {
                layer: tuple(None if part[0] is None else torch.cat(part) for part in zip(*parts))
                for layer, parts in grouped.items()
            },
        )
        pass_logits = run.run(
            len(chunk),
            entries,
            given,
            start=min(starts[cell][0] for cell in chunk),
            prefix=prefix,
            first_layer=min(starts[cell][1] for cell in chunk),
            last_only=last_only,
        )
        for slot, cell in enumerate(chunk):
            cell_logits = pass_logits[slot * batch : (slot + 1) * batch]
            layer, position, head = cells[cell]
            label = None if position_labels is None else position_labels[position]
            cell_axes = (("layer", layer), ("pos", label), ("head", head))
            named = ", ".join(f"{name}={value!r}" for name, value in cell_axes if value is not None)
            where = f"on the cell {named} (logits of shape {list(cell_logits.shape)})."
            returned = _call(metric, cell_logits, where)
            results[cell] = _evaluate(returned, cell_logits, batch, options.reduce)

    shape = [len(values) for _, values in axes]
    values = torch.stack(results).float().cpu()
    values = values.reshape(*shape, batch) if options.reduce == "none" else values.reshape(shape)
    return PatchSweep(values, _frame(axes, values, site, direction, options.reduce))


def _patch_run(
    models: ModelSet,
    tokens: torch.Tensor,
    site: str,
    source: int,
    target: int,
    direction: str,
    attention_mask: torch.Tensor | None,
    patch_tokens: torch.Tensor | None,
) -> tuple[PatchRun, str]:
    """Check what every patch and sweep is given; the run, and the direction's name."""
    check_model_set(models)
    site = check_site(site, models)
    direction = check_direction(direction)
    n = len(models)
    valid = is_integer(source) and is_integer(target) and 0 <= min(source, target)
    if not valid or max(source, target) >= n or (source == target and patch_tokens is None):
        typed = isinstance(source, (int, float)) and isinstance(target, (int, float))
        typed = typed or is_integer(source) and is_integer(target)
        raise (PatchingError if typed else ArgumentTypeError)(
            f"source={source!r} and target={target!r} must be checkpoints of the model set "
            f"(0..{n - 1}), and two different ones unless patch_tokens gives other tokens: "
            "a run patched with its own activations does not change."
        )
    shape = models.check_tokens(tokens, "tokens")
    if patch_tokens is not None and models.check_tokens(patch_tokens, "patch_tokens") != shape:
        raise PatchingError(
            f"patch_tokens have shape {list(patch_tokens.shape)}, tokens have {list(shape)}: "
            "the activations must line up position by position with the run they go into."
        )
    # Padded rows need their attention mask, or "last" is a padding column.
    for checked in (tokens, patch_tokens):
        if checked is not None:
            check_padding(checked, attention_mask, models.tokenizer)
    row_lengths(shape, attention_mask)
    # source (under study) and target (the reference) keep their meaning; which runs changes.
    running, giving = (target, source) if direction == "sufficiency" else (source, target)
    models.check_placement({running, giving}, "This patch")
    run = PatchRun(
        models,
        site=site,
        running=int(running),
        giving=int(giving),
        tokens=token_ids(tokens),
        patch_tokens=None if patch_tokens is None else token_ids(patch_tokens),
        attention_mask=attention_mask,
    )
    return run, direction


def _heads(heads: int | Sequence[int] | None, site: str, models: ModelSet) -> list[int] | None:
    if heads is None:
        return None if site != "z" else list(range(int(models.base.cfg.n_heads)))
    if site != "z":
        raise PatchingError(
            f"heads applies to the per-head site 'z' only, not {site!r}; drop heads=... or "
            "use site='z'."
        )
    n_heads = int(models.base.cfg.n_heads)
    single = is_integer(heads)
    known = single or isinstance(heads, (Sequence, torch.Tensor, np.ndarray))
    head_list: list[Any] = [heads] if single or not known else list(heads)  # type: ignore[arg-type]
    if (
        not head_list
        or not all(is_integer(head) and 0 <= head < n_heads for head in head_list)
        # int(): torch scalars hash by identity, so a set would keep a head given twice.
        or len({int(head) for head in head_list}) != len(head_list)
    ):
        raise (PatchingError if known else ArgumentTypeError)(
            f"heads must be distinct head indices in 0..{n_heads - 1} ({models.architecture} "
            f"has {n_heads} heads per layer): a head index or a list of them, got {shown(heads)}."
        )
    return [int(head) for head in head_list]


def _position_axis(
    spec: SweepPositions, shape: tuple[int, int], attention_mask: torch.Tensor | None
) -> tuple[list | None, list[torch.Tensor]]:
    """Labels and ``[batch, pos]`` selections of a sweep's position cells
    (``(None, [selection])`` for a single selection: no position axis)."""
    if isinstance(spec, str) and spec == "each":
        # One column each; rows shorter than it stay unpatched.
        real = row_lengths(shape, attention_mask)[:, None] > torch.arange(shape[1])
        column = torch.eye(shape[1], dtype=torch.bool)
        return list(range(shape[1])), [real & column[index] for index in range(shape[1])]
    if isinstance(spec, Mapping):
        if not spec:
            raise PatchingError("The mapping of position selections is empty.")
        labels = list(spec)
        return labels, [resolve_positions(spec[label], shape, attention_mask) for label in labels]
    if isinstance(spec, torch.Tensor) and spec.dim() == 1 and not spec.is_floating_point():
        spec = spec.tolist()
    if isinstance(spec, (list, tuple, range)) and spec and all(map(is_integer, spec)):
        indices = [int(index) for index in spec]
        return indices, [resolve_positions(index, shape, attention_mask) for index in indices]
    return None, [resolve_positions(spec, shape, attention_mask)]


class LastTokenMetric:
    """A metric known to read each row's last token only, which a sweep does not probe first
    (for metrics with side effects, such as the comparison's scorer)."""

    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.metric(logits)


def _call(metric: Metric, logits: torch.Tensor, where: str) -> object:
    """What ``metric`` returns on ``logits``; what it raises becomes a PatchingError naming it
    in one line and ``where``."""
    try:
        return metric(logits)
    except Exception as error:
        lines = str(error).strip().splitlines()
        raised = type(error).__name__ + (f": {lines[0]}" if lines else "")
        raise PatchingError(f"The metric raised {raised} {where}") from error


def _probe_metric(metric: Metric, unpatched: torch.Tensor, run: PatchRun, reduce: str) -> None:
    """Refuse, before any patched pass, a metric that ``logits="last"`` would break (raising
    on ``[batch, 1, d_vocab]``) or mislead (unpadded, reading other positions than the last),
    tried on the ``unpatched`` run's logits at every position."""
    batch, length = run.shape
    last_positions = run.last_positions.to(unpatched.device)
    last = unpatched[torch.arange(batch, device=unpatched.device), last_positions][:, None]
    returned = _call(
        metric,
        last,
        "on the unpatched run's logits. Under logits='last' (the default) it gets each row's "
        f"last real token, [batch, 1, d_vocab] = {list(last.shape)}; a metric written for "
        "TransformerLens, which reads every position, needs logits='all'.",
    )
    at_last = _evaluate(returned, last, batch, reduce, per_prompt=True)
    if not bool((last_positions == length - 1).all()):
        return  # right padding: every position's logits are not TransformerLens's input
    try:
        everywhere = _evaluate(metric(unpatched), unpatched, batch, reduce, per_prompt=True)
    except Exception:
        return  # a metric made for [batch, 1, d_vocab] alone
    if reads_other_positions(at_last, everywhere):
        raise PatchingError(
            f"The metric reads positions other than the last: on the unpatched run it gives "
            f"{at_last.flatten()[0].item():.4g} from each row's last token ([batch, 1, d_vocab], "
            f"what logits='last', the default, passes) but {everywhere.flatten()[0].item():.4g} "
            "from every position. Pass logits='all' (every position, as TransformerLens)."
        )


def reads_other_positions(at_last: torch.Tensor, everywhere: torch.Tensor) -> bool:
    """Whether a metric's values from every position's logits differ (beyond float rounding)
    from those from the last token's: it read other positions than the last."""
    scale = 1e-5 * (1.0 + float(at_last.abs().nan_to_num().max()))
    return everywhere.shape == at_last.shape and not torch.allclose(
        at_last, everywhere, rtol=1e-4, atol=scale, equal_nan=True
    )


def _evaluate(
    returned: object, logits: torch.Tensor, batch: int, reduce: str, *, per_prompt: bool = False
) -> torch.Tensor:
    """One cell's value from what the metric ``returned`` on ``logits``: the per-prompt values
    (``reduce="none"``) or their mean (``per_prompt``: as returned, ``[batch]`` or a scalar)."""
    try:
        value = torch.as_tensor(returned).detach().float()
    except (TypeError, ValueError, RuntimeError):
        value = None
    if value is not None and value.dim() == 1 and value.shape[0] == batch:
        return value if reduce == "none" or per_prompt else value.mean()
    if value is not None and value.dim() == 0 and (reduce == "mean" or batch == 1):
        return value if reduce == "mean" or per_prompt else value.reshape(1)
    described = f"shape {list(value.shape)}" if value is not None else type(returned).__name__
    raise PatchingError(
        f"The metric returned {described} from logits of shape {list(logits.shape)}; it must "
        f"return numbers: one per prompt ([{batch}])"
        + (" or a scalar." if reduce == "mean" else ", since reduce='none' keeps them.")
    )


def _frame(
    axes: list[tuple[str, list]], values: torch.Tensor, site: str, direction: str, reduce: str
) -> pd.DataFrame:
    names, labels = (list(column) for column in zip(*axes))
    if reduce == "none":
        names.append("example")
        labels.append(list(range(values.shape[-1])))
    frame = pd.DataFrame(list(itertools.product(*labels)), columns=names)
    frame.insert(0, "direction", direction)
    frame.insert(0, "site", site)
    frame["value"] = values.flatten().numpy()
    return frame
