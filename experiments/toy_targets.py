"""Measure every target the toy world was built for, with its 95% interval, PASS or FAIL.

The setting is the one that reproduces the authors' released code, the REFERENCE
semantics (:data:`grafting_lens.study.REFERENCE`: the code's prompt wording,
tokenization, layer quarters, hybrid model and ranking), on the toy world shipped with
the package, or on one rebuilt from the recipe (``--rebuild``). Each number pools both
test prompts (``headline`` and ``qa``); the per-prompt values are printed beside it.

A target PASSes when its pooled estimate meets the threshold; the interval says how
sure that is (95% percentile bootstrap over the examples, 1,000 resamples, seed 0;
ratios and differences resample (relation, prompt) pairs, so both configurations are
compared on the same examples).

The targets:

* position grafting, SFT into PRE, all relations: SFT >= 95% top-5, PRE <= 10%,
  FE+LT >= 90% of SFT, (FE+LT)^C <= PRE + 5 points, LT >= 30%, FE >= 15%;
* component grafting at the last token (the relation model's components grafted into
  the task model, relation split; the ``component`` experiment), over the last half of
  the layers (REFERENCE: the third and fourth quarters): O+FFN >= 70% of ATTN+O+FFN, and
  FFN alone at least 15 points below O+FFN;
* the hybrid graft (``hybrid`` experiment, ``LT+FE:ATTN``: task ATTN at the first entity,
  the code's hybrid model at the last token) >= 30%.

Run::

    python experiments/toy_targets.py                      # the shipped world
    python experiments/toy_targets.py --json targets.json  # also write the numbers as JSON
    python experiments/toy_targets.py --rebuild            # rebuild from the recipe, then check
                                                           # each finding against the shipped
                                                           # world's interval
    python experiments/toy_targets.py --runs out/smollm2_figure2_position \
        out/smollm2_figure4_component out/smollm2_figure5_hybrid   # the same targets, measured
                                                           # on finished runs of any world

With ``--runs``, nothing is run: the targets are measured on the ``results.csv`` of
``grafting-lens run`` directories (position, component and hybrid; e.g. the smollm2 world's
runs of ``experiments/smollm2_*.toml``), which must have run under REFERENCE (or the
semantics ``--semantics`` names) and hold every configuration a target names.

(docs/results.md gives the times of both, measured.)

With ``--rebuild`` the script exits non-zero when a rebuilt estimate falls outside the
shipped world's 95% interval (the finding is not reproduced); otherwise it exits 0,
whatever the PASS/FAIL verdicts (they are measurements, reported, not asserted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# The toy world ships with the package or is built here: there is nothing to download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pandas as pd

from grafting_lens.study import get_experiment, run_spec, setup_experiment
from grafting_lens.study.specs import Part
from grafting_lens.worlds import toy
from grafting_lens.worlds.toy_shipped import shipped_manifest

SEMANTICS = "reference"
PROMPTS = ("headline", "qa")
N_RESAMPLES = 1000

RUNS: dict[str, tuple[str, ...]] = {
    "position": ("PRE", "SFT", "FE", "LT", "FE+LT", "(FE+LT)^C", "FE^C", "LT^C"),
    "component": (
        "BASE",
        "DONOR",
        "ATTN+O+FFN@last_half",
        "O+FFN@last_half",
        "FFN@last_half",
        "ATTN+O+FFN@all",
        "O+FFN@all",
        "FFN@all",
    ),
    "hybrid": ("PRE", "RELATION", "LT", "LT+FE:ATTN"),
}
"""The configurations each experiment runs: the targets' and a few to read them by."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One target: what is measured, how it is computed from per-example hits, its threshold."""

    name: str
    experiment: str
    kind: str  # "rate": mean of a; "ratio": mean(a) / mean(b); "difference": mean(a) - mean(b)
    a: str
    b: str | None
    threshold: float
    at_least: bool  # True: PASS when the estimate >= threshold; False: <=
    paper: str


