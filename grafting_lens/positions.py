"""Choosing token positions, per row, for grafts and patches.

Every position selector turns a specification into a boolean ``[batch, pos]``
tensor: ``True`` where the intervention applies. Rows differ (the first entity of
one prompt spans tokens 1-3, of another 1-4), so the boolean tensor is the common
currency; the helpers below build one from the forms people write:

* ``"all"``: every real (non-padding) token;
* ``"last"``: the last real token of each row (the paper's LT);
* an int or a list of ints: the same indices in every row (negative counts from
  each row's last real token);
* a list of lists: one list of indices per row;
* a ``[batch, pos]`` boolean tensor, used as given;
* :func:`span_positions` for ``[start, end)`` spans per row, and
  :func:`complement` for "everything except" (the paper's ``(FE+LT)^C``).

Padding is always right padding: real tokens are ``0 .. length-1`` in each row.
A selector never selects a padding position, and an index beyond a row's real
tokens is an error rather than a silent no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

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
        GraftMaskError: The attention mask has the wrong shape, or is not right
            padded (a zero followed by a one in some row).
    """
    batch, pos = shape
    if attention_mask is None:
        return torch.full((batch,), pos, dtype=torch.long)
    if tuple(attention_mask.shape) != (batch, pos):
        raise GraftMaskError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, tokens have {(batch, pos)}."
        )
    mask = attention_mask.to(torch.long).cpu()
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
    starts_list = [starts] * batch if isinstance(starts, int) else list(starts)
    ends_list = [ends] * batch if isinstance(ends, int) else list(ends)
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
            shape, or a specification of an unknown form.
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
    if isinstance(spec, int):
        spec = [spec]
    spec = list(spec)
    per_row = bool(spec) and not isinstance(spec[0], int)
    if per_row and len(spec) != batch:
        raise GraftMaskError(f"Got position lists for {len(spec)} rows, the tokens have {batch}.")
    selected = torch.zeros(shape, dtype=torch.bool)
    for row in range(batch):
        indices = list(spec[row]) if per_row else spec
        length = int(lengths[row])
        for index in indices:
            if not isinstance(index, int):
                raise GraftMaskError(f"Position indices must be ints, got {index!r}.")
            resolved = index + length if index < 0 else index
            if not 0 <= resolved < length:
                raise GraftMaskError(
                    f"Position {index} is beyond row {row}, which has {length} real tokens "
                    f"(positions 0..{length - 1})."
                )
            selected[row, resolved] = True
    return selected


def _check_bool(tensor: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        raise GraftMaskError(
            f"The position tensor has shape {tuple(tensor.shape)}, the tokens have {tuple(shape)}."
        )
    if tensor.dtype != torch.bool:
        raise GraftMaskError(f"A position tensor must be boolean, got {tensor.dtype}.")
    return tensor.cpu()
