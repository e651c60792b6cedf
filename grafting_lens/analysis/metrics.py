"""Scoring next-token predictions: ranks, probabilities, top-k hits and their uncertainty.

The paper counts a relation as recalled when the answer's first token is among the top
five at the prompt's last real token; the rank and the probability say how close a miss
was. A NaN logit would rank 0, so every scorer raises ``NonFiniteLogitsError`` instead.
Aggregates carry a percentile bootstrap interval (:func:`bootstrap_ci`), since a toy
experiment has tens of examples; :func:`summarize` gives one row per configuration.

Examples:
    >>> ranks = target_rank(last_token_logits(logits, attention_mask), target_ids)
    >>> summarize(results).loc[:, ["config", "prompt", "top5", "top5_low", "top5_high"]]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int

from grafting_lens.core import defaults
from grafting_lens.core.arguments import as_texts, check_table, is_integer, is_number, shown
from grafting_lens.core.errors import (
    ArgumentTypeError,
    GraftingLensError,
    NonFiniteLogitsError,
    check_known,
    refuse_first,
)
from grafting_lens.engine.positions import row_lengths

__all__ = [
    "MAX_RESAMPLES",
    "MIN_INTERVAL_ROWS",
    "RANK_BY",
    "TIE_RULES",
    "TopTokens",
    "bootstrap_ci",
    "column_names",
    "last_token_logits",
    "recovery_ci",
    "summarize",
    "target_probability",
    "target_rank",
    "top_k_hit",
    "top_k_tokens",
]

MIN_INTERVAL_ROWS = 10
"""The fewest rows a bootstrap interval is shown for: figures draw no whisker below it
and tables say "no interval" (two hits in two rows resample to [100%, 100%])."""

TIE_RULES: tuple[str, ...] = ("pessimistic", "optimistic")
"""How :func:`target_rank` counts a tie with the target: as above it, or (the code's and the
default) not."""

MAX_RESAMPLES = 1_000_000
"""The most resamples :func:`bootstrap_ci` draws: they are held at once, ``n_resamples`` rows
of the sample's length (a million of a thousand values is 8 GB); 1000 is usual."""

RANK_BY: tuple[str, ...] = ("logit", "probability")
"""What :func:`target_rank` compares: logits, or (the code's and the default) float32
probabilities."""


class TopTokens(NamedTuple):
    """The ``k`` most likely next tokens of each row, best first.

    Attributes:
        ids: ``[batch, k]`` token ids.
        probabilities: ``[batch, k]`` softmax probabilities.
        strings: Per row, the ``k`` decoded tokens (``None`` without a tokenizer).
    """

    ids: Int[torch.Tensor, "batch k"]
    probabilities: Float[torch.Tensor, "batch k"]
    strings: list[list[str]] | None


def column_names(value: object, name: str, example: str) -> list[str]:
    """``value`` as a list of distinct column names: one name, or a list of them.

    Raises:
        ArgumentTypeError: Neither a string nor a list of them (a number, a tensor, a mapping).
        GraftingLensError: No name, a blank one, or one named twice; each naming ``name=``.
    """
    forms = f"a column name or a list of them, e.g. {example}"
    tensor = isinstance(value, torch.Tensor)  # as_texts reads one; a column name is no number
    refuse_first(
        ArgumentTypeError, [(tensor, f"{name}={shown(value)} cannot be read; give {forms}.")]
    )
    names = as_texts(value, name, forms, GraftingLensError)
    twice = [column for column in dict.fromkeys(names) if names.count(column) > 1]
    if twice:
        raise GraftingLensError(f"{name}= names {twice[0]!r} twice; give each column once.")
    return names


def _check_bootstrap(n_resamples: object, confidence: object, seed: object) -> None:
    """Refuse what :func:`bootstrap_ci` cannot resample with, naming the argument."""
    refuse_first(
        ArgumentTypeError,
        [
            (
                not is_integer(n_resamples),
                f"n_resamples= must be an integer, got {shown(n_resamples)}.",
            ),
            (
                not is_number(confidence),
                f"confidence= must be a number in (0, 1), e.g. 0.95; got {shown(confidence)}.",
            ),
            (not is_integer(seed), f"seed= must be an integer >= 0, got {shown(seed)}."),
        ],
    )
    refuse_first(
        GraftingLensError,
        [
            (
                not 1 <= n_resamples <= MAX_RESAMPLES,  # type: ignore[operator]
                f"n_resamples= must be in 1..{MAX_RESAMPLES:,} (1000 is usual), got "
                f"{shown(n_resamples)}.",
            ),
            (
                not 0.0 < float(confidence) < 1.0,  # type: ignore[arg-type]  # NaN too
                f"confidence= must lie in (0, 1), e.g. 0.95; got {shown(confidence)}.",
            ),
            (seed < 0, f"seed= must be an integer >= 0, got {shown(seed)}."),  # type: ignore[operator]
        ],
    )


