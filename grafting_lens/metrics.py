"""Scoring next-token predictions: ranks, probabilities, top-k hits and their uncertainty.

The paper scores a relation as recalled when the first token of the answer is
among the model's top five next-token candidates at the prompt's last token
(top-5 accuracy). Top-1 is too strict for small models that hesitate between
parts of speech (" the" versus a name) or between tokenizations of one name
(" Rob", " Robert"); the rank of the target, and its probability, say how close
a miss was. Everything here starts from the logits at the last *real* token of
each row (:func:`last_token_logits` picks them out of a right-padded batch).

Definitions, fixed once so every table agrees:

* ``rank``: the number of vocabulary entries whose logit is strictly greater than
  the target's. 0 means the target is the top prediction. Ties are resolved in
  the target's favour, which only matters for exactly equal float logits.
* top-k hit: ``rank < k``. This is the same as "the target is in ``topk(k)``"
  except when ties straddle the k-th place.
* probability: softmax of the logits, computed in float32.

Aggregates come with a percentile bootstrap confidence interval of the mean
(:func:`bootstrap_ci`), because a toy experiment has tens of examples, and a
difference of five points between two configurations means nothing without
one. :func:`summarize` turns a tidy results table (one row per example and
configuration, as :func:`grafting_lens.position_grafting.run_position_grafting`
returns) into one row per configuration and prompt.

Examples:
    >>> final = last_token_logits(logits, attention_mask)
    >>> ranks = target_rank(final, target_ids)
    >>> hits = top_k_hit(final, target_ids, k=5)
    >>> summarize(results).loc[:, ["config", "prompt", "top5", "top5_low", "top5_high"]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int

from grafting_lens.errors import GraftingLensError

__all__ = [
    "TopTokens",
    "bootstrap_ci",
    "last_token_logits",
    "summarize",
    "target_probability",
    "target_rank",
    "top_k_hit",
    "top_k_tokens",
]


class TopTokens(NamedTuple):
    """The ``k`` most likely next tokens of each row, best first.

    Attributes:
        ids: ``[batch, k]`` token ids.
        probabilities: ``[batch, k]`` softmax probabilities.
        strings: Per row, the ``k`` decoded tokens (``None`` when no tokenizer was given).
    """

    ids: Int[torch.Tensor, "batch k"]
    probabilities: Float[torch.Tensor, "batch k"]
    strings: list[list[str]] | None


# ------------------------------------------------------------------- per example


def last_token_logits(
    logits: Float[torch.Tensor, "batch pos d_vocab"],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Float[torch.Tensor, "batch d_vocab"]:
    """The logits at the last real (non-padding) token of each row.

    Args:
        logits: Model output for a right-padded batch.
        attention_mask: Ones then zeros in each row; ``None`` means no padding,
            so the last position of every row is taken.

    Raises:
        GraftingLensError: Logits that are not ``[batch, pos, d_vocab]``, or an
            attention mask of another shape or with an empty row.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise GraftingLensError(
            "last_token_logits expects [batch, pos, d_vocab] logits, got " + _describe(logits) + "."
        )
    batch, positions, _ = logits.shape
    if attention_mask is None:
        return logits[:, -1]
    if tuple(attention_mask.shape) != (batch, positions):
        raise GraftingLensError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, the logits have "
            f"[batch, pos] = {[batch, positions]}."
        )
    lengths = attention_mask.to(torch.long).sum(dim=1)
    if (lengths == 0).any():
        raise GraftingLensError(
            "A row of attention_mask has no real token, so it has no last token."
        )
    rows = torch.arange(batch, device=logits.device)
    return logits[rows, (lengths - 1).to(logits.device)]


def target_rank(
    logits: Float[torch.Tensor, "batch d_vocab"], target_ids: Int[torch.Tensor, " batch"]
) -> Int[torch.Tensor, " batch"]:
    """Rank of each target among the vocabulary: 0 when it is the top prediction.

    The rank counts the tokens whose logit is strictly greater than the target's,
    so ties go to the target (see the module docstring).

    Args:
        logits: Logits at the last real token of each row (:func:`last_token_logits`).
        target_ids: The correct next token of each row.

    Raises:
        GraftingLensError: Shapes that do not match, or a target outside the vocabulary.
    """
    logits, target_ids = _check(logits, target_ids)
    target_logit = logits.gather(1, target_ids[:, None])
    return (logits > target_logit).sum(dim=1)


