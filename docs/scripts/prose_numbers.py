"""Write the toy world's numbers quoted in README.md, getting-started, results and concepts.

Prose must quote what a reader's own run gives, not what a run on some machine once gave.
Each such number sits between markers, ``<!-- numbers:KEY -->...<!-- /numbers -->`` (in the
middle of a line: a line that starts with a comment is an HTML block to Markdown; in a
table, after the row's first ``|``), and this script fills them from what the code computes
today on the shipped toy world, running what a reader runs (:data:`RUNS`, each on one
thread, in a temporary directory):

* ``reference``: ``grafting-lens run position`` (its paper part is the demo's eight
  configurations, the default ``--semantics reference``; its movie part the movie-title
  variants); ``clean``: ``grafting-lens demo --semantics clean``;
* ``component``, ``component_baseline``, ``reversal`` and ``hybrid``: ``grafting-lens run``
  of that name (configurations such as ``O+FFN@last_half``, ``BASE`` or ``LT+FE:ATTN``);
* ``pvg``: ``grafting-lens run patching_vs_grafting`` (about four minutes), its
  configurations named ``DIRECTION:POSITIONS:LAYER:PAIR-METHOD`` (e.g.
  ``sufficiency:LT:7:stream-graft``; ``stream-patch`` patches ``resid_post``) and its
  references ``reference:PRE``, ``reference:SFT`` and ``reference:READOUT`` (SFT's stream read
  out by PRE's final norm and unembedding);
* each checkpoint's own evaluation (:func:`grafting_lens.worlds.toy_recipe._evaluate_world`,
  the function that wrote ``manifest.json``'s ``"evaluation"``), run again here;
* the targets that ``experiments/toy_targets.py --json`` measured and the manifest ships
  (the position rows are checked against today's position run by ``tests/test_docs.py``).

The keys. ``RUN`` is one of the runs above, optionally with ``/movie`` (the prompts
``headline_movie`` and ``qa_movie``) or ``/PROMPT`` (that prompt only; the default is
``headline`` then ``qa``); ``CONFIG`` one of its configurations; ``CONFIGS`` several, separated
by commas or written ``PREFIX{A,B}`` (``PREFIXA,PREFIXB``); ``PATTERN`` a shell-style pattern
of configurations (``LT*``):

* ``top5:RUN:CONFIG``: ``"91% / 97%"``, headline then QA top-5 (``"4%"`` for one prompt);
* ``span:RUN:CONFIG``: ``"39-41%"``, the lower and the higher of the two;
* ``row:RUN:CONFIGS``: ``"91% [85, 96] | 97% [93, 100]"``, table cells with intervals, for
  each prompt every configuration; ``interval:RUN:CONFIG``: the same in prose, ``" / "``;
* ``pooled:RUN:CONFIGS``: ``"7%"``, top-5 over both prompts' examples (several: ``"6-7%"``);
* ``gap:RUN:A,B``: ``"15"``, A's pooled top-5 minus B's, in points;
* ``points:RUN:A,B``: ``"60 / 52"``, A minus B per prompt, in points;
* ``most:RUN:PATTERN``: ``"10%"``, the highest top-5 of the matching configurations and prompts;
* ``drop:RUN:CONFIG,PATTERN``: ``"11"``, the most any matching configuration falls below
  CONFIG on the same prompt, in points;
* ``rows:RUN``: ``"76,800"``, the rows of the run's ``results.csv``;
* ``evaluation:CHECKPOINT:DIRECTION:SUBSET``: ``"99% | 97%"``, two table cells (the code's
  wording, a BOS prepended); ``checkpoint:...``: the same in prose, ``"99% / 97%"``;
* ``target:SLUG``: ``"96% [94, 98] | 96% [92, 99] | 97% [93, 100]"``, pooled, headline and
  QA cells of one target (``SLUG``: its name, lower case, runs of other characters as ``-``);
  ``verdict:SLUG``: ``"96%, undecided"``, its pooled estimate and verdict (met, not met or
  undecided, from its interval: :func:`grafting_lens.study.verdicts.verdict`); ``met:SLUG``:
  the verdict alone.

(An interval's bounds are joined by ``&nbsp;``: see :func:`_estimate`.) After the toy world
or the code changes, run

    python docs/scripts/prose_numbers.py            # rewrite the marked numbers
    python docs/scripts/prose_numbers.py --check    # exit 1 if any is stale

Unpacks the shipped toy world on first use (set ``GRAFTING_LENS_CACHE`` to reuse one); the
runs take about six minutes on one thread, four of them the patching comparison.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FILES = [
    ROOT / "README.md",
    DOCS / "getting-started.md",
    DOCS / "results.md",
    DOCS / "concepts" / "grafting-vs-patching.md",
]
NBSP = "&nbsp;"  # between an interval's bounds: see _estimate
MARKER = re.compile(r"<!-- numbers:(?P<key>[^\s>]+) -->(?P<text>.*?)<!-- /numbers -->", re.S)
RUNS = {
    "reference": ["run", "position"],
    "clean": ["demo", "--semantics", "clean"],
    "component": ["run", "component"],
    "component_baseline": ["run", "component_baseline"],
    "reversal": ["run", "reversal"],
    "hybrid": ["run", "hybrid"],
    "pvg": ["run", "patching_vs_grafting"],
}
"""Each run's ``grafting-lens`` command (``--out``, ``--no-png``, ``--no-progress`` and
``--threads 1`` added), by the name the keys give it."""
PROMPTS = ("headline", "qa")
PROMPT_SETS = {"movie": ("headline_movie", "qa_movie")}
MINUS = "\N{MINUS SIGN}"


@dataclass
class Sources:
    """What the numbers are computed from."""

    runs: dict[str, pd.DataFrame]
    """Each run's ``summary.csv`` (:data:`RUNS`), indexed by (config, prompt)."""
    evaluation: dict[str, Any]
    """Each checkpoint's own top-5, keyed as ``manifest.json``'s ``"evaluation"``."""
    targets: list[dict[str, Any]]
    """``manifest.json``'s ``"targets"`` list (``experiments/toy_targets.py --json``)."""
    rows: dict[str, int]
    """The rows of each run's ``results.csv``."""


