"""Choosing token positions, per row, for grafts and patches.

Every position selector turns a specification into a boolean ``[batch, pos]``
tensor: ``True`` where the intervention applies. Rows differ (the first entity of
one prompt spans tokens 1-3, of another 1-4), so the boolean tensor is the common
currency; the helpers below build one from the forms people write:

* ``"all"``: every real (non-padding) token;
* ``"last"``: the last real token of each row (the paper's LT);
* an int or a list of ints: the same indices in every row (negative counts from
  each row's last real token); numpy integers and integer arrays work too;
* a list of lists: one list of indices per row;
* a ``[batch, pos]`` boolean tensor (or numpy array), used as given;
* :func:`span_positions` for ``[start, end)`` spans per row, and
  :func:`complement` for "everything except" (the paper's ``(FE+LT)^C``).

Padding is always right padding: real tokens are ``0 .. length-1`` in each row.
A selector never selects a padding position, and an index beyond a row's real
tokens is an error rather than a silent no-op.

A row's real length, hence its last token, has one definition everywhere
(masks, grafted and patched runs, scoring): :func:`row_lengths` of the
attention mask, whose values must be 0 or 1. Without an attention mask every
position is real, so a padded batch must come with its attention mask:
:func:`check_padding` refuses tokens whose rows end in the pad token (right
padding), or start with more pad tokens than other rows (left padding), when no
mask says where they are.

Span expressions
----------------
A tokenized batch (:class:`grafting_lens.analysis.batch.TokenizedExamples`) carries named
spans, one ``[batch, pos]`` boolean tensor each: the first entity, the relation
words, the movie title, the last token. :func:`select_positions` reads an
expression over them, in the paper's notation: ``FE`` (first entity), ``LT`` (last
token), ``M`` (movie), ``REL`` (relation), ``ALL`` (every real token) or any span's
own name, joined with ``+`` (union) and complemented with ``^C`` among the row's real
tokens, as in ``(FE+LT)^C``. Grafts, patches and comparisons name positions this way.

Every mistake raises :class:`~grafting_lens.core.errors.SelectionError`, which says what
was given and how to fix it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch
from jaxtyping import Bool, Int

from grafting_lens.core.errors import SelectionError, did_you_mean

PositionSpec = Union[str, int, Sequence[int], Sequence[Sequence[int]], torch.Tensor]
"""Anything :func:`resolve_positions` accepts."""


def row_lengths(
    shape: tuple[int, ...], attention_mask: Int[torch.Tensor, "batch pos"] | None = None
) -> Int[torch.Tensor, " batch"]:
    """Number of real tokens in each row of a right-padded batch.

    Raises:
        SelectionError: The attention mask has the wrong shape, holds values
            other than 0 and 1, or is not right padded (a zero followed by a one
            in some row).
    """
    batch, pos = shape
    if attention_mask is None:
        return torch.full((batch,), pos, dtype=torch.long)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a [batch, pos] tensor of 0/1, got {type(attention_mask).__name__}."
        )
    if tuple(attention_mask.shape) != (batch, pos):
        raise SelectionError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, tokens have {(batch, pos)}."
        )
    values = attention_mask.detach().cpu()
    if values.is_complex() or not bool(((values == 0) | (values == 1)).all()):
        # A model reads the mask as given: a 2 or a 0.5 would move its logits
        # while a length computed here would silently disagree with it.
        raise SelectionError(
            "attention_mask must hold only 0 (padding) and 1 (real token), got values "
            f"{sorted(set(values.flatten().tolist()))[:5]}. Pass the tokenizer's attention_mask "
            "as it comes."
        )
    mask = values.to(torch.long)
    lengths = mask.sum(dim=1)
    expected = torch.arange(pos)[None, :] < lengths[:, None]
    if not torch.equal(expected, mask.bool()):
        raise SelectionError(
            "attention_mask must describe right padding (ones, then zeros, in every row). "
            "Tokenize with padding_side='right'."
        )
    if (lengths == 0).any():
        raise SelectionError("A row of attention_mask has no real token.")
    return lengths


def check_padding(
    tokens: Int[torch.Tensor, "batch pos"],
    attention_mask: Int[torch.Tensor, "batch pos"] | None,
    tokenizer: Any,
    *,
    fix: str | None = None,
) -> None:
    """Refuse a padded batch given without its attention mask.

    Without an attention mask every position counts as real, so "last" would be
    the padding column of every shorter row. Two signs give padding away:

    * rows ending in the pad token (right padding);
    * rows that start with more pad tokens than others (left padding: a shorter row
      begins with padding; a BOS that is the pad token, as GPT-2's, starts every row
      once, and is not counted against it).

    The check refuses either unless an attention mask says where rows are. The pad
    token is the tokenizer's, or its EOS token when it has none (what
    :func:`~grafting_lens.worlds.data.tokenize_examples` and most scripts pad with). Prompts
    that really end or start with that token pass with
    ``attention_mask=torch.ones_like(tokens)``.

    Args:
        tokens: ``[batch, pos]`` token ids.
        attention_mask: The batch's attention mask, or ``None``.
        tokenizer: The model set's tokenizer; ``None`` (or one with neither a pad
            nor an EOS token) skips the check.
        fix: What the caller can do about it, instead of passing an attention mask
            (for a function that takes none, such as ``graft_generate``).

    Raises:
        SelectionError: ``attention_mask`` is ``None`` and some row ends in the pad
            token, or rows start with different numbers of pad tokens.
    """
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "eos_token_id", None)
    if attention_mask is not None or pad_token_id is None or not isinstance(tokens, torch.Tensor):
        return
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        return
    padding = (tokens == int(pad_token_id)).cpu()
    padded = padding[:, -1]
    if bool(padded.any()):
        rows = padded.nonzero().squeeze(1).tolist()
        raise SelectionError(
            f"{len(rows)} of {tokens.shape[0]} rows (rows {_shown(rows)}) end in the pad token "
            f"{int(pad_token_id)}, but no attention_mask says where the rows really end: every "
            "position would count as real, and 'last' would be a padding column. "
            + (
                fix
                or "Pass the tokenizer's attention_mask=..., or "
                "attention_mask=torch.ones_like(tokens) if those tokens are real."
            )
        )
    # Leading pad tokens per row: the position of the first other token.
    leading = torch.where(
        padding.all(dim=1), padding.shape[1], (~padding).to(torch.int8).argmax(dim=1)
    )
    if int(leading.max()) != int(leading.min()):
        rows = (leading > leading.min()).nonzero().squeeze(1).tolist()
        raise SelectionError(
            f"{len(rows)} of {tokens.shape[0]} rows (rows {_shown(rows)}) start with more pad "
            f"tokens ({int(pad_token_id)}) than the others, but no attention_mask says where "
            "the rows really start: a left-padded batch, whose padding would count as real "
            "tokens (positions are indices from each row's start). "
            + (
                fix
                or "Tokenize with padding_side='right' and pass the tokenizer's "
                "attention_mask=..., or attention_mask=torch.ones_like(tokens) if those "
                "tokens are real."
            )
        )


def _shown(rows: list[int]) -> str:
    """Row numbers for a message: the first five, then an ellipsis."""
    return ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")


def last_token(
    shape: tuple[int, ...], attention_mask: Int[torch.Tensor, "batch pos"] | None = None
) -> Bool[torch.Tensor, "batch pos"]:
    """The last real token of each row (the paper's LT)."""
    lengths = row_lengths(shape, attention_mask)
    selected = torch.zeros(shape, dtype=torch.bool)
    selected[torch.arange(shape[0]), lengths - 1] = True
    return selected


def span_positions(
    shape: tuple[int, ...],
    starts: int | Sequence[int],
    ends: int | Sequence[int],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Bool[torch.Tensor, "batch pos"]:
    """Token spans ``[start, end)``, one per row (or one for every row).

    Raises:
        SelectionError: A span is empty or reaches past the row's real tokens.
    """
    batch = shape[0]
    starts_list, ends_list = _per_row(starts, batch, "starts"), _per_row(ends, batch, "ends")
    if len(starts_list) != batch or len(ends_list) != batch:
        raise SelectionError(
            f"Got {len(starts_list)} starts and {len(ends_list)} ends for {batch} rows."
        )
    rows = [list(range(s, e)) for s, e in zip(starts_list, ends_list)]
    for row, (s, e) in enumerate(zip(starts_list, ends_list)):
        if e <= s:
            raise SelectionError(f"Row {row}: the span [{s}, {e}) is empty.")
    return resolve_positions(rows, shape, attention_mask)


def complement(
    positions: Bool[torch.Tensor, "batch pos"],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Bool[torch.Tensor, "batch pos"]:
    """Every real token not in ``positions`` (the paper's ``X^C``)."""
    positions = _check_bool(positions, tuple(positions.shape))
    real = resolve_positions("all", tuple(positions.shape), attention_mask)
    return real & ~positions


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
        SelectionError: An index outside a row's real tokens, a tensor of the wrong
            shape, a specification of an unknown form, an empty list or per-row
            lists that are all empty (they would select nothing), or a bool where an
            index is expected (``True`` would read as position 1).
    """
    batch, pos = shape
    lengths = row_lengths(shape, attention_mask)
    real = torch.arange(pos)[None, :] < lengths[:, None]
    if isinstance(spec, str):
        if spec == "all":
            return real
        if spec in ("last", "last_token"):
            return last_token(shape, attention_mask)
        raise SelectionError(
            f"Unknown position specification {spec!r}: use 'all', 'last', indices or a "
            "[batch, pos] boolean tensor."
        )
    if isinstance(spec, torch.Tensor):
        selected = _check_bool(spec, shape)
        if (selected & ~real).any():
            row = int((selected & ~real).any(dim=1).nonzero()[0])
            raise SelectionError(
                f"Row {row} selects padding positions (it has {int(lengths[row])} real tokens)."
            )
        return selected
    if isinstance(spec, np.ndarray) and spec.dtype == np.bool_:
        return resolve_positions(torch.from_numpy(spec), shape, attention_mask)
    given: Any = [spec] if _is_index(spec) else spec
    if isinstance(given, (bool, np.bool_)) or not isinstance(given, (Sequence, np.ndarray)):
        raise SelectionError(
            f"Cannot read positions from {given!r}: use 'all', 'last', an int, a list of ints, "
            "one list per row, or a [batch, pos] boolean tensor."
        )
    items: list[Any] = list(given)
    if not items:
        raise SelectionError(
            "positions=[] selects no position, so nothing would be grafted or patched. Give "
            "at least one index, or one list per row."
        )
    first = items[0]
    per_row = isinstance(first, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(first, str)
    if not per_row and not _is_index(first):
        raise SelectionError(
            f"Position indices must be ints, got {first!r}: give ints, or one list of ints per row."
        )
    if per_row and len(items) != batch:
        raise SelectionError(f"Got position lists for {len(items)} rows, the tokens have {batch}.")
    selected = torch.zeros(shape, dtype=torch.bool)
    for row in range(batch):
        indices = items[row] if per_row else items
        if _is_index(indices) or isinstance(indices, (str, bool, np.bool_)):
            raise SelectionError(
                f"Row {row}'s positions are {indices!r}; per-row positions are one list of "
                "ints per row, e.g. [[1, 2], [3]]."
            )
        length = int(lengths[row])
        for index in list(indices):
            if not _is_index(index):
                raise SelectionError(f"Position indices must be ints, got {index!r}.")
            index = int(index)
            resolved = index + length if index < 0 else index
            if not 0 <= resolved < length:
                raise SelectionError(
                    f"Position {index} is beyond row {row}, which has {length} real tokens "
                    f"(positions 0..{length - 1})."
                )
            selected[row, resolved] = True
    if not bool(selected.any()):
        # One empty list per row ([[]], [[], []]) reads as a selection, yet grafts nothing.
        raise SelectionError(
            f"positions={spec!r} selects no position in any row, so nothing would be grafted "
            "or patched. Give at least one index in some row, e.g. [[1, 2], []], or "
            "positions='last'."
        )
    return selected


def _per_row(value: Any, batch: int, name: str) -> list[int]:
    """One int per row from an int (the same for every row) or a sequence of ints."""
    if not (_is_index(value) or isinstance(value, (Sequence, np.ndarray))):
        raise SelectionError(f"{name} must be an int or one int per row, got {value!r}.")
    values = [value] * batch if _is_index(value) else list(value)
    for item in values:
        if not _is_index(item):
            raise SelectionError(f"Span starts and ends must be ints, got {item!r}.")
    return [int(item) for item in values]


def _is_index(value: object) -> bool:
    """An int (numpy's included), but not a bool, which would read as 0 or 1."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_bool(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        raise SelectionError(
            f"The position tensor has shape {tuple(tensor.shape)}, the tokens have {tuple(shape)}."
        )
    if tensor.dtype != torch.bool:
        raise SelectionError(f"A position tensor must be boolean, got {tensor.dtype}.")
    return tensor.cpu()


# ------------------------------------------------------------------ span expressions

Spans = Mapping[str, Bool[torch.Tensor, "batch pos"]]
"""Named ``[batch, pos]`` token spans of a batch, e.g. ``TokenizedExamples.spans``."""

PositionFunction = Callable[
    [Spans, Int[torch.Tensor, "batch pos"]], Bool[torch.Tensor, "batch pos"]
]
"""``(spans, attention_mask) -> selected positions``, for positions no span expression says."""

SPAN_ALIASES: dict[str, str] = {
    "FE": "first_entity",
    "LT": "last_token",
    "M": "movie",
    "REL": "relation",
}
"""The paper's labels for the spans :func:`grafting_lens.worlds.data.tokenize_examples` marks."""

_SPAN_TOKEN = re.compile(r"\s*(\^[Cc]|\(|\)|\+|[A-Za-z_][A-Za-z_0-9]*)")


def parse_span_expression(expression: str) -> tuple:
    """Parse a span expression into a tree of tuples, checking its syntax.

    Grammar: ``expr := term ('+' term)*``, ``term := atom '^C'*``,
    ``atom := NAME | '(' expr ')'``; ``^C`` binds tighter than ``+``. Nodes are
    ``("all",)``, ``("span", name)`` (aliases resolved), ``("union", children)`` and
    ``("complement", child)``.

    Raises:
        SelectionError: An empty expression, a character outside the grammar, or
            unbalanced parentheses.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise SelectionError(f"A span expression must be a non-empty string, got {expression!r}.")
    tokens: list[str] = []
    position = 0
    text = expression.rstrip()
    while position < len(text):
        match = _SPAN_TOKEN.match(text, position)
        if match is None:
            raise SelectionError(
                f"Cannot read the span expression {expression!r} at {text[position:]!r}: use span "
                f"names ({', '.join(SPAN_ALIASES)}, ALL or a span's own name), '+', '^C' and "
                "parentheses, e.g. '(FE+LT)^C'."
            )
        tokens.append(match.group(1))
        position = match.end()
    stream = iter([*tokens, ""])
    current = [next(stream)]

    def advance() -> str:
        token = current[0]
        current[0] = next(stream, "")
        return token

    def parse_expr() -> tuple:
        terms = [parse_term()]
        while current[0] == "+":
            advance()
            terms.append(parse_term())
        return terms[0] if len(terms) == 1 else ("union", tuple(terms))

    def parse_term() -> tuple:
        node = parse_atom()
        while current[0].upper() == "^C":
            advance()
            node = ("complement", node)
        return node

    def parse_atom() -> tuple:
        token = advance()
        if token == "(":
            node = parse_expr()
            if advance() != ")":
                raise SelectionError(
                    f"Unbalanced parentheses in the span expression {expression!r}."
                )
            return node
        if not token or not (token[0].isalpha() or token[0] == "_"):
            raise SelectionError(
                f"The span expression {expression!r} has {token or 'nothing'!r} where a span "
                "name or '(' belongs."
            )
        if token.upper() == "ALL":
            return ("all",)
        return ("span", SPAN_ALIASES.get(token, token))

    tree = parse_expr()
    if current[0]:
        raise SelectionError(f"Unexpected {current[0]!r} in the span expression {expression!r}.")
    return tree


def span_names(expression: str) -> set[str]:
    """The spans a span expression reads, e.g. ``{"first_entity", "last_token"}`` for ``FE+LT``.

    Raises:
        SelectionError: The expression does not parse.
    """
    names: set[str] = set()

    def walk(node: tuple) -> None:
        if node[0] == "span":
            names.add(node[1])
        elif node[0] == "union":
            for child in node[1]:
                walk(child)
        elif node[0] == "complement":
            walk(node[1])

    walk(parse_span_expression(expression))
    return names


def select_positions(
    expression: str | PositionFunction,
    spans: Spans,
    attention_mask: Int[torch.Tensor, "batch pos"],
) -> Bool[torch.Tensor, "batch pos"]:
    """The positions a span expression (or a position function) selects in each row.

    Span names: ``FE`` (first_entity), ``LT`` (last_token), ``M`` (movie), ``REL``
    (relation), ``ALL`` (every real token) or any span's own name. ``A+B`` is the union,
    ``A^C`` the complement among the row's real tokens (padding is never selected).

    Args:
        expression: A span expression such as ``"(FE+LT)^C"``, or a function
            ``(spans, attention_mask) -> [batch, pos]`` boolean tensor.
        spans: Named ``[batch, pos]`` boolean spans. ``last_token`` may be absent: it
            follows from the padding.
        attention_mask: ``[batch, pos]`` right padding.

    Raises:
        SelectionError: Bad syntax, a function that returns something other than a
            boolean ``[batch, pos]`` tensor, positions on padding, or a span the
            batch lacks (the message lists the ones it has).

    Examples:
        >>> select_positions("FE+LT", batch.spans, batch.attention_mask)
    """
    attention_mask = torch.as_tensor(attention_mask).cpu()
    shape = tuple(attention_mask.shape)
    real = resolve_positions("all", shape, attention_mask)
    if callable(expression):
        selected = expression(spans, attention_mask)
        if not isinstance(selected, torch.Tensor) or selected.dtype != torch.bool:
            described = (
                f"a tensor of {selected.dtype}"
                if isinstance(selected, torch.Tensor)
                else type(selected).__name__
            )
            raise SelectionError(
                f"The position function {callable_name(expression)} returned {described}; it "
                "must return a boolean [batch, pos] tensor."
            )
        return resolve_positions(selected.cpu(), shape, attention_mask)

    def evaluate(node: tuple) -> torch.Tensor:
        kind = node[0]
        if kind == "all":
            return real
        if kind == "span":
            return _named_span(spans, node[1], attention_mask)
        if kind == "union":
            result = torch.zeros(shape, dtype=torch.bool)
            for child in node[1]:
                result = result | evaluate(child)
            return result
        return real & ~evaluate(node[1])

    return resolve_positions(evaluate(parse_span_expression(expression)), shape, attention_mask)


def callable_name(function: Callable[..., Any]) -> str:
    """``module.qualname`` of a function, for messages and run descriptions."""
    module = getattr(function, "__module__", "?")
    return f"{module}.{getattr(function, '__qualname__', repr(function))}"


def _named_span(spans: Spans, name: str, attention_mask: torch.Tensor) -> torch.Tensor:
    if name in spans:
        value = torch.as_tensor(spans[name]).cpu()
        if tuple(value.shape) != tuple(attention_mask.shape):
            raise SelectionError(
                f"The span {name!r} has shape {tuple(value.shape)}, the batch has "
                f"{tuple(attention_mask.shape)}."
            )
        return value.bool()
    if name == "last_token":
        # The last real token follows from the padding; a batch built by hand need not mark it.
        return resolve_positions("last", tuple(attention_mask.shape), attention_mask)
    raise SelectionError(
        f"This configuration needs the {name!r} span, but the batch has only {sorted(spans)}. "
        + (
            "Use a prompt that names the movie (see grafting_lens.study.MOVIE_PROMPTS)."
            if name == "movie"
            else "Tokenize with grafting_lens.worlds.data.tokenize_examples, which marks it."
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

    The position axis of a comparison or an attribution: several places to intervene
    at, each with a label for tables and figures.

    Args:
        positions: One span expression, several (each its own label), or a mapping from a
            label to a span expression, a ``[batch, pos]`` boolean tensor over the batch's
            rows, or a position function (see :func:`select_positions`).
        spans: The batch's named spans.
        attention_mask: The batch's right padding.

    Raises:
        SelectionError: No position set, a label given twice, an unknown span name
            (with the names the batch has), or a specification of another kind.
    """
    if isinstance(positions, str):
        positions = [positions]
    if isinstance(positions, Mapping):
        items = list(positions.items())
    else:
        items = [(name, name) for name in positions]
    if not items:
        raise SelectionError(f"No position set given; e.g. {('LT', 'FE')}.")
    shape = tuple(attention_mask.shape)
    # Names a span expression may use here: the paper's labels, ALL, the batch's spans.
    known = {*SPAN_ALIASES.values(), *spans}
    vocabulary = [*SPAN_ALIASES, "ALL", *spans]
    selections: dict[str, torch.Tensor] = {}
    for label, spec in items:
        if label in selections:
            raise SelectionError(f"The position set {label!r} is given twice.")
        if isinstance(spec, str):
            unknown = sorted(span_names(spec) - known)
            if unknown:
                raise SelectionError(
                    f"Unknown position set {spec!r}.{did_you_mean(spec, vocabulary)} Known: "
                    f"{', '.join(vocabulary)} and span expressions over them (FE+LT, "
                    "(FE+LT)^C...), or pass {label: [batch, pos] boolean tensor}."
                )
            selection = select_positions(spec, spans, attention_mask)
        elif isinstance(spec, torch.Tensor):
            selection = resolve_positions(spec.cpu(), shape, attention_mask)
        elif callable(spec):
            selection = select_positions(spec, spans, attention_mask)
        else:
            raise SelectionError(
                f"Position set {label!r}: expected a span expression, a [batch, pos] boolean "
                f"tensor or a position function, got {type(spec).__name__}."
            )
        selections[str(label)] = selection
    return selections
