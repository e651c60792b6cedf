"""Measure every target the toy world was built for, with its 95% interval and verdict.

The setting is the one that reproduces the authors' released code, the REFERENCE
semantics (:data:`grafting_lens.study.REFERENCE`: the code's prompt wording,
tokenization, layer quarters, hybrid model and ranking), on the toy world shipped with
the package, or on one rebuilt from the recipe (``--rebuild``). Each number pools both
test prompts (``headline`` and ``qa``); the per-prompt values are printed beside it.

A target's verdict reads its pooled 95% interval (percentile bootstrap over the examples,
1,000 resamples, seed 0; ratios and differences resample (relation, prompt) pairs, so
both configurations are compared on the same examples): *met* when the whole interval
meets the threshold, *not met* when none of it does, *undecided* when it holds values on
both sides (:func:`grafting_lens.study.verdicts.verdict`).

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
whatever the verdicts (they are measurements, reported, not asserted). Run directories
or a targets file that cannot be used exit 2 with one line saying why.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shlex
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

from grafting_lens.core.errors import ExperimentError, GraftingLensError, RunError
from grafting_lens.core.files import check_writable
from grafting_lens.study import get_experiment, run_spec, setup_experiment
from grafting_lens.study.specs import Part
from grafting_lens.study.verdicts import verdict
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
    at_least: bool  # True: the target is value >= threshold; False: value <= threshold
    paper: str


TARGETS_FILE = Path(__file__).with_name("targets.toml")
"""The targets as data, beside the paper's runs (see experiments/README.md)."""


