"""Scoring each row's prediction at its last real token: the result columns every table shares.

Every runner scores through :class:`LastTokenScorer` (and a :class:`Score` beyond the first
token), so their tables agree column by column and a new score is added here once.

Examples:
    >>> scorer = LastTokenScorer(models.tokenizer, top_k=10)
    >>> columns = scorer(logits, batch.target_ids, batch.attention_mask)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int

from grafting_lens.analysis import metrics
from grafting_lens.core import defaults
from grafting_lens.core.arguments import as_texts, is_integer, shown
from grafting_lens.core.errors import ArgumentTypeError, GraftingLensError, ScoreError, check_known
from grafting_lens.engine.graft import graft_forward
from grafting_lens.engine.masks import GraftMask

__all__ = [
    "ANSWER_SOURCES",
    "SCORES",
    "SCORE_COLUMNS",
    "TOP_K_COLUMNS",
    "TOP_TOKEN_COLUMNS",
    "LastTokenScorer",
    "Score",
    "ScoredPass",
]

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
        tokenizer: Decodes ``top_token`` and ``topk_tokens`` (without one they are ``None``).
        top_k: Also list the ``top_k`` most likely tokens (:data:`TOP_K_COLUMNS`).
        top_token: Also name the top token (:data:`TOP_TOKEN_COLUMNS`).
        rank_by: ``target_rank``'s ``by`` (default the paper's code's, ``"probability"``).
        ties: ``target_rank``'s ``ties`` (default the paper's code's, ``"optimistic"``).

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
        self.rank_by = check_known(rank_by, metrics.RANK_BY, "rank_by")
        self.ties = check_known(ties, metrics.TIE_RULES, "ties")
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
            tokenizer = self.tokenizer
            self._decoded[token_id] = None if tokenizer is None else tokenizer.decode([token_id])
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


SCORES: tuple[str, ...] = ("first_token", "answer_logprob", "logit_diff", "kl")
"""The scores named by a string; a function is a score too (see :class:`Score`)."""

ANSWER_SOURCES: tuple[str, ...] = ("last", "base")
"""Which weights compute an answer's own (teacher-forced) positions: ``"last"`` (each
component and layer keeps the source it had at the prompt's last token, as
:func:`~grafting_lens.engine.graft.graft_generate`'s ``new_token_sources="last"``), or the
base's."""

SCORE_VALUE_COLUMNS: dict[str, tuple[str, ...]] = {
    "first_token": (),
    "answer_logprob": ("answer_logprob", "answer_logprob_mean"),
    "logit_diff": ("logit_diff",),
    "kl": ("kl", "kl_recovered"),
    "function": ("score",),
}
"""The columns each score adds after the paper's (:data:`SCORE_COLUMNS`)."""