def target_probability(
    logits: Float[torch.Tensor, "batch d_vocab"], target_ids: Int[torch.Tensor, " batch"]
) -> Float[torch.Tensor, " batch"]:
    """Softmax probability of each target, computed in float32.

    Raises:
        GraftingLensError: Shapes that do not match, or a target outside the vocabulary.
    """
    logits, target_ids = _check(logits, target_ids)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(1, target_ids[:, None]).squeeze(1).exp()


def top_k_hit(
    logits: Float[torch.Tensor, "batch d_vocab"], target_ids: Int[torch.Tensor, " batch"], k: int
) -> Bool[torch.Tensor, " batch"]:
    """Whether each target is among the ``k`` most likely tokens (``rank < k``).

    Raises:
        GraftingLensError: ``k < 1``, shapes that do not match, or a target
            outside the vocabulary.
    """
    _check_k(k)
    return target_rank(logits, target_ids) < k


def top_k_tokens(
    logits: Float[torch.Tensor, "batch d_vocab"], k: int = 10, tokenizer: Any = None
) -> TopTokens:
    """The ``k`` most likely next tokens of each row, with probabilities and text.

    The paper lists the top ten tokens of sample predictions: they show whether a
    miss was a near miss (another tokenization of the name, a co-star from another
    relation) or the model answering something else entirely.

    Args:
        logits: Logits at the last real token of each row.
        k: How many tokens; at most the vocabulary size.
        tokenizer: Decodes each id on its own (``tokenizer.decode([id])``); without
            one, ``strings`` is ``None``.

    Raises:
        GraftingLensError: ``k`` outside ``1..d_vocab`` or logits that are not
            ``[batch, d_vocab]``.
    """
    _check_k(k)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise GraftingLensError(
            "top_k_tokens expects [batch, d_vocab] logits at the last token, got "
            + _describe(logits)
            + ". Use last_token_logits(logits, attention_mask) first."
        )
    if k > logits.shape[1]:
        raise GraftingLensError(f"k={k} exceeds the vocabulary size {logits.shape[1]}.")
    probabilities = torch.softmax(logits.float(), dim=-1)
    top = probabilities.topk(k, dim=-1)
    strings = None
    if tokenizer is not None:
        strings = [[tokenizer.decode([int(i)]) for i in row] for row in top.indices.tolist()]
    return TopTokens(top.indices, top.values, strings)


# -------------------------------------------------------------------- aggregates


