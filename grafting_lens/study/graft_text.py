"""Grafting from text: prompts and answers in, a table of how each graft answers out.

The tensor API (:class:`~grafting_lens.GraftMask`, :func:`~grafting_lens.graft_forward`)
takes token ids and position tensors; :func:`graft` takes prompts and answers, as a front end
to :func:`~grafting_lens.study.runner.run_experiment`, so its numbers are a full run's.
:func:`~grafting_lens.analysis.plots.plot_graft` draws the table.

Places are named the way you would say them: ``"last"`` (the token that predicts the
answer), a piece of the prompt's text (``"Keanu Reeves"``: its tokens), a token index
(``0``, ``-2``, a numpy or torch integer too; a BOS the tokenizer adds counts), ``"all"``,
a list of these (their union), or, for examples that carry named spans
(:func:`grafting_lens.worlds.data.make_examples`), a span expression in the paper's
notation (``"FE+LT"``, ``"(FE+LT)^C"``). A dict of them runs several grafts side by side.
A piece of text must occur once in each prompt, as written (in the same Unicode form), and
start and end where tokens do.

Examples:
    >>> table = gl.graft(models, "Keanu Reeves starred in a movie alongside",
    ...                  answer="Laurence Fishburne", at=["Keanu Reeves", "last"])
    >>> gl.plot_graft(table)
"""

from __future__ import annotations

import dataclasses
import unicodedata
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import pandas as pd
import torch

from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.analysis.chat import chat_examples, is_chat
from grafting_lens.analysis.scoring import Score
from grafting_lens.core.arguments import as_list, as_table, as_texts, check_table, is_integer, shown
from grafting_lens.core.errors import ArgumentTypeError, SelectionError
from grafting_lens.engine.positions import parse_span_expression, select_positions, span_names
from grafting_lens.models.directions import check_matrix_components
from grafting_lens.models.layers import LayerSpec
from grafting_lens.models.model_set import ModelSet
from grafting_lens.study.configs import Graft, GraftConfig
from grafting_lens.study.runner import run_experiment
from grafting_lens.study.semantics import Semantics, semantics_or_default
from grafting_lens.study.testsets import TestSet, check_answers

__all__ = ["graft"]

Place = Union[str, int, Sequence[Union[str, int]]]
"""Where a graft takes the donor's weights: ``"last"``, ``"all"``, a piece of the prompt,
a token index, a span expression, or a list of these (their union)."""

COLUMNS = ("config", "target_rank", "target_prob", "top1", "top5", "grafted", "target", "text")
"""The columns :func:`graft` shows first, then the top tokens (the prompt's text, the widest,
comes last so that it pushes nothing out of a notebook's view)."""


