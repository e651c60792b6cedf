"""The paper's runs as data (experiments/*.toml) and the toy world's targets
(experiments/targets.toml) stay true to the registered experiments: each file expands into
a command the experiment's own parser takes, and each target names configurations the
experiment runs. A renamed experiment, option or configuration fails here, not in a
reader's terminal."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from grafting_lens.study import EXPERIMENTS, as_semantics, get_experiment
from grafting_lens.study.run_command import WORLDS, experiment_parser

FOLDER = Path(__file__).resolve().parents[1] / "experiments"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, FOLDER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


RUNNER = _script("run")
RUNS = RUNNER.runs()


def test_every_experiment_of_the_command_has_a_run_file():
    ran = {RUNNER.read(path)["experiment"] for path in RUNS}
    assert ran == set(EXPERIMENTS) - {"demo"}  # demo is position's quick look


@pytest.mark.parametrize("path", RUNS, ids=lambda path: path.name)
def test_each_run_file_expands_into_a_command_its_experiment_takes(path):
    run = RUNNER.read(path)
    argv = RUNNER.command(path)
    assert argv[:2] == ["run", run["experiment"]]
    spec = get_experiment(run["experiment"])
    parsed = experiment_parser(spec.name).parse_args(argv[2:])  # SystemExit on a bad option
    assert parsed.out == run["out"] and run["out"].startswith("out/")
    assert run.get("world", "toy") in WORLDS
    if "semantics" in run:
        as_semantics(run["semantics"])
        assert run["semantics"] == spec.semantics, "a paper run says its experiment's default"
    assert Path(run["result"].split(":")[0]).suffix == ".md"
    assert (FOLDER.parent / run["result"].split(":")[0]).is_file()


def test_a_file_with_an_unknown_key_is_refused(tmp_path):
    bad = tmp_path / "typo.toml"
    bad.write_text(
        'figure = "x"\nexperiment = "position"\nout = "out/x"\nclaim = "c"\nresult = "r"\n'
        'semantcs = "clean"\n'
    )
    with pytest.raises(SystemExit, match=r"unknown keys \['semantcs'\]"):
        RUNNER.read(bad)


def test_options_become_the_commands_flags(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text(
        'figure = "x"\nexperiment = "graft_attribution"\nout = "out/x"\nclaim = "c"\n'
        'result = "r"\n[options]\nbatch_size = 4\nquick = true\nno_png = false\n'
    )
    argv = RUNNER.command(run)
    assert argv == ["run", "graft_attribution", "--out", "out/x", "--batch-size", "4", "--quick"]
    experiment_parser("graft_attribution").parse_args(argv[2:])


def test_every_target_names_configurations_its_experiment_runs():
    targets = _script("toy_targets").TARGETS
    assert len(targets) == 9
    for target in targets:
        configs = {
            name for part in get_experiment(target.experiment).parts for name in part.configs
        }
        named = [target.a] + ([target.b] if target.b is not None else [])
        assert set(named) <= configs, f"{target.name}: {set(named) - configs} not in {configs}"
        assert (target.b is None) == (target.kind == "rate")
        assert 0 < target.threshold <= 1


def test_the_folders_readme_lists_every_run_with_its_command():
    readme = (FOLDER / "README.md").read_text()
    for path in RUNS:
        line = next((line for line in readme.splitlines() if f"[`{path.name}`]" in line), None)
        assert line is not None, f"experiments/README.md does not list {path.name}"
        assert f"`grafting-lens {' '.join(RUNNER.command(path))}`" in line


def _position_run(directory: Path, semantics: str = "reference") -> Path:
    """A finished position run as `grafting-lens run` leaves it (report.json, results.csv):
    4 relations x 2 prompts, and movie-part rows that the targets must not read."""
    import json

    import pandas as pd

    hits = {  # top-5 hits per config for examples 0..3, the same on both prompts
        "PRE": [0, 0, 0, 1],
        "SFT": [1, 1, 1, 0],
        "FE": [0, 1, 0, 0],
        "LT": [1, 0, 0, 0],
        "FE+LT": [1, 1, 0, 0],
        "(FE+LT)^C": [0, 0, 0, 0],
        "FE^C": [0, 0, 0, 0],
        "LT^C": [0, 0, 0, 0],
    }
    rows = [
        {"part": "paper", "prompt": prompt, "example": example, "config": config, "top5": hit}
        for config, values in hits.items()
        for prompt in ("headline", "qa")
        for example, hit in enumerate(values)
    ]
    rows += [  # the movie part: all hits, which would lift every rate if read
        {"part": "movie", "prompt": "headline_movie", "example": e, "config": "SFT", "top5": 1}
        for e in range(4)
    ]
    directory.mkdir()
    pd.DataFrame(rows).to_csv(directory / "results.csv", index=False)
    report = {
        "experiment": "position",
        "description": {"semantics": semantics, "options": {"world": "smollm2"}},
    }
    (directory / "report.json").write_text(json.dumps(report))
    return directory


def test_targets_are_measured_on_a_finished_run_of_any_world(tmp_path):
    targets = _script("toy_targets")
    table, world = targets.read_runs([_position_run(tmp_path / "position")])
    assert world == "smollm2"
    assert set(table["prompt"]) == {"headline", "qa"}  # the movie part is not read
    measured = {row["target"]: row for row in targets.measure(table, n_resamples=50)}
    assert measured["SFT top-5"]["pooled"]["estimate"] == 3 / 4
    assert measured["SFT top-5"]["verdict"] == "FAIL"
    assert measured["PRE top-5"]["pooled"]["estimate"] == 1 / 4
    assert measured["FE+LT / SFT"]["pooled"]["estimate"] == (2 / 4) / (3 / 4)
    assert measured["LT top-5"]["per_prompt"]["qa"]["estimate"] == 1 / 4


def test_targets_refuse_a_run_of_another_semantics_unless_asked_for_it(tmp_path):
    targets = _script("toy_targets")
    run = _position_run(tmp_path / "position", semantics="reference+bos=always")
    with pytest.raises(SystemExit, match=r"--semantics reference\+bos=always"):
        targets.read_runs([run])
    table, _ = targets.read_runs([run], "reference+bos=always")
    assert len(table) == 8 * 2 * 4


def test_targets_refuse_a_directory_that_is_not_a_finished_run(tmp_path):
    targets = _script("toy_targets")
    with pytest.raises(SystemExit, match="not a finished run"):
        targets.read_runs([tmp_path])
