"""Position grafting: which token positions need the finetuned weights to recall a fact?

The paper's first experiment (section 4.1) grafts *every* weight of the finetuned
model (SFT) onto the pretrained one (PRE), but only at some token positions, and
asks whether the fact comes back. Grafting at a position means that position's
residual stream is computed by the finetuned weights, and so are the keys and
values it offers to later positions; every other position runs the pretrained
weights. Eight configurations, named as in the paper's figures:

====================  ============================================================
``PRE``               nothing grafted: the pretrained model
``SFT``               every position grafted
``FE``                the first entity's tokens (the actor named in the prompt)
``LT``                the last token (where the answer is predicted)
``FE+LT``             both
``(FE+LT)^C``         every position except the first entity and the last token
``FE^C``              every position except the first entity (so LT included)
``LT^C``              every position except the last token (so FE included)
====================  ============================================================

The paper finds FE+LT recovers nearly all of SFT's accuracy while ``(FE+LT)^C``
stays near PRE: finetuned facts are retrieved along two paths, "enrichment" while
reading the entity and "recall" just before answering.

Which weights: by default every component except the unembedding. Grafted
positions read the finetuned embeddings, and every position predicts through the
pretrained unembedding, as in the paper ("we use the finetuned embeddings for all
grafted token positions and use the original model's unembeddings"). So the
``SFT`` row is the finetuned model with the pretrained unembedding; pass
``include_unembed=True`` to make it exactly the finetuned model, or
``include_embeddings=False`` to keep the pretrained embeddings everywhere.

The configurations are a small registry (:data:`POSITION_CONFIGS`, extended with
:func:`register_position_config`): each maps the token spans of a batch to a
boolean ``[batch, pos]`` tensor of grafted positions. :func:`run_position_grafting`
runs all of them over a tokenized batch, stacking the configurations of the same
examples as rows of one forward pass, and returns one row per example and
configuration.

Example:
    >>> from grafting_lens import data
    >>> examples = data.make_examples(relations, prompt="headline")
    >>> batch = data.tokenize_examples(examples, models.tokenizer)
    >>> results = run_position_grafting(models, batch)
    >>> metrics.summarize(results)  # top-1/top-5 accuracy per configuration
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Int
from tqdm.auto import tqdm

from grafting_lens import metrics
from grafting_lens.errors import GraftingLensError, did_you_mean
from grafting_lens.graft import graft_forward
from grafting_lens.masks import GraftMask
from grafting_lens.models import ModelSet
from grafting_lens.positions import complement, last_token, resolve_positions

__all__ = [
    "PAPER_CONFIGS",
    "POSITION_CONFIGS",
    "PositionConfig",
    "config_positions",
    "position_grafting_components",
    "position_grafting_masks",
    "register_position_config",
    "run_position_grafting",
]

Spans = Mapping[str, Bool[torch.Tensor, "batch pos"]]
"""Named token spans of a batch, e.g. ``TokenizedExamples.spans``."""

PositionConfig = Callable[[Spans, Int[torch.Tensor, "batch pos"]], Bool[torch.Tensor, "batch pos"]]
"""``(spans, attention_mask) -> grafted positions``; never selects padding."""

RESULT_COLUMNS = (
    "example",
    "relation_id",
    "prompt",
    "direction",
    "text",
    "config",
    "target",
    "target_id",
    "target_rank",
    "target_prob",
    "top1",
    "top5",
    "topk_tokens",
    "topk_ids",
    "topk_probs",
)
"""Columns of :func:`run_position_grafting`'s table, in order."""


def _span(spans: Spans, name: str) -> torch.Tensor:
    if name in spans:
        return spans[name].bool().cpu()
    raise GraftingLensError(
        f"This configuration needs the {name!r} span, but the batch has only "
        f"{sorted(spans)}. Tokenize with grafting_lens.data.tokenize_examples, which marks it."
    )


def _real(attention_mask: torch.Tensor) -> torch.Tensor:
    return resolve_positions("all", tuple(attention_mask.shape), attention_mask.cpu())


def _first_entity(spans: Spans, attention_mask: torch.Tensor) -> torch.Tensor:
    return _span(spans, "first_entity")


def _last_token(spans: Spans, attention_mask: torch.Tensor) -> torch.Tensor:
    # The last real token is fully determined by the padding; a batch built by
    # hand need not mark it.
    if "last_token" in spans:
        return spans["last_token"].bool().cpu()
    return last_token(tuple(attention_mask.shape), attention_mask.cpu())