_NO_ANSWER = " the"
"""What follows a prompt without an answer (``kl`` or a function); its columns are dropped."""


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
    prompts: str | Iterable[Any] | pd.DataFrame,
    answer: str | Iterable[str] | None = None,
    *,
    at: Place | Mapping[str, Place] = "last",
    components: str | Sequence[str] = "all",
    layers: LayerSpec = "all",
    donor: int | str = 1,
    semantics: Semantics | str | None = None,
    top_k: int = 5,
    score: Any = "first_token",
    counter: Any = None,
    rank: Any = None,
    strength: Any = None,
) -> pd.DataFrame:
    """Graft the donor's weights into prompts at named places and score the answer.

    Each prompt runs as the base, as the donor, and once per graft of ``at``: the
    donor's ``components`` at ``layers`` compute the positions ``at`` names, the base's
    weights everything else (one pass, equal to the paper's token-by-token procedure).

    Args:
        models: The checkpoints, from :func:`~grafting_lens.load_models`.
        prompts: A prompt; prompts (any iterable of strings); a DataFrame, records or
            ``datasets.Dataset`` with a ``text`` column and the answers in a ``target`` or
            ``answer`` column (or in ``answer=``); or examples with ``text``, ``target`` and
            named ``spans`` (:func:`grafting_lens.worlds.data.make_examples`).
        answer: What should follow each prompt (one for all, or one per prompt), e.g.
            ``"Laurence Fishburne"``; a space joins it to the prompt unless it starts with
            one. Its first token is scored (checked by
            :func:`~grafting_lens.study.testsets.check_answers`). ``score="kl"`` and a
            function need none: ``kl`` then compares at the last token, and the answer's
            columns are left out.
        at: Where to graft (see the module's documentation), or ``{label: place}``.
        components: What the donor computes there (``"all"``, ``"o+ffn"``..., read under
            ``semantics``).
        layers: At which layers (``"all"``, ``"last_half"``, a list...).
        donor: The donor's index or name in the model set.
        semantics: How the run reads components, tokenizes and ranks (default
            :data:`~grafting_lens.study.semantics.DEFAULT_SEMANTICS`).
        top_k: How many of the most likely next tokens each row lists.
        score: What else each row scores (:class:`~grafting_lens.analysis.scoring.Score`):
            ``"answer_logprob"`` (the whole answer), ``"logit_diff"`` (against ``counter``),
            ``"kl"`` (to the donor's distribution, at the last token and the answer's), or a
            function ``logits [batch, pos, d_vocab] -> [batch]``; its columns follow ``text``.
        counter: ``score="logit_diff"``'s counter-answer, one or one per prompt.
        rank: Graft only these singular directions of each weight matrix's change (a count
            or indices; :meth:`~grafting_lens.models.model_set.ModelSet.directions`).
        strength: Graft ``W_base + strength * dW`` (0 the base, 1 the graft), or one per cell.

    Returns:
        One row per prompt and run (the base, the donor, then each graft): ``config``,
        ``text`` (the prompt), ``target`` (the answer), ``grafted`` (the tokens the
        donor computed, each with its index: ``" Keanu@1| Reeves@2"``), ``target_rank``
        (0 = top-1), ``target_prob``, ``top1``, ``top5``, ``topk_tokens``,
        ``topk_probs``, ``semantics``, and for examples ``relation_id`` and ``prompt``.

    Raises:
        ArgumentTypeError: An argument of the wrong type (a number for prompts, a float at=).
        SelectionError: Prompts, answers, places or a donor it cannot use (a place in no
            prompt, twice in one, or cutting a token).
        ExperimentError: An answer scored by a bare-whitespace token.
        GraftingLensError: What :func:`~grafting_lens.study.runner.run_experiment` refuses.
    """
    if not isinstance(models, ModelSet):
        raise ArgumentTypeError(
            f"models= takes a model set (gl.load_models), got {type(models).__name__}."
        )
    donor_index = _donor_index(models, donor)
    scored = Score.of(score, donor=donor_index, counter=counter)
    # A behaviour has no answer: kl (at the last token) and a function score without one.
    optional = scored.name in ("kl", "function")
    chat: Any = is_chat(prompts)
    unanswered = bool(chat) and optional and answer is None
    if chat:  # through the tokenizer's own template, tokenized as the semantics says
        rules = semantics_or_default(semantics).tokenization()
        bos, spans = rules["bos"], rules["spans"]
        reply = _NO_ANSWER if unanswered else answer
        prompts = chat = chat_examples(prompts, reply, models.tokenizer, bos=bos, spans=spans)  # type: ignore[arg-type]
        answer = None
    examples, lacking = _prompts(prompts, answer, optional)
    unanswered = unanswered or lacking
    if unanswered and scored.name == "kl":
        scored = dataclasses.replace(scored, at="last")
    grafts = _places(at)
    if chat:  # a role's name is its place in every conversation, not a piece of the text
        places = chat[0].places
        grafts = {
            k: [places.get(p, p) if isinstance(p, str) else p for p in v] for k, v in grafts.items()
        }
    wanted = (
        components
        if isinstance(components, str)
        else tuple(as_texts(components, "components", "a component name or a list of them"))
    )
    source = donor_index
    if rank is not None or strength is not None:  # a donor of part of the change
        if rank is not None:
            check_matrix_components(models, wanted)
        models = models.directions(
            donor_index, rank=rank, strength=1 if strength is None else strength
        )
        source = len(models) - 1
    pieces = _text_pieces(grafts.values(), examples)
    examples = [
        dataclasses.replace(e, spans={**e.spans, **_piece_spans(e, pieces, models.tokenizer)})
        for e in examples
    ]
    named = examples[0].prompt_name != "text"
    test_set = (
        TestSet(examples) if named else TestSet(examples, dataset="gl.graft", prompt="answer")
    )
    if not named and not unanswered:  # one token check for own answers, as `run --prompts`
        for line in check_answers([test_set], models, semantics):
            warnings.warn(line, stacklevel=2)
    base, donor_name = models.names[0], models.names[donor_index]
    configs = [
        GraftConfig(base),
        GraftConfig(donor_name, (Graft("ALL", "all", "all", source=donor_index),)),
        *(
            GraftConfig(label, (Graft(_selector(parts, pieces), wanted, layers, source),))
            for label, parts in grafts.items()
        ),
    ]
    if len({config.name for config in configs}) < len(configs):
        raise SelectionError(
            f"A graft's label repeats a run's name ({base}, {donor_name}): name it otherwise "
            "with at={label: place}."
        )
    rows = run_experiment(
        models,
        test_set,
        configs,
        registry={config.name: config for config in configs},
        semantics=semantics,
        top_k=top_k,
        progress=False,
        score=scored,
    )
    rows["grafted"] = _grafted(models, rows, configs, examples, semantics)
    order = rows["example"] * len(configs) + rows["config"].map(
        {config.name: index for index, config in enumerate(configs)}
    )
    shown = [*COLUMNS, *scored.columns, "topk_tokens", "topk_probs", "semantics"]
    shown += ["relation_id", "prompt"] if named else []
    if unanswered:  # the answer's columns would score the placeholder
        shown = [c for c in shown if c not in ("target_rank", "target_prob", "top1", "top5")]
        rows["target"] = None
    return rows.iloc[order.argsort(kind="stable")][shown].reset_index(drop=True)