def run_summary(arguments: list[str], out: Path) -> pd.DataFrame:
    """The run's summary per configuration and prompt (``pvg``'s: see :func:`pvg_summary`)."""
    command = [sys.executable, "-m", "grafting_lens.study.cli", *arguments, "--out", str(out)]
    options = ["--no-progress", "--no-png", "--threads", "1"]
    run = subprocess.run([*command, *options], cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"grafting-lens {' '.join(arguments)} failed:\n{run.stderr[-5000:]}")
    if arguments[-1] == "patching_vs_grafting":
        return pvg_summary(out)
    return pd.read_csv(out / "summary.csv").set_index(["config", "prompt"])


def pvg_summary(out: Path) -> pd.DataFrame:
    """The patching comparison's summary and references, one configuration per table cell."""
    summary = pd.read_csv(out / "summary.csv")
    cell = summary[["direction", "positions", "layer"]].astype(str).agg(":".join, axis=1)
    summary["config"] = cell + ":" + summary["pair"] + "-" + summary["method"]
    references = pd.read_csv(out / "references_summary.csv")
    model = references["model"].where(references["model"].isin(["PRE", "SFT"]), "READOUT")
    references["config"] = "reference:" + model
    return pd.concat([summary, references]).set_index(["config", "prompt"])


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
    """Run everything the markers quote (:data:`RUNS` and the checkpoints' evaluation)."""
    from grafting_lens.worlds.toy_shipped import shipped_manifest

    runs, rows = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, arguments in RUNS.items():
            runs[name] = run_summary(arguments, Path(tmp) / name)
            with open(Path(tmp) / name / "results.csv", newline="") as results:
                rows[name] = sum(1 for _ in csv.reader(results)) - 1
    targets = shipped_manifest()["targets"]["targets"]
    return Sources(runs, evaluate_checkpoints(), targets, rows)


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