def _both(spans: Spans, attention_mask: torch.Tensor) -> torch.Tensor:
    return _first_entity(spans, attention_mask) | _last_token(spans, attention_mask)


POSITION_CONFIGS: dict[str, PositionConfig] = {
    "PRE": lambda spans, mask: torch.zeros(tuple(mask.shape), dtype=torch.bool),
    "SFT": lambda spans, mask: _real(mask),
    "FE": _first_entity,
    "LT": _last_token,
    "FE+LT": _both,
    "(FE+LT)^C": lambda spans, mask: complement(_both(spans, mask), mask.cpu()),
    "FE^C": lambda spans, mask: complement(_first_entity(spans, mask), mask.cpu()),
    "LT^C": lambda spans, mask: complement(_last_token(spans, mask), mask.cpu()),
}
"""Every known configuration: the paper's eight, then any registered later."""

PAPER_CONFIGS: tuple[str, ...] = tuple(POSITION_CONFIGS)
"""The paper's eight labels, in the order of its figures; the default everywhere."""


def register_position_config(name: str, positions: PositionConfig, overwrite: bool = False) -> None:
    """Add a configuration, e.g. ``"M"`` for the movie title's tokens.

    Args:
        name: The label it gets in result tables and figures.
        positions: ``(spans, attention_mask) -> [batch, pos]`` boolean tensor.
        overwrite: Allow replacing an existing configuration.

    Raises:
        GraftingLensError: The name is taken (and ``overwrite`` is False) or
            ``positions`` is not callable.

    Example:
        >>> register_position_config("M", lambda spans, mask: spans["movie"])
    """
    if not callable(positions):
        raise GraftingLensError(
            f"positions must be a function (spans, attention_mask) -> tensor, got {positions!r}."
        )
    if name in POSITION_CONFIGS and not overwrite:
        raise GraftingLensError(
            f"A position configuration named {name!r} exists; pass overwrite=True to replace it."
        )
    POSITION_CONFIGS[name] = positions


def config_positions(
    name: str, spans: Spans, attention_mask: Int[torch.Tensor, "batch pos"]
) -> Bool[torch.Tensor, "batch pos"]:
    """The positions configuration ``name`` grafts in each row.

    Raises:
        GraftingLensError: An unknown name (the message lists the known ones), a
            span the configuration needs but the batch lacks, or a result that is
            not a boolean ``[batch, pos]`` tensor outside the padding.
    """
    _check_names([name])
    attention_mask = torch.as_tensor(attention_mask).cpu()
    selected = POSITION_CONFIGS[name](spans, attention_mask)
    if not isinstance(selected, torch.Tensor) or selected.dtype != torch.bool:
        raise GraftingLensError(
            f"Position configuration {name!r} returned {type(selected).__name__}"
            + (f" of {selected.dtype}" if isinstance(selected, torch.Tensor) else "")
            + "; it must return a boolean [batch, pos] tensor."
        )
    # resolve_positions checks the shape and that no padding is selected.
    return resolve_positions(selected.cpu(), tuple(attention_mask.shape), attention_mask)


def position_grafting_components(
    models: ModelSet, include_unembed: bool = False, include_embeddings: bool = True
) -> tuple[str, ...]:
    """The components a position graft swaps: all of them except, by default, ``unembed``.

    Args:
        models: The model set (components the architecture lacks are left out).
        include_unembed: Also predict through the donor's unembedding at grafted
            positions.
        include_embeddings: Read the donor's token (and position) embeddings at
            grafted positions, as the paper does.
    """
    left_out = set()
    if not include_unembed:
        left_out.add("unembed")
    if not include_embeddings:
        left_out.update({"embed", "pos_embed"})
    return tuple(name for name in models.components if name not in left_out)