def _donor_index(models: ModelSet, donor: int | str) -> int:
    if isinstance(donor, str) and donor in models.names[1:]:
        return models.names.index(donor)
    if is_integer(donor) and 1 <= int(donor) < len(models):
        return int(donor)
    raise (SelectionError if isinstance(donor, str) or is_integer(donor) else ArgumentTypeError)(
        f"donor={shown(donor)} is not a donor of this model set: give an index "
        f"1..{len(models) - 1} or a name of {list(models.names[1:])}."
    )


def _prompts(prompts: Any, answer: Any, optional: bool = False) -> tuple[list[_Prompt], bool]:
    """The prompts as the runner reads them, with answers, and whether they lack them
    (allowed when ``optional``: each then gets :data:`_NO_ANSWER`)."""
    prompts = as_table(prompts)
    if isinstance(prompts, pd.DataFrame):  # iterating it gives its column names, not its rows
        check_table(prompts, "prompts", "a DataFrame", SelectionError)
        given = [column for column in ("target", "answer") if column in prompts]
        if "text" not in prompts or len(given) > 1 or (given and answer is not None):
            raise SelectionError(
                f"A DataFrame of prompts has a 'text' column and the answers in a 'target' or "
                f"'answer' column, or in answer=; this one has {list(prompts.columns)}"
                + (f" and answer={shown(answer)}" if answer is not None else "")
                + ": rename or drop columns, or drop answer=."
            )
        prompts, answer = prompts["text"], prompts[given[0]] if given else answer
    forms = "a prompt, a list of them, a DataFrame or records with a 'text' column, or examples"
    items = as_list(prompts, "prompts", forms)
    examples = [hasattr(item, "text") and hasattr(item, "spans") for item in items]
    if any(examples):
        if not all(examples) or answer is not None:
            bad = examples.index(False) if not all(examples) else None
            raise SelectionError(
                "These examples carry their answers (target): drop answer=."
                if bad is None
                else f"prompts[{bad}] is {shown(items[bad])}, among examples."
            )
        return [
            _Prompt(e.text, e.target, dict(e.spans), e.relation_id, e.prompt_name) for e in items
        ], False
    texts = as_texts(items, "prompts", forms)
    answers = (
        []
        if answer is None
        else as_texts(answer, "answer", "an answer for all prompts, or a list of one per prompt")
    )
    answers = answers * len(texts) if isinstance(answer, str) else answers
    lacking = answer is None and optional
    answers = [_NO_ANSWER] * len(texts) if lacking else answers
    if len(answers) != len(texts):
        counted = f"; answer= gives {len(answers)} answers for {len(texts)} prompts"
        raise SelectionError(
            "Each prompt needs an answer to score: answer='...' for all, or one per prompt"
            + (f"{counted}." if answers else " (score='kl' or a function scores without one).")
        )
    return [
        _Prompt(text.rstrip(), reply if reply[:1].isspace() else " " + reply, {}, index)
        for index, (text, reply) in enumerate(zip(texts, answers))
    ], lacking