TARGETS_FILE = Path(__file__).with_name("targets.toml")
"""The targets as data, beside the paper's runs (see experiments/README.md)."""


def load_targets(path: Path = TARGETS_FILE) -> tuple[Target, ...]:
    """The targets of ``path``, each checked to name a known kind."""
    with path.open("rb") as file:
        entries = tomllib.load(file)["target"]
    targets = tuple(Target(**{"b": None, **entry}) for entry in entries)
    unknown = [t.name for t in targets if t.kind not in ("rate", "ratio", "difference")]
    if unknown:
        raise SystemExit(f"{path}: targets of an unknown kind: {unknown}")
    return targets


TARGETS = load_targets()


def run_experiments(cache_dir: Path | None, progress: bool) -> pd.DataFrame:
    """Every configuration of :data:`RUNS` under REFERENCE, one table (``experiment`` column)."""
    tables = []
    for name, configs in RUNS.items():
        spec = get_experiment(name)
        spec = dataclasses.replace(spec, parts=(Part(name, PROMPTS, configs),))
        setup = setup_experiment(spec, cache_dir=cache_dir, progress=progress)
        table = run_spec(spec, setup, semantics=SEMANTICS, progress=progress)["results"]
        table.insert(0, "experiment", name)
        tables.append(table)
    return pd.concat(tables, ignore_index=True)


def read_runs(directories: list[Path], wanted: str = SEMANTICS) -> tuple[pd.DataFrame, str]:
    """The tables of finished ``grafting-lens run`` directories, as :func:`run_experiments`
    returns them (each experiment's first part, the two test prompts), and their world.
    Every run must have run under the semantics ``wanted`` (its label, as the run wrote it)."""
    tables, worlds = [], set()
    for directory in directories:
        report_file, results_file = directory / "report.json", directory / "results.csv"
        if not report_file.is_file() or not results_file.is_file():
            raise SystemExit(
                f"{directory}: not a finished run (no report.json or results.csv); run it with "
                "grafting-lens run (or experiments/run.py) first."
            )
        report = json.loads(report_file.read_text())
        name = report["experiment"]
        if name not in RUNS:
            raise SystemExit(f"{directory}: a {name!r} run; the targets read {sorted(RUNS)}.")
        semantics = report["description"].get("semantics")
        if semantics != wanted:
            raise SystemExit(
                f"{directory}: ran under {semantics!r}; the targets are measured "
                f"under {wanted!r} (rerun it with --semantics {wanted}, or pass "
                f"--semantics {semantics} to measure runs made under it)."
            )
        table = pd.read_csv(results_file)
        part = get_experiment(name).parts[0].name
        table = table[(table["part"] == part) & table["prompt"].isin(PROMPTS)]
        missing = sorted(set(RUNS[name]) - set(table["config"]))
        if missing:
            raise SystemExit(f"{directory}: no rows for {missing} (a --quick run?).")
        table.insert(0, "experiment", name)
        tables.append(table[table["config"].isin(RUNS[name])])
        worlds.add(report["description"]["options"].get("world") or "checkpoints")
    return pd.concat(tables, ignore_index=True), ", ".join(sorted(worlds))


def relations_per_experiment(table: pd.DataFrame) -> dict[str, int]:
    """How many relations each experiment of ``table`` asked about."""
    return {
        name: int(table[table["experiment"] == name]["example"].nunique())
        for name in RUNS
        if name in set(table["experiment"])
    }


def hits(table: pd.DataFrame, experiment: str, config: str) -> pd.Series:
    """Top-5 hits of one configuration, indexed by (prompt, example)."""
    rows = table[(table["experiment"] == experiment) & (table["config"] == config)]
    if rows.empty:
        raise SystemExit(f"no rows for {experiment}/{config}")
    return rows.set_index(["prompt", "example"])["top5"].astype(float).sort_index()


