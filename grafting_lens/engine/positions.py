"""Choosing token positions, per row, for grafts and patches.

Every selector turns a specification into a boolean ``[batch, pos]`` tensor, ``True`` where
the intervention applies (rows differ: one prompt's first entity spans tokens 1-3, another's
1-4), from the forms people write:

* ``"all"``: every real (non-padding) token;
* ``"last"``: the last real token of each row (the paper's LT);
* an int or a list of ints: the same indices in every row (negative counts from
  each row's last real token); numpy integers and integer arrays work too;
* a list of lists: one list of indices per row;
* a ``[batch, pos]`` boolean tensor (or numpy array), used as given;
* :func:`span_positions` for ``[start, end)`` spans per row, and
  :func:`complement` for "everything except" (the paper's ``(FE+LT)^C``).

Padding is always right padding, and a selector never selects it; an index beyond a row's
real tokens is an error, not a silent no-op. A row's length, hence its last token, has one
definition everywhere: :func:`row_lengths` of the attention mask (0 and 1 only). Without one
every position is real, so :func:`check_padding` refuses a batch that looks padded.

A tokenized batch's named spans (the first entity, the relation, the movie, the last token)
are selected by span expressions in the paper's notation, such as ``(FE+LT)^C``
(:func:`select_positions`). Every mistake raises
:class:`~grafting_lens.core.errors.SelectionError`, saying what was given and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard, Union

import numpy as np
import torch
from jaxtyping import Bool, Int

from grafting_lens.core.arguments import is_integer, shown
from grafting_lens.core.errors import (
    ArgumentTypeError,
    GraftingLensError,
    SelectionError,
    did_you_mean,
    kind,
)

PositionSpec = Union[str, int, Sequence[int], Sequence[Sequence[int]], torch.Tensor]
"""Anything :func:`resolve_positions` accepts."""


def row_lengths(
    shape: tuple[int, ...], attention_mask: Int[torch.Tensor, "batch pos"] | None = None
) -> Int[torch.Tensor, " batch"]:
    """Number of real tokens in each row of a right-padded batch (on the CPU).

    Raises:
        SelectionError: An attention mask that is not a ``[batch, pos]`` tensor (not on the
            ``meta`` device) of 0 and 1, right padded, with a real token in every row (a
            model reads a 2 or a 0.5 as given, which a length here would disagree with).
    """
    batch, pos = int(shape[0]), int(shape[1])
    if attention_mask is None:
        return torch.full((batch,), pos, dtype=torch.long)
    lengths = None
    if _has_values(attention_mask) and tuple(attention_mask.shape) == (batch, pos):
        values = attention_mask.detach().cpu()
        if not values.is_complex() and bool(((values == 0) | (values == 1)).all()):
            lengths = values.long().sum(dim=1)
            if not torch.equal(_real(lengths, pos), values.bool()) or bool((lengths == 0).any()):
                lengths = None
    if lengths is None:
        raise kind(attention_mask, (torch.Tensor, np.ndarray, list, tuple), SelectionError)(
            f"attention_mask must be a [batch, pos] = {[batch, pos]} tensor holding only 0 "
            "(padding) and 1 (real token), with right padding (ones, then zeros) and a real "
            f"token in every row; got {_described(attention_mask)}.\nPass the tokenizer's "
            "attention_mask as it comes, tokenized with padding_side='right'."
        )
    return lengths


def _has_values(value: object) -> TypeGuard[torch.Tensor]:
    """A tensor whose values can be read (one on the ``meta`` device has none)."""
    return isinstance(value, torch.Tensor) and value.device.type != "meta"


def _described(value: object) -> str:
    """What was given, for a message: a tensor's dtype, shape, device and first values."""
    if not isinstance(value, torch.Tensor):
        return f"{type(value).__name__} {value!r:.60}"
    shown = value.flatten()[:6].tolist() if _has_values(value) else "no values"
    return f"{value.dtype} of shape {list(value.shape)} on {value.device} ({shown})"


