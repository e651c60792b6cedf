"""The paper's runs as data (experiments/*.toml) and the toy world's targets
(experiments/targets.toml) stay true to the registered experiments: each file expands into
a command the experiment's own parser takes, and each target names configurations the
experiment runs. A renamed experiment, option or configuration fails here, not in a
reader's terminal."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from grafting_lens.core.errors import RunError
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


HEAD = 'figure = "x"\nexperiment = "position"\nout = "out/x"\nclaim = "c"\nresult = "r"\n'
"""The keys every run file needs."""


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (HEAD + 'semantcs = "clean"\n', [], r"typo.toml: unknown keys \['semantcs'\]"),
        (None, [], r"typo.toml is a directory; name a run file"),
        ("", [], r"No run file .*typo.toml"),
        (HEAD.encode() + b'claim = "Jos\xe9"\n', [], r"typo.toml is not UTF-8 \(byte 0xe9"),
        (HEAD + 'world = "toy\n', [], r"typo.toml is not valid TOML: .*line 6"),
        (HEAD + 'world = "toy"\nworld = "smollm2"\n', [], r"typo.toml is not valid TOML"),
        (HEAD.replace('"out/x"', '["out/x", "out/y"]'), [], r"typo.toml: out is an array"),
        (HEAD + 'semantics = ["clean"]\n', [], r"typo.toml: semantics is an array"),
        (
            HEAD + 'semantics = "clean"\n[options]\nsemantics = "reference"\n',
            [],
            r"typo.toml: semantics is set both at the top \('clean'\) and in \[options\]",
        ),
        (
            HEAD + "[options]\nbatch_size = 4\nbatch-size = 8\n",
            [],
            r"typo.toml: \[options\] sets 'batch_size' and 'batch-size', one option twice",
        ),
        (HEAD + "[options]\nbatch_size = [4, 8]\n", [], r"batch_size is an array .*one value"),
        (HEAD + "[options]\nbatch_sise = 4\n", [], r"batch_sise is not an option.*batch_size"),
        (HEAD + '[options]\nquick = "yes"\n', [], r"typo.toml: quick is a string .*a switch"),
        (HEAD + "[options]\nbatch_size = 0\n", [], r"typo.toml: batch_size = 0: must be >= 1"),
        (HEAD + "[options]\nunembed = 'bas'\n", [], r"unembed = 'bas' is not one of base"),
        (HEAD + "[options]\nquick = { a = 1 }\n", [], r"\[options\] quick is a table"),
        (HEAD.replace('"position"', '"positon"'), [], r"typo.toml: Unknown experiment 'positon'"),
        (
            HEAD + 'semantics = "clean"\n',
            ["--semantics", "reference"],
            r"--semantics is given after -- and typo.toml sets semantics too",
        ),
        (HEAD, ["--out=elsewhere"], r"--out is given after -- and typo.toml sets out too"),
    ],
    ids=[
        "unknown key",
        "a directory",
        "no such file",
        "latin-1 bytes",
        "toml syntax",
        "a key twice",
        "list for out",
        "list for semantics",
        "top and options",
        "an option twice",
        "list for a scalar option",
        "unknown option",
        "switch given a string",
        "value out of range",
        "value not a choice",
        "a table for an option",
        "unknown experiment",
        "extra repeats a top key",
        "extra repeats out",
    ],
)
def test_a_run_file_that_cannot_be_used_fails_in_one_line_with_status_2(
    tmp_path, capsys, content, extra, message
):
    """Every mistake in a run file (or in what follows --) is one line naming the file, the
    key and the fix, exit status 2, before any run starts; never a traceback, never a
    value silently dropped or overridden."""
    path = tmp_path / "typo.toml"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content:
        path.write_text(content)
    status = RUNNER.main([str(path), "--dry-run", *(["--", *extra] if extra else [])])
    captured = capsys.readouterr()
    assert status == 2, captured.out + captured.err
    assert re.search(message, captured.err), captured.err
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert captured.out == ""  # no command printed, none run


def test_a_false_flag_with_a_negative_form_becomes_it(tmp_path):
    """``progress = false`` means --no-progress, not "leave it to the default"."""
    run = tmp_path / "run.toml"
    run.write_text(HEAD + "[options]\nprogress = false\n")
    assert RUNNER.command(run)[-1] == "--no-progress"


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


def _position_run(
    directory: Path, semantics: str = "reference", command: str = "grafting-lens run position"
) -> Path:
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
    table = pd.DataFrame(rows).assign(semantics=semantics)
    table.to_csv(directory / "results.csv", index=False)
    report = {
        "experiment": "position",
        "fingerprint": f"{directory.name}-{semantics}",
        "command": command,
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
    assert measured["PRE top-5"]["pooled"]["estimate"] == 1 / 4
    assert measured["FE+LT / SFT"]["pooled"]["estimate"] == (2 / 4) / (3 / 4)
    assert measured["LT top-5"]["per_prompt"]["qa"]["estimate"] == 1 / 4
    # Each verdict reads its interval: SFT's reaches 1.00 (>= 0.95), so 3/4 is undecided,
    # not a failure; (FE+LT)^C - PRE lies below +0.05 whole.
    for name, verdict in (("SFT top-5", "undecided"), ("(FE+LT)^C - PRE", "met")):
        low, high = measured[name]["pooled"]["ci95"]
        assert measured[name]["verdict"] == verdict, (name, low, high)
    assert measured["SFT top-5"]["pooled"]["ci95"][1] == 1.0


def test_a_run_is_labelled_by_what_it_ran_on(tmp_path):
    targets = _script("toy_targets")
    for name, command, label in (
        ("toy", "grafting-lens run position --out x", "toy"),
        ("mine", "grafting-lens run position --model ./pre --donor ./sft", "checkpoints ./pre"),
    ):
        run = _position_run(tmp_path / name, command=command)
        report = json.loads((run / "report.json").read_text())
        report["description"]["options"]["world"] = None
        (run / "report.json").write_text(json.dumps(report))
        assert targets.read_runs([run])[1] == label


def test_targets_refuse_a_run_of_another_semantics_unless_asked_for_it(tmp_path):
    targets = _script("toy_targets")
    run = _position_run(tmp_path / "position", semantics="reference+bos=always")
    with pytest.raises(RunError, match=r"--semantics reference\+bos=always"):
        targets.read_runs([run])
    table, _ = targets.read_runs([run], "reference+bos=always")
    assert len(table) == 8 * 2 * 4


def _edit_rows(run: Path, edit) -> None:
    import pandas as pd

    table = pd.read_csv(run / "results.csv")
    edit(table).to_csv(run / "results.csv", index=False)


def _edit_report(run: Path, edit) -> None:
    report = json.loads((run / "report.json").read_text())
    edit(report)
    (run / "report.json").write_text(json.dumps(report))


def _copy(run: Path) -> list[Path]:
    import shutil

    return [run, Path(shutil.copytree(run, run.with_name("copy")))]


def _not_a_run(run: Path) -> list[Path]:
    return [run.parent / "nothing"]


def _twice(run: Path) -> list[Path]:
    return [run, run]


def _by_another_path(run: Path) -> list[Path]:
    return [run, run.parent / ".." / run.parent.name / run.name]


def _copied_rows(run: Path) -> list[Path]:
    runs = _copy(run)
    _edit_report(runs[1], lambda report: report.update(fingerprint="another"))
    return runs


def _edited(edit):
    def damage(run: Path) -> list[Path]:
        _edit_rows(run, edit)
        return [run]

    return damage


def _top5_of_2(table):
    table.loc[0, "top5"] = 2
    return table


def _report(text: str | None = None, drop: str | None = None):
    def damage(run: Path) -> list[Path]:
        if text is not None:
            (run / "report.json").write_text(text)
        else:
            _edit_report(run, lambda report: report.pop(drop))
        return [run]

    return damage


def _empty_results(run: Path) -> list[Path]:
    (run / "results.csv").write_text("")
    return [run]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_not_a_run, r"nothing: not a finished run"),
        (_twice, r"position is the same directory as .*position"),
        (_by_another_path, r"is the same directory as"),
        (_copy, r"copy holds the same run \(the same fingerprint\) as .*position"),
        (_copied_rows, r"copy holds the same results.csv as"),
        (
            _edited(lambda table: table.iloc[[0, *range(len(table))]]),
            r"holds the row \(part 'paper', prompt 'headline', example 0, config 'PRE'\) 2 times",
        ),
        (_edited(_top5_of_2), r"results.csv, line 2: top5 is 2"),
        (_edited(lambda table: table.drop(columns="top5")), r"results.csv has no column top5"),
        (
            _edited(lambda table: table.assign(semantics="clean")),
            r"its rows ran under \['clean'\], but .*report.json says 'reference'",
        ),
        (_report(text="{"), r"report.json cannot be read as JSON"),
        (_report(drop="description"), r"report.json lacks description.semantics"),
        (_empty_results, r"results.csv cannot be read as CSV"),
    ],
    ids=[
        "not a run",
        "the same path twice",
        "the same directory by another path",
        "a copied run",
        "a copied results.csv",
        "a row twice",
        "top5 out of range",
        "a column missing",
        "rows of another semantics",
        "malformed report.json",
        "report.json without its description",
        "empty results.csv",
    ],
)
def test_runs_that_cannot_be_measured_fail_in_one_line_with_status_2(
    tmp_path, capsys, damage, message
):
    """toy_targets.py --runs believes nothing it has not checked: a run given twice would be
    pooled twice (narrower intervals), a row twice would count twice, a hit of 2 would
    lift a rate; each is refused in one line naming the file, exit status 2."""
    targets = _script("toy_targets")
    runs = damage(_position_run(tmp_path / "position"))
    status = targets.main(["--quiet", "--runs", *map(str, runs)])
    captured = capsys.readouterr()
    assert status == 2, captured.out + captured.err
    assert re.search(message, captured.err), captured.err
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1


def test_the_directions_script_measures_a_rank_curve_between_the_base_and_the_graft(tmp_path):
    # experiments/directions_real_world.py on the toy world, three cells given: rank 0 is the
    # base (recovery 0) and the whole cells are the graft (recovery 1), as dose_response
    # measures them (its own tests check the ranks in between against hand-cut checkpoints).
    cells = tmp_path / "cells.csv"
    cells.write_text("component,layer,positions\nmlp_out,0,LT\nmlp_in,5,LT\nv,7,FE\n")
    script = _script("directions_real_world")
    result = script.main(
        [
            "toy",
            "--cells",
            str(cells),
            "--relations",
            "8",
            "--threads",
            str(torch.get_num_threads()),
        ]
    )
    assert result["cells"] == 3 and result["relations"] == {"headline": 8, "qa": 8}
    for curve in result["by_rank"].values():
        by_rank = {point["rank"]: point for point in curve}
        assert by_rank[0]["recovery"] == 0 and by_rank[None]["recovery"] == 1
    assert result["svd"]["matrices"] > 0 and result["svd"]["gib"] > 0
    assert {row["cell"] for row in result["directions"]} == {
        "mlp_out[0]@LT",
        "mlp_in[5]@LT",
        "v[7]@FE",
    }
