"""Every Markdown report the library writes shows the strings it was given as text: a name
holding a table's ``|``, a newline, HTML or Markdown keeps the tables' shape and leaves no
tag for a viewer to run."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from grafting_lens.study import graft_attribution, patching_vs_grafting
from grafting_lens.study.report import figure_lines, summary_markdown

HOSTILE = "a|b\n<script>alert(1)</script><img src=x onerror=alert(1)> `c` [d](javascript:e) *f*"
FIGURE = {"html": f"out/{HOSTILE}.html", "png": None, "png_error": f"no Chrome {HOSTILE}"}


def _summary() -> str:
    summary = pd.DataFrame(
        {
            "config": [HOSTILE, "LT"],
            "prompt": ["qa", HOSTILE],
            "n": [40, 40],
            **{f"top{k}{end}": [0.5, 0.25] for k in (1, 5) for end in ("", "_low", "_high")},
        }
    )
    return summary_markdown(
        summary, HOSTILE, command=f"grafting-lens run x --out '{HOSTILE}'", notes=[HOSTILE]
    ) + "\n".join(figure_lines({"f": FIGURE}))


def _attribution() -> str:
    tables = {
        "results": pd.DataFrame(
            {
                "prompt": [HOSTILE],
                "cell": [HOSTILE],
                "estimate": [0.5],
                "exact": [0.25],
                "exact_se": [0.1],
            }
        ),
        "references": pd.DataFrame(
            {"prompt": [HOSTILE], "n": [3], "start_metric": [-2.0], "all_cells_metric": [-1.0]}
        ),
        "agreement": pd.DataFrame(
            {
                "prompt": [HOSTILE],
                "positions": [HOSTILE],
                "cells": [HOSTILE],
                "spearman": [0.5],
                "pearson": [0.5],
                "sign_agreement": [1.0],
            }
        ),
        "recovery": pd.DataFrame(
            {
                "prompts": ["search", "held_out"],
                "cells": [1, 1],
                "cell": [HOSTILE] * 2,
                "recovery": [0.5, 0.4],
            }
        ),
    }
    settings = {"command": HOSTILE, "fraction": HOSTILE, "reached": HOSTILE}
    return graft_attribution._markdown(tables, settings, {"f": FIGURE})


def _comparison() -> str:
    interval = {
        f"{v}{end}": [0.5] for v in ("top5", "target_prob") for end in ("", "_low", "_high")
    }
    summary = pd.DataFrame(
        {
            "direction": [HOSTILE],
            "prompt": [HOSTILE],
            "positions": [HOSTILE],
            "pair": [HOSTILE],
            "method": ["graft"],
            "layer": [3],
            **interval,
        }
    )
    references = pd.DataFrame({"prompt": [HOSTILE], "model": [HOSTILE], "n": [3], **interval})
    return patching_vs_grafting._markdown(summary, references, {"notes": [HOSTILE]}, {"f": FIGURE})


@pytest.mark.parametrize(
    "write",
    [_summary, _attribution, _comparison],
    ids=["summary_markdown", "graft_attribution", "patching_vs_grafting"],
)
def test_a_markdown_report_shows_what_it_was_given_as_text(write):
    text = write()
    # Fenced blocks (the command, the settings as JSON) show their content verbatim: a
    # fence is closed only by a line of as many backticks, which no line inside holds.
    outside = []
    fence = None
    for line in text.splitlines():
        ticks = re.match(r"`{3,}", line)
        if fence is None and ticks:
            fence = ticks[0]
        elif fence is not None:
            assert not line.startswith(fence) or line == fence
            fence = None if line == fence else fence
        else:
            outside.append(line)
    assert fence is None
    # Nor is anything markup inside a code span (a figure's file name).
    spans = re.compile(r"(?<![\\`])(`+)(?!`).*?(?<!`)\1(?!`)")
    assert not re.search(r"<[A-Za-z/!?]", spans.sub("", "\n".join(outside)))  # no raw tag
    tables: list[list[int]] = []
    previous = ""
    for line in outside:
        if line.startswith("|"):
            assert line.endswith("|"), line  # no row broken by a newline
            cells = len(re.split(r"(?<!\\)\|", line))
            if not previous.startswith("|"):
                tables.append([])
            tables[-1].append(cells)
        previous = line
    assert tables and all(len(set(shape)) == 1 for shape in tables), tables
    assert "a\\|b\\n&lt;script&gt;" in text  # the name, escaped, on its line
    assert "\\[d\\](javascript:e)" in text and "\\*f\\*" in text  # no link, no emphasis