def check_padding(
    tokens: Int[torch.Tensor, "batch pos"],
    attention_mask: Int[torch.Tensor, "batch pos"] | None,
    tokenizer: Any,
    *,
    fix: str | None = None,
) -> None:
    """Refuse a padded batch given without its attention mask.

    Without one every position counts as real, so "last" would be the padding column of
    every shorter row. Two signs give padding away: rows ending in the pad token (the
    tokenizer's, else its EOS token), and rows that start with more of it than others (a BOS
    that is the pad token, as GPT-2's, starts every row once). Prompts that really end or
    start with it pass with ``attention_mask=torch.ones_like(tokens)``.

    Args:
        tokens: ``[batch, pos]`` token ids.
        attention_mask: The batch's attention mask, or ``None``.
        tokenizer: The model set's tokenizer; ``None`` (or one with neither a pad nor an
            EOS token) skips the check.
        fix: What the caller can do about it, for a function that takes no attention mask.
    """
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = getattr(tokenizer, "eos_token_id", None) if pad is None else pad
    if attention_mask is not None or pad is None or not _has_values(tokens) or tokens.dim() != 2:
        return
    padding = (tokens == int(pad)).cpu()
    # Leading pad tokens per row: the position of the first other token.
    leading = torch.where(padding.all(1), padding.shape[1], (~padding).to(torch.int8).argmax(1))
    ends, starts = padding[:, -1], leading > leading.min()
    right = bool(ends.any())
    if right or bool(starts.any()):
        rows = (ends if right else starts).nonzero().squeeze(1).tolist()
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        sign = f"end in the pad token {int(pad)}"
        if not right:
            sign = f"start with more pad tokens ({int(pad)}) than the others"
        fix = fix or (
            "Pass the tokenizer's attention_mask=... (padding_side='right'), or "
            "attention_mask=torch.ones_like(tokens) if those tokens are real."
        )
        raise SelectionError(
            f"{len(rows)} of {tokens.shape[0]} rows (rows {shown}) {sign}, but no attention_mask "
            "says where the rows really are: padding would count as real tokens ('last' a "
            f"padding column).\n{fix}"
        )


def last_token(
    shape: tuple[int, ...], attention_mask: Int[torch.Tensor, "batch pos"] | None = None
) -> Bool[torch.Tensor, "batch pos"]:
    """The last real token of each row (the paper's LT)."""
    return _last(row_lengths(shape, attention_mask), int(shape[1]))


def _last(lengths: torch.Tensor, pos: int) -> torch.Tensor:
    selected = torch.zeros((len(lengths), pos), dtype=torch.bool)
    selected[torch.arange(len(lengths)), lengths - 1] = True
    return selected