def load_targets(path: Path = TARGETS_FILE) -> tuple[Target, ...]:
    """The targets of ``path``, each entry's keys and their kinds checked.

    Raises:
        ExperimentError: A file that does not read as TOML, or an entry with an unknown,
            missing or mistyped key, an unknown kind, or a name used twice.
    """
    try:
        entries = tomllib.loads(path.read_text(encoding="utf-8")).get("target")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ExperimentError(f"{path} cannot be read as TOML: {error}.") from None
    if not isinstance(entries, list) or not entries:
        raise ExperimentError(f"{path} has no [[target]] entries.")
    kinds = {field.name: field.type for field in dataclasses.fields(Target)}
    targets = []
    for number, entry in enumerate(entries, start=1):
        where = f"{path}, target {number}"
        unknown = sorted(set(entry) - set(kinds))
        missing = sorted(set(kinds) - set(entry) - {"b"})
        if unknown or missing:
            raise ExperimentError(f"{where}: unknown keys {unknown}, missing keys {missing}.")
        for key, value in entry.items():
            wanted = {"float": (int, float), "bool": bool}.get(str(kinds[key]), str)
            if not isinstance(value, wanted) or (wanted is not bool and isinstance(value, bool)):
                raise ExperimentError(f"{where}: {key} = {value!r} is not a {kinds[key]}.")
        target = Target(**{"b": None, **entry})
        if target.kind not in ("rate", "ratio", "difference") or (target.b is None) != (
            target.kind == "rate"
        ):
            raise ExperimentError(
                f"{where}: kind {target.kind!r} with b = {target.b!r}; a rate has no b, a "
                "ratio or difference has one."
            )
        if target.name in {t.name for t in targets}:
            raise ExperimentError(f"{where}: the name {target.name!r} is used twice.")
        targets.append(target)
    return tuple(targets)


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
    returns them (each experiment's first part, the two test prompts), and what they ran
    on (``"toy"``, ``"smollm2"``, ``"checkpoints ..."``). Every run must have run under the
    semantics ``wanted`` (its label, as the run wrote it), one run per experiment.

    Raises:
        RunError: A directory that is not a finished run; a ``report.json`` or
            ``results.csv`` that cannot be read, lacks what the targets read, holds a
            value out of its range, repeats a row, or disagrees with the other (its
            semantics); a run given twice (by path or content) or two runs of one
            experiment; a run of another semantics than ``wanted``.
    """
    tables, worlds = [], set()
    seen: dict[Any, Path] = {}
    for directory in directories:
        report_file, results_file = directory / "report.json", directory / "results.csv"
        if not report_file.is_file() or not results_file.is_file():
            raise RunError(
                f"{directory}: not a finished run (no report.json or results.csv); run it with "
                "grafting-lens run (or experiments/run.py) first."
            )
        report = _read_report(report_file)
        name = report["experiment"]
        description = report["description"]
        for key in (
            ("path", directory.resolve()),
            ("fingerprint", report.get("fingerprint") or object()),
            ("rows", hashlib.sha256(results_file.read_bytes()).hexdigest()),
            ("experiment", name),
        ):
            if key in seen:
                why = {
                    "path": "is the same directory as",
                    "fingerprint": "holds the same run (the same fingerprint) as",
                    "rows": "holds the same results.csv as",
                    "experiment": f"is a second {name} run beside",
                }[key[0]]
                raise RunError(
                    f"{directory} {why} {seen[key]}: its rows would be pooled twice. Pass one "
                    "run per experiment."
                )
            seen[key] = directory
        if name not in RUNS:
            raise RunError(f"{directory}: a {name!r} run; the targets read {sorted(RUNS)}.")
        semantics = description["semantics"]
        if semantics != wanted:
            raise RunError(
                f"{directory}: ran under {semantics!r}; the targets are measured "
                f"under {wanted!r} (rerun it with --semantics {wanted}, or pass "
                f"--semantics {semantics} to measure runs made under it)."
            )
        table = _read_results(results_file)
        written = sorted(set(table["semantics"].astype(str)))
        if written != [semantics]:
            raise RunError(
                f"{results_file}: its rows ran under {written}, but {report_file} says "
                f"{semantics!r}: the two files come from different runs. Rerun the experiment "
                "into an empty directory."
            )
        part = get_experiment(name).parts[0].name
        table = table[(table["part"] == part) & table["prompt"].isin(PROMPTS)]
        missing = sorted(set(RUNS[name]) - set(table["config"]))
        if missing:
            raise RunError(f"{directory}: no rows for {missing} (a --quick run?).")
        table.insert(0, "experiment", name)
        tables.append(table[table["config"].isin(RUNS[name])])
        worlds.add(_ran_on(report))
    return pd.concat(tables, ignore_index=True), ", ".join(sorted(worlds))


def _read_report(path: Path) -> dict[str, Any]:
    """A run's ``report.json``, with the keys the targets read."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunError(
            f"{path} cannot be read as JSON ({error}); the run directory is damaged: rerun "
            "the experiment into an empty directory."
        ) from None
    description = report.get("description") if isinstance(report, dict) else None
    lacking = [
        key
        for key, value in (
            ("experiment", report.get("experiment") if isinstance(report, dict) else None),
            ("description.semantics", (description or {}).get("semantics")),
        )
        if not isinstance(value, str)
    ]
    if not isinstance((description or {}).get("options", {}), dict):
        lacking.append("description.options")
    if lacking:
        raise RunError(
            f"{path} lacks {', '.join(lacking)}: it is not the report.json grafting-lens run "
            "writes (or it was edited). Rerun the experiment into an empty directory."
        )
    return report


RESULT_COLUMNS = {
    "part": "text",
    "prompt": "text",
    "example": "count",
    "config": "text",
    "semantics": "text",
    "top5": "hit",
}
"""The columns of ``results.csv`` the targets read, and what each holds."""

RANGES = {"top1": "hit", "target_rank": "count", "target_prob": "probability"}
"""Further columns whose values are checked when present."""

IDENTITY = ("models", "part", "dataset", "prompt", "direction", "example", "config")
"""The columns that name a row: two rows with the same values are one row given twice."""


