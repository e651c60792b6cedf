"""Generations judged: how often a graft's continuations do what a user asks of them.

The first token of an answer cannot show a behaviour (a style, a refusal): the text that
follows can. :func:`generate_text` continues every prompt under every named graft, greedily;
:func:`judge_rate` gives the share of each graft's texts that a user's judge accepts, with a
bootstrap interval. Generating is the cost; one set of generations can be judged many ways.

Examples:
    >>> texts = generate_text(models, prompts, {"base": dict(source=0), "donor": {}})
    >>> judge_rate(texts, lambda text: "Fishburne" in text)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from grafting_lens.analysis.batch import TokenizedExamples, as_batch
from grafting_lens.analysis.metrics import bootstrap_ci
from grafting_lens.core.arguments import as_texts, check_table, shown
from grafting_lens.core.errors import ArgumentTypeError, GraftingError, refuse_first
from grafting_lens.engine.graft import graft_generate
from grafting_lens.engine.masks import GraftMask
from grafting_lens.engine.positions import callable_name
from grafting_lens.models.model_set import ModelSet

__all__ = ["GENERATION_COLUMNS", "generate_text", "judge_rate"]

GENERATION_COLUMNS: tuple[str, ...] = ("graft", "prompt", "text", "generation")
"""What :func:`generate_text` returns: the graft's name, the prompt's index and text, and the
text generated after it."""

BUILD_KEYWORDS = ("positions", "layers", "components", "source")
"""The keywords of :meth:`GraftMask.build` a graft may give (the batch gives the rest)."""


def generate_text(
    models: ModelSet,
    prompts: str | Sequence[str] | TokenizedExamples,
    grafts: Mapping[str, GraftMask | Mapping[str, Any]],
    *,
    max_new_tokens: int = 20,
    new_token_sources: str | int = "last",
) -> pd.DataFrame:
    """Greedy continuations of every prompt under every graft, as text: one call of
    :func:`~grafting_lens.engine.graft.graft_generate`, each prompt generating what it would
    alone, each generation ending before its first end-of-text token.

    Args:
        models: The aligned checkpoints, loaded with their tokenizer.
        prompts: A text, texts (tokenized as ``tokenizer(text)`` does), or a tokenized batch.
        grafts: Names to grafts, each a :class:`~grafting_lens.GraftMask` for the batch, or
            :meth:`GraftMask.build`'s keywords (:data:`BUILD_KEYWORDS`): ``dict(source=0)``
            is the base, ``{}`` the whole donor, ``dict(positions="last")`` the donor at the
            last token.
        max_new_tokens: Tokens to generate after each prompt.
        new_token_sources: ``graft_generate``'s: ``"last"`` or one source index.

    Returns:
        :data:`GENERATION_COLUMNS`, one row per graft and prompt, grafts in the order given.

    Raises:
        ArgumentTypeError: Prompts that are not text or a batch, ``grafts`` not names to
            masks or keywords, a model set without a tokenizer.
        GraftingError: No graft, or a keyword ``GraftMask.build`` does not take here.
        GraftMaskError: A graft that does not fit the batch; and what ``GraftMask.build``
            and ``graft_generate`` refuse.
    """
    tokenizer = models.tokenizer
    names = list(grafts) if isinstance(grafts, Mapping) else []
    given = [grafts[name] for name in names]
    extra = sorted({k for g in given if isinstance(g, Mapping) for k in g} - {*BUILD_KEYWORDS})
    refuse_first(
        ArgumentTypeError,
        [
            (
                not isinstance(grafts, Mapping)
                or not all(isinstance(n, str) for n in names)
                or not all(isinstance(g, (GraftMask, Mapping)) for g in given),
                "grafts= takes names to GraftMasks or to GraftMask.build's keywords, e.g. "
                f"{{'base': dict(source=0), 'last': dict(positions='last')}}; got {shown(grafts)}.",
            ),
            (
                tokenizer is None,
                "generate_text reads and writes text with the model set's tokenizer, and it has "
                "none: load the models with load_models(..., tokenizer=...).",
            ),
        ],
    )
    refuse_first(
        GraftingError,
        [
            (not names, "grafts= names no graft; give one or more, e.g. {'base': dict(source=0)}."),
            (
                extra,
                f"grafts= gives {extra}, which a graft does not take: its keywords are "
                f"GraftMask.build's {', '.join(BUILD_KEYWORDS)} (the prompts give the tokens).",
            ),
        ],
    )
    tokens, attention_mask, texts = _tokenized(models, prompts)
    masks = []
    for graft in given:
        if isinstance(graft, GraftMask):
            graft.check_rows(attention_mask, shape=tuple(tokens.shape))
            masks.append(graft)
        else:
            masks.append(GraftMask.build(models, tokens, attention_mask=attention_mask, **graft))
    out = graft_generate(
        models,
        tokens.repeat(len(masks), 1),
        GraftMask.cat(masks),
        max_new_tokens,
        new_token_sources,
        attention_mask=attention_mask.repeat(len(masks), 1),
    ).cpu()
    lengths = attention_mask.sum(dim=1).repeat(len(masks)).tolist()
    eos = getattr(tokenizer, "eos_token_id", None)
    rows = []
    for row, (length, ids) in enumerate(zip(lengths, out.tolist())):
        new = ids[length : length + int(max_new_tokens)]
        new = new[: new.index(eos)] if eos in new else new
        prompt = row % len(texts)
        rows.append((names[row // len(texts)], prompt, texts[prompt], tokenizer.decode(new)))
    return pd.DataFrame(rows, columns=list(GENERATION_COLUMNS))


def judge_rate(
    generations: pd.DataFrame,
    judge: Callable[[str], bool],
    *,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """The share of each graft's generations a judge accepts, with a bootstrap interval.

    Args:
        generations: A table with ``graft`` and ``generation`` columns (:func:`generate_text`).
        judge: Called on each generated text; returns ``True`` (accepted) or ``False``.
        n_resamples: :func:`~grafting_lens.analysis.metrics.bootstrap_ci`'s, as
            ``confidence`` and ``seed``.

    Returns:
        One row per graft, in order of first appearance: ``graft``, ``n``, ``rate`` (the
        accepted share), ``rate_low`` and ``rate_high`` (its interval).

    Raises:
        ArgumentTypeError: ``generations`` that is not a DataFrame, a ``judge`` that is not
            callable or returns something other than a bool.
        GraftingError: A table without the columns or rows, a judge that raised.
    """
    check_table(generations, "generations", "the DataFrame generate_text returns")
    missing = [column for column in ("graft", "generation") if column not in generations]
    refuse_first(
        ArgumentTypeError,
        [(not callable(judge), f"judge= must be a function of the text, got {shown(judge)}.")],
    )
    if missing or generations.empty:
        raise GraftingError(
            f"generations= needs rows with the columns graft and generation, lacking "
            f"{missing or 'rows'}: pass what generate_text returns."
        )
    verdicts = [_verdict(judge, text, row) for row, text in enumerate(generations["generation"])]
    rows = []
    accepted = pd.Series(verdicts, index=generations.index, dtype=float)
    for graft, group in accepted.groupby(generations["graft"], sort=False):
        values = group.to_numpy()
        low, high = bootstrap_ci(values, n_resamples, confidence, seed)
        rows.append((graft, len(values), float(values.mean()), low, high))
    return pd.DataFrame(rows, columns=["graft", "n", "rate", "rate_low", "rate_high"])


def _tokenized(models: ModelSet, prompts: Any) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Tokens, attention mask and text of text prompts (right padded) or a tokenized batch."""
    if hasattr(prompts, "tokens"):
        batch = as_batch(prompts, models)
        real = [row[mask.bool()].tolist() for row, mask in zip(batch.tokens, batch.attention_mask)]
        texts = models.tokenizer.batch_decode(real, skip_special_tokens=True)
        return batch.tokens, batch.attention_mask, texts
    texts = as_texts(prompts, "prompts", "a text, texts or a tokenized batch")
    ids = models.tokenizer(texts)["input_ids"]
    lengths = torch.tensor([len(row) for row in ids])
    attention_mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()
    tokens = torch.zeros_like(attention_mask)  # the padding is never read
    tokens[attention_mask.bool()] = torch.tensor([token for row in ids for token in row])
    return tokens, attention_mask, texts


def _verdict(judge: Callable[[str], bool], text: str, row: int) -> bool:
    """The judge's verdict on one generation, refused unless a bool."""
    try:
        verdict = judge(text)
    except Exception as error:  # the user's code: named, with what it raised
        raise GraftingError(
            f"judge= {callable_name(judge)} raised {type(error).__name__}: {error} on generation "
            f"{row} ({shown(text)}); make it return False for text it cannot judge."
        ) from error
    if not isinstance(verdict, (bool, np.bool_)):
        raise ArgumentTypeError(
            f"judge= {callable_name(judge)} returned {shown(verdict)} for generation {row} "
            f"({shown(text)}); it must return True or False, e.g. bool(...) of its test."
        )
    return bool(verdict)
