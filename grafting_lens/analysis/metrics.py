"""Scoring next-token predictions: ranks, probabilities, top-k hits and their uncertainty.

The paper scores a relation as recalled when the first token of the answer is
among the model's top five next-token candidates at the prompt's last token
(top-5 accuracy). Top-1 is too strict for small models that hesitate between
parts of speech (" the" versus a name) or between tokenizations of one name
(" Rob", " Robert"); the rank of the target, and its probability, say how close
a miss was. Everything here starts from the logits at the last *real* token of
each row (:func:`last_token_logits` picks them out of a right-padded batch).

Definitions, fixed once so every table agrees:

* ``rank``: the number of other vocabulary entries whose logit is greater than
  the target's, or equal to it. 0 means the target is the top prediction and no
  other token ties with it. This is the *pessimistic* rank: a tie is never
  counted as a win for the target, so a top-k hit means the target is in the
  top ``k`` under every ordering of the tied tokens (and greedy decoding, which
  breaks ties by index, may well not pick it). Ties are rare in float32 but
  common in bfloat16, where counting them for the target would bias ranks
  upward. ``ties="optimistic"`` counts only strictly greater logits, the rule
  of the paper's code; a table built with it says so in its parameters, not
  here. (A mean rank over tie orderings would be unbiased, but fractional, and
  a top-k hit would stop being a yes or a no.) Ranks compare logits by default;
  ``by="probability"`` compares the float32 softmax instead, as the paper's code
  does: tokens whose logits differ by less than float32 can tell apart after the
  softmax (an underflow to 0, say) then tie.
* top-k hit: ``rank < k``, under the same tie rule.
* probability: softmax of the logits, computed in float32.
* Non-finite logits: a row holding a NaN or an infinite logit has no rank, hit
  or probability. A NaN compares false with everything, so counting "tokens
  above the target" would give it rank 0, a perfect answer; an infinite logit
  (float16 overflow) makes ties and probabilities meaningless. Every scorer
  here raises :class:`~grafting_lens.core.errors.NonFiniteLogitsError` naming the
  rows instead, so a NaN can never reach a table as a hit. Such logits come
  from a NaN or infinite weight in a checkpoint or from float16 overflow, and
  the fix is there, not in the scoring.

Aggregates come with a percentile bootstrap confidence interval of the mean
(:func:`bootstrap_ci`), because a toy experiment has tens of examples, and a
difference of five points between two configurations means nothing without
one. :func:`summarize` turns a tidy results table (one row per example and
configuration, as :func:`grafting_lens.study.run_position_grafting`
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

from grafting_lens.core import defaults
from grafting_lens.core.arguments import is_integer
from grafting_lens.core.errors import GraftingLensError, NonFiniteLogitsError
from grafting_lens.engine.positions import row_lengths

__all__ = [
    "MIN_INTERVAL_ROWS",
    "RANK_BY",
    "TIE_RULES",
    "TopTokens",
    "bootstrap_ci",
    "last_token_logits",
    "summarize",
    "target_probability",
    "target_rank",
    "top_k_hit",
    "top_k_tokens",
]


MIN_INTERVAL_ROWS = 10
"""The fewest rows a bootstrap interval is shown for. Below it the percentile bootstrap
says little (two hits in two rows resample to [100%, 100%]): figures draw no whisker and
tables print "n = 2, no interval" instead. :func:`summarize` still computes it."""

TIE_RULES: tuple[str, ...] = ("pessimistic", "optimistic")
"""How :func:`target_rank` counts tokens whose logit equals the target's.

``"pessimistic"`` counts them as above the target; ``"optimistic"`` (the default, the
paper's code's) ignores them (the rank counts strictly greater values only).
"""


RANK_BY: tuple[str, ...] = ("logit", "probability")
"""What :func:`target_rank` compares: the logits, or the float32 softmax probabilities
(the default, as the paper's code: ``torch.softmax(logits, -1)``)."""


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
        GraftingLensError: Logits that are not ``[batch, pos, d_vocab]`` or have no
            position, or an attention mask of another shape, with values other than 0 and 1,
            not right padded, or with an empty row (see
            :func:`~grafting_lens.engine.positions.row_lengths`).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise GraftingLensError(
            "last_token_logits expects [batch, pos, d_vocab] logits, got " + _describe(logits) + "."
        )
    batch, positions, _ = logits.shape
    if positions == 0:
        raise GraftingLensError(
            f"The logits have no position (shape {tuple(logits.shape)}), so there is no last "
            "token to score: they came from empty tokens. Run at least one token per row."
        )
    if attention_mask is None:
        return logits[:, -1]
    if tuple(attention_mask.shape) != (batch, positions):
        raise GraftingLensError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, the logits have "
            f"[batch, pos] = {[batch, positions]}."
        )
    # The same rule for a row's last real token as masks and runs use.
    lengths = row_lengths((batch, positions), attention_mask)
    rows = torch.arange(batch, device=logits.device)
    return logits[rows, (lengths - 1).to(logits.device)]