def _span(values: list[float]) -> str:
    """``"7%"`` or, for values that differ in percent, ``"6-7%"``."""
    low, high = min(round(100 * v) for v in values), max(round(100 * v) for v in values)
    return f"{low}%" if low == high else f"{low}-{high}%"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _configs(text: str) -> list[str]:
    """``"A,B"`` or ``"PREFIX{A,B}SUFFIX"``: the configurations a key lists."""
    braces = re.fullmatch(r"(?P<head>[^{]*)\{(?P<items>[^}]*)\}(?P<tail>.*)", text)
    if braces:
        return [braces["head"] + item + braces["tail"] for item in braces["items"].split(",")]
    return text.split(",")


def _run_value(kind: str, argument: str, sources: Sources) -> str:
    """The keys that read one run's summary: ``KIND:RUN[/PROMPTS]:CONFIGS``."""
    source, _, configs = argument.partition(":")
    name, _, prompt_set = source.partition("/")
    table = sources.runs[name]
    prompts = PROMPT_SETS.get(prompt_set, (prompt_set,)) if prompt_set else PROMPTS

    def top5(config: str, prompt: str) -> float:
        return float(table.loc[(config, prompt), "top5"])

    def pooled(config: str) -> float:
        rows = table.loc[[(config, prompt) for prompt in prompts]]
        return float((rows["top5"] * rows["n"]).sum() / rows["n"].sum())

    if kind == "top5":
        return " / ".join(percent(top5(configs, prompt)) for prompt in prompts)
    if kind == "span":
        return _span([top5(configs, prompt) for prompt in prompts])
    if kind in ("row", "interval"):
        rows = [table.loc[(c, p)] for p in prompts for c in _configs(configs)]
        cells = [_estimate("rate", r["top5"], r["top5_low"], r["top5_high"]) for r in rows]
        return (" | " if kind == "row" else " / ").join(cells)
    if kind == "pooled":
        return _span([pooled(config) for config in _configs(configs)])
    if kind in ("gap", "points"):
        first, second = _configs(configs)
        if kind == "gap":
            return str(round(100 * (pooled(first) - pooled(second))))
        return " / ".join(str(round(100 * (top5(first, p) - top5(second, p)))) for p in prompts)
    names = table.index.get_level_values("config").unique()
    if kind == "most":
        matching = fnmatch.filter(names, configs)
        return percent(max(top5(config, prompt) for config in matching for prompt in prompts))
    if kind == "drop":
        reference, pattern = configs.split(",")
        matching = fnmatch.filter(names, pattern)
        drops = [top5(reference, p) - top5(c, p) for c in matching for p in prompts]
        return str(round(100 * max(drops)))
    raise KeyError(kind)


def target_verdict(target: dict[str, Any]) -> str:
    """A measured target's verdict, from its pooled interval and threshold (``">= 0.95"``),
    by the one rule every script uses (the manifest's own ``verdict`` is not read)."""
    from grafting_lens.study.verdicts import verdict

    sign, threshold = target["threshold"].split()
    low, high = target["pooled"]["ci95"]
    return verdict(low, high, float(threshold), at_least=sign == ">=")


def value(key: str, sources: Sources) -> str:
    """The text of the marker ``key``; ``KeyError`` for a key no rule knows."""
    kind, _, argument = key.partition(":")
    if kind == "rows":
        return f"{sources.rows[argument]:,}"
    if kind in ("top5", "span", "row", "interval", "pooled", "gap", "points", "most", "drop"):
        return _run_value(kind, argument, sources)
    if kind in ("evaluation", "checkpoint"):
        checkpoint, direction, subset = argument.split(":")
        scores = sources.evaluation[checkpoint]
        return (" | " if kind == "evaluation" else " / ").join(
            percent(scores[f"code:{prompt}/{direction}/{subset}"]["top5_accuracy"])
            for prompt in PROMPTS
        )
    if kind in ("target", "verdict", "met"):
        (target,) = [t for t in sources.targets if slug(t["target"]) == argument]
        if kind == "met":
            return target_verdict(target)
        if kind == "verdict":
            pooled = target["pooled"]["estimate"]
            shown = (
                percent(pooled)
                if target["kind"] == "rate"
                else f"{pooled:.2f}"
                if target["kind"] == "ratio"
                else f"{_points(pooled)} pts"
            )
            return f"{shown}, {target_verdict(target)}"
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