def span_positions(
    shape: tuple[int, ...],
    starts: int | Sequence[int],
    ends: int | Sequence[int],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Bool[torch.Tensor, "batch pos"]:
    """Token spans ``[start, end)``, one per row (or one for every row).

    Raises:
        SelectionError: Not one int (or one per row) each, an empty span, or a span
            reaching past the row's real tokens.
    """
    batch = int(shape[0])
    bounds = [[v] * batch if is_integer(v) else v for v in (starts, ends)]
    fits = all(
        isinstance(b, (Sequence, np.ndarray)) and len(b) == batch and all(map(is_integer, b))
        for b in bounds
    )
    if not fits or any(end <= start for start, end in zip(*bounds)):
        raise SelectionError(
            f"Spans need starts and ends that are ints (one for every row, or one per row of "
            f"{batch}) with start < end; got starts={starts!r}, ends={ends!r}."
        )
    rows = [list(range(int(s), int(e))) for s, e in zip(*bounds)]
    return resolve_positions(rows, shape, attention_mask)


def complement(
    positions: Bool[torch.Tensor, "batch pos"],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Bool[torch.Tensor, "batch pos"]:
    """Every real token not in ``positions`` (the paper's ``X^C``)."""
    lengths = row_lengths(tuple(positions.shape), attention_mask)
    real = _real(lengths, int(positions.shape[1]))
    return real & ~_selection(positions, lengths, int(positions.shape[1]), "The positions")


def _real(lengths: torch.Tensor, pos: int) -> torch.Tensor:
    return torch.arange(pos)[None, :] < lengths[:, None]


def resolve_positions(
    spec: PositionSpec,
    shape: tuple[int, ...],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Bool[torch.Tensor, "batch pos"]:
    """Turn a position specification into a boolean ``[batch, pos]`` tensor.

    Args:
        spec: See the module docstring for the accepted forms.
        shape: ``(batch, pos)`` of the tokens.
        attention_mask: ``[batch, pos]``, right padded; ``None`` means no padding.

    Returns:
        ``True`` at every selected position (never at a padding position).

    Raises:
        SelectionError: A form it cannot read (a bool reads as no index: ``True`` would
            be position 1), an index outside a row's real tokens, a tensor of another
            shape or dtype, or a specification that selects nothing.
    """
    return selected_positions(spec, row_lengths(shape, attention_mask), int(shape[1]))


def selected_positions(spec: PositionSpec, lengths: torch.Tensor, pos: int) -> torch.Tensor:
    """:func:`resolve_positions` for rows of checked ``lengths``."""
    if isinstance(spec, str) and spec in ("all", "last", "last_token"):
        return _real(lengths, pos) if spec == "all" else _last(lengths, pos)
    if isinstance(spec, torch.Tensor) or (isinstance(spec, np.ndarray) and spec.dtype == np.bool_):
        selected = _selection(torch.as_tensor(spec), lengths, pos, "A position tensor")
    else:
        batch = len(lengths)
        given: Any = [spec] if is_integer(spec) else spec
        rows: list[list[Any]] | None = None  # one list of indices per row, once read
        if isinstance(given, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(given, str):
            items: list[Any] = list(given)
            per_row = bool(items) and all(_is_row(item) for item in items)
            if per_row and len(items) == batch:
                rows = [list(item) for item in items]
            elif not per_row:
                rows = [items] * batch
        if rows is None or not all(is_integer(i) for row in rows for i in row):
            readable = (str, int, float, Sequence, np.ndarray, np.integer, torch.Tensor)
            raise kind(spec, readable, SelectionError)(
                f"Cannot read positions from {spec!r:.80}: use 'all', 'last', an int, a list of "
                f"ints, one list of ints per row ({batch} rows), or a [batch, pos] boolean tensor."
            )
        selected = torch.zeros((batch, pos), dtype=torch.bool)
        for row, (indices, length) in enumerate(zip(rows, lengths.tolist())):
            for index in map(int, indices):
                if not -length <= index < length:
                    raise SelectionError(
                        f"Position {index} is beyond row {row}, which has {length} real tokens "
                        f"(positions 0..{length - 1}; negative indices count from the end)."
                    )
                selected[row, index % length] = True
        if not bool(selected.any()):
            # One empty list per row ([[]], [[], []]) reads as a selection, yet grafts nothing.
            raise SelectionError(
                f"positions={spec!r:.80} selects no position in any row, so nothing would be "
                "grafted or patched.\nGive at least one index in some row, e.g. [[1, 2], []], "
                "or 'last'."
            )
    return selected


def _is_row(value: object) -> bool:
    """One row's positions: a list, tuple, array or tensor (not a string)."""
    listed = isinstance(value, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(value, str)
    return listed and getattr(value, "ndim", 1) != 0  # a 0-d tensor is one index


def _selection(value: object, lengths: torch.Tensor, pos: int, what: str) -> torch.Tensor:
    """``value`` as the boolean ``[batch, pos]`` selection of real tokens it must be, on the CPU."""
    shape = [len(lengths), pos]
    got = _described(value)
    if _has_values(value) and value.dtype == torch.bool and list(value.shape) == shape:
        value = value.cpu()
        padding = (value & ~_real(lengths, pos)).any(dim=1)
        if not bool(padding.any()):
            return value
        row = int(padding.nonzero()[0])
        got = f"one selecting padding in row {row} (it has {int(lengths[row])} real tokens)"
    raise SelectionError(
        f"{what} must be a boolean [batch, pos] = {shape} tensor selecting real tokens only; "
        f"got {got}."
    )


# ------------------------------------------------------------------ span expressions

Spans = Mapping[str, Bool[torch.Tensor, "batch pos"]]
"""Named ``[batch, pos]`` token spans of a batch, e.g. ``TokenizedExamples.spans``."""

PositionFunction = Callable[
    [Spans, Int[torch.Tensor, "batch pos"]], Bool[torch.Tensor, "batch pos"]
]
"""``(spans, attention_mask) -> selected positions``, for positions no span expression says."""

SPAN_ALIASES = {"FE": "first_entity", "LT": "last_token", "M": "movie", "REL": "relation"}
"""The paper's labels for the spans :func:`grafting_lens.analysis.batch.tokenize_examples` marks."""

_SPAN_TOKEN = re.compile(r"\^[Cc]|[()+]|[A-Za-z_][A-Za-z_0-9]*|\S")


def parse_span_expression(expression: str) -> tuple:
    """Parse a span expression into a tree of tuples, checking its syntax.

    Grammar: ``expr := term ('+' term)*``, ``term := atom '^C'*``,
    ``atom := NAME | '(' expr ')'``; ``^C`` binds tighter than ``+``. Nodes are ``("all",)``,
    ``("span", name)`` (aliases resolved), ``("union", children)``, ``("complement", child)``.

    Raises:
        SelectionError: Not a non-empty string, a character outside the grammar, a
            misplaced name or operator, or unbalanced parentheses.
    """
    tokens = _SPAN_TOKEN.findall(expression) if isinstance(expression, str) else []
    # One list of terms per open parenthesis; a term is complemented where '^C' follows it.
    groups: list[list[tuple]] = [[]]
    operand = True  # whether a name or '(' comes next
    problem = "Nothing to read" if not tokens else None
    for token in tokens:
        if operand and token == "(":
            groups.append([])
        elif operand and (token[0].isalpha() or token[0] == "_"):
            name = ("all",) if token.upper() == "ALL" else ("span", SPAN_ALIASES.get(token, token))
            groups[-1].append(name)
            operand = False
        elif not operand and token.upper() == "^C":
            groups[-1][-1] = ("complement", groups[-1][-1])
        elif not operand and token == "+":
            operand = True
        elif not operand and token == ")" and len(groups) > 1:
            terms = groups.pop()
            groups[-1].append(terms[0] if len(terms) == 1 else ("union", tuple(terms)))
        else:
            closing = token == ")" and not operand
            problem = "Unbalanced parentheses" if closing else f"Cannot read {token!r} there"
            break
    if problem is None and (operand or len(groups) > 1):
        problem = "Unbalanced parentheses" if not operand else "A name is missing at the end"
    if problem is not None:
        raise kind(expression, str, SelectionError)(
            f"{problem} in the span expression {expression!r}: use span names ("
            f"{', '.join(SPAN_ALIASES)}, ALL or a span's own name), '+', '^C' and parentheses, "
            "e.g. '(FE+LT)^C'."
        )
    terms = groups[0]
    return terms[0] if len(terms) == 1 else ("union", tuple(terms))


def span_names(expression: str) -> set[str]:
    """The spans a span expression reads, e.g. ``{"first_entity", "last_token"}`` for ``FE+LT``.

    Raises:
        SelectionError: The expression does not parse.
    """

    def walk(node: tuple) -> set[str]:
        if node[0] == "span":
            return {node[1]}
        children = node[1] if node[0] == "union" else (node[1],) if node[0] == "complement" else ()
        return set().union(*map(walk, children))

    return walk(parse_span_expression(expression))


def select_positions(
    expression: str | PositionFunction,
    spans: Spans,
    attention_mask: Int[torch.Tensor, "batch pos"],
) -> Bool[torch.Tensor, "batch pos"]:
    """The positions a span expression (or a position function) selects in each row.

    Span names: ``FE`` (first_entity), ``LT`` (last_token), ``M`` (movie), ``REL`` (relation),
    ``ALL`` (every real token) or any span's own name; ``A+B`` is the union, ``A^C`` the
    complement among the row's real tokens.

    Args:
        expression: A span expression such as ``"(FE+LT)^C"``, or a function
            ``(spans, attention_mask) -> [batch, pos]`` boolean tensor.
        spans: Named ``[batch, pos]`` boolean spans. ``last_token`` may be absent: it
            follows from the padding.
        attention_mask: ``[batch, pos]`` right padding.

    Raises:
        SelectionError: Bad syntax, a function that returns something other than a
            boolean ``[batch, pos]`` tensor of real tokens, positions on padding, or a
            span the batch lacks (the message lists the ones it has).

    Examples:
        >>> select_positions("FE+LT", batch.spans, batch.attention_mask)
    """
    if not isinstance(spans, Mapping) or not isinstance(attention_mask, (torch.Tensor, np.ndarray)):
        raise ArgumentTypeError(
            f"select_positions takes spans= as a dict of [batch, pos] masks and attention_mask= "
            f"as a tensor; got spans={shown(spans)}, attention_mask={shown(attention_mask)}."
        )
    attention_mask = torch.as_tensor(attention_mask)
    shape = tuple(attention_mask.shape)
    lengths = row_lengths(shape, attention_mask)
    real = _real(lengths, shape[1])
    if callable(expression):
        what = f"The position function {callable_name(expression)}"
        try:
            selected = expression(spans, attention_mask)
        except GraftingLensError:  # a refusal names the user's own argument already
            raise
        except Exception as error:  # the user's code: named, with what it raised
            raise SelectionError(
                f"{what} raised {type(error).__name__}: {error} (it is called with the spans "
                "and the attention mask)."
            ) from error
        return _selection(selected, lengths, shape[1], f"{what}'s result")

    def evaluate(node: tuple) -> torch.Tensor:
        if node[0] == "all":
            return real
        if node[0] == "span":
            return _named_span(spans, node[1], expression, lengths, shape[1])
        if node[0] == "union":
            return torch.stack([evaluate(child) for child in node[1]]).any(dim=0)
        return real & ~evaluate(node[1])

    tree = parse_span_expression(expression)
    return _selection(evaluate(tree), lengths, shape[1], f"The positions of {expression!r}")


def callable_name(function: Callable[..., Any]) -> str:
    """``module.qualname`` of a function, for messages and run descriptions."""
    module = getattr(function, "__module__", "?")
    return f"{module}.{getattr(function, '__qualname__', repr(function))}"


def _named_span(
    spans: Spans, name: str, expression: str, lengths: torch.Tensor, pos: int
) -> torch.Tensor:
    if name in spans:
        value = spans[name]
        return _selection(
            value.bool() if _has_values(value) else value, lengths, pos, f"The span {name!r}"
        )
    if name == "last_token":
        # The last real token follows from the padding; a batch built by hand need not mark it.
        return _last(lengths, pos)
    known = name in SPAN_ALIASES.values()  # a paper's span this batch lacks: no typo
    raise SelectionError(
        f"Unknown position set {expression!r}: this batch has no {name!r} span."
        f"{'' if known else did_you_mean(name, [*SPAN_ALIASES, 'ALL', *spans])} It has "
        f"{sorted(spans)}; "
        + (
            "use a prompt that names the movie (see grafting_lens.study.MOVIE_PROMPTS)."
            if name == "movie"
            else "tokenize with grafting_lens.analysis.batch.tokenize_examples, which marks the "
            "paper's spans, or give a [batch, pos] boolean tensor."
        )
    )


# --------------------------------------------------------------- labelled position sets

PositionSets = Union[str, Sequence[str], Mapping[str, Union[str, torch.Tensor, PositionFunction]]]
"""Span expressions (``"LT"``, ``"FE"``, ``"FE+LT"``...), or ``{label: expression, tensor or
position function}``."""


def position_sets(
    positions: PositionSets,
    spans: Spans,
    attention_mask: Int[torch.Tensor, "batch pos"],
) -> dict[str, Bool[torch.Tensor, "batch pos"]]:
    """Labelled position sets of a batch: label to ``[batch, pos]`` selection.

    The position axis of a comparison or an attribution, each with a label for tables.

    Args:
        positions: One span expression, several (each its own label), or a mapping from a
            label to a span expression, a ``[batch, pos]`` boolean tensor or a position
            function (see :func:`select_positions`).
        spans: The batch's named spans.
        attention_mask: The batch's right padding.

    Raises:
        SelectionError: No position set, a label given twice, a specification of another
            kind, or one :func:`select_positions` refuses (an unknown span name: the
            message has the names the batch has).
    """
    if isinstance(positions, str):
        positions = [positions]
    if isinstance(positions, Mapping):
        items = list(positions.items())
    else:
        items = [(p, p) for p in positions] if isinstance(positions, Sequence) else []
    labels = [str(label) for label, _ in items]
    if (
        not items
        or len(set(labels)) < len(labels)
        or not all(isinstance(spec, (str, torch.Tensor)) or callable(spec) for _, spec in items)
    ):
        raise kind(positions, (Mapping, Sequence), SelectionError)(
            "positions must be span expressions such as ('LT', 'FE'), or {label: span "
            "expression, [batch, pos] boolean tensor or position function}, each label once; "
            f"got {positions!r:.80}."
        )
    shape = tuple(attention_mask.shape)
    return {
        label: resolve_positions(spec, shape, attention_mask)
        if isinstance(spec, torch.Tensor)
        else select_positions(spec, spans, attention_mask)
        for label, (_, spec) in zip(labels, items)
    }
