"""Print the results page's table of every target across worlds, from measured targets files.

Each world's targets come from ``experiments/toy_targets.py --json FILE`` (the toy world
as shipped, or ``--runs DIR...`` on a real world's REFERENCE runs); this script only lays
them side by side, one column per world, each cell the pooled estimate, its 95% interval
and the verdict the interval gives, and the paper's number last::

    python experiments/toy_targets.py --json out/targets_toy.json
    python experiments/toy_targets.py --runs out/gemma3_figure2_position \\
        out/gemma3_figure4_component out/gemma3_figure5_hybrid --json out/targets_gemma3.json
    python docs/scripts/targets_across_worlds.py toy=out/targets_toy.json \\
        gemma3=out/targets_gemma3.json

A world whose runs lack an experiment has an empty cell for its targets. ``--seed
NAME=FILE`` gives a world's targets measured again with its ``sft`` of another training
seed (``grafting-lens run position --world smollm2 --sft-seed 1``, then ``toy_targets.py
--runs`` on that run): two columns follow the world's, that seed's cell and the *seed
spread*, the difference between the two seeds' estimates, to read beside the interval
(targets the second seed's runs do not measure, those of the task and relation models,
trained once, have none).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

NBSP = "&nbsp;"
NAMES = {"toy": "toy world", "smollm2": "SmolLM2-135M", "gemma3": "Gemma 3 270M"}


def number(value: float, kind: str) -> str:
    if kind == "rate":
        return f"{round(100 * value)}%"
    if kind == "difference":
        return f"{round(100 * value):+d}{NBSP}pts".replace("-", "−")
    return f"{value:.2f}"


def cell(row: dict) -> str:
    pooled, kind = row["pooled"], row["kind"]
    low, high = pooled["ci95"]
    if kind == "rate":
        interval = f"[{round(100 * low)},{NBSP}{round(100 * high)}]"
    else:
        interval = f"[{number(low, kind)},{NBSP}{number(high, kind)}]".replace(f"{NBSP}pts", "")
    return f"{number(pooled['estimate'], kind)} {interval}, {row['verdict']}"


def spread(row: dict, other: dict) -> str:
    """How far a second seed's estimate lies from the first's, in the target's units."""
    difference = abs(other["pooled"]["estimate"] - row["pooled"]["estimate"])
    if row["kind"] == "ratio":
        return f"{difference:.2f}"
    return f"{round(100 * difference)}{NBSP}pts"


def table(worlds: dict[str, dict], seeds: dict[str, dict] | None = None) -> str:
    seeds = seeds or {}
    order: list[str] = []
    rows: dict[str, dict[str, dict]] = {}
    for world, measured in worlds.items():
        for row in measured["targets"]:
            if row["target"] not in rows:
                order.append(row["target"])
                rows[row["target"]] = {}
            rows[row["target"]][world] = row
    seeded = {
        world: {row["target"]: row for row in measured["targets"]}
        for world, measured in seeds.items()
    }
    header = ["target", "threshold"]
    for world in worlds:
        header.append(NAMES.get(world, world))
        if world in seeded:
            header += [f"{NAMES.get(world, world)}, sft seed {seeds[world]['seed']}", "seed spread"]
    header.append("paper")
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for target in order:
        found = rows[target]
        first = next(iter(found.values()))
        cells = []
        for world in worlds:
            cells.append(cell(found[world]) if world in found else "")
            if world in seeded:
                other = seeded[world].get(target)
                both = other is not None and world in found
                cells += [cell(other) if both else "", spread(found[world], other) if both else ""]
        sign, _, value = first["threshold"].partition(" ")
        threshold = {">=": "≥ ", "<=": "≤ "}[sign] + number(float(value), first["kind"])
        lines.append(f"| {target} | {threshold} | " + " | ".join(cells) + f" | {first['paper']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("worlds", nargs="+", help="NAME=FILE, a targets JSON per world")
    parser.add_argument(
        "--seed",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a world's targets with its sft of another seed (the seed is read from the runs)",
    )
    args = parser.parse_intermixed_args(argv)  # --seed anywhere among the worlds

    def read(items: list[str]) -> dict[str, dict]:
        read = {}
        for item in items:
            name, _, path = item.partition("=")
            if not path:
                parser.error(f"{item!r}: write NAME=FILE (toy=out/targets_toy.json)")
            read[name] = json.loads(Path(path).read_text(encoding="utf-8"))
        return read

    worlds, seeds = read(args.worlds), read(args.seed)
    alone = sorted(set(seeds) - set(worlds))
    if alone:
        parser.error(f"--seed {', '.join(alone)}: name the world's own targets file too")
    for measured in seeds.values():
        measured["seed"] = sft_seed(measured, parser)
    print(table(worlds, seeds))
    return 0


def sft_seed(measured: dict, parser: argparse.ArgumentParser) -> int:
    """The sft seed a targets file's position run grafted, from the run's own command."""
    for run in measured["runs"]:
        report = json.loads((Path(run) / "report.json").read_text(encoding="utf-8"))
        words = shlex.split(report["command"])
        if "--sft-seed" in words:
            return int(words[words.index("--sft-seed") + 1])
    parser.error(f"{measured['runs']}: no run grafted another sft seed (--sft-seed)")
    raise AssertionError  # parser.error exits


if __name__ == "__main__":
    sys.exit(main())