def position_grafting_masks(
    models: ModelSet,
    spans: Spans,
    attention_mask: Int[torch.Tensor, "batch pos"],
    configs: Sequence[str] = PAPER_CONFIGS,
    components: str | Iterable[str] | None = None,
    source: int = 1,
) -> GraftMask:
    """One graft mask for several configurations, stacked along the batch.

    Rows ``i * batch .. (i + 1) * batch - 1`` are configuration ``configs[i]`` of
    the batch's rows, so the tokens must be repeated the same way:
    ``tokens.repeat(len(configs), 1)``. The result equals :meth:`GraftMask.cat` of
    one mask per configuration; it is built in one go instead because every
    configuration grafts the same components, so all ``(component, layer)`` pairs
    can share one ``[len(configs) * batch, pos]`` tensor, which the graft splits
    into positions once per forward pass rather than once per pair.

    Args:
        models: The model set.
        spans: Named ``[batch, pos]`` spans of the batch.
        attention_mask: ``[batch, pos]``, right padded.
        configs: Names in :data:`POSITION_CONFIGS`.
        components: What to graft at the chosen positions (default:
            :func:`position_grafting_components`).
        source: Index of the donor in the model set.

    Raises:
        GraftingLensError: An unknown configuration or a missing span.
    """
    configs = _check_names(configs)
    attention_mask = torch.as_tensor(attention_mask).cpu()
    if components is None:
        components = position_grafting_components(models)
    positions = torch.cat([config_positions(name, spans, attention_mask) for name in configs])
    return GraftMask.build(
        models,
        tuple(positions.shape),
        positions=positions,
        layers="all",
        components=components,
        source=source,
        attention_mask=attention_mask.repeat(len(configs), 1),
    )


def run_position_grafting(
    models: ModelSet,
    tokenized: Any,
    configs: Sequence[str] = PAPER_CONFIGS,
    batch_size: int = 8,
    *,
    components: str | Iterable[str] | None = None,
    include_unembed: bool = False,
    include_embeddings: bool = True,
    source: int = 1,
    top_k: int = 10,
    progress: bool = True,
) -> pd.DataFrame:
    """Run position-grafting configurations over a tokenized batch and score each prediction.

    The examples are taken ``batch_size`` at a time; each forward pass holds every
    configuration of those examples (``batch_size * len(configs)`` rows), built with
    :meth:`GraftMask.cat` over the repeated tokens. Each chunk is cut to its own
    longest row, so a long prompt elsewhere in the batch costs nothing here. Rows
    are independent, so the result does not depend on ``batch_size``.

    Args:
        models: Base (source 0, PRE) and donor (``source``, SFT).
        tokenized: A :class:`grafting_lens.data.TokenizedExamples` (or anything with
            ``tokens``, ``attention_mask``, ``target_ids``, ``spans`` and
            ``examples``): right-padded prompts ending right before the answer.
        configs: Names in :data:`POSITION_CONFIGS`, in the order wanted in tables.
        batch_size: Examples per forward pass.
        components: What to graft; overrides ``include_unembed`` and
            ``include_embeddings``. Default: :func:`position_grafting_components`.
        include_unembed: Graft the unembedding too (then ``SFT`` is exactly the donor).
        include_embeddings: Graft the token and position embeddings.
        source: Index of the donor in the model set.
        top_k: How many top tokens to list per row (``topk_tokens``, ``topk_ids``,
            ``topk_probs``).
        progress: Show a progress bar.

    Returns:
        A tidy DataFrame, one row per configuration and example (grouped by
        configuration, in ``configs`` order), with the columns of
        :data:`RESULT_COLUMNS`: ``example`` (row in ``tokenized``), ``relation_id``,
        ``prompt``, ``direction``, ``text``, ``config``, ``target`` (the answer's
        text), ``target_id`` (its first token), ``target_rank`` (0 = top-1),
        ``target_prob``, ``top1`` and ``top5`` (booleans), ``topk_tokens`` (decoded),
        ``topk_ids`` and ``topk_probs``.

    Raises:
        GraftingLensError: An unknown configuration (the message lists the known
            ones), an empty batch, a bad ``batch_size``, or a batch whose parts
            disagree in shape.
    """
    configs = _check_names(configs)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise GraftingLensError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    tokens, attention_mask, target_ids, spans, examples = _unpack(tokenized)
    if components is None:
        components = position_grafting_components(models, include_unembed, include_embeddings)
    tokenizer = models.tokenizer
    n_examples = tokens.shape[0]
    per_config: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    starts = range(0, n_examples, batch_size)
    with torch.inference_mode():
        for start in tqdm(starts, desc="position grafting", disable=not progress, unit="batch"):
            stop = min(start + batch_size, n_examples)
            chunk_mask = attention_mask[start:stop]
            length = int(chunk_mask.sum(dim=1).max())
            chunk_mask = chunk_mask[:, :length]
            chunk_tokens = tokens[start:stop, :length]
            chunk_spans = {name: value[start:stop, :length] for name, value in spans.items()}
            mask = position_grafting_masks(
                models, chunk_spans, chunk_mask, configs, components=components, source=source
            )
            repeats = len(configs)
            logits = graft_forward(
                models,
                chunk_tokens.repeat(repeats, 1),
                mask,
                attention_mask=chunk_mask.repeat(repeats, 1),
            )
            final = metrics.last_token_logits(
                logits, chunk_mask.repeat(repeats, 1).to(logits.device)
            )
            targets = target_ids[start:stop].repeat(repeats)
            ranks = metrics.target_rank(final, targets).cpu()
            probabilities = metrics.target_probability(final, targets).cpu()
            top = metrics.top_k_tokens(final, min(top_k, final.shape[-1]), tokenizer)
            top_ids, top_probabilities = top.ids.cpu().tolist(), top.probabilities.cpu().tolist()
            for block, name in enumerate(configs):
                for offset in range(stop - start):
                    row = block * (stop - start) + offset
                    example_index = start + offset
                    example = examples[example_index] if examples is not None else None
                    rank = int(ranks[row])
                    per_config[name].append(
                        {
                            "example": example_index,
                            "relation_id": getattr(example, "relation_id", None),
                            "prompt": getattr(example, "prompt_name", None),
                            "direction": getattr(example, "direction", None),
                            "text": getattr(example, "text", None),
                            "config": name,
                            "target": getattr(example, "target", None),
                            "target_id": int(target_ids[example_index]),
                            "target_rank": rank,
                            "target_prob": float(probabilities[row]),
                            "top1": rank < 1,
                            "top5": rank < 5,
                            "topk_tokens": top.strings[row] if top.strings is not None else None,
                            "topk_ids": top_ids[row],
                            "topk_probs": [round(p, 6) for p in top_probabilities[row]],
                        }
                    )
    rows = [row for name in configs for row in per_config[name]]
    return pd.DataFrame(rows, columns=list(RESULT_COLUMNS))


