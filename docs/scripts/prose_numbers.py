"""Write the toy world's numbers quoted in README.md, getting-started and results from runs.

Prose must quote what a reader's own run gives, not what a run on some machine once gave.
Each such number sits between markers, ``<!-- numbers:KEY -->...<!-- /numbers -->`` (in the
middle of a line: a line that starts with a comment is an HTML block to Markdown; in a
table, after the row's first ``|``), and this script fills them from what the code computes
today on the shipped toy world:

* the demo (position grafting) under three settings: the default (``--semantics
  reference``), ``--semantics clean`` and ``--semantics clean --unembed donor``;
* each checkpoint's own evaluation (:func:`grafting_lens.worlds.toy_recipe._evaluate_world`,
  the function that wrote ``manifest.json``'s ``"evaluation"``), run again here;
* the targets that ``experiments/toy_targets.py --json`` measured and the manifest ships
  (the component and hybrid runs behind them take minutes; the position rows are checked
  against today's demo by ``tests/test_docs.py``).

The keys (``SETTING`` is ``reference``, ``clean`` or ``clean_donor``; ``CONFIG`` a demo
configuration such as ``FE+LT`` or ``(FE+LT)^C``):

* ``first-graft``: getting-started's printed line;
* ``top5:SETTING:CONFIG``: ``"91% / 97%"``, headline then QA top-5;
* ``span:SETTING:CONFIG``: ``"39-41%"``, the lower and the higher of the two;
* ``row:SETTING:CONFIG``: ``"91% [85, 96] | 97% [93, 100]"``, two table cells with intervals;
* ``evaluation:CHECKPOINT:DIRECTION:SUBSET``: ``"99% | 97%"``, two table cells (the code's
  wording, a BOS prepended); ``checkpoint:...``: the same in prose, ``"99% / 97%"``;
* ``target:SLUG``: ``"96% [94, 98] | 96% [92, 99] | 97% [93, 100]"``, pooled, headline and
  QA cells of one target (``SLUG``: its name, lower case, runs of other characters as ``-``).

After the toy world or the code changes, run

    python docs/scripts/prose_numbers.py            # rewrite the marked numbers
    python docs/scripts/prose_numbers.py --check    # exit 1 if any is stale

Unpacks the shipped toy world on first use (set ``GRAFTING_LENS_CACHE`` to reuse one); each
demo takes seconds.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md", ROOT / "docs" / "results.md"]
NBSP = "&nbsp;"  # between an interval's bounds: see _estimate
MARKER = re.compile(r"<!-- numbers:(?P<key>[^\s>]+) -->(?P<text>.*?)<!-- /numbers -->", re.S)
SETTINGS = {
    "reference": [],
    "clean": ["--semantics", "clean"],
    "clean_donor": ["--semantics", "clean", "--unembed", "donor"],
}
PROMPTS = ("headline", "qa")
MINUS = "\N{MINUS SIGN}"


@dataclass
class Sources:
    """What the numbers are computed from."""

    runs: dict[str, pd.DataFrame]
    """The demo's ``summary.csv`` per setting, indexed by (config, prompt)."""
    evaluation: dict[str, Any]
    """Each checkpoint's own top-5, keyed as ``manifest.json``'s ``"evaluation"``."""
    targets: list[dict[str, Any]]
    """``manifest.json``'s ``"targets"`` list (``experiments/toy_targets.py --json``)."""


def demo_summary(options: list[str], out: Path) -> pd.DataFrame:
    """The demo's summary per configuration and prompt, for these options."""
    command = [sys.executable, "-m", "grafting_lens.study.cli", "demo", "--out", str(out)]
    run = subprocess.run(
        [*command, "--no-progress", "--no-png", *options], cwd=ROOT, capture_output=True, text=True
    )
    if run.returncode != 0:
        raise SystemExit(f"grafting-lens demo {' '.join(options)} failed:\n{run.stderr[-5000:]}")
    return pd.read_csv(out / "summary.csv").set_index(["config", "prompt"])


def evaluate_checkpoints() -> dict[str, Any]:
    """Each shipped checkpoint's top-5, computed now as the build computed it."""
    from grafting_lens.worlds import toy
    from grafting_lens.worlds.toy_recipe import _evaluate_world

    world = toy.build_toy_world()
    return _evaluate_world(
        world.root,
        world.load_tokenizer(),
        world.relations,
        world.task_relations,
        world.relation_relations,
    )