def _places(at: Any) -> dict[str, list[str | int]]:
    """``at`` as ``{label: parts}``, each part a string or an ``int``."""
    if not isinstance(at, Mapping):
        parts = _parts(at)
        return {"+".join(map(str, parts)): parts}
    bad = [label for label in at if not (isinstance(label, str) and label.strip())]
    if bad or not at:
        raise (ArgumentTypeError if bad and not isinstance(bad[0], str) else SelectionError)(
            f"at={{{shown(bad[0])}: ...}}: a graft's label names its rows, a non-empty string."
            if bad
            else "at={} names no graft: give a place, e.g. at='last'."
        )
    return {label: _parts(place) for label, place in at.items()}


def _parts(place: Any) -> list[str | int]:
    """The places a place is the union of (numpy's and torch's integers as ``int``)."""
    forms = (
        "'last', 'all', a piece of the prompt's text, a token index, a span expression, "
        "a list of these, or {label: place}"
    )
    parts = [place] if is_integer(place) else as_list(place, "at", forms)
    bad = [p for p in parts if not (isinstance(p, str) and p.strip() or is_integer(p))]
    if bad:
        what = "an empty string" if isinstance(bad[0], str) else shown(bad[0])
        kind = SelectionError if isinstance(bad[0], str) else ArgumentTypeError
        raise kind(f"at={shown(place)}: {what} is not a place; give {forms}.")
    return [part if isinstance(part, str) else int(part) for part in parts]


def _is_expression(text: str, names: set[str]) -> bool:
    """Whether ``text`` is a span expression over spans the examples have."""
    try:
        parse_span_expression(text)
        wanted = span_names(text)
    except SelectionError:
        return False
    return wanted <= names | {"last_token"}


def _text_pieces(places: Iterable[list[str | int]], examples: list[_Prompt]) -> dict[str, str]:
    """Every place that is a piece of the prompts' text, with the span name it gets."""
    names = set(examples[0].spans)
    pieces: dict[str, str] = {}
    for part in (part for parts in places for part in parts):
        chat = examples[0].prompt_name == "chat"  # "user" is the turn, not the word
        if (
            not isinstance(part, str)
            or part in ("last", "all", *pieces)
            or (chat and _is_expression(part, names))
        ):
            continue
        if all(part in e.text for e in examples):
            pieces[part] = f"text{len(pieces)}"
        elif not _is_expression(part, names):
            text = next(e.text for e in examples if part not in e.text)
            raise SelectionError(
                f"{part!r} is in the prompt {shown(text)} only in another Unicode normal "
                "form (the same letters, composed otherwise): normalize both, e.g. "
                "unicodedata.normalize('NFC', text)."
                if unicodedata.normalize("NFC", part) in unicodedata.normalize("NFC", text)
                else f"{part!r} is not in the prompt {shown(text)}: give a piece of every "
                "prompt's text, 'last', 'all', a token index"
                + (f", or a span expression over {sorted(names)}." if names else ".")
            )
    return pieces


