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
from targets_across_worlds import NAMES  # the worlds' display names: one place

from grafting_lens.models.components import COMPONENT_GROUPS
from grafting_lens.models.layers import quarter_ranges

KINDS = {
    **{c: "attention (q, k, v)" for c in COMPONENT_GROUPS["attn"]},
    "o": "attention output (O)",
    **{c: "MLP (in, gate, out)" for c in COMPONENT_GROUPS["ffn"]},
    "ln_final": "final norm",
    "embed": "embedding",
    "unembed": "unembedding",
}
"""The kind of each component (a layer's norms: "norms"; any other by its name)."""
POSITIONS = ("FE", "LT", "(FE+LT)^C")


def kind_of(component: str) -> str:
    return KINDS.get(component, "norms" if component.startswith("ln") else component)


def quarters(layers: int) -> list[tuple[int, int]]:
    """The first and last layer of each quarter of the depth, as the paper's code cuts it."""
    named = quarter_ranges(layers)
    spans = [named[q] for q in ("first_quarter", "second_quarter", "third_quarter", "last_quarter")]
    return [(span[0], span[-1]) for span in spans]


def table(name: str, measured: dict, cells: pd.DataFrame) -> str:
    bounds = quarters(int(measured["layers"]))
    cells = cells.assign(kind=[kind_of(c) for c in cells["component"]])
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