def target_rank(
    logits: Float[torch.Tensor, "batch d_vocab"],
    target_ids: Int[torch.Tensor, " batch"],
    *,
    ties: str = defaults.TIES,
    by: str = defaults.RANK_BY,
) -> Int[torch.Tensor, " batch"]:
    """Rank of each target among the vocabulary: 0 when it is the sole top prediction.

    The rank counts the other tokens whose logit is greater than the target's
    and, with ``ties="pessimistic"``, those whose logit equals it (see the
    module docstring for why ties do not go to the target).

    Args:
        logits: Logits at the last real token of each row (:func:`last_token_logits`).
        target_ids: The correct next token of each row.
        ties: ``"optimistic"`` (default: only strictly greater values count, as in
            the paper's code) or ``"pessimistic"`` (a tie counts against the target).
            See :data:`TIE_RULES`.
        by: ``"probability"`` (default: the float32 softmax, as the paper's code) or
            ``"logit"`` (see :data:`RANK_BY`).

    Raises:
        NonFiniteLogitsError: A row holds a NaN or infinite logit.
        GraftingLensError: Shapes that do not match, a target outside the
            vocabulary, or an unknown tie rule or ``by``.
    """
    _check_ties(ties)
    if by not in RANK_BY:
        raise GraftingLensError(
            f"by must be one of {', '.join(map(repr, RANK_BY))}, got {by!r}: 'logit' ranks "
            "by logits, 'probability' by the float32 softmax (as the paper's code)."
        )
    logits, target_ids = _check(logits, target_ids)
    values = torch.softmax(logits.float(), dim=-1) if by == "probability" else logits
    target_value = values.gather(1, target_ids[:, None])
    rank = (values > target_value).sum(dim=1)
    if ties == "pessimistic":
        rank = rank + (values == target_value).sum(dim=1) - 1  # the target ties with itself
    return rank


def target_probability(
    logits: Float[torch.Tensor, "batch d_vocab"], target_ids: Int[torch.Tensor, " batch"]
) -> Float[torch.Tensor, " batch"]:
    """Softmax probability of each target, computed in float32.

    Raises:
        NonFiniteLogitsError: A row holds a NaN or infinite logit.
        GraftingLensError: Shapes that do not match, or a target outside the vocabulary.
    """
    logits, target_ids = _check(logits, target_ids)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(1, target_ids[:, None]).squeeze(1).exp()


def top_k_hit(
    logits: Float[torch.Tensor, "batch d_vocab"],
    target_ids: Int[torch.Tensor, " batch"],
    k: int,
    *,
    ties: str = defaults.TIES,
    by: str = defaults.RANK_BY,
) -> Bool[torch.Tensor, " batch"]:
    """Whether each target is among the ``k`` most likely tokens (``rank < k``).

    Args:
        logits: Logits at the last real token of each row.
        target_ids: The correct next token of each row.
        k: How many top tokens count as a hit.
        ties: The tie rule of the rank (see :func:`target_rank`).
        by: What the rank compares (see :func:`target_rank`).

    Raises:
        NonFiniteLogitsError: A row holds a NaN or infinite logit.
        GraftingLensError: ``k < 1``, shapes that do not match, a target
            outside the vocabulary, or an unknown tie rule or ``by``.
    """
    _check_k(k)
    return target_rank(logits, target_ids, ties=ties, by=by) < k


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
        NonFiniteLogitsError: A row holds a NaN or infinite logit.
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
    _check_finite(logits)
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
    if not is_integer(n_resamples) or n_resamples < 1:
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
            :func:`~grafting_lens.study.position_grafting.run_position_grafting` returns.
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
    ks = [ks] if is_integer(ks) else list(ks)
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
    if target_ids.is_floating_point() or target_ids.is_complex() or target_ids.dtype == torch.bool:
        raise GraftingLensError(f"target_ids must hold integer token ids, got {target_ids.dtype}.")
    vocab = logits.shape[1]
    # As int64: torch has no min/max for its unsigned types wider than 8 bits.
    target_ids = target_ids.to(torch.long)
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
        raise GraftingLensError(
            f"target_ids must lie in 0..{vocab - 1}, the vocabulary of the logits."
        )
    _check_finite(logits)
    return logits, target_ids.to(device=logits.device, dtype=torch.long)


def _check_finite(logits: torch.Tensor) -> None:
    """Refuse rows holding a NaN or infinite logit (see the module docstring)."""
    bad = ~torch.isfinite(logits).all(dim=1)
    if not bool(bad.any()):
        return
    rows = bad.nonzero().squeeze(1).tolist()
    shown = ", ".join(str(row) for row in rows[:5]) + (", ..." if len(rows) > 5 else "")
    nan = bool(torch.isnan(logits[bad]).any())
    raise NonFiniteLogitsError(
        f"{len(rows)} of {logits.shape[0]} rows of logits (rows {shown}) hold "
        f"{'NaN' if nan else 'infinite'} values, so they have no rank, hit or probability; "
        "they are refused rather than scored (a NaN would rank 0, a perfect answer). Usual "
        "causes: a NaN or infinite weight in a checkpoint (check "
        "all(torch.isfinite(p).all() for p in model.parameters()) for each source), or "
        f"float16 overflow (these logits are {logits.dtype}; load the models with "
        "dtype=torch.float32 or torch.bfloat16)."
    )


def _check_ties(ties: object) -> None:
    if ties not in TIE_RULES:
        raise GraftingLensError(
            f"ties must be one of {', '.join(map(repr, TIE_RULES))}, got {ties!r}: "
            "'pessimistic' counts a tie against the target, 'optimistic' for it."
        )


def _check_k(k: int) -> None:
    if not is_integer(k) or k < 1:
        raise GraftingLensError(f"k must be an integer >= 1, got {k!r}.")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return type(value).__name__