def _read_results(path: Path) -> pd.DataFrame:
    """A run's ``results.csv``, every column the targets read present and in range, no row
    given twice."""
    try:
        table = pd.read_csv(path, encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError, ValueError) as error:  # pandas' parser errors too
        raise RunError(
            f"{path} cannot be read as CSV ({type(error).__name__}: {error}); rerun the "
            "experiment into an empty directory."
        ) from None
    missing = sorted(set(RESULT_COLUMNS) - set(table.columns))
    if missing:
        raise RunError(
            f"{path} has no column {', '.join(missing)}: it is not the results.csv of "
            "grafting-lens run (or it was edited)."
        )
    for column, kind in {**RESULT_COLUMNS, **RANGES}.items():
        if column not in table.columns or kind == "text":
            continue
        values = pd.to_numeric(table[column].replace({"True": 1, "False": 0}), errors="coerce")
        good = {
            "hit": values.isin([0, 1]),
            "count": (values >= 0) & (values % 1 == 0),
            "probability": (values >= 0) & (values <= 1),
        }[kind]
        if not good.all():
            row = int((~good).to_numpy().nonzero()[0][0])
            what = {"hit": "0 or 1", "count": "a whole number >= 0", "probability": "in [0, 1]"}
            raise RunError(
                f"{path}, line {row + 2}: {column} is {_plain(table[column].iloc[row])!r}, but a "
                f"{column} is {what[kind]}. The file was edited or damaged: rerun the experiment."
            )
        table[column] = values
    identity = [column for column in IDENTITY if column in table.columns]
    repeated = table.duplicated(identity, keep=False)
    if repeated.any():
        first = table[repeated].iloc[0]
        named = ", ".join(f"{column} {_plain(first[column])!r}" for column in identity)
        raise RunError(
            f"{path} holds the row ({named}) {int(repeated.sum())} times: it would count more "
            "than once. Rerun the experiment into an empty directory."
        )
    return table


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value a message shows (``2``, not ``np.int64(2)``)."""
    return value.item() if hasattr(value, "item") else value


def _ran_on(report: dict[str, Any]) -> str:
    """What a run ran on, from the command that made it: your checkpoints (``--model``),
    or a world (``--world``, the toy world when neither is given)."""
    try:
        words = shlex.split(report.get("command") or "")
    except ValueError:
        words = []
    for index, word in enumerate(words):
        if word == "--model" and index + 1 < len(words):
            return f"checkpoints {words[index + 1]}"
        if word.startswith("--model="):
            return f"checkpoints {word.removeprefix('--model=')}"
    return report["description"]["options"].get("world") or "toy"


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
        rows.append(
            {
                "target": target.name,
                "experiment": target.experiment,
                "kind": target.kind,
                "threshold": (">= " if target.at_least else "<= ") + f"{target.threshold:g}",
                "pooled": pooled,
                "per_prompt": per_prompt,
                "verdict": verdict(*pooled["ci95"], target.threshold, at_least=target.at_least),
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
    if args.runs is not None and args.rebuild:
        parser.error("--runs measures finished runs; --rebuild builds a world: choose one")
    from grafting_lens.study.run_command import interrupted

    try:
        return _measure(args)
    except GraftingLensError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return interrupted("run the same command to start again (nothing was written)")


def _measure(args: argparse.Namespace) -> int:
    if args.json is not None:
        if args.json.is_dir():
            raise GraftingLensError(f"--json {args.json} is a directory; name a file.")
        check_writable(args.json.parent, "--json's folder")
    progress = not args.quiet
    start = time.perf_counter()
    if args.runs is not None:
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
            _write_json(args.json, result)
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
        if any(row["reproduced"] is False for row in result["reproduction"]):
            status = 1
    if args.json is not None:
        _write_json(args.json, result)
    print(json.dumps({"seconds": result["seconds"], "json": str(args.json) if args.json else None}))
    return status


def _write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