def _statistic(kind: str) -> Callable[[np.ndarray, np.ndarray | None], float]:
    if kind == "rate":
        return lambda a, b: float(a.mean())
    if kind == "difference":
        return lambda a, b: float(a.mean() - b.mean())  # type: ignore[union-attr]

    def ratio(a: np.ndarray, b: np.ndarray | None) -> float:
        assert b is not None
        return float(a.mean() / b.mean()) if b.mean() > 0 else float("nan")

    return ratio


def estimate(
    a: pd.Series, b: pd.Series | None, kind: str, n_resamples: int = N_RESAMPLES
) -> dict[str, Any]:
    """Point estimate and 95% percentile bootstrap interval; paired when ``b`` is given."""
    if b is not None:
        a, b = a.align(b, join="inner")
    statistic = _statistic(kind)
    values_a = a.to_numpy()
    values_b = None if b is None else b.to_numpy()
    point = statistic(values_a, values_b)
    rng = np.random.default_rng(0)
    draws = []
    for _ in range(n_resamples):
        index = rng.integers(0, len(values_a), len(values_a))
        draws.append(statistic(values_a[index], None if values_b is None else values_b[index]))
    finite = np.asarray([d for d in draws if np.isfinite(d)])
    low, high = (
        (float(np.quantile(finite, 0.025)), float(np.quantile(finite, 0.975)))
        if len(finite)
        else (float("nan"), float("nan"))
    )
    return {"estimate": point, "ci95": [low, high], "n": len(values_a)}


def measure(table: pd.DataFrame, n_resamples: int = N_RESAMPLES) -> list[dict[str, Any]]:
    """Every target: pooled and per-prompt estimates with intervals, and the verdict."""
    rows = []
    for target in TARGETS:
        if target.experiment not in set(table["experiment"]):
            continue  # a partial run (e.g. position only) measures what it ran
        a = hits(table, target.experiment, target.a)
        b = None if target.b is None else hits(table, target.experiment, target.b)
        pooled = estimate(a, b, target.kind, n_resamples)
        per_prompt = {
            prompt: estimate(
                a.xs(prompt, level="prompt"),
                None if b is None else b.xs(prompt, level="prompt"),
                target.kind,
                n_resamples,
            )
            for prompt in PROMPTS
        }
        if b is not None:  # what a ratio or difference is made of: a ratio of two small
            # numbers can pass while neither configuration recovers anything
            pooled["a"], pooled["b"] = float(a.mean()), float(b.mean())
        value = pooled["estimate"]
        passed = value >= target.threshold if target.at_least else value <= target.threshold
        rows.append(
            {
                "target": target.name,
                "experiment": target.experiment,
                "kind": target.kind,
                "threshold": (">= " if target.at_least else "<= ") + f"{target.threshold:g}",
                "pooled": pooled,
                "per_prompt": per_prompt,
                "verdict": "PASS" if passed else "FAIL",
                "paper": target.paper,
            }
        )
    return rows


def config_rates(table: pd.DataFrame) -> list[dict[str, Any]]:
    """Top-5 accuracy of every configuration run, per prompt, with intervals (for the docs)."""
    rows = []
    for (experiment, config), group in table.groupby(["experiment", "config"], sort=False):
        row: dict[str, Any] = {"experiment": experiment, "config": config}
        for prompt in PROMPTS:
            values = group[group["prompt"] == prompt]["top5"].astype(float)
            row[prompt] = estimate(values.reset_index(drop=True), None, "rate")
        rows.append(row)
    return rows


def _format(value: float, kind: str) -> str:
    return f"{value:+.2f}" if kind == "difference" else f"{value:.2f}"


def _cell(result: dict[str, Any], kind: str) -> str:
    low, high = result["ci95"]
    return f"{_format(result['estimate'], kind)} [{_format(low, kind)}, {_format(high, kind)}]"


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'target':34} {'threshold':>10} {'pooled [95% CI]':>24} {'headline':>24} {'qa':>24}  verdict"
    print(header)
    print("-" * len(header))
    for row in rows:
        kind = row["kind"]
        print(
            f"{row['target']:34} {row['threshold']:>10} {_cell(row['pooled'], kind):>24} "
            f"{_cell(row['per_prompt']['headline'], kind):>24} "
            f"{_cell(row['per_prompt']['qa'], kind):>24}  {row['verdict']}"
        )
        if "a" in row["pooled"]:
            target = next(t for t in TARGETS if t.name == row["target"])
            print(
                f"{'':34} {'':>10} {target.a} {row['pooled']['a']:.2f}, "
                f"{target.b} {row['pooled']['b']:.2f} (pooled top-5)"
            )


