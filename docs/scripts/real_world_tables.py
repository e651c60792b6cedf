"""Print the real-model sections' tables of docs/results.md from finished runs of a real world.

A real-model world (smollm2, gemma3) takes hours to build, so the docs cannot compute its
numbers on every build as ``prose_numbers.py`` does for the toy world; the sections' tables
are printed by this script from the runs it names, and pasted. Each cell is top-5 accuracy with its 95%
bootstrap interval, as ``summary.csv`` holds it::

    python docs/scripts/real_world_tables.py position out/smollm2_position_reference out/smollm2_position_clean
    python docs/scripts/real_world_tables.py component out/smollm2_component_reference out/smollm2_component_clean
    python docs/scripts/real_world_tables.py hybrid out/smollm2_hybrid_reference out/smollm2_hybrid_clean
    python docs/scripts/real_world_tables.py heatmaps out/smollm2_component_reference docs/assets/smollm2

(``heatmaps`` writes the component run's heatmap one prompt per figure, narrow enough to
read in the page's column: ``component_heatmap_<prompt>.png``.)

Each run directory comes from ``grafting-lens run EXPERIMENT --world WORLD --semantics
SEMANTICS --out DIR``, labelled by the run's semantics: every run's headline and QA cells,
each with its interval (a reader compares cells a few points apart).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

NBSP = "&nbsp;"
PROMPTS = ("headline", "qa")
POSITION = ("PRE", "SFT", "FE", "LT", "FE+LT", "(FE+LT)^C", "FE^C", "LT^C")
COMPONENT_SETS = ("ATTN+O+FFN", "O+FFN", "FFN", "O", "O+FFN-up", "O+FFN-down")
COMPONENT_RANGES = {"all": "all layers", "last_half": "last half", "last_quarter": "last quarter"}
HYBRID = ("PRE", "TASK", "RELATION", "LT", "LT+FE:ATTN", "LT+FE:ATTN+O", "LT+FE:O+FFN", "LT+FE:ALL")


def cell(row: pd.Series) -> str:
    """Top-5 with its 95% interval: a table's every number carries one."""
    value = f"{round(100 * row['top5'])}%"
    return f"{value} [{round(100 * row['top5_low'])},{NBSP}{round(100 * row['top5_high'])}]"


def load(directory: Path) -> tuple[str, pd.DataFrame]:
    """A run's semantics (as Markdown text: a label is the user's string) and its summary."""
    from grafting_lens.study.markdown import escape

    report = json.loads((directory / "report.json").read_text(encoding="utf-8"))
    summary = pd.read_csv(directory / "summary.csv", encoding="utf-8-sig")
    return escape(report["description"]["semantics"]), summary


def rows_table(directories: list[Path], configs: tuple[str, ...]) -> str:
    """One row per configuration; for each run, its headline and QA cells with intervals."""
    runs = [load(directory) for directory in directories]
    header = "| config | " + " | ".join(
        f"{semantics}: {label}" for semantics, _ in runs for label in ("headline", "QA")
    )
    lines = [header + " |", "|---" * (1 + 2 * len(runs)) + "|"]
    for config in configs:
        cells = []
        for _, summary in runs:
            for prompt in PROMPTS:
                selected = summary[(summary["config"] == config) & (summary["prompt"] == prompt)]
                (index,) = selected.index  # one row, or the run is not this experiment's
                cells.append(cell(selected.loc[index]))
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def component_table(directory: Path) -> str:
    """The grid of one run: a column per layer range and prompt, every cell with its interval."""
    semantics, summary = load(directory)
    indexed = summary.set_index(["config", "prompt"])
    columns = [(key, label) for key, label in COMPONENT_RANGES.items()]
    header = "| component set | " + " | ".join(
        f"{label}: {prompt}" for _, label in columns for prompt in ("headline", "QA")
    )
    width = 2 * len(columns)
    lines = [f"{semantics}: top-5", "", header + " |", "|---" * (1 + width) + "|"]
    for name, label in (
        ("BASE", "`BASE` (nothing grafted)"),
        ("DONOR", "`DONOR` (the donor whole)"),
    ):
        values = [cell(indexed.loc[(name, p)]) for p in PROMPTS]
        lines.append(f"| {label} | " + " | ".join(values) + " |" + " |" * (width - 2))
    for name in COMPONENT_SETS:
        values = [
            cell(indexed.loc[(f"{name}@{key}", prompt)]) for key, _ in columns for prompt in PROMPTS
        ]
        lines.append(f"| {name} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def write_heatmaps(directory: Path, target: Path) -> int:
    """The component run's heatmap, one figure per prompt, as PNG files in ``target``."""
    from grafting_lens.analysis.figure_style import save_figure
    from grafting_lens.study.report import component_heatmap, figure_caption

    results = pd.read_csv(directory / "results.csv", usecols=["semantics"], encoding="utf-8-sig")
    report = json.loads((directory / "report.json").read_text(encoding="utf-8"))
    caption = figure_caption(f"{report['description']['options']['world']} world", results)
    _, summary = load(directory)
    for prompt in PROMPTS:
        figure = component_heatmap(
            summary[summary["prompt"] == prompt],
            "Component grafting at the last token",
            caption=caption,
        )
        written = save_figure(figure, target / f"component_heatmap_{prompt}", warn=True)
        (target / f"component_heatmap_{prompt}.html").unlink(missing_ok=True)  # the PNG only
        print(written)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", choices=("position", "component", "hybrid", "heatmaps"))
    parser.add_argument("runs", type=Path, nargs="+", help="grafting-lens run directories")
    args = parser.parse_args(argv)
    if args.experiment == "heatmaps":
        run, target = args.runs
        return write_heatmaps(run, target)
    if args.experiment == "position":
        print(rows_table(args.runs, POSITION))
    elif args.experiment == "hybrid":
        print(rows_table(args.runs, HYBRID))
    else:
        print("\n\n".join(component_table(directory) for directory in args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
