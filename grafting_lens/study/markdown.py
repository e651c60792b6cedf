"""Text of the Markdown reports: every string a user gave shown as typed, never as markup.

Written raw, a name's ``|`` shifts a table's cells, a newline breaks its row, and
``<script>`` is HTML a Markdown viewer runs: every report writer puts such strings through
:func:`escape` (or :func:`code`, :func:`fence`) and builds tables with :func:`table`; the
terminal's summary goes through :func:`visible`.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence

__all__ = ["Markup", "code", "escape", "fence", "table", "visible"]

# Markdown's inline markup (emphasis, code, links, tables, strikethrough, math) and
# the backslash that escapes it; CommonMark lets a backslash escape any of them.
_PUNCTUATION = re.compile(r"([\\`*_\[\]|~$])")
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def _escaped(character: str) -> str:
    """A control or line-separator character as its escape sequence, so it breaks no line."""
    named = {"\n": "\\n", "\r": "\\r"}
    if character in named:
        return named[character]
    return f"\\x{ord(character):02x}" if ord(character) < 0x100 else f"\\u{ord(character):04x}"


def visible(value: object) -> str:
    """``value`` with each control or line-separator character (a tab aside) as its escape
    (``\\n``, ``\\x1b``): one line on a terminal, and no escape sequence for it to obey."""
    return "".join(
        _escaped(c) if c != "\t" and unicodedata.category(c) in ("Cc", "Zl", "Zp") else c
        for c in str(value)
    )


def escape(value: object) -> str:
    """``value`` as Markdown inline text (a table cell, a list item, a heading) that shows
    exactly its characters: markup characters backslash-escaped, ``&``, ``<`` and ``>`` as
    HTML entities, a line break or other control character as its escape (``\\n``)."""
    text = _PUNCTUATION.sub(r"\\\1", str(value))
    # Last: the backslash of "\\n" is before a letter, which Markdown shows as it is.
    return visible("".join(_HTML.get(c, c) for c in text))


def code(value: object) -> str:
    """``value`` as an inline code span, its delimiter longer than any run of backticks in
    it, on one line (control characters escaped)."""
    text = visible(str(value))
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def fence(text: str, info: str = "") -> list[str]:
    """``text`` as a fenced code block (its lines), the fence longer than any run of
    backticks in it, so that no line of ``text`` can close it (other control characters
    than its newlines escaped)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return [ticks + info, *(visible(line) for line in text.split("\n")), ticks]


def table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table's lines, every cell escaped (:func:`escape`).

    A cell that is already Markdown (a number the writer formatted) may be passed as
    :class:`Markup`, which is taken as it is.
    """
    lines = ["| " + " | ".join(_cell(cell) for cell in header) + " |"]
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return lines


class Markup(str):
    """Text a report wrote itself, already Markdown: :func:`table` leaves it as it is."""

    __slots__ = ()


def _cell(value: object) -> str:
    return value if isinstance(value, Markup) else escape(value)
