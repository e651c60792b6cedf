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

A world whose runs lack an experiment has an empty cell for its targets.
"""

from __future__ import annotations

import argparse
import json
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


def table(worlds: dict[str, dict]) -> str:
    order: list[str] = []
    rows: dict[str, dict[str, dict]] = {}
    for world, measured in worlds.items():
        for row in measured["targets"]:
            if row["target"] not in rows:
                order.append(row["target"])
                rows[row["target"]] = {}
            rows[row["target"]][world] = row
    header = ["target", "threshold", *(NAMES.get(world, world) for world in worlds), "paper"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for target in order:
        found = rows[target]
        first = next(iter(found.values()))
        cells = [cell(found[world]) if world in found else "" for world in worlds]
        sign, _, value = first["threshold"].partition(" ")
        threshold = {">=": "≥ ", "<=": "≤ "}[sign] + number(float(value), first["kind"])
        lines.append(f"| {target} | {threshold} | " + " | ".join(cells) + f" | {first['paper']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("worlds", nargs="+", help="NAME=FILE, a targets JSON per world")
    args = parser.parse_args(argv)
    worlds = {}
    for item in args.worlds:
        name, _, path = item.partition("=")
        if not path:
            parser.error(f"{item!r}: write NAME=FILE (toy=out/targets_toy.json)")
        worlds[name] = json.loads(Path(path).read_text(encoding="utf-8"))
    print(table(worlds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