def gather() -> Sources:
    """Run everything the markers quote (three demos and the checkpoints' evaluation)."""
    from grafting_lens.worlds.toy_shipped import shipped_manifest

    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: demo_summary(opts, Path(tmp) / name) for name, opts in SETTINGS.items()}
    return Sources(runs, evaluate_checkpoints(), shipped_manifest()["targets"]["targets"])


def percent(value: float) -> str:
    return f"{round(100 * value)}%"


def _points(value: float) -> str:
    """``"+3"``, ``"0"`` or ``"−2"`` (a minus sign, not a hyphen): percentage points."""
    number = round(100 * value)
    return f"+{number}" if number > 0 else f"{MINUS}{-number}" if number < 0 else "0"


def _estimate(kind: str, value: float, low: float, high: float) -> str:
    """One estimate with its interval, as the targets table writes a rate, ratio or difference.
    The interval's bounds are joined by a non-breaking space (``[94,&nbsp;98]``), so that a
    narrow table column never wraps an interval after its comma."""
    if kind == "rate":
        return f"{percent(value)} [{round(100 * low)},{NBSP}{round(100 * high)}]"
    if kind == "ratio":
        return f"{value:.2f} [{low:.2f},{NBSP}{high:.2f}]"
    return f"{_points(value)} pts [{_points(low)},{NBSP}{_points(high)}]"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def value(key: str, sources: Sources) -> str:
    """The text of the marker ``key``; ``KeyError`` for a key no rule knows."""
    kind, _, argument = key.partition(":")
    if kind == "first-graft":
        table = sources.runs["clean_donor"]
        return (
            f"`pretrained {percent(table.loc[('PRE', 'headline'), 'top5'])}, "
            f"grafted at FE+LT {percent(table.loc[('FE+LT', 'headline'), 'top5'])}`"
        )
    if kind in ("top5", "span", "row"):
        setting, _, config = argument.partition(":")
        rows = [sources.runs[setting].loc[(config, prompt)] for prompt in PROMPTS]
        if kind == "top5":
            return " / ".join(percent(row["top5"]) for row in rows)
        if kind == "span":
            low, high = sorted(round(100 * row["top5"]) for row in rows)
            return f"{low}%" if low == high else f"{low}-{high}%"
        return " | ".join(
            _estimate("rate", row["top5"], row["top5_low"], row["top5_high"]) for row in rows
        )
    if kind in ("evaluation", "checkpoint"):
        checkpoint, direction, subset = argument.split(":")
        scores = sources.evaluation[checkpoint]
        return (" | " if kind == "evaluation" else " / ").join(
            percent(scores[f"code:{prompt}/{direction}/{subset}"]["top5_accuracy"])
            for prompt in PROMPTS
        )
    if kind == "target":
        (target,) = [t for t in sources.targets if slug(t["target"]) == argument]
        cells = [target["pooled"], *(target["per_prompt"][prompt] for prompt in PROMPTS)]
        return " | ".join(_estimate(target["kind"], c["estimate"], *c["ci95"]) for c in cells)
    raise KeyError(key)


def stale_markers(sources: Sources, write: bool = False) -> list[str]:
    """``"FILE KEY: 'quoted' -> 'computed'"`` for every marker whose text is not current;
    with ``write``, rewrite those files with the computed text."""
    stale = []
    for path in FILES:
        text = path.read_text()

        def fill(match: re.Match[str], path: Path = path) -> str:
            key = match["key"]
            try:
                computed = value(key, sources)
            except (KeyError, ValueError) as error:
                raise SystemExit(f"{path.name}: marker {key!r} names nothing ({error})") from None
            if match["text"] != computed:
                stale.append(f"{path.name} {key}: {match['text']!r} -> {computed!r}")
            return f"<!-- numbers:{key} -->{computed}<!-- /numbers -->"

        updated = MARKER.sub(fill, text)
        if write and updated != text:
            path.write_text(updated)
    return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Only say whether a number is stale.")
    args = parser.parse_args()
    stale = stale_markers(gather(), write=not args.check)
    print("\n".join(stale) or "every marked number is current")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