def _check_names(configs: Sequence[str] | str) -> list[str]:
    if isinstance(configs, str):
        configs = [configs]
    configs = list(configs)
    if not configs:
        raise GraftingLensError(
            f"No configuration given; choose from {', '.join(POSITION_CONFIGS)}."
        )
    for name in configs:
        if name not in POSITION_CONFIGS:
            raise GraftingLensError(
                f"Unknown position-grafting configuration {name!r}."
                f"{did_you_mean(str(name), POSITION_CONFIGS)} Known: {', '.join(POSITION_CONFIGS)}."
            )
    if len(set(configs)) != len(configs):
        raise GraftingLensError(f"A configuration is listed twice: {configs}.")
    return configs


def _unpack(tokenized: Any):
    missing = [
        name
        for name in ("tokens", "attention_mask", "target_ids", "spans")
        if not hasattr(tokenized, name)
    ]
    if missing:
        raise GraftingLensError(
            f"run_position_grafting needs a tokenized batch with tokens, attention_mask, "
            f"target_ids and spans; {type(tokenized).__name__} lacks {missing}. Build one with "
            "grafting_lens.data.tokenize_examples(examples, models.tokenizer)."
        )
    tokens = torch.as_tensor(tokenized.tokens).cpu()
    if tokens.dim() != 2 or tokens.shape[0] == 0:
        raise GraftingLensError(
            f"tokens must be a non-empty [batch, pos] tensor, got shape {tuple(tokens.shape)}."
        )
    shape = tuple(tokens.shape)
    attention_mask = tokenized.attention_mask
    attention_mask = (
        torch.ones(shape, dtype=torch.long)
        if attention_mask is None
        else torch.as_tensor(attention_mask).cpu().long()
    )
    if tuple(attention_mask.shape) != shape:
        raise GraftingLensError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, the tokens have {shape}."
        )
    target_ids = torch.as_tensor(tokenized.target_ids).cpu().long()
    if tuple(target_ids.shape) != (shape[0],):
        raise GraftingLensError(
            f"target_ids has shape {tuple(target_ids.shape)}; expected one id per example, "
            f"({shape[0]},)."
        )
    spans = {name: torch.as_tensor(value).cpu() for name, value in dict(tokenized.spans).items()}
    for name, value in spans.items():
        if tuple(value.shape) != shape:
            raise GraftingLensError(
                f"The span {name!r} has shape {tuple(value.shape)}, the tokens have {shape}."
            )
    examples = getattr(tokenized, "examples", None)
    if examples is not None and len(examples) != shape[0]:
        raise GraftingLensError(
            f"The batch has {len(examples)} examples but {shape[0]} rows of tokens."
        )
    return tokens, attention_mask, target_ids, spans, examples