def compare(rows: list[dict[str, Any]], reference: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rebuilt estimate against the shipped world's interval: reproduced or not."""
    shipped = {row["target"]: row for row in reference}
    out = []
    for row in rows:
        before = shipped.get(row["target"])
        if before is None:
            out.append({"target": row["target"], "reproduced": None})
            continue
        low, high = before["pooled"]["ci95"]
        value = row["pooled"]["estimate"]
        out.append(
            {
                "target": row["target"],
                "shipped": before["pooled"]["estimate"],
                "shipped_ci95": [low, high],
                "rebuilt": value,
                "reproduced": bool(low <= value <= high),
                "same_verdict": before["verdict"] == row["verdict"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="build the world from the recipe (into --cache-dir, by default a cache beside the "
        "shipped world's) and check each finding against the shipped world's interval",
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="toy-world cache directory")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument(
        "--runs",
        type=Path,
        nargs="+",
        default=None,
        help="measure on these finished grafting-lens run directories instead of running",
    )
    parser.add_argument(
        "--semantics",
        default=SEMANTICS,
        help="with --runs: the semantics every run must have run under (default: reference; "
        "e.g. reference+bos=always)",
    )
    args = parser.parse_args(argv)
    if args.semantics != SEMANTICS and args.runs is None:
        parser.error("--semantics applies to --runs; the toy world's targets run under reference")
    progress = not args.quiet
    start = time.perf_counter()
    if args.runs is not None:
        if args.rebuild:
            parser.error("--runs measures finished runs; --rebuild builds a world: choose one")
        table, world_name = read_runs(args.runs, args.semantics)
        rows = measure(table)
        n_relations = relations_per_experiment(table)
        print(f"Runs of {world_name}, semantics {args.semantics}; relations: {n_relations}")
        print_table(rows)
        if args.json is not None:
            result = {
                "semantics": args.semantics,
                "world": world_name,
                "runs": [str(path) for path in args.runs],
                "n_relations": n_relations,
                "targets": rows,
                "configs": config_rates(table),
            }
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    cache_dir = args.cache_dir
    if args.rebuild:
        cache_dir = cache_dir or toy.default_cache_dir().parent / "toy_rebuilt"
        world = toy.build_toy_world(cache_dir=cache_dir, force=True, progress=progress)
    else:
        world = toy.build_toy_world(cache_dir=cache_dir, progress=progress)
    table = run_experiments(cache_dir, progress)
    rows = measure(table)
    result: dict[str, Any] = {
        "semantics": SEMANTICS,
        "prompts": "code",
        "world": {
            "key": world.manifest["key"],
            "source": world.manifest.get("source", "built"),
            "root": str(world.root),
        },
        "n_relations": relations_per_experiment(table),
        "targets": rows,
        "configs": config_rates(table),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(
        f"\nToy world {world.manifest['key']} ({result['world']['source']}), semantics "
        f"{SEMANTICS}, the code's prompts; relations: {result['n_relations']}"
    )
    print_table(rows)
    status = 0
    if args.rebuild:
        shipped = shipped_manifest().get("targets", {}).get("targets", [])
        result["reproduction"] = compare(rows, shipped)
        print("\nRebuilt against the shipped world (estimate inside the shipped 95% interval?):")
        for row in result["reproduction"]:
            print(json.dumps(row))
        if not all(row["reproduced"] for row in result["reproduction"]):
            status = 1
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"seconds": result["seconds"], "json": str(args.json) if args.json else None}))
    return status


if __name__ == "__main__":
    sys.exit(main())
