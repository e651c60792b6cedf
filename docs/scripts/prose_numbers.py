"""Write the toy world's numbers quoted in README.md and docs/getting-started.md from runs.

Prose must quote what a reader's own run gives, not what a run on some machine once gave.
Each such number sits between markers, ``<!-- numbers:KEY -->...<!-- /numbers -->`` (in the
middle of a line: a line that starts with a comment is an HTML block to Markdown), and
this script fills them from the demo (position grafting on the toy world) under three
settings: the default (``--semantics reference``), ``--semantics clean`` and
``--semantics clean --unembed donor``. After the toy world changes, run

    python docs/scripts/prose_numbers.py            # rewrite the marked numbers
    python docs/scripts/prose_numbers.py --check    # exit 1 if any is stale

Builds the toy world on first use (cached; set ``GRAFTING_LENS_CACHE`` to reuse one); each
demo takes seconds once the world exists.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
MARKER = re.compile(r"<!-- numbers:(?P<key>[\w-]+) -->(?P<text>.*?)<!-- /numbers -->", re.S)
SETTINGS = {
    "reference": [],
    "clean": ["--semantics", "clean"],
    "clean_donor": ["--semantics", "clean", "--unembed", "donor"],
}


def demo_summary(options: list[str], out: Path) -> pd.DataFrame:
    """The demo's top-5 per configuration and prompt, for these options."""
    command = [sys.executable, "-m", "grafting_lens.study.cli", "demo", "--out", str(out)]
    subprocess.run([*command, "--no-progress", "--no-png", *options], check=True, cwd=ROOT)
    return pd.read_csv(out / "summary.csv").set_index(["config", "prompt"])


def percent(value: float) -> str:
    return f"{round(100 * value)}%"


def both(summary: pd.DataFrame, config: str) -> str:
    """``"89% / 96%"``: the headline prompt's top-5, then the question's."""
    return " / ".join(percent(summary.loc[(config, p), "top5"]) for p in ("headline", "qa"))


def span(summary: pd.DataFrame, config: str) -> str:
    """``"39-41%"``: the lower and the higher of the two prompts' top-5."""
    low, high = sorted(round(100 * summary.loc[(config, p), "top5"]) for p in ("headline", "qa"))
    return f"{low}%" if low == high else f"{low}-{high}%"


NUMBERS: dict[str, Callable[[dict[str, pd.DataFrame]], str]] = {
    "first-graft": lambda runs: (
        f"`pretrained {percent(runs['clean_donor'].loc[('PRE', 'headline'), 'top5'])}, "
        f"grafted at FE+LT {percent(runs['clean_donor'].loc[('FE+LT', 'headline'), 'top5'])}`"
    ),
    "reference-sft": lambda runs: both(runs["reference"], "SFT"),
    "reference-fe-lt": lambda runs: both(runs["reference"], "FE+LT"),
    "reference-lt": lambda runs: both(runs["reference"], "LT"),
    "reference-fe": lambda runs: both(runs["reference"], "FE"),
    "clean-sft": lambda runs: span(runs["clean"], "SFT"),
    "clean-donor-sft": lambda runs: span(runs["clean_donor"], "SFT"),
}
"""Each marker's text, from the runs."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Only say whether a number is stale.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: demo_summary(opts, Path(tmp) / name) for name, opts in SETTINGS.items()}
    values = {key: make(runs) for key, make in NUMBERS.items()}
    stale = []
    for path in FILES:
        text = path.read_text()

        def fill(match: re.Match[str], path: Path = path) -> str:
            key = match["key"]
            if key not in values:
                raise SystemExit(f"{path.name}: unknown marker {key!r}; known: {sorted(values)}")
            if match["text"] != values[key]:
                stale.append(f"{path.name} {key}: {match['text']!r} -> {values[key]!r}")
            return f"<!-- numbers:{key} -->{values[key]}<!-- /numbers -->"

        updated = MARKER.sub(fill, text)
        if not args.check and updated != text:
            path.write_text(updated)
    print("\n".join(stale) or "every marked number is current")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
