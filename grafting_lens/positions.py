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
position is real, so a right-padded batch must come with its attention mask:
:func:`check_padding` refuses tokens whose rows end in the pad token when no
mask says where they end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import numpy as np
import torch
from jaxtyping import Bool, Int

from grafting_lens.errors import GraftMaskError

PositionSpec = Union[str, int, Sequence[int], Sequence[Sequence[int]], torch.Tensor]
"""Anything :func:`resolve_positions` accepts."""


def row_lengths(
    shape: tuple[int, int], attention_mask: Int[torch.Tensor, "batch pos"] | None = None
) -> Int[torch.Tensor, " batch"]:
    """Number of real tokens in each row of a right-padded batch.

    Raises:
        GraftMaskError: The attention mask has the wrong shape, holds values
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
        raise GraftMaskError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, tokens have {(batch, pos)}."
        )
    values = attention_mask.detach().cpu()
    if values.is_complex() or not bool(((values == 0) | (values == 1)).all()):
        # A model reads the mask as given: a 2 or a 0.5 would move its logits
        # while a length computed here would silently disagree with it.
        raise GraftMaskError(
            "attention_mask must hold only 0 (padding) and 1 (real token), got values "
            f"{sorted(set(values.flatten().tolist()))[:5]}. Pass the tokenizer's attention_mask "
            "as it comes."
        )
    mask = values.to(torch.long)
    lengths = mask.sum(dim=1)
    expected = torch.arange(pos)[None, :] < lengths[:, None]
    if not torch.equal(expected, mask.bool()):
        raise GraftMaskError(
            "attention_mask must describe right padding (ones, then zeros, in every row). "
            "Tokenize with padding_side='right'."
        )
    if (lengths == 0).any():
        raise GraftMaskError("A row of attention_mask has no real token.")
    return lengths


def check_padding(
    tokens: Int[torch.Tensor, "batch pos"],
    attention_mask: Int[torch.Tensor, "batch pos"] | None,
    tokenizer: Any,
) -> None:
    """Refuse a right-padded batch given without its attention mask.

    Without an attention mask every position counts as real, so "last" would be
    the padding column of every shorter row. Rows ending in the pad token are the
    sign: the check refuses them unless an attention mask says where rows end.
    The pad token is the tokenizer's, or its EOS token when it has none (what
    :func:`~grafting_lens.data.tokenize_examples` and most scripts pad with). A
    prompt that really ends in that token passes with
    ``attention_mask=torch.ones_like(tokens)``.

    Args:
        tokens: ``[batch, pos]`` token ids.
        attention_mask: The batch's attention mask, or ``None``.
        tokenizer: The model set's tokenizer; ``None`` (or one with neither a pad
            nor an EOS token) skips the check.

    Raises:
        GraftMaskError: ``attention_mask`` is ``None`` and some row ends in the pad token.
    """
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "eos_token_id", None)
    if attention_mask is not None or pad_token_id is None or not isinstance(tokens, torch.Tensor):
        return
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        return
    padded = (tokens[:, -1] == int(pad_token_id)).cpu()
    if bool(padded.any()):
        rows = padded.nonzero().squeeze(1).tolist()
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        raise GraftMaskError(
            f"{len(rows)} of {tokens.shape[0]} rows (rows {shown}) end in the pad token "
            f"{int(pad_token_id)}, but no attention_mask says where the rows really end: every "
            "position would count as real, and 'last' would be a padding column. Pass the "
            "tokenizer's attention_mask=..., or attention_mask=torch.ones_like(tokens) if "
            "those tokens are real."
        )


def last_token(
    shape: tuple[int, int], attention_mask: Int[torch.Tensor, "batch pos"] | None = None
) -> Bool[torch.Tensor, "batch pos"]:
    """The last real token of each row (the paper's LT)."""
    lengths = row_lengths(shape, attention_mask)
    selected = torch.zeros(shape, dtype=torch.bool)
    selected[torch.arange(shape[0]), lengths - 1] = True
    return selected


def span_positions(
    shape: tuple[int, int],
    starts: int | Sequence[int],
    ends: int | Sequence[int],
    attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
) -> Bool[torch.Tensor, "batch pos"]:
    """Token spans ``[start, end)``, one per row (or one for every row).

    Raises:
        GraftMaskError: A span is empty or reaches past the row's real tokens.
    """
    batch = shape[0]
    for name, value in (("starts", starts), ("ends", ends)):
        if not (_is_index(value) or isinstance(value, (Sequence, np.ndarray))):
            raise GraftMaskError(f"{name} must be an int or one int per row, got {value!r}.")
    starts_list = [starts] * batch if _is_index(starts) else list(starts)
    ends_list = [ends] * batch if _is_index(ends) else list(ends)
    for value in starts_list + ends_list:
        if not _is_index(value):
            raise GraftMaskError(f"Span starts and ends must be ints, got {value!r}.")
    starts_list, ends_list = [int(v) for v in starts_list], [int(v) for v in ends_list]
    if len(starts_list) != batch or len(ends_list) != batch:
        raise GraftMaskError(
            f"Got {len(starts_list)} starts and {len(ends_list)} ends for {batch} rows."
        )
    rows = [list(range(s, e)) for s, e in zip(starts_list, ends_list)]
    for row, (s, e) in enumerate(zip(starts_list, ends_list)):
        if e <= s:
            raise GraftMaskError(f"Row {row}: the span [{s}, {e}) is empty.")
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
    shape: tuple[int, int],
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
        GraftMaskError: An index outside a row's real tokens, a tensor of the wrong
            shape, a specification of an unknown form, an empty list (it would
            select nothing), or a bool where an index is expected (``True``
            would read as position 1).
    """
    batch, pos = shape
    lengths = row_lengths(shape, attention_mask)
    real = torch.arange(pos)[None, :] < lengths[:, None]
    if isinstance(spec, str):
        if spec == "all":
            return real
        if spec in ("last", "last_token"):
            return last_token(shape, attention_mask)
        raise GraftMaskError(
            f"Unknown position specification {spec!r}: use 'all', 'last', indices or a "
            "[batch, pos] boolean tensor."
        )
    if isinstance(spec, torch.Tensor):
        selected = _check_bool(spec, shape)
        if (selected & ~real).any():
            row = int((selected & ~real).any(dim=1).nonzero()[0])
            raise GraftMaskError(
                f"Row {row} selects padding positions (it has {int(lengths[row])} real tokens)."
            )
        return selected
    if isinstance(spec, np.ndarray) and spec.dtype == np.bool_:
        return resolve_positions(torch.from_numpy(spec), shape, attention_mask)
    if _is_index(spec):
        spec = [spec]
    if isinstance(spec, (bool, np.bool_)) or not isinstance(spec, (Sequence, np.ndarray)):
        raise GraftMaskError(
            f"Cannot read positions from {spec!r}: use 'all', 'last', an int, a list of ints, "
            "one list per row, or a [batch, pos] boolean tensor."
        )
    spec = list(spec)
    if not spec:
        raise GraftMaskError(
            "positions=[] selects no position, so nothing would be grafted or patched. Give "
            "at least one index, or one list per row."
        )
    per_row = isinstance(spec[0], (Sequence, np.ndarray, torch.Tensor)) and not isinstance(spec[0], str)
    if not per_row and not _is_index(spec[0]):
        raise GraftMaskError(
            f"Position indices must be ints, got {spec[0]!r}: give ints, or one list of ints per row."
        )
    if per_row and len(spec) != batch:
        raise GraftMaskError(f"Got position lists for {len(spec)} rows, the tokens have {batch}.")
    selected = torch.zeros(shape, dtype=torch.bool)
    for row in range(batch):
        indices = spec[row] if per_row else spec
        if _is_index(indices) or isinstance(indices, (str, bool, np.bool_)):
            raise GraftMaskError(
                f"Row {row}'s positions are {indices!r}; per-row positions are one list of "
                "ints per row, e.g. [[1, 2], [3]]."
            )
        length = int(lengths[row])
        for index in list(indices):
            if not _is_index(index):
                raise GraftMaskError(f"Position indices must be ints, got {index!r}.")
            index = int(index)
            resolved = index + length if index < 0 else index
            if not 0 <= resolved < length:
                raise GraftMaskError(
                    f"Position {index} is beyond row {row}, which has {length} real tokens "
                    f"(positions 0..{length - 1})."
                )
            selected[row, resolved] = True
    return selected


def _is_index(value: object) -> bool:
    """An int (numpy's included), but not a bool, which would read as 0 or 1."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_bool(tensor: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        raise GraftMaskError(
            f"The position tensor has shape {tuple(tensor.shape)}, the tokens have {tuple(shape)}."
        )
    if tensor.dtype != torch.bool:
        raise GraftMaskError(f"A position tensor must be boolean, got {tensor.dtype}.")
    return tensor.cpu()
