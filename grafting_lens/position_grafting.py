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
:func:`register_position_config`) of :class:`~grafting_lens.experiments.GraftConfig` s,
each one graft at a span expression (``"FE+LT"``, ``"(FE+LT)^C"``; see
:func:`~grafting_lens.experiments.select_positions`). :func:`run_position_grafting`
runs them over one tokenized batch through the general runner,
:func:`grafting_lens.experiments.run_experiment` (which also runs grids of model sets and
prompts, and saves and resumes long runs), stacking the configurations of the same
examples as rows of one forward pass, and returns one row per example and
configuration. The movie-title variants (``M``, ``FE+M``...) are in
:data:`grafting_lens.experiments.MOVIE_CONFIGS`.

Examples:
    >>> from grafting_lens import data
    >>> examples = data.make_examples(relations, prompt="headline")
    >>> batch = data.tokenize_examples(examples, models.tokenizer)
    >>> results = run_position_grafting(models, batch)
    >>> metrics.summarize(results)  # top-1/top-5 accuracy per configuration
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Int

from grafting_lens import experiments
from grafting_lens.errors import GraftingLensError
from grafting_lens.experiments import (
    Graft,
    GraftConfig,
    PositionFunction,
    Spans,
    TestSet,
    select_positions,
)
from grafting_lens.masks import GraftMask
from grafting_lens.models import ModelSet

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

PositionConfig = PositionFunction
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

POSITION_CONFIGS: dict[str, GraftConfig] = experiments.POSITION_CONFIGS
"""Every known configuration: the paper's eight, then any registered later (the same
registry as :data:`grafting_lens.experiments.POSITION_CONFIGS`)."""

PAPER_CONFIGS: tuple[str, ...] = experiments.PAPER_POSITION_CONFIGS
"""The paper's eight labels, in the order of its figures; the default everywhere."""


def register_position_config(
    name: str, positions: str | PositionConfig, overwrite: bool = False
) -> None:
    """Add a configuration, e.g. ``"REL"`` for the relation words.

    Args:
        name: The label it gets in result tables and figures.
        positions: A span expression (``"REL"``, ``"FE+REL+LT"``) or a function
            ``(spans, attention_mask) -> [batch, pos]`` boolean tensor.
        overwrite: Allow replacing an existing configuration.

    Raises:
        GraftingLensError: The name is taken (and ``overwrite`` is False), or
            ``positions`` is neither a span expression nor callable.

    Examples:
        >>> register_position_config("REL", "REL")
    """
    if not (callable(positions) or isinstance(positions, str)):
        raise GraftingLensError(
            f"positions must be a span expression such as 'FE+LT' or a function "
            f"(spans, attention_mask) -> tensor, got {positions!r}."
        )
    if name in POSITION_CONFIGS and not overwrite:
        raise GraftingLensError(
            f"A position configuration named {name!r} exists; pass overwrite=True to replace it."
        )
    POSITION_CONFIGS[name] = GraftConfig(name, (Graft(positions),))


def config_positions(
    name: str, spans: Spans, attention_mask: Int[torch.Tensor, "batch pos"]
) -> Bool[torch.Tensor, "batch pos"]:
    """The positions configuration ``name`` grafts in each row.

    Raises:
        GraftingLensError: An unknown name (the message lists the known ones), a
            span the configuration needs but the batch lacks, or a result that is
            not a boolean ``[batch, pos]`` tensor outside the padding.
    """
    (config,) = _configs([name])
    attention_mask = torch.as_tensor(attention_mask).cpu()
    selected = torch.zeros(tuple(attention_mask.shape), dtype=torch.bool)
    for graft in config.grafts:
        selected |= select_positions(graft.positions, spans, attention_mask)
    return selected


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
    return experiments.resolve_components(
        "all", models, include_unembed=include_unembed, include_embeddings=include_embeddings
    )


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
    one mask per configuration; it is built in one go (see
    :func:`grafting_lens.experiments.config_masks`) so that all ``(component, layer)``
    pairs share one ``[len(configs) * batch, pos]`` tensor, which the graft splits
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
    return experiments.config_masks(
        models, _configs(configs, components, source), spans, attention_mask
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

    A thin wrapper over :func:`grafting_lens.experiments.run_experiment` for one model set
    and one batch, kept in memory. The examples are taken ``batch_size`` at a time; each
    forward pass holds every configuration of those examples
    (``batch_size * len(configs)`` rows). Each pass is cut to its own longest row, and
    examples go in order of length, so little padding is computed. Rows are
    independent, so the result does not depend on ``batch_size``.

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
        ``topk_ids`` and ``topk_probs``. For a grid, more columns and saved, resumable
        runs, use :func:`grafting_lens.experiments.run_experiment`.

    Raises:
        GraftingLensError: An unknown configuration (the message lists the known
            ones), an empty batch, a bad ``batch_size``, or a batch whose parts
            disagree in shape.
    """
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
    explicit = components is not None
    results = experiments.run_experiment(
        models,
        TestSet(tokenized),
        _configs(configs, components, source),
        batch_size=batch_size,
        chunk_size=max(64, batch_size) if isinstance(batch_size, int) else 64,
        # Explicit components are taken as given; the flags only filter the default "all".
        include_unembed=include_unembed or explicit,
        include_embeddings=include_embeddings or explicit,
        top_k=top_k,
        progress=progress,
    )
    return results.loc[:, list(RESULT_COLUMNS)]


def _configs(
    names: Sequence[str] | str,
    components: str | Iterable[str] | None = None,
    source: int = 1,
) -> list[GraftConfig]:
    """The registered configurations, with the components and source asked for."""
    configs = experiments.get_configs(names, POSITION_CONFIGS, kind="position-grafting")
    if components is None and source == 1:
        return configs
    if components is not None and not isinstance(components, str):
        components = tuple(components)
    return [
        GraftConfig(
            config.name,
            tuple(
                Graft(
                    graft.positions,
                    graft.components if components is None else components,
                    graft.layers,
                    source,
                )
                for graft in config.grafts
            ),
            config.tags,
            config.description,
        )
        for config in configs
    ]
