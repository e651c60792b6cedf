"""Grafting from text: prompts and answers in, a table of how each graft answers out.

The tensor API (:class:`~grafting_lens.GraftMask`, :func:`~grafting_lens.graft_forward`)
takes token ids, attention masks and position tensors; a researcher with a question
("does the finetuned model's last-token computation carry the fact?") has prompts and
answers. :func:`graft` asks it in one call. It is a front end to the experiment runner
(:func:`~grafting_lens.study.runner.run_experiment`): the prompts are tokenized, the grafts
built and run (logits at the scored token only), and the answer scored exactly as every
experiment of the library does, under the one default semantics (the paper's released
code, :data:`~grafting_lens.study.semantics.REFERENCE`) unless ``semantics=`` says otherwise, so a
number read here is the number a full run reports. :func:`plot_graft` draws the table.

Places are named the way you would say them: ``"last"`` (the token that predicts the
answer), a piece of the prompt's text (``"Keanu Reeves"``: its tokens), a token index
(``0``, ``-2``; a BOS the tokenizer adds counts), ``"all"``, a list of these (their
union), or, for examples that carry named spans
(:func:`grafting_lens.worlds.data.make_examples`), a span expression in the paper's
notation (``"FE+LT"``, ``"(FE+LT)^C"``). A dict of them runs several grafts side by side.

Examples:
    >>> table = gl.graft(models, "Keanu Reeves starred in a movie alongside",
    ...                  answer="Laurence Fishburne", at=["Keanu Reeves", "last"])
    >>> gl.plot_graft(table)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Union

import pandas as pd
import plotly.graph_objects as go
import torch

from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.analysis.figure_style import axis_range, figure_style, subtitle
from grafting_lens.analysis.metrics import summarize
from grafting_lens.analysis.plots import plot_accuracy
from grafting_lens.core.arguments import is_integer
from grafting_lens.core.errors import SelectionError
from grafting_lens.engine.positions import parse_span_expression, select_positions, span_names
from grafting_lens.models.layers import LayerSpec
from grafting_lens.models.model_set import ModelSet
from grafting_lens.study.configs import Graft, GraftConfig
from grafting_lens.study.runner import run_experiment
from grafting_lens.study.semantics import Semantics, semantics_or_default
from grafting_lens.study.testsets import TestSet

__all__ = ["graft", "plot_graft"]

Place = Union[str, int, Sequence[Union[str, int]]]
"""Where a graft takes the donor's weights: ``"last"``, ``"all"``, a piece of the prompt,
a token index, a span expression, or a list of these (their union)."""

COLUMNS = ("config", "target_rank", "target_prob", "top1", "top5", "grafted", "target", "text")
"""The columns :func:`graft` shows first (the runner's names), then the top tokens: the
answer's rank and probability before the prompt's text, which is the widest column and would
push them out of a notebook's view."""


@dataclasses.dataclass(frozen=True)
class _Prompt:
    """A prompt as the runner tokenizes it: text, answer, character spans."""

    text: str
    target: str
    spans: dict[str, tuple[int, int]]
    relation_id: int
    prompt_name: str = "text"


def graft(
    models: ModelSet,
    prompts: str | Sequence[Any],
    answer: str | Sequence[str] | None = None,
    *,
    at: Place | Mapping[str, Place] = "last",
    components: str | Sequence[str] = "all",
    layers: LayerSpec = "all",
    donor: int | str = 1,
    semantics: Semantics | str | None = None,
    top_k: int = 5,
) -> pd.DataFrame:
    """Graft the donor's weights into prompts at named places and score the answer.

    Each prompt runs as the base, as the donor, and once per graft of ``at``: the
    donor's ``components`` at ``layers`` compute the positions ``at`` names, the base's
    weights everything else (one pass, equal to the paper's token-by-token procedure).

    Args:
        models: The checkpoints, from :func:`~grafting_lens.load_models`.
        prompts: A prompt, a list of prompts, or examples with ``text``, ``target`` and
            named ``spans`` (:func:`grafting_lens.worlds.data.make_examples`), which
            carry their answers.
        answer: What should follow each prompt (one for all, or one per prompt), e.g.
            ``"Laurence Fishburne"``; a space joins it to the prompt unless it starts
            with one. Its first token is scored.
        at: Where to graft (see the module's documentation), or ``{label: place}``.
        components: What the donor computes there (``"all"``, ``"o+ffn"``,
            ``"attn"``..., read under ``semantics`` as every experiment reads them).
        layers: At which layers (``"all"``, ``"last_half"``, a list...).
        donor: The donor's index or name in the model set.
        semantics: How the run reads components, tokenizes and ranks (default: the
            one default, :data:`~grafting_lens.study.semantics.REFERENCE`; ``"clean"`` for the
            library's reading).
        top_k: How many of the most likely next tokens each row lists.

    Returns:
        One row per prompt and run (the base, the donor, then each graft): ``config``,
        ``text`` (the prompt), ``target`` (the answer), ``grafted`` (the tokens the
        donor computed), ``target_rank`` (0 = top-1), ``target_prob``, ``top1``,
        ``top5``, ``topk_tokens``, ``topk_probs``, ``semantics``, and for examples
        ``relation_id`` and ``prompt``.

    Raises:
        SelectionError: A place that is in no prompt or selects nothing, a bad donor,
            prompts or answers that are not text.
        GraftingLensError: What :func:`~grafting_lens.study.runner.run_experiment` refuses (an
            unknown component, a layer outside the model...).
    """
    if not isinstance(models, ModelSet):
        raise SelectionError(
            f"graft takes a model set (gl.load_models), got {type(models).__name__}."
        )
    donor_index = _donor_index(models, donor)
    examples = _prompts(prompts, answer)
    grafts = dict(at) if isinstance(at, Mapping) else {_label(at): at}
    if not grafts:
        raise SelectionError("at={} names no graft: give a place, e.g. at='last'.")
    pieces = _text_pieces(grafts.values(), examples)
    examples = [
        dataclasses.replace(e, spans={**e.spans, **_piece_spans(e, pieces)}) for e in examples
    ]
    base, donor_name = models.names[0], models.names[donor_index]
    wanted = components if isinstance(components, str) else tuple(components)
    configs = [
        GraftConfig(base),
        GraftConfig(donor_name, (Graft("ALL", "all", "all", source=donor_index),)),
        *(
            GraftConfig(label, (Graft(_selector(place, pieces), wanted, layers, donor_index),))
            for label, place in grafts.items()
        ),
    ]
    if len({config.name for config in configs}) < len(configs):
        raise SelectionError(
            f"A graft's label repeats a run's name ({base}, {donor_name}): name it otherwise "
            "with at={label: place}."
        )
    rows = run_experiment(
        models,
        TestSet(examples),
        configs,
        registry={config.name: config for config in configs},
        semantics=semantics,
        top_k=top_k,
        progress=False,
    )
    rows["grafted"] = _grafted(models, rows, configs, examples, semantics)
    order = rows["example"] * len(configs) + rows["config"].map(
        {config.name: index for index, config in enumerate(configs)}
    )
    named = examples[0].prompt_name != "text"
    shown = [*COLUMNS, "topk_tokens", "topk_probs", "semantics"]
    shown += ["relation_id", "prompt"] if named else []
    return rows.iloc[order.argsort(kind="stable")][shown].reset_index(drop=True)


def plot_graft(table: pd.DataFrame, k: int = 5, title: str | None = None) -> go.Figure:
    """Draw a table from :func:`graft`: the answer's probability, or top-k accuracy.

    One prompt: the answer's probability under each run, its rank on the bar. Several:
    the top-``k`` accuracy of each run with its 95% bootstrap interval (one bar per
    test prompt wording where the examples name one).

    Args:
        table: What :func:`graft` returned (rows may be filtered).
        k: The top-k of the accuracy figure.
        title: The figure's title.

    Raises:
        SelectionError: A table that is not :func:`graft`'s.
    """
    missing = {"config", "text", "target", "target_rank", "target_prob"} - set(
        getattr(table, "columns", ())
    )
    if not isinstance(table, pd.DataFrame) or table.empty or missing:
        raise SelectionError(
            "plot_graft draws the table gl.graft returns"
            + (f"; this one lacks {sorted(missing)}." if missing else ", non-empty.")
        )
    if table["text"].nunique() == 1:
        fig = go.Figure(
            go.Bar(
                x=table["config"],
                y=table["target_prob"],
                text=[f"rank {rank}" for rank in table["target_rank"]],
                textposition="outside",
                marker_color="#4C72B0",
            )
        )
        fig.update_yaxes(
            title_text=f"P({table['target'].iloc[0].strip()})",
            range=axis_range(table["target_prob"]),
            tickformat=".0%",
        )
        fig.update_xaxes(title_text="run")
        return figure_style(
            fig,
            title or "The answer's probability under each graft",
            subtitle(repr(table["text"].iloc[0]), [1], interval=False),
        )
    color = "prompt" if "prompt" in table else "prompts"
    if color == "prompts":
        table = table.assign(prompts=f"{table['text'].nunique()} prompts")
    summary = summarize(table, by=("config", color), ks=(k,))
    return plot_accuracy(summary, k=k, x="config", color=color, title=title)


def _donor_index(models: ModelSet, donor: int | str) -> int:
    if isinstance(donor, str) and donor in models.names[1:]:
        return models.names.index(donor)
    if is_integer(donor) and 1 <= int(donor) < len(models):
        return int(donor)
    raise SelectionError(
        f"donor={donor!r} is not a donor of this model set: give an index 1..{len(models) - 1} "
        f"or a name of {list(models.names[1:])}."
    )


def _prompts(prompts: str | Sequence[Any], answer: str | Sequence[str] | None) -> list[_Prompt]:
    """The prompts as the runner reads them, each with its answer."""
    items = [prompts] if isinstance(prompts, str) else list(prompts)
    if not items:
        raise SelectionError("No prompts: give a prompt or a list of them.")
    examples: list[Any] = items
    if all(hasattr(item, "text") and hasattr(item, "spans") for item in examples):
        if answer is not None:
            raise SelectionError("These examples carry their answers (target): drop answer=.")
        return [
            _Prompt(e.text, e.target, dict(e.spans), e.relation_id, e.prompt_name) for e in examples
        ]
    answers: list[Any] = (
        [answer] * len(items) if isinstance(answer, str) or answer is None else list(answer)
    )
    if len(answers) != len(items) or not all(isinstance(a, str) and a.strip() for a in answers):
        raise SelectionError(
            f"Each prompt needs an answer to score: answer='...' for all, or one per prompt "
            f"({len(items)} prompts, got {answer!r})."
        )
    bad = next((item for item in items if not isinstance(item, str) or not item.strip()), None)
    if bad is not None:
        raise SelectionError(f"Prompts are non-empty strings; got {bad!r}.")
    return [
        _Prompt(str(text).rstrip(), reply if reply[:1].isspace() else " " + reply, {}, index)
        for index, (text, reply) in enumerate(zip(items, answers))
    ]


def _label(place: Place) -> str:
    return str(place) if isinstance(place, (str, int)) else "+".join(map(str, place))


def _parts(place: Place) -> list[str | int]:
    return [place] if isinstance(place, (str, int)) else list(place)


def _is_expression(text: str, names: set[str]) -> bool:
    """Whether ``text`` is a span expression over spans the examples have."""
    try:
        parse_span_expression(text)
        wanted = span_names(text)
    except SelectionError:
        return False
    return wanted <= names | {"last_token"}


def _text_pieces(places: Any, examples: list[_Prompt]) -> dict[str, str]:
    """Every place that is a piece of the prompts' text, with the span name it gets."""
    names = set(examples[0].spans)
    pieces: dict[str, str] = {}
    for place in places:
        for part in _parts(place):
            if is_integer(part) or part in ("last", "all") or part in pieces:
                continue
            if not isinstance(part, str):
                raise SelectionError(
                    f"Cannot read the place {part!r}: give 'last', 'all', a piece of the "
                    "prompt's text, a token index or a list of these."
                )
            if all(part in e.text for e in examples):
                pieces[part] = f"text{len(pieces)}"
            elif not _is_expression(part, names):
                missing = next(e.text for e in examples if part not in e.text)
                raise SelectionError(
                    f"{part!r} is not in the prompt {missing!r}: give a piece of every prompt's "
                    "text, 'last', 'all', a token index"
                    + (f", or a span expression over {sorted(names)}." if names else ".")
                )
    return pieces


def _piece_spans(example: _Prompt, pieces: dict[str, str]) -> dict[str, tuple[int, int]]:
    spans = {}
    for text, name in pieces.items():
        start = example.text.index(text)
        spans[name] = (start, start + len(text))
    return spans


def _selector(place: Place, pieces: dict[str, str]) -> Any:
    """The positions function of a place: ``(spans, attention_mask) -> [batch, pos]``."""

    def positions(spans: dict[str, torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros(tuple(attention_mask.shape), dtype=torch.bool)
        lengths = attention_mask.sum(dim=1)
        for part in _parts(place):
            if is_integer(part):
                index = torch.full_like(lengths, int(part))
                index = torch.where(index < 0, lengths + index, index)
                if bool(((index < 0) | (index >= lengths)).any()):
                    raise SelectionError(
                        f"Token index {part} is outside a prompt of {int(lengths.min())} tokens."
                    )
                chosen[torch.arange(len(lengths)), index] = True
            elif part == "last":
                chosen |= select_positions("LT", spans, attention_mask)
            elif part == "all":
                chosen |= attention_mask.bool()
            else:
                expression = str(part)
                chosen |= select_positions(
                    pieces.get(expression, expression), spans, attention_mask
                )
        return chosen

    positions.__name__ = f"at_{_label(place)}"
    return positions


def _grafted(
    models: ModelSet,
    rows: pd.DataFrame,
    configs: list[GraftConfig],
    examples: list[_Prompt],
    semantics: Semantics | str | None,
) -> list[str]:
    """The tokens each row's donor computed, as text (``"all"`` for the whole donor)."""
    rules = semantics_or_default(semantics).tokenization()
    batch = tokenize_examples(examples, models.tokenizer, **rules)
    by_name = {config.name: config for config in configs}
    shown = []
    for name, example in zip(rows["config"], rows["example"]):
        config = by_name[name]
        if not config.grafts:
            shown.append("")
            continue
        if config is configs[1]:
            shown.append("all")
            continue
        row = batch.rows([int(example)])
        picked = config.grafted_positions(row.spans, row.attention_mask)[0]
        shown.append("|".join(models.tokenizer.decode([int(t)]) for t in row.tokens[0][picked]))
    return shown