@dataclass(frozen=True)
class Score:
    """What a table scores beyond the answer's first token: one concept that every runner
    asks for its columns and for what its pass must hold (``docs/concepts/scores.md``).

    - ``"first_token"`` (the default): the paper's columns alone, today's tables byte for byte.
    - ``"answer_logprob"``: the log-probability of the *whole* answer, teacher-forced in the
      same pass (``answer_logprob``, and ``answer_logprob_mean`` per token).
    - ``"logit_diff"``: the answer's first-token logit minus a counter-answer's, at the
      prompt's last token (``logit_diff``).
    - ``"kl"``: ``KL(donor || run)`` at the prompt's last token and at each of the answer's
      tokens (``at="last"``: the last alone), summed (``kl``), and ``kl_recovered = 1 -
      KL(donor || run) / KL(donor || base)`` (NaN where the donor and the base agree). The
      donor's and the base's rows run in the same pass, reused where a configuration is one.
    - a function: ``logits [batch, pos, d_vocab] -> [batch]`` (TransformerLens's convention),
      given each prompt's positions without padding (column ``score``).

    Attributes:
        name: One of :data:`SCORES`, or ``"function"``.
        function: The function, for ``name="function"``.
        answer_sources: One of :data:`ANSWER_SOURCES`.
        donor: The source whose distribution ``"kl"`` compares with.
    """

    name: str = "first_token"
    function: Callable[[torch.Tensor], torch.Tensor] | None = None
    answer_sources: str = "last"
    donor: int = 1
    counter: str | tuple[str, ...] | None = None
    at: str = "answer"

    @classmethod
    def of(
        cls,
        score: Any = "first_token",
        *,
        answer_sources: str = "last",
        donor: int = 1,
        counter: Any = None,
        at: str = "answer",
    ) -> Score:
        """``score`` (a :class:`Score`, a name of :data:`SCORES` or a function) checked.

        Args:
            score: What to score.
            answer_sources: One of :data:`ANSWER_SOURCES`.
            donor: The source ``"kl"`` compares with.
            counter: ``"logit_diff"``'s counter-answer, one or one per prompt (``" Paris"``).
            at: Where ``"kl"`` compares: ``"answer"`` (the prompt's last token and the
                answer's, teacher-forced) or ``"last"`` (the prompt's last token alone).

        Raises:
            ScoreError: An unknown name or ``answer_sources``, a ``donor`` below 1, a
                ``counter`` missing for ``"logit_diff"`` or given to another score.
            ArgumentTypeError: A score that is neither a name nor a function, a counter that
                is not text.
        """
        if isinstance(score, Score):
            return score
        check_known(answer_sources, ANSWER_SOURCES, "answer_sources", ScoreError)
        check_known(at, ("answer", "last"), "at (where kl compares)", ScoreError)
        if not is_integer(donor) or donor < 1:
            raise ScoreError(f"donor={shown(donor)}: give the donor's source index, 1 or more.")
        if callable(score) and not isinstance(score, str):
            name = "function"
        else:
            known = " or a function (logits -> [batch])"
            name = check_known(score, SCORES, "score", ScoreError, known)
        if counter is not None and not isinstance(counter, (str, Sequence)):
            raise ArgumentTypeError(f"counter={shown(counter)}: give a text, or one per prompt.")
        if (counter is None) == (name == "logit_diff"):
            raise ScoreError(
                "score='logit_diff' needs counter=, the answer it is compared with (one for all "
                "prompts or one per prompt)."
                if counter is None
                else f"counter= is score='logit_diff''s; drop it for score={name!r}."
            )
        if counter is not None:  # written as answers are: a space joins it to the prompt
            many = as_texts([counter] if isinstance(counter, str) else counter, "counter", "text")
            many = [c if c[:1].isspace() else " " + c for c in many]
            counter = many[0] if isinstance(counter, str) else tuple(many)
        function = score if name == "function" else None
        return cls(name, function, answer_sources, int(donor), counter, at)

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns this score adds after the paper's."""
        return SCORE_VALUE_COLUMNS[self.name]

    @property
    def teacher_forced(self) -> bool:
        """Whether a pass holds each prompt's answer after it (its positions are scored)."""
        return self.name == "answer_logprob" or (self.name == "kl" and self.at == "answer")

    def describe(self) -> dict[str, Any]:
        """What makes this score this score, for a run's fingerprint."""
        if self.name == "first_token":
            return {}
        named = getattr(self.function, "__qualname__", type(self.function).__qualname__)
        function = f"{getattr(self.function, '__module__', '')}.{named}"
        return {
            "score": self.name,
            **({"function": function} if self.function else {}),
            **({"answer_sources": self.answer_sources} if self.teacher_forced else {}),
            **({"donor": self.donor, "at": self.at} if self.name == "kl" else {}),
            **({"counter": self.counter} if self.counter is not None else {}),
        }

    def counter_ids(self, examples: Sequence[Any], batch: Any, tokenizer: Any) -> torch.Tensor:
        """The first token of each kept example's counter-answer, by the batch's own rules.

        Raises:
            ScoreError: Counters that are not one per example, a batch without its examples,
                a counter that cannot be tokenized, or one equal to its answer.
        """
        from grafting_lens.analysis.batch import tokenize_examples

        per = [self.counter] * len(examples) if isinstance(self.counter, str) else self.counter
        if per is None or len(per) != len(examples) or batch.examples is None or not batch.rules:
            raise ScoreError(
                f"counter= gives {0 if per is None else len(per)} counter-answers for "
                f"{len(examples)} prompts (of a batch tokenized by tokenize_examples): give "
                "one for all, or one per prompt."
            )
        given = {id(example): reply for example, reply in zip(examples, per)}
        replaced = [
            dataclasses.replace(e, target=given[id(e)], alternative_targets=())
            if hasattr(e, "alternative_targets")
            else dataclasses.replace(e, target=given[id(e)])
            for e in batch.examples
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # said below, once, naming the counter
            counters = tokenize_examples(replaced, tokenizer, **batch.rules)
        if counters.dropped:
            example, why = counters.dropped[0]
            raise ScoreError(f"counter= {example.target!r} cannot be scored: {why}.")
        same = (counters.target_ids == batch.target_ids).nonzero()
        if len(same):
            raise ScoreError(
                f"counter= {replaced[int(same[0])].target!r} starts with the answer's own first "
                "token, so the logit difference is 0: give a different counter-answer."
            )
        return counters.target_ids

    def check(self, n_sources: int, d_vocab: Sequence[int]) -> None:
        """Refuse what this score cannot compute on ``n_sources`` sources of ``d_vocab`` tokens.

        Raises:
            ScoreError: ``kl`` with a donor the model set lacks, or vocabularies that differ.
        """
        if self.name == "kl" and self.donor >= n_sources:
            raise ScoreError(
                f"score='kl' compares with source {self.donor}, but the model set has "
                f"{n_sources} sources: pass donor= one of 1..{n_sources - 1}."
            )
        if self.name == "kl" and len(set(d_vocab)) > 1:
            raise ScoreError(
                f"score='kl' compares distributions over one vocabulary; the sources' "
                f"unembeddings give {list(d_vocab)} tokens: use models of one vocabulary."
            )

    def lay_out(self, batch: Any, selections: Sequence[Sequence[torch.Tensor]]) -> ScoredPass:
        """The pass for ``batch`` (right padded, with ``target_full_ids``), each of
        ``selections``' ``[rows, pos]`` positions continued over the answer's positions.

        Raises:
            ScoreError: A teacher-forced score on a batch without its answers' tokens.
        """
        tokens, attention_mask = batch.tokens, batch.attention_mask
        lengths = attention_mask.sum(dim=1)
        rows = torch.arange(len(lengths))
        if not self.teacher_forced:
            read = (lengths - 1)[:, None]
            return ScoredPass(self, tokens, attention_mask, selections, read, read >= 0, None)
        answers = getattr(batch, "target_full_ids", None)
        if answers is None or not all(answers):
            raise ScoreError(
                f"score={self.name!r} scores every token of each answer, but this batch holds "
                "only their first (target_full_ids is None): tokenize it with "
                "tokenize_examples."
            )
        counts = torch.tensor([len(answer) for answer in answers])
        width = int((lengths + counts).max())
        padding = tokens[attention_mask == 0]  # the batch's own pad id, where it has one
        grown = torch.full((len(rows), width), int(padding[0]) if len(padding) else 0)
        grown_mask = torch.zeros((len(rows), width), dtype=attention_mask.dtype)
        for row, (length, answer) in enumerate(zip(lengths.tolist(), answers)):
            grown[row, :length] = tokens[row, :length]
            grown[row, length : length + len(answer)] = torch.tensor(answer)
            grown_mask[row, : length + len(answer)] = 1
        after = torch.arange(width)[None, :] >= lengths[:, None]

        def extended(positions: torch.Tensor) -> torch.Tensor:
            wide = torch.zeros((len(rows), width), dtype=torch.bool)
            wide[:, : positions.shape[1]] = positions
            # "base": the base computes the answer, but where a graft takes every
            # position of a prompt (the whole donor), it takes the answer's too.
            keep = positions[rows, lengths - 1]
            if self.answer_sources == "base":
                padding = attention_mask[:, : positions.shape[1]] == 0
                keep = keep & (positions | padding).all(1)
            return (wide | (after & keep[:, None])) & (grown_mask == 1)

        grown_selections = [[extended(positions) for positions in s] for s in selections]
        # Read: the prompt's last token and each answer token but the last, which predict the
        # answer's tokens; kl also reads the last (what follows the answer).
        after_answer = int(self.name == "kl")
        offsets = torch.arange(int(counts.max()) + after_answer)
        valid = offsets[None, :] < counts[:, None] + after_answer
        read = torch.where(valid, (lengths - 1)[:, None] + offsets[None, :], (lengths - 1)[:, None])
        answer_ids = torch.zeros((len(rows), int(counts.max())), dtype=torch.long)
        for row, answer in enumerate(answers):
            answer_ids[row, : len(answer)] = torch.tensor(answer)
        return ScoredPass(self, grown, grown_mask, grown_selections, read, valid, answer_ids)


@dataclass(frozen=True)
class ScoredPass:
    """One batch laid out for a score (:meth:`Score.lay_out`): what the pass runs, where it
    reads the logits, and the score's columns from them.

    Attributes:
        score: The score.
        tokens: ``[rows, pos]``: the prompts, each followed by its answer when teacher-forced.
        attention_mask: Their right padding.
        selections: Per configuration, each graft's ``[rows, pos]`` positions.
        read: ``[rows, k]``: where the logits are read, the prompt's last token first.
        valid: ``[rows, k]``: which of ``read`` are real (answers differ in length).
        answer_ids: ``[rows, n]``: each answer's tokens, padded (teacher-forced scores only).
    """

    score: Score
    tokens: torch.Tensor
    attention_mask: torch.Tensor
    selections: Sequence[Sequence[torch.Tensor]]
    read: torch.Tensor
    valid: torch.Tensor
    answer_ids: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, pos)`` of one configuration's block."""
        return int(self.tokens.shape[0]), int(self.tokens.shape[1])

    def logits(self, blocks: int) -> str | torch.Tensor:
        """What :func:`~grafting_lens.engine.graft.graft_forward`'s ``logits=`` reads for
        ``blocks`` blocks of rows: the positions scored, or every one for a function."""
        if self.score.name == "function":
            return "all"
        return self.read.repeat(blocks, 1) if self.score.teacher_forced else "last"

    def references(
        self, mask: GraftMask, blocks: int, wholes: Sequence[GraftMask]
    ) -> list[int | None]:
        """For each of ``wholes`` (the whole base, the whole donor), the block of ``mask`` that
        already computes it, or None (its rows must be added)."""
        rows = self.shape[0]

        def computes(block: int, whole: GraftMask) -> bool:
            part = slice(block * rows, (block + 1) * rows)
            return all(torch.equal(mask[k][part], whole[k]) for k in {*mask.keys(), *whole.keys()})

        return [next((b for b in range(blocks) if computes(b, whole)), None) for whole in wholes]

    def values(
        self,
        logits: torch.Tensor,
        blocks: int,
        target_ids: torch.Tensor,
        counter_ids: torch.Tensor | None = None,
        reference: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> dict[str, list[float]]:
        """The score's columns for ``blocks`` blocks (configurations) of rows of ``logits``.

        Args:
            logits: The pass's logits, ``[blocks * rows, k, d_vocab]``.
            blocks: How many blocks of rows.
            target_ids: Each prompt's answer's first token (``[rows]``).
            counter_ids: Each prompt's counter-answer's first token (``logit_diff``).
            reference: The base's and the donor's logits, ``[rows, k, d_vocab]`` each (``kl``).

        Raises:
            ScoreError: A function's value of the wrong type, shape, or not finite.
        """
        name, rows = self.score.name, self.shape[0]
        if name == "first_token":
            return {}
        if name == "function":
            mask = self.attention_mask.repeat(blocks, 1)
            return {"score": function_values(self.score, logits, mask).tolist()}
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        if name == "logit_diff":
            assert counter_ids is not None  # checked at the door
            both = torch.stack([target_ids, counter_ids], dim=1).repeat(blocks, 1)
            picked = logits[:, 0].float().gather(1, both.to(logits.device))
            return {"logit_diff": (picked[:, 0] - picked[:, 1]).tolist()}
        valid = self.valid.repeat(blocks, 1)
        if name == "answer_logprob":
            assert self.answer_ids is not None
            answer = self.answer_ids.repeat(blocks, 1)
            each = log_probs.gather(2, answer[:, :, None])[:, :, 0]  # read j predicts token j
            total = (each * valid).sum(dim=1)
            return {
                "answer_logprob": total.tolist(),
                "answer_logprob_mean": (total / valid.sum(dim=1)).tolist(),
            }
        assert reference is not None
        base, donor = (torch.log_softmax(part.float(), dim=-1) for part in reference)

        def kl(run: torch.Tensor) -> torch.Tensor:  # KL(donor || run), summed over positions
            donors = donor.repeat(len(run) // len(donor), 1, 1)
            each = (donors.exp() * (donors - run)).sum(dim=-1)
            return (each * self.valid.repeat(len(run) // rows, 1)).sum(dim=1)

        divergence, baseline = kl(log_probs), kl(base).repeat(blocks)
        return {
            "kl": divergence.tolist(),
            "kl_recovered": (1 - divergence / baseline).where(baseline > 0, torch.nan).tolist(),
        }


def function_values(
    score: Score, logits: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """A function score's value per row, ``[rows]`` (differentiable): each row's positions
    without padding, the rows of one length called together.

    Raises:
        ScoreError: A value of the wrong type, shape, or not finite.
    """
    function = score.function
    assert function is not None
    lengths = attention_mask.sum(dim=1).tolist()
    if logits.shape[1] == 1:  # the last token's logits alone: every row is one position
        lengths = [1] * len(lengths)
    parts: list[torch.Tensor] = []
    order: list[int] = []
    for length in dict.fromkeys(lengths):
        index = [i for i, n in enumerate(lengths) if n == length]
        value = function(logits[index, :length])
        if (
            not isinstance(value, torch.Tensor)
            or value.shape != (len(index),)
            or not bool(torch.isfinite(value.detach().float()).all())
        ):
            raise ScoreError(
                f"score={getattr(function, '__name__', function)!r} returned "
                f"{shown(value)} for {len(index)} prompts of logits "
                f"{list(logits[index, :length].shape)}: return a finite tensor of one "
                "number per prompt, [batch]."
            )
        parts.append(value.float())
        order += index
    values = torch.cat(parts)
    return values[torch.tensor(order).argsort().to(values.device)]


def score_pass(
    models: Any,
    score: Score,
    batch: Any,
    selections: Sequence[Sequence[torch.Tensor]],
    mask_of: Callable[[Sequence[Sequence[torch.Tensor]], tuple[int, int]], GraftMask],
    scorer: LastTokenScorer,
    *,
    counter_ids: torch.Tensor | None = None,
    logits: str = "scored",
    base: int = 0,
) -> dict[str, list[Any]]:
    """Every configuration of ``batch``'s rows in one grafted pass, scored: the paper's
    columns (``scorer``'s) and ``score``'s, one value per row, configuration by configuration.

    Args:
        models: The model set.
        score: What to score.
        batch: The rows (a :class:`~grafting_lens.analysis.batch.TokenizedExamples`).
        selections: Per configuration, each graft's ``[rows, pos]`` positions.
        mask_of: The mask of every configuration, a block of rows each, from the laid-out
            selections and one block's shape.
        scorer: The paper's columns.
        counter_ids: Each row's counter-answer's first token (``logit_diff``).
        logits: ``"scored"``, or ``"all"`` to unembed every position (the same scores).
        base: The source ``kl_recovered`` measures from.
    """
    laid = score.lay_out(batch, selections)
    blocks, rows = len(selections), laid.shape[0]
    limit = models.max_positions
    if score.teacher_forced and limit is not None and laid.shape[1] > limit:
        raise ScoreError(
            f"A prompt and its answer are {laid.shape[1]} tokens, past the {limit} positions "
            f"the model embeds: shorten the answer, or score its first token "
            f"(score='first_token', or Score.of('kl', at='last'))."
        )
    mask = mask_of(laid.selections, laid.shape)
    found: list[int | None] = [None, None]
    added: list[GraftMask] = []
    if score.name == "kl":
        wholes = [
            GraftMask.build(models, laid.tokens, source=i, attention_mask=laid.attention_mask)
            for i in (base, score.donor)
        ]
        found = laid.references(mask, blocks, wholes)
        added = [whole for whole, block in zip(wholes, found) if block is None]
    total = blocks + len(added)
    every = logits == "all" and score.name == "first_token"
    out = graft_forward(
        models,
        laid.tokens.repeat(total, 1),
        GraftMask.cat([mask, *added]) if added else mask,
        attention_mask=laid.attention_mask.repeat(total, 1),
        logits="all" if every else laid.logits(total),
    )
    targets = batch.target_ids.repeat(blocks)
    scored = out[: blocks * rows]
    columns = (
        scorer(scored, targets, laid.attention_mask.repeat(blocks, 1))
        if every or score.name == "function"
        else scorer(scored[:, :1], targets)
    )
    reference = None
    if score.name == "kl":
        extra = iter(range(blocks, total))
        base_at, donor_at = (block if block is not None else next(extra) for block in found)
        by_block = out.unflatten(0, (total, rows))
        reference = (by_block[base_at], by_block[donor_at])
    return {**columns, **laid.values(scored, blocks, batch.target_ids, counter_ids, reference)}


def score_metric(
    score: Score, models: Any, batch: Any
) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """``score`` as the attribution's and the minimal-graft search's metric: one
    differentiable number per prompt, higher nearer the donor (``kl``: minus the KL). A
    teacher-forced score reads rows laid out by :meth:`Score.lay_out` from every position's
    logits; the others read each row's last token.

    Args:
        score: Any :class:`Score` (``"first_token"``: the first token's log-probability).
        models: The model set (``kl`` runs the donor on each prompt once, cached).
        batch: The batch the metric will score rows of (``logit_diff``: its counters).
    """
    forced = score.teacher_forced
    after_answer = int(score.name == "kl")

    def final(logits: torch.Tensor, rows: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities where the score reads, ``[rows, k, d_vocab]``, and which are real."""
        if not forced:
            last = metrics.last_token_logits(logits, rows.attention_mask)
            return last.float().log_softmax(-1)[:, None], torch.ones(len(last), 1, dtype=torch.bool)
        counts = torch.tensor([len(answer) for answer in rows.target_full_ids])
        start = rows.attention_mask.sum(dim=1) - counts - 1  # the prompt's last token
        offsets = torch.arange(int(counts.max()) + after_answer)
        valid = offsets[None, :] < counts[:, None] + after_answer
        read = torch.where(valid, start[:, None] + offsets[None, :], start[:, None])
        picked = logits[torch.arange(len(read))[:, None], read.to(logits.device)]
        return picked.float().log_softmax(-1), valid.to(logits.device)

    if score.name == "first_token":
        return lambda logits, rows: final(logits, rows)[0][:, 0].gather(
            1, rows.target_ids[:, None].to(logits.device)
        )[:, 0]
    if score.name == "function":
        return lambda logits, rows: function_values(score, logits, rows.attention_mask)
    if score.name == "answer_logprob":

        def whole_answer(logits: torch.Tensor, rows: Any) -> torch.Tensor:
            log_probs, valid = final(logits, rows)
            ids = torch.zeros(valid.shape, dtype=torch.long)
            for row, answer in enumerate(rows.target_full_ids):
                ids[row, : len(answer)] = torch.tensor(answer)
            each = log_probs.gather(2, ids[:, :, None].to(log_probs.device))[:, :, 0]
            return (each * valid).sum(dim=1)

        return whole_answer
    if score.name == "logit_diff":
        counters = score.counter_ids(batch.examples, batch, models.tokenizer).tolist()
        counter_of = {id(example): c for example, c in zip(batch.examples, counters)}

        def difference(logits: torch.Tensor, rows: Any) -> torch.Tensor:
            last = metrics.last_token_logits(logits, rows.attention_mask).float()
            ids = torch.tensor([counter_of[id(example)] for example in rows.examples])
            picked = last.gather(1, torch.stack([rows.target_ids, ids], dim=1).to(last.device))
            return picked[:, 0] - picked[:, 1]

        return difference
    donors: dict[tuple[int, ...], torch.Tensor] = {}

    def minus_kl(logits: torch.Tensor, rows: Any) -> torch.Tensor:
        lengths = rows.attention_mask.sum(dim=1).tolist()
        keys = [tuple(rows.tokens[i, :n].tolist()) for i, n in enumerate(lengths)]
        if any(key not in donors for key in keys):  # the donor's own run, once per prompt
            whole = GraftMask.build(
                models, rows.tokens, source=score.donor, attention_mask=rows.attention_mask
            )
            with torch.no_grad():
                own = graft_forward(
                    models,
                    rows.tokens,
                    whole,
                    attention_mask=rows.attention_mask,
                    logits="all" if forced else "last",
                )
            read, real = final(own, rows)
            for key, row, count in zip(keys, read.cpu(), real.sum(dim=1).tolist()):
                donors[key] = row[:count]  # its own positions: chunks pad to their longest
        run, valid = final(logits, rows)
        donor = torch.zeros_like(run)
        for row, key in enumerate(keys):
            donor[row, : len(donors[key])] = donors[key].to(run.device)
        return -((donor.exp() * (donor - run)).sum(dim=-1) * valid).sum(dim=1)

    return minus_kl
