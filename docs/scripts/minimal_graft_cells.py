"""Print where each world's minimal graft sits: its cells by position, component and depth.

Reads what ``benchmarks/minimal_graft.py --cells FILE.csv`` printed (its JSON line, saved to
a file, which names the cells file) for each world, and lays the worlds' grafts side by
side: one row per position group and kind of component, one column per quarter of the
model's depth (worlds of different depths compare by quarter), every cell a count::

    python benchmarks/minimal_graft.py --world smollm2 --cells out/minimal_smollm2.csv \\
        > out/minimal_smollm2.json
    python benchmarks/minimal_graft.py --world gemma3 --relations 48 \\
        --cells out/minimal_gemma3.csv > out/minimal_gemma3.json
    python docs/scripts/minimal_graft_cells.py smollm2=out/minimal_smollm2.json \\
        gemma3=out/minimal_gemma3.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

NAMES = {"toy": "toy world", "smollm2": "SmolLM2-135M", "gemma3": "Gemma 3 270M"}
KINDS = {
    "q": "attention (q, k, v)",
    "k": "attention (q, k, v)",
    "v": "attention (q, k, v)",
    "o": "attention output (O)",
    "mlp_in": "MLP (in, gate, out)",
    "mlp_gate": "MLP (in, gate, out)",
    "mlp_out": "MLP (in, gate, out)",
    "ln1": "norms",
    "ln2": "norms",
    "ln_final": "final norm",
    "embed": "embedding",
    "unembed": "unembedding",
}
"""The kind of each component (any other by its name)."""
POSITIONS = ("FE", "LT", "(FE+LT)^C")


def quarters(layers: int) -> list[tuple[int, int]]:
    """The first and last layer of each quarter of the depth (the last takes what is left)."""
    size = layers // 4
    return [(i * size, (i + 1) * size - 1 if i < 3 else layers - 1) for i in range(4)]


def table(name: str, measured: dict, cells: pd.DataFrame) -> str:
    bounds = quarters(int(measured["layers"]))
    cells = cells.assign(kind=[KINDS.get(c, c) for c in cells["component"]])
    header = ["positions", "component", *(f"layers {a}-{b}" for a, b in bounds), "all"]
    lines = [
        f"{NAMES.get(name, name)}: {len(cells)} cells recover {measured['recovery']:.2f} of the "
        f"gap on the search prompts, {measured['held_out_recovery']:.2f} held out "
        f"({measured['relations']['headline']} relations per prompt)",
        "",
        "| " + " | ".join(header) + " |",
        "|---" * len(header) + "|",
    ]
    order = [p for p in POSITIONS if p in set(cells["positions"])]
    order += sorted(set(cells["positions"]) - set(POSITIONS))
    for positions in order:
        here = cells[cells["positions"] == positions]
        for kind in sorted(set(here["kind"]), key=lambda k: -int((here["kind"] == k).sum())):
            rows = here[here["kind"] == kind]
            layer = rows["layer"]
            counts = [int(((layer >= a) & (layer <= b)).sum()) for a, b in bounds]
            shown = [str(c) if c else "" for c in counts]
            if layer.isna().all():  # a global component (embedding, unembedding)
                shown = ["", "", "", ""]
            lines.append(f"| {positions} | {kind} | " + " | ".join(shown) + f" | {len(rows)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("worlds", nargs="+", help="NAME=FILE, the benchmark's JSON per world")
    args = parser.parse_args(argv)
    for item in args.worlds:
        name, _, path = item.partition("=")
        if not path:
            parser.error(f"{item!r}: write NAME=FILE (smollm2=out/minimal_smollm2.json)")
        measured = json.loads(Path(path).read_text(encoding="utf-8"))
        if not measured.get("cells_file"):
            parser.error(f"{path}: the benchmark ran without --cells; run it with --cells FILE")
        cells = pd.read_csv(measured["cells_file"])
        print(table(name, measured, cells))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