def bootstrap_ci(
    values: Sequence[float] | np.ndarray | torch.Tensor | pd.Series,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean.

    Resamples ``values`` with replacement ``n_resamples`` times, takes the mean of
    each resample, and returns the ``(1 - confidence) / 2`` and
    ``(1 + confidence) / 2`` quantiles of those means. Seeded with its own
    ``numpy.random.Generator``, so the same inputs give the same interval and no
    global random state is touched. For 0/1 values (hits) the interval never leaves
    ``[0, 1]``, unlike a normal approximation; with a single value it is that value.

    Args:
        values: Per-example numbers (booleans count as 0/1).
        n_resamples: Number of bootstrap resamples.
        confidence: Coverage of the interval, in (0, 1).
        seed: Seed of the resampling.

    Returns:
        ``(low, high)``.

    Raises:
        GraftingLensError: No values, a NaN or infinite value, ``n_resamples < 1``
            or ``confidence`` outside (0, 1).
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size == 0:
        raise GraftingLensError("bootstrap_ci needs at least one value, got none.")
    if not np.isfinite(array).all():
        raise GraftingLensError(
            "bootstrap_ci got NaN or infinite values; drop or fill them first "
            f"({int((~np.isfinite(array)).sum())} of {array.size})."
        )
    if not isinstance(n_resamples, (int, np.integer)) or n_resamples < 1:
        raise GraftingLensError(f"n_resamples must be an integer >= 1, got {n_resamples!r}.")
    if not 0.0 < confidence < 1.0:
        raise GraftingLensError(f"confidence must lie in (0, 1), e.g. 0.95; got {confidence!r}.")
    generator = np.random.default_rng(seed)
    n = array.size
    # Resample in blocks so a large table does not need an n_resamples x n index array.
    block = max(1, min(n_resamples, 4_000_000 // n))
    means = np.empty(n_resamples)
    for start in range(0, n_resamples, block):
        stop = min(start + block, n_resamples)
        indices = generator.integers(0, n, size=(stop - start, n))
        means[start:stop] = array[indices].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


def summarize(
    results: pd.DataFrame,
    by: Sequence[str] = ("config", "prompt"),
    ks: Sequence[int] = (1, 5),
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Top-k accuracy and mean rank per group, each with a bootstrap confidence interval.

    Args:
        results: One row per example and configuration with a ``target_rank``
            column (0 = top-1) and the ``by`` columns, as
            :func:`~grafting_lens.position_grafting.run_position_grafting` returns.
        by: Columns that define a group. Groups keep the order in which they first
            appear, so configurations stay in the order they were run (PRE, SFT,
            FE...), not alphabetical.
        ks: The k of each top-k accuracy column, computed as ``rank < k``.
        n_resamples: Bootstrap resamples per interval (see :func:`bootstrap_ci`).
        confidence: Coverage of every interval.
        seed: Seed of every bootstrap, so the table is reproducible.

    Returns:
        One row per group: the ``by`` columns, ``n``, then for each ``k``
        ``top{k}``, ``top{k}_low``, ``top{k}_high``, then ``mean_rank``,
        ``mean_rank_low``, ``mean_rank_high``.

    Raises:
        GraftingLensError: An empty table, missing columns, or a bad ``k``.
    """
    if not isinstance(results, pd.DataFrame):
        raise GraftingLensError(
            f"summarize expects a pandas DataFrame, got {type(results).__name__}."
        )
    if isinstance(by, str):
        by = (by,)
    by = list(by)
    ks = [ks] if isinstance(ks, int) else list(ks)
    for k in ks:
        _check_k(k)
    if len(set(ks)) != len(ks):
        raise GraftingLensError(f"ks has repeated values: {ks}.")
    missing = [column for column in [*by, "target_rank"] if column not in results.columns]
    if missing:
        raise GraftingLensError(
            f"summarize needs the columns {missing}, which the table lacks (it has "
            f"{list(results.columns)}). Pass by=... naming columns it has."
        )
    if results.empty:
        raise GraftingLensError("summarize got an empty table: there is nothing to summarize.")
    ranks = pd.to_numeric(results["target_rank"], errors="coerce")
    if ranks.isna().any() or (ranks < 0).any():
        raise GraftingLensError(
            "target_rank must hold non-negative numbers (0 = top-1), without NaN."
        )

    columns = [*by, "n"]
    for k in ks:
        columns += [f"top{k}", f"top{k}_low", f"top{k}_high"]
    columns += ["mean_rank", "mean_rank_low", "mean_rank_high"]
    rows = []
    grouped = results.assign(_rank=ranks).groupby(by, sort=False, observed=True, dropna=False)
    for key, group in grouped:
        key = key if isinstance(key, tuple) else (key,)
        row: dict[str, Any] = dict(zip(by, key))
        group_ranks = group["_rank"].to_numpy(dtype=np.float64)
        row["n"] = len(group_ranks)
        for k in ks:
            hits = group_ranks < k
            row[f"top{k}"] = float(hits.mean())
            row[f"top{k}_low"], row[f"top{k}_high"] = bootstrap_ci(
                hits, n_resamples, confidence, seed
            )
        row["mean_rank"] = float(group_ranks.mean())
        row["mean_rank_low"], row["mean_rank_high"] = bootstrap_ci(
            group_ranks, n_resamples, confidence, seed
        )
        rows.append(row)
    return pd.DataFrame(rows, columns=columns)


# ----------------------------------------------------------------------- helpers


def _check(logits: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise GraftingLensError(
            "Expected [batch, d_vocab] logits at the last token, got "
            + _describe(logits)
            + ". Use last_token_logits(logits, attention_mask) to pick them out."
        )
    target_ids = torch.as_tensor(target_ids)
    if target_ids.dim() != 1 or target_ids.shape[0] != logits.shape[0]:
        raise GraftingLensError(
            f"target_ids has shape {tuple(target_ids.shape)}; expected one id per row, "
            f"({logits.shape[0]},)."
        )
    if logits.shape[0] == 0:
        raise GraftingLensError("Got an empty batch: there is no prediction to score.")
    if target_ids.is_floating_point() or target_ids.dtype == torch.bool:
        raise GraftingLensError(f"target_ids must hold integer token ids, got {target_ids.dtype}.")
    vocab = logits.shape[1]
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
        raise GraftingLensError(
            f"target_ids must lie in 0..{vocab - 1}, the vocabulary of the logits."
        )
    return logits, target_ids.to(device=logits.device, dtype=torch.long)


def _check_k(k: int) -> None:
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise GraftingLensError(f"k must be an integer >= 1, got {k!r}.")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return type(value).__name__