def last_token_logits(
    logits: Float[torch.Tensor, "batch pos d_vocab"],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Float[torch.Tensor, "batch d_vocab"]:
    """The logits at the last real (non-padding) token of each row.

    Args:
        logits: Model output for a right-padded batch (one position: each row's last).
        attention_mask: Ones then zeros in each row; ``None`` means no padding.

    Raises:
        GraftingLensError: Logits that are not ``[batch, pos, d_vocab]`` with a position.
        SelectionError: An attention mask of another shape, not right padding or not 0/1.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[1] == 0:
        raise GraftingLensError(
            f"Expected [batch, pos, d_vocab] logits with a position, got {_describe(logits)} "
            "(no position means empty tokens were run)."
        )
    if attention_mask is None or logits.shape[1] == 1:
        return logits[:, -1]
    lengths = row_lengths(tuple(logits.shape[:2]), attention_mask)
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits[rows, (lengths - 1).to(logits.device)]


def target_rank(
    logits: Float[torch.Tensor, "batch d_vocab"],
    target_ids: Int[torch.Tensor, " batch"],
    *,
    ties: str = defaults.TIES,
    by: str = defaults.RANK_BY,
) -> Int[torch.Tensor, " batch"]:
    """Rank of each target among the vocabulary: 0 when it is the sole top prediction.

    By default, as the paper's code does, the rank counts the other tokens whose float32
    probability is greater than the target's; ``ties="pessimistic"`` counts equal ones too
    (ties are common in bfloat16), ``by="logit"`` compares the logits.

    Args:
        logits: Logits at the last real token of each row (:func:`last_token_logits`).
        target_ids: The correct next token of each row.
        ties: One of :data:`TIE_RULES` (default ``"optimistic"``, the code's).
        by: One of :data:`RANK_BY` (default ``"probability"``, the code's).

    Raises:
        NonFiniteLogitsError: A row holds a NaN or infinite logit.
        GraftingLensError: Shapes that do not match, a target outside the
            vocabulary, or an unknown ``ties`` or ``by``.
    """
    check_known(ties, TIE_RULES, "ties")
    check_known(by, RANK_BY, "by")
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
    """Softmax probability of each target, computed in float32 (checks as :func:`target_rank`)."""
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

    Raises:
        GraftingLensError: ``k < 1``, and what :func:`target_rank` refuses.
    """
    _check_k(k)
    return target_rank(logits, target_ids, ties=ties, by=by) < k


def top_k_tokens(
    logits: Float[torch.Tensor, "batch d_vocab"], k: int = 10, tokenizer: Any = None
) -> TopTokens:
    """The ``k`` most likely next tokens of each row, with probabilities and text.

    Args:
        logits: Logits at the last real token of each row.
        k: How many tokens; at most the vocabulary size.
        tokenizer: Decodes each id on its own; without one, ``strings`` is ``None``.

    Raises:
        NonFiniteLogitsError: A row holds a NaN or infinite logit.
        GraftingLensError: ``k`` outside ``1..d_vocab``, logits not ``[batch, d_vocab]``.
    """
    _check_k(k)
    logits, _ = _check(logits)
    if k > logits.shape[1]:
        raise GraftingLensError(f"k={k} exceeds the vocabulary size {logits.shape[1]}.")
    top = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    ids = top.indices.tolist()
    strings = None if tokenizer is None else [[tokenizer.decode([i]) for i in row] for row in ids]
    return TopTokens(top.indices, top.values, strings)


def bootstrap_ci(
    values: Sequence[float] | np.ndarray | torch.Tensor | pd.Series,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean (``scipy.stats.bootstrap``), seeded
    with its own generator; for 0/1 values it stays in ``[0, 1]``; one value is its own.

    Args:
        values: Per-example numbers (booleans count as 0/1).
        n_resamples: Number of bootstrap resamples.
        confidence: Coverage of the interval, in (0, 1).
        seed: Seed of the resampling.

    Returns:
        ``(low, high)``.

    Raises:
        ArgumentTypeError: ``values`` that are not numbers, ``n_resamples`` or ``seed`` not
            an integer, ``confidence`` not a number.
        GraftingLensError: No values, a NaN or infinite value, ``n_resamples`` outside
            ``1..MAX_RESAMPLES``, ``confidence`` outside (0, 1) or a negative ``seed``.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    try:
        if isinstance(values, (str, bytes, Mapping)):
            raise TypeError
        array = np.asarray(values, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise ArgumentTypeError(
            f"bootstrap_ci needs numbers (values=), got {shown(values)}."
        ) from None
    not_finite = int((~np.isfinite(array)).sum())
    refuse_first(
        GraftingLensError,
        [
            (array.size == 0, "bootstrap_ci needs at least one value (values=), got none."),
            (
                not_finite,
                f"bootstrap_ci got {not_finite} NaN or infinite values of {array.size} "
                "(values=); drop or fill them first.",
            ),
        ],
    )
    _check_bootstrap(n_resamples, confidence, seed)
    if array.size == 1:  # scipy refuses one observation; its every resample is itself
        return float(array[0]), float(array[0])
    return _percentile_interval((array,), np.mean, n_resamples, confidence, seed)


def recovery_ci(
    scores: np.ndarray,
    base: np.ndarray,
    whole: np.ndarray,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The recovery ``(mean(scores) - mean(base)) / (mean(whole) - mean(base))`` of per-prompt
    values, with a percentile bootstrap interval that resamples the prompts together.

    Returns:
        ``(recovery, low, high)``: NaN without a gap; one prompt's interval is its value.

    Raises:
        GraftingLensError: What :func:`bootstrap_ci` refuses of ``n_resamples``,
            ``confidence`` and ``seed``.
    """
    _check_bootstrap(n_resamples, confidence, seed)
    arrays = (np.asarray(scores), np.asarray(base), np.asarray(whole))
    value = float(_recovery(*arrays))
    if len(arrays[0]) < 2 or not np.isfinite(value):
        return value, value, value
    return value, *_percentile_interval(arrays, _recovery, n_resamples, confidence, seed, True)


def _percentile_interval(
    data: tuple, statistic: Any, n_resamples: Any, confidence: Any, seed: Any, paired: bool = False
) -> tuple[float, float]:
    """``scipy.stats.bootstrap``'s percentile interval of ``statistic``, seeded on its own."""
    from scipy import stats  # imported when needed: it takes a second to import

    interval = stats.bootstrap(
        data,
        statistic,
        paired=paired,
        n_resamples=int(n_resamples),
        confidence_level=float(confidence),
        method="percentile",
        rng=np.random.default_rng(int(seed)),
    ).confidence_interval
    return float(interval.low), float(interval.high)


def _recovery(scores: Any, base: Any, whole: Any, axis: int = -1) -> Any:
    """The ratio of means of :func:`recovery_ci` along ``axis`` (NaN without a gap)."""
    scores, base, whole = (np.asarray(a).mean(axis=axis) for a in (scores, base, whole))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(whole != base, (scores - base) / (whole - base), np.nan)[()]


AVERAGED: tuple[str, ...] = (
    "answer_logprob",
    "answer_logprob_mean",
    "logit_diff",
    "kl",
    "kl_recovered",
    "score",
)
"""The columns of :class:`~grafting_lens.analysis.scoring.Score`'s scores that
:func:`summarize` averages with intervals, where a table has them."""


def summarize(
    results: pd.DataFrame,
    by: Sequence[str] = ("config", "prompt"),
    ks: Sequence[int] = (1, 5),
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Top-k accuracy and mean rank per group, each with a bootstrap confidence interval, and
    the mean of every score column the table has (:data:`AVERAGED`), with its interval.

    ``n_resamples``, ``confidence`` and ``seed`` are :func:`bootstrap_ci`'s.

    Args:
        results: One row per example and configuration, with ``target_rank`` (0 = top-1)
            and the ``by`` columns.
        by: Columns that define a group (groups keep their order of first appearance).
        ks: The k of each top-k accuracy column (``rank < k``), or one k.

    Returns:
        One row per group: the ``by`` columns, ``n``, then ``top{k}`` for each ``k``,
        ``mean_rank`` and each score column's mean (``kl``...), each followed by its
        interval (``_low``, ``_high``), a score over the group's rows that have one.

    Raises:
        ArgumentTypeError: ``by`` or ``ks`` of the wrong type, and what :func:`bootstrap_ci`
            refuses of its arguments.
        GraftingLensError: Not a non-empty table with the columns, ranks that are not
            non-negative numbers, no ``by`` column or one twice, a bad or repeated ``k``.
    """
    by = column_names(by, "by", "('config', 'prompt')")
    ks = _check_ks(ks)
    _check_bootstrap(n_resamples, confidence, seed)
    check_table(results, "results", "the results table of a run (a DataFrame)")
    missing = [column for column in [*by, "target_rank"] if column not in results.columns]
    if results.empty or missing:
        raise GraftingLensError(
            f"summarize needs a non-empty DataFrame with the columns {[*by, 'target_rank']}; "
            f"got a DataFrame lacking {missing}. Pass by=... naming its columns."
        )
    ranks = pd.to_numeric(results["target_rank"], errors="coerce")
    if ranks.isna().any() or (ranks < 0).any():
        raise GraftingLensError(
            "summarize needs results' target_rank to hold numbers >= 0 (0 = top-1), without NaN."
        )
    rows = []
    groups = results.assign(_rank=ranks).groupby(by, sort=False, observed=True, dropna=False)
    for key, group in groups:
        row: dict[str, Any] = dict(zip(by, key if isinstance(key, tuple) else (key,)))
        group_ranks = group["_rank"].to_numpy(dtype=np.float64)
        row["n"] = len(group_ranks)
        hits = {f"top{k}": group_ranks < k for k in ks}
        means = [(c, group[c].to_numpy(dtype=np.float64)) for c in AVERAGED if c in group]
        for name, values in [*hits.items(), ("mean_rank", group_ranks), *means]:
            values = values[~np.isnan(values)]
            row[name] = float(values.mean()) if len(values) else np.nan
            row[f"{name}_low"], row[f"{name}_high"] = (
                bootstrap_ci(values, n_resamples, confidence, seed)
                if len(values)
                else (np.nan, np.nan)
            )
        rows.append(row)
    return pd.DataFrame(rows)


def _check(logits: Any, target_ids: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, d_vocab]`` finite logits and, if given, one in-vocabulary id per row."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] == 0:
        raise GraftingLensError(
            f"Expected [batch, d_vocab] logits at the last token with a row, got "
            f"{_describe(logits)}. Use last_token_logits(logits, attention_mask) first."
        )
    wide = torch.empty(0, dtype=torch.long)
    if target_ids is not None:
        ids = torch.as_tensor(target_ids)
        integer = not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
        # As int64: torch has no min/max for its unsigned types wider than 8 bits.
        wide = ids.to(torch.long)
        if (
            ids.dim() != 1
            or ids.shape[0] != logits.shape[0]
            or not integer
            or int(wide.min()) < 0
            or int(wide.max()) >= logits.shape[1]
        ):
            raise GraftingLensError(
                f"target_ids must hold one id per row in 0..{logits.shape[1] - 1} (the "
                f"vocabulary of the logits); got {ids.dtype} of shape {tuple(ids.shape)} for "
                f"{logits.shape[0]} rows."
            )
    bad = ~torch.isfinite(logits).all(dim=1)
    if bool(bad.any()):
        rows = bad.nonzero().squeeze(1).tolist()
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        kind = "NaN" if bool(torch.isnan(logits[bad]).any()) else "infinite"
        raise NonFiniteLogitsError(
            f"{len(rows)} of {logits.shape[0]} rows of logits (rows {shown}) hold {kind} values, "
            f"so they are not scored. Check the checkpoints' weights; these are {logits.dtype}: "
            "float16 overflows (load in float32 or bfloat16)."
        )
    return logits, wide.to(logits.device)


def _check_k(k: object) -> None:
    if not is_integer(k) or k < 1:
        error = GraftingLensError if is_integer(k) else ArgumentTypeError
        raise error(f"k (ks=, k=) must be an integer >= 1, got {shown(k)}.")


def _check_ks(ks: object) -> list[int]:
    """``ks`` as distinct Python ints (a torch k would name a column 'toptensor(5)')."""
    if is_integer(ks):
        ks = [ks]
    scalar = isinstance(ks, torch.Tensor) and ks.dim() == 0  # a float one: no k, no list
    unreadable = scalar or isinstance(ks, (str, bytes, Mapping)) or not isinstance(ks, Iterable)
    refuse_first(
        ArgumentTypeError,
        [(unreadable, f"ks= must be an integer or a list of them, e.g. (1, 5); got {shown(ks)}.")],
    )
    given = list(ks)  # type: ignore[call-overload]
    for k in given:
        _check_k(k)
    plain = [int(k) for k in given]
    refuse_first(
        GraftingLensError,
        [
            (not plain, "ks= holds nothing; give the k of each top-k column, e.g. (1, 5)."),
            (len(set(plain)) != len(plain), f"ks= has repeated values: {plain}; give each k once."),
        ],
    )
    return plain


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    return type(value).__name__
