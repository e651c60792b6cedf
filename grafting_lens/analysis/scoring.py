"""Scoring each row's prediction at its last real token: the result columns every table shares.

Every runner asks one question of a logit tensor: *is the answer the model's next
token?* The experiment runner, the position-grafting wrapper, the grafting-versus-
patching comparison and the reference scores all answer it through
:class:`LastTokenScorer`, so their tables agree column by column, and a new score
is added here, once, for all of them.

The columns, in the order tables show them:

* :data:`SCORE_COLUMNS`, in every table: ``target_rank`` (0 = top-1, also where
  the paper's figures add 1 to a mean rank; see
  :func:`grafting_lens.analysis.metrics.target_rank` for ties and for ranking by logit or
  by probability), ``target_prob`` (softmax in float32), ``top1`` and ``top5``
  (``rank < k``; the paper's measure is top-5);
* :data:`TOP_TOKEN_COLUMNS`, with ``top_token=True``: the model's top token,
  ``top_token_id`` and its text ``top_token``;
* :data:`TOP_K_COLUMNS`, with ``top_k=k``: the ``k`` most likely tokens, best
  first, as ``topk_tokens`` (text), ``topk_ids`` and ``topk_probs`` (rounded to six
  decimals, which keeps saved runs small and loses nothing a table shows).

The primitives (ranks, probabilities, top-k) are :mod:`grafting_lens.analysis.metrics`'s;
this module only decides which of them a results table holds and what the columns
are called.

Examples:
    >>> scorer = LastTokenScorer(models.tokenizer, top_k=10)
    >>> columns = scorer(logits, batch.target_ids, batch.attention_mask)
    >>> columns["target_rank"][:3], scorer.columns
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
"""The scores every results table holds."""

TOP_TOKEN_COLUMNS: tuple[str, ...] = ("top_token_id", "top_token")
"""The model's top token, when a table asks for it (``top_token=True``)."""

TOP_K_COLUMNS: tuple[str, ...] = ("topk_tokens", "topk_ids", "topk_probs")
"""The ``k`` most likely tokens, when a table asks for them (``top_k=k``)."""


class LastTokenScorer:
    """Scores the prediction at each row's last real token, as table columns.

    Args:
        tokenizer: Decodes token ids for ``top_token`` and ``topk_tokens`` (each id
            decoded on its own, once per scorer). Without one, those columns hold
            ``None``.
        top_k: Also list the ``top_k`` most likely tokens (:data:`TOP_K_COLUMNS`).
        top_token: Also name the top token (:data:`TOP_TOKEN_COLUMNS`).
        rank_by: What ``target_rank`` compares: ``"probability"`` (default: the float32
            softmax, as the paper's code) or ``"logit"``; see
            :func:`grafting_lens.analysis.metrics.target_rank`.
        ties: How ``target_rank`` counts ties: ``"optimistic"`` (default, the paper's
            code) or ``"pessimistic"``.

    Raises:
        GraftingLensError: ``top_k`` that is not a positive integer, or an unknown
            ``rank_by`` or ``ties``.
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
        if rank_by not in metrics.RANK_BY:
            raise GraftingLensError(
                f"rank_by must be one of {', '.join(map(repr, metrics.RANK_BY))}, got {rank_by!r}."
            )
        if ties not in metrics.TIE_RULES:
            raise GraftingLensError(
                f"ties must be one of {', '.join(map(repr, metrics.TIE_RULES))}, got {ties!r}."
            )
        self.tokenizer = tokenizer
        self.top_k = None if top_k is None else int(top_k)
        self.top_token = top_token
        self.rank_by = rank_by
        self.ties = ties
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
        """Score every row at its last real token.

        Args:
            logits: A run's logits, right padded.
            target_ids: The correct next token of each row.
            attention_mask: The right padding (``None``: no padding).

        Returns:
            ``{column: one value per row}`` for every column of :attr:`columns`.

        Raises:
            GraftingLensError: Shapes that do not fit, a target outside the
                vocabulary, or ``top_k`` above it.
        """
        if attention_mask is not None:
            attention_mask = attention_mask.to(logits.device)
        final = metrics.last_token_logits(logits, attention_mask)
        target_ids = torch.as_tensor(target_ids).to(final.device)
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