def _piece_spans(
    example: _Prompt, pieces: dict[str, str], tokenizer: Any
) -> dict[str, tuple[int, int]]:
    """The characters of each piece in a prompt, refused if it occurs twice or cuts a token."""
    offsets = tokenizer(example.text, add_special_tokens=False, return_offsets_mapping=True)[
        "offset_mapping"
    ]
    spans = {}
    for piece, name in pieces.items():
        start = example.text.index(piece)
        end = start + len(piece)
        if example.text.find(piece, start + 1) >= 0:
            longer = next(
                example.text[start:stop]
                for stop in [*(i for i, c in enumerate(example.text) if c == " " and i > end), None]
                if example.text.count(example.text[start:stop]) == 1
            )
            raise SelectionError(
                f"{piece!r} occurs more than once in the prompt {shown(example.text)}: give a "
                f"piece that occurs once, e.g. at={longer!r}, or token indices."
            )
        for a, b in offsets:
            # A token's offsets may hold the space before its word: the word starts after it.
            a += len(example.text[a:b]) - len(example.text[a:b].lstrip())
            cut = "starts" if a < start < b else "ends" if a < end < b else ""
            if cut:
                raise SelectionError(
                    f"{piece!r} {cut} inside the token {example.text[a:b]!r} of the prompt "
                    f"{shown(example.text)}: give whole tokens, e.g. "
                    f"at={example.text[min(a, start) : max(b, end)]!r}."
                )
        spans[name] = (start, end)
    return spans


def _selector(parts: list[str | int], pieces: dict[str, str]) -> Any:
    """The positions function of a place: ``(spans, attention_mask) -> [batch, pos]``."""

    def positions(spans: dict[str, torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros(tuple(attention_mask.shape), dtype=torch.bool)
        lengths = attention_mask.sum(dim=1)
        for part in parts:
            if isinstance(part, int):
                index = torch.full_like(lengths, part)
                index = torch.where(index < 0, lengths + index, index)
                if bool(((index < 0) | (index >= lengths)).any()):
                    raise SelectionError(
                        f"at={part}: the token index is outside a prompt of "
                        f"{int(lengths.min())} tokens (a BOS counts)."
                    )
                chosen[torch.arange(len(lengths)), index] = True
            elif part == "last":
                chosen |= select_positions("LT", spans, attention_mask)
            elif part == "all":
                chosen |= attention_mask.bool()
            else:
                chosen |= select_positions(pieces.get(part, part), spans, attention_mask)
        return chosen

    positions.__name__ = f"at_{'+'.join(map(str, parts))}"
    return positions


def _grafted(
    models: ModelSet,
    rows: pd.DataFrame,
    configs: list[GraftConfig],
    examples: list[_Prompt],
    semantics: Semantics | str | None,
) -> list[str]:
    """The tokens each row's donor computed, as ``text@index`` (``"all"``: the whole donor)."""
    rules = semantics_or_default(semantics).tokenization()
    batch = tokenize_examples(examples, models.tokenizer, **rules)
    by_name = {config.name: config for config in configs}
    shown = []
    for name, example in zip(rows["config"], rows["example"]):
        config = by_name[name]
        if not config.grafts or config is configs[1]:  # the base, or the whole donor
            shown.append("all" if config.grafts else "")
            continue
        row = batch.rows([int(example)])
        picked = config.grafted_positions(row.spans, row.attention_mask)[0].nonzero()[:, 0]
        tokens = row.tokens[0].tolist()
        shown.append(
            "|".join(f"{models.tokenizer.decode([tokens[i]])}@{i}" for i in picked.tolist())
        )
    return shown
