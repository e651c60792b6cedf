"""Scoring each row's prediction at its last real token: the result columns every table shares.

Every runner (the experiment runner, position grafting, the comparison, the reference
scores) scores through :class:`LastTokenScorer`, so their tables agree column by column and
a new score is added here once. The primitives are :mod:`grafting_lens.analysis.metrics`';
this module decides which columns a table holds and what they are called.

Examples:
    >>> scorer = LastTokenScorer(models.tokenizer, top_k=10)
    >>> columns = scorer(logits, batch.target_ids, batch.attention_mask)
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int

from grafting_lens.analysis import metrics
from grafting_lens.core import defaults
from grafting_lens.core.arguments import is_integer
from grafting_lens.core.errors import GraftingLensError

__all__ = ["SCORE_COLUMNS", "TOP_K_COLUMNS", "TOP_TOKEN_COLUMNS", "LastTokenScorer"]

SCORE_COLUMNS: tuple[str, ...] = ("target_rank", "target_prob", "top1", "top5")
"""In every table: the rank (0 = top-1, :func:`~grafting_lens.analysis.metrics.target_rank`),
the float32 probability, and the hits ``rank < 1`` and ``rank < 5`` (the paper's)."""

TOP_TOKEN_COLUMNS: tuple[str, ...] = ("top_token_id", "top_token")
"""The model's top token and its text, with ``top_token=True``."""

TOP_K_COLUMNS: tuple[str, ...] = ("topk_tokens", "topk_ids", "topk_probs")
"""The ``k`` most likely tokens, best first, with ``top_k=k`` (probabilities to 6 decimals,
which keeps saved runs small and loses nothing a table shows)."""


class LastTokenScorer:
    """Scores the prediction at each row's last real token, as table columns.

    Args:
        tokenizer: Decodes ``top_token`` and ``topk_tokens``, each id on its own (without
            one, those columns hold ``None``).
        top_k: Also list the ``top_k`` most likely tokens (:data:`TOP_K_COLUMNS`).
        top_token: Also name the top token (:data:`TOP_TOKEN_COLUMNS`).
        rank_by: ``target_rank``'s ``by`` (:data:`~grafting_lens.analysis.metrics.RANK_BY`;
            default the paper's code's, ``"probability"``).
        ties: ``target_rank``'s ``ties`` (:data:`~grafting_lens.analysis.metrics.TIE_RULES`;
            default the paper's code's, ``"optimistic"``).

    Raises:
        GraftingLensError: A ``top_k`` below 1, or an unknown ``rank_by`` or ``ties``.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        top_k: int | None = None,
        top_token: bool = False,
        rank_by: str = defaults.RANK_BY,
        ties: str = defaults.TIES,
    ):
        if top_k is not None and (not is_integer(top_k) or top_k < 1):
            raise GraftingLensError(f"top_k must be an integer >= 1, got {top_k!r}.")
        self.rank_by = metrics.check_choice("rank_by", rank_by, metrics.RANK_BY)
        self.ties = metrics.check_choice("ties", ties, metrics.TIE_RULES)
        self.tokenizer = tokenizer
        self.top_k = None if top_k is None else int(top_k)
        self.top_token = top_token
        self._decoded: dict[int, str | None] = {}

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns a call returns, in table order."""
        return (
            SCORE_COLUMNS
            + (TOP_TOKEN_COLUMNS if self.top_token else ())
            + (TOP_K_COLUMNS if self.top_k is not None else ())
        )

    def decode(self, token_id: int) -> str | None:
        """The text of one token id (``None`` without a tokenizer); cached."""
        if token_id not in self._decoded:
            text = None if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._decoded[token_id] = text
        return self._decoded[token_id]

    def __call__(
        self,
        logits: Float[torch.Tensor, "rows pos d_vocab"],
        target_ids: Int[torch.Tensor, " rows"],
        attention_mask: Int[torch.Tensor, "rows pos"] | None = None,
    ) -> dict[str, list[Any]]:
        """``{column: one value per row}`` for every column of :attr:`columns`.

        Args:
            logits: A run's right-padded logits, or each row's last token alone
                (``[rows, 1, d_vocab]``, which needs no attention mask).
            target_ids: The correct next token of each row.
            attention_mask: The right padding (``None``: no padding).

        Raises:
            GraftingLensError: What :func:`~grafting_lens.analysis.metrics.target_rank` refuses.
        """
        final = metrics.last_token_logits(logits, attention_mask)
        ranked = metrics.target_rank(final, target_ids, ties=self.ties, by=self.rank_by)
        ranks = [int(rank) for rank in ranked.cpu().tolist()]
        probabilities = metrics.target_probability(final, target_ids).cpu().tolist()
        columns: dict[str, list[Any]] = {
            "target_rank": ranks,
            "target_prob": [float(p) for p in probabilities],
            "top1": [rank < 1 for rank in ranks],
            "top5": [rank < 5 for rank in ranks],
        }
        if self.top_token:
            top = [int(token) for token in final.argmax(dim=-1).cpu().tolist()]
            columns["top_token_id"] = top
            columns["top_token"] = [self.decode(token) for token in top]
        if self.top_k is not None:
            best = metrics.top_k_tokens(final, self.top_k)
            ids = best.ids.cpu().tolist()
            columns["topk_tokens"] = [[self.decode(token) for token in row] for row in ids]
            columns["topk_ids"] = ids
            columns["topk_probs"] = [
                [round(p, 6) for p in row] for row in best.probabilities.cpu().tolist()
            ]
        return columns
