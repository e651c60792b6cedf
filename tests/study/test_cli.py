"""Tests for the grafting-lens command line: bad input fails clearly, runs write complete files."""

from __future__ import annotations

import json
import os
import re
import types
import warnings

import pandas as pd
import pytest
from conftest import invoke, make_tokenizer, random_model

from grafting_lens import study as experiments
from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.core.errors import LazyLoadWarning
from grafting_lens.study import POSITION_CONFIGS, cli, run_command
from grafting_lens.worlds import toy


def _output(result) -> str:
    """What a user sees (stdout and stderr), without rich's box and line wrapping."""
    text = result.output
    for character in "│╭╮╰╯─":
        text = text.replace(character, " ")
    return " ".join(text.split())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny random base and donor saved like real checkpoints, with their tokenizer."""
    root = tmp_path_factory.mktemp("checkpoints")
    tokenizer = make_tokenizer()
    for name, seed in (("base", 0), ("sft", 1)):
        random_model("llama", seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


@pytest.fixture
def world(monkeypatch, checkpoints):
    """The tiny checkpoints as the toy world (what the experiments read of one)."""
    from grafting_lens.worlds import data

    fake = types.SimpleNamespace(
        root=checkpoints,
        base_dir=checkpoints / "base",
        sft_dir=checkpoints / "sft",
        model_dir=lambda name: checkpoints / name,
        relations=data.make_relations("fake_movies_real_actors", n=6, seed=0),
        load_tokenizer=make_tokenizer,
        config=types.SimpleNamespace(seed=0, dataset="fake_movies_real_actors"),
        manifest={},
    )
    monkeypatch.setattr(toy, "build_toy_world", lambda **kwargs: fake)
    return fake


def test_out_pointing_at_a_file_fails_with_a_clear_message(tmp_path):
    target = tmp_path / "results.csv"
    target.write_text("already here")
    result = invoke(["demo", "--out", str(target)])
    assert result.exit_code != 0
    assert "is an existing file" in _output(result) and "--out" in _output(result)
    assert target.read_text() == "already here"


def test_unknown_model_fails_with_a_clear_message(tmp_path):
    result = invoke(
        ["demo", "--out", str(tmp_path / "out"), "--model", "no-such-org/no-such-model-xyz"],
    )
    assert result.exit_code == 1
    assert "Unknown model 'no-such-org/no-such-model-xyz'" in _output(result)
    assert not (tmp_path / "out").exists()


def test_donor_without_model_is_refused(tmp_path):
    result = invoke(["demo", "--out", str(tmp_path), "--donor", str(tmp_path)])
    assert result.exit_code == 1 and "--donor needs --model" in _output(result)


def _check_outputs(out, n_relations: int) -> pd.DataFrame:
    results = pd.read_csv(out / "results.csv")
    summary = pd.read_csv(out / "summary.csv")
    assert set(results.config) == set(POSITION_CONFIGS)
    assert set(results.prompt) == {"headline", "qa"}
    # One row per example and configuration, for every kept example of both prompts.
    counts = results.groupby(["prompt", "config"]).size()
    assert counts.nunique() == 1 and 1 <= counts.iloc[0] <= n_relations
    assert list(summary.config.unique()) == list(POSITION_CONFIGS)
    assert len(summary) == 2 * len(POSITION_CONFIGS)
    assert {"top5", "top5_low", "top5_high", "mean_rank"} <= set(summary.columns)
    assert (out / "position_grafting.html").stat().st_size > 0
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]
    return results


def test_demo_on_a_toy_world_writes_results_summary_and_figure(tmp_path, world):
    out = tmp_path / "new" / "dir"
    result = invoke(["demo", "--out", str(out), "--n-examples", "3", "--no-progress"])
    assert result.exit_code == 0, _output(result)
    assert "top-5" in result.output and "FE+LT" in result.output
    results = _check_outputs(out, n_relations=3)
    assert set(results.relation_id) <= {0, 1, 2}
    # A PNG, or a line saying why there is none (no Chrome in CI).
    assert (out / "position_grafting.png").exists() or "No PNG:" in result.output


def test_a_file_size_limit_while_the_figures_are_written_is_one_line_and_the_same_command_resumes(
    tmp_path, world
):
    import resource

    out = tmp_path / "out"
    command = ["demo", "--out", out, "--n-examples", "3", "--no-progress", "--no-png"]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # The figure's HTML carries plotly.js (megabytes); the tables and chunks are far smaller.
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        stopped = invoke(command)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    assert stopped.exit_code == 1 and "Traceback" not in stopped.output
    last = stopped.output.strip().splitlines()[-1]
    assert last.startswith(f"Error: The file {out / 'position_grafting.html'} cannot be written")
    assert "(File too large)" in last and "`ulimit -f`" in last
    assert last.endswith("run the same command again to carry on.")
    assert (out / "results.csv").is_file() and not (out / "position_grafting.html").exists()
    resumed = invoke(command)
    assert resumed.exit_code == 0, _output(resumed)
    assert (out / "position_grafting.html").stat().st_size > 1 << 20


def test_demo_with_model_and_donor_directories(tmp_path, checkpoints):
    out = tmp_path / "out"
    result = invoke(
        [
            "demo",
            "--out",
            str(out),
            "--model",
            str(checkpoints / "base"),
            "--donor",
            str(checkpoints / "sft"),
            "--n-relations",
            "5",
            "--n-examples",
            "2",
            "--no-progress",
            "--no-png",
        ],
    )
    assert result.exit_code == 0, _output(result)
    _check_outputs(out, n_relations=2)
    assert not (out / "position_grafting.png").exists()  # --no-png


def test_a_lazy_donor_runs_through_the_command_without_being_read_whole(tmp_path, checkpoints):
    def run(out, *extra):  # the shared demo on checkpoints; a later option wins in argparse
        return _demo_on_checkpoints(
            out, checkpoints, "--n-examples", "2", "--semantics", "reference", *extra
        )

    with warnings.catch_warnings():
        # Reading the donor whole (running it alone, casting it, iterating the model
        # set) warns with LazyLoadWarning: here that fails the run.
        warnings.simplefilter("error", LazyLoadWarning)
        lazy = run(tmp_path / "lazy", "--lazy")
    assert lazy.exit_code == 0, _output(lazy)
    whole = run(tmp_path / "whole")
    assert whole.exit_code == 0, _output(whole)
    pd.testing.assert_frame_equal(
        pd.read_csv(tmp_path / "lazy" / "results.csv"),
        pd.read_csv(tmp_path / "whole" / "results.csv"),
    )


def test_demo_finetunes_a_model_given_without_donor(tmp_path, checkpoints):
    out = tmp_path / "out"
    result = invoke(
        [
            "demo",
            "--out",
            str(out),
            "--model",
            str(checkpoints / "base"),
            "--quick",
            "--n-relations",
            "2",
            "--no-progress",
            "--no-png",
        ],
    )
    assert result.exit_code == 0, _output(result)
    assert "Finetuning base on 2 relations" in result.output
    _check_outputs(out, n_relations=2)


def test_model_directory_without_config_is_refused(tmp_path):
    result = invoke(["demo", "--out", str(tmp_path / "out"), "--model", str(tmp_path)])
    assert result.exit_code == 1 and "config.json" in _output(result)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """A tiny base and donor as GGUF files, as llama.cpp writes them."""
    from tiny_gguf import tiny_llama, write_gguf

    root = tmp_path_factory.mktemp("gguf")
    return [write_gguf(tiny_llama(seed=seed), root / f"{name}.gguf") for name, seed in
            (("base", 0), ("sft", 1))]  # fmt: skip


def test_demo_runs_on_gguf_files_converted_once(tmp_path, gguf_files, monkeypatch):
    monkeypatch.setenv("GRAFTING_LENS_CACHE", str(tmp_path / "cache"))
    base, donor = gguf_files
    flags = ["--model", base, "--donor", donor, "--n-examples", "3", "--no-progress", "--no-png"]
    result = invoke(["demo", "--out", tmp_path / "out", *flags])
    assert result.exit_code == 0, _output(result)
    converted = sorted((tmp_path / "cache" / "worlds").glob("base-*"))
    assert len(converted) == 2 and all((c / "config.json").is_file() for c in converted)


def _weight_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"{}")
    return tmp_path / "model.safetensors"


@pytest.mark.parametrize(
    ("option", "make", "message"),
    [
        ("--model", lambda p: p, r"--model '.*' is a directory without a config\.json \(it holds"),
        ("--donor", _weight_file, r"--donor '.*model\.safetensors' is a \.safetensors weight file"),
        ("--model", _weight_file, r"--model '.*' is a \.safetensors weight file alone"),
    ],
    ids=["a directory without config.json", "a weight file as donor", "a weight file as model"],
)
def test_a_checkpoint_option_that_is_no_checkpoint_says_what_to_give(
    tmp_path, gguf_files, option, make, message
):
    given = make(tmp_path)
    other = ["--donor", gguf_files[1]] if option == "--model" else ["--model", gguf_files[0]]
    result = invoke(["demo", "--out", tmp_path / "out", option, given, *other])
    assert result.exit_code == 1
    assert re.search(message, _output(result)), _output(result)
    assert "a .gguf file, or a hub id" in _output(result)


def _demo_on_checkpoints(out, checkpoints, *flags):
    return invoke(
        [
            "demo",
            "--out",
            str(out),
            "--model",
            str(checkpoints / "base"),
            "--donor",
            str(checkpoints / "sft"),
            "--n-relations",
            "5",
            "--n-examples",
            "3",
            "--no-progress",
            "--no-png",
            *flags,
        ],
    )


def _donor_ranks(checkpoints, semantics, donor=None):
    """The finetuned model's own ranks of the headline answers, tokenized as ``semantics`` says
    (``donor``: another donor of the base than ``checkpoints / "sft"``)."""
    import grafting_lens as gl
    from grafting_lens.analysis import metrics
    from grafting_lens.worlds import data

    models = gl.load_models(checkpoints / "base", donor or checkpoints / "sft")
    relations = data.make_relations("fake_movies_real_actors", n=5, seed=0)[:3]
    examples = data.make_examples(relations, prompt="headline", templates=semantics.prompts)
    batch = tokenize_examples(examples, models.tokenizer, **semantics.tokenization())
    final = metrics.last_token_logits(models[1](batch.tokens), batch.attention_mask)
    ranks = metrics.target_rank(final, batch.target_ids, by=semantics.rank_by, ties=semantics.ties)
    return [e.text for e in batch.examples], ranks.tolist()


def test_demo_runs_the_reference_semantics_by_default_and_sft_is_the_donor(tmp_path, checkpoints):
    import grafting_lens as gl

    result = _demo_on_checkpoints(tmp_path / "out", checkpoints)
    assert result.exit_code == 0, _output(result)
    assert "Semantics: reference" in _output(result)
    rows = pd.read_csv(tmp_path / "out" / "results.csv")
    assert set(rows.semantics) == {"reference"}
    sft = rows[(rows.config == "SFT") & (rows.prompt == "headline")].sort_values("example")
    texts, ranks = _donor_ranks(checkpoints, gl.REFERENCE)
    assert sft.text.tolist() == texts and all("stars in in a movie" in t for t in texts)
    assert sft.target_rank.tolist() == ranks


def test_the_command_and_the_python_api_have_one_default_semantics(tmp_path, checkpoints):
    """`grafting-lens demo` without --semantics, run_named_experiment and run_experiment
    without a semantics: the same rows, all of them the reference's."""
    import grafting_lens as gl
    from grafting_lens import study as experiments
    from grafting_lens.worlds import data

    result = _demo_on_checkpoints(tmp_path / "out", checkpoints)
    assert result.exit_code == 0, _output(result)
    command = pd.read_csv(tmp_path / "out" / "results.csv")
    models = gl.load_models(checkpoints / "base", checkpoints / "sft", names=["PRE", "SFT"])
    relations = data.make_relations("fake_movies_real_actors", n=5, seed=0)[:3]
    named = experiments.run_named_experiment("demo", models, relations, progress=False)
    grid = experiments.run_experiment(
        models,
        experiments.make_test_sets(relations, prompts=("headline", "qa")),
        experiments.PAPER_POSITION_CONFIGS,
        progress=False,
    )
    key = ["prompt", "config", "example"]
    columns = [*key, "text", "semantics", "target_id", "target_rank"]

    def rows(table):
        return table.sort_values(key)[columns].reset_index(drop=True)

    assert len(command) == len(named) == len(grid) == 2 * 3 * len(POSITION_CONFIGS)
    assert set(command.semantics) == {"reference"}
    for table in (named, grid):
        pd.testing.assert_frame_equal(rows(table), rows(command), check_dtype=False)
        probabilities = table.sort_values(key).target_prob.to_numpy()
        expected = command.sort_values(key).target_prob.to_numpy()
        assert probabilities == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_a_lora_adapter_directory_is_a_donor_as_load_models_takes_it(tmp_path, checkpoints):
    """--donor <adapter dir> was refused as "not a checkpoint" though load_models takes it."""
    import peft
    import torch

    import grafting_lens as gl

    adapter = tmp_path / "lora"
    config = peft.LoraConfig(r=4, target_modules=["o_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    peft.get_peft_model(random_model("llama", 0), config).save_pretrained(adapter)
    result = invoke(
        ["demo", "--out", str(tmp_path / "out"), "--model", str(checkpoints / "base")]
        + ["--donor", str(adapter), "--n-relations", "5", "--n-examples", "3"]
        + ["--no-progress", "--no-png"],
    )
    assert result.exit_code == 0, _output(result)
    rows = pd.read_csv(tmp_path / "out" / "results.csv")
    sft = rows[(rows.config == "SFT") & (rows.prompt == "headline")].sort_values("example")
    assert sft.target_rank.tolist() == _donor_ranks(checkpoints, gl.REFERENCE, adapter)[1]
    assert sft.target_rank.tolist() != _donor_ranks(checkpoints, gl.REFERENCE)[1]
    # The base is no adapter: said so, not "not a checkpoint".
    refused = invoke(
        ["demo", "--out", str(tmp_path / "x"), "--model", str(adapter), "--donor", "y"]
    )
    assert refused.exit_code == 1
    assert "is a LoRA adapter, but --model is the base" in _output(refused)


def test_unembed_donor_makes_the_clean_sft_rows_the_donor_itself(tmp_path, checkpoints):
    import grafting_lens as gl

    result = _demo_on_checkpoints(
        tmp_path / "out", checkpoints, "--semantics", "clean", "--unembed", "donor"
    )
    assert result.exit_code == 0, _output(result)
    assert "Semantics: clean+unembed=donor" in _output(result)
    rows = pd.read_csv(tmp_path / "out" / "results.csv")
    assert set(rows.semantics) == {"clean+unembed=donor"}
    sft = rows[(rows.config == "SFT") & (rows.prompt == "headline")].sort_values("example")
    assert sft.target_rank.tolist() == _donor_ranks(checkpoints, gl.CLEAN)[1]


def test_single_switch_flags_change_one_field_of_the_experiments_semantics():
    import dataclasses

    from grafting_lens.study import CLEAN, REFERENCE, get_experiment

    def semantics(experiment, *flags):
        args = run_command.experiment_parser(experiment).parse_args(["--out", "x", *flags])
        return run_command._semantics(get_experiment(experiment), args)

    assert semantics("position") == REFERENCE
    assert semantics("hybrid", "--semantics", "clean") == CLEAN
    assert semantics("patching_vs_grafting") == CLEAN
    changed = semantics(
        "component", "--unembed", "base", "--lm-head", "always", "--dtype", "bfloat16"
    )
    assert changed == dataclasses.replace(
        REFERENCE, unembed="base", lm_head="always", dtype="bfloat16"
    )
    assert semantics("demo", "--unembed", "follow-embed", "--semantics", "clean").unembed == (
        "follow_embed"
    )


def test_semantics_does_not_apply_to_the_patching_comparison(tmp_path, capsys):
    status = cli.main(
        ["run", "patching_vs_grafting", "--out", str(tmp_path), "--semantics", "clean"]
    )
    assert status == 1
    assert "--semantics do not apply here" in capsys.readouterr().err


@pytest.mark.parametrize("experiment", ["patching_vs_grafting", "graft_attribution"])
def test_a_semantics_an_experiment_would_ignore_is_refused(experiment, tmp_path, capsys):
    from grafting_lens.core.errors import ExperimentError
    from grafting_lens.study import REFERENCE
    from grafting_lens.study.named import run_spec
    from grafting_lens.study.specs import ExperimentSetup

    # These runners work the library's way only; a REFERENCE run would silently be CLEAN.
    setup = ExperimentSetup(models=None, relations=[], label="x", dataset="x")  # type: ignore[arg-type]
    with pytest.raises(ExperimentError, match=f"The {experiment} experiment runs with"):
        run_spec(experiment, setup, semantics=REFERENCE)
    status = cli.main(["run", experiment, "--out", str(tmp_path), "--semantics", "reference"])
    assert status == 1
    assert "--semantics do not apply here" in capsys.readouterr().err


def test_a_bad_device_fails_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(toy, "build_toy_world", lambda *a, **k: pytest.fail("built a toy world"))
    result = invoke(["demo", "--out", str(tmp_path / "out"), "--device", "banana"])
    assert result.exit_code == 1
    assert "device='banana' cannot be used" in _output(result)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        # 4,096 threads were accepted and made the machine unusable; 100,000 a MemoryError.
        (["--threads", "4096"], "--threads must be between 1 and"),
        (["--threads", "100000"], "(the CPU cores this process may use), got 100000"),
        (["--device", "banana"], "device='banana' cannot be used"),
        (["--semantics", "referense"], "Unknown semantics 'referense'"),
        (["--semantics", "reference+unembed=nowhere"], "Semantics.unembed must be one of"),
        (["--semantics", "clean+colour=red"], "Cannot read 'colour=red'"),
        # json keeps the last of a key set twice, without a word.
        (["--toy-config", '{"seed": 1, "seed": 2}'], "--toy-config sets 'seed' twice"),
        # The toy world has one sft: a second seed's belongs to a real world.
        (["--sft-seed", "1"], "sft_seed (--sft-seed) chooses among a real world's sft"),
    ],
)
def test_script_options_are_checked_before_loading(
    tmp_path, monkeypatch, capsys, arguments, message
):
    monkeypatch.setattr(toy, "build_toy_world", lambda *a, **k: pytest.fail("built a toy world"))
    status = cli.main(["run", "position", "--out", str(tmp_path), *arguments])
    assert status == 1
    assert message in capsys.readouterr().err


def test_own_prompts_for_an_experiment_that_asks_its_own_are_refused_before_loading(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(toy, "build_toy_world", lambda *a, **k: pytest.fail("built a toy world"))
    prompts = tmp_path / "mine.json"
    prompts.write_text('[{"prompt": "Who?", "target": " Bob"}]')
    out = str(tmp_path / "out")
    status = cli.main(["run", "graft_attribution", "--out", out, "--prompts", str(prompts)])
    assert status == 1
    assert "asks its own questions" in capsys.readouterr().err


# ------------------------------------------------------------------ the output directory


def _demo(out, *options):
    return invoke(["demo", "--out", str(out), "--no-progress", "--no-png", *options])


def test_another_runs_results_are_refused_then_replaced_completely_on_overwrite(tmp_path, world):
    out = tmp_path / "out"
    assert _demo(out).exit_code == 0
    first = (out / "results.csv").read_text()
    # A PNG the first run wrote (where Chrome was), listed in its report.json.
    (out / "position_grafting.png").write_bytes(b"png")
    manifest = json.loads((out / "report.json").read_text())
    manifest["files"].append("position_grafting.png")
    (out / "report.json").write_text(json.dumps(manifest))

    refused = _demo(out, "--semantics", "clean")
    assert refused.exit_code == 1
    message = _output(refused)
    assert "holds the report of another run (demo" in message
    assert "differs in options (semantics)" in message and "--overwrite" in message
    assert (out / "results.csv").read_text() == first  # untouched

    replaced = _demo(out, "--semantics", "clean", "--overwrite")
    assert replaced.exit_code == 0, _output(replaced)
    assert not (out / "position_grafting.png").exists()  # nothing of the old run is left
    assert (out / "results.csv").read_text() != first
    assert json.loads((out / "report.json").read_text())["files"] == [
        "results.csv",
        "summary.csv",
        "summary.md",
        "position_grafting.html",
        "position_mean_rank.html",
    ]


def test_a_rerun_of_the_same_run_rewrites_its_report_and_drops_what_it_no_longer_writes(
    tmp_path, world
):
    out = tmp_path / "out"
    assert _demo(out).exit_code == 0
    (out / "position_grafting.png").write_bytes(b"an older png")
    manifest = json.loads((out / "report.json").read_text())
    manifest["files"].append("position_grafting.png")
    (out / "report.json").write_text(json.dumps(manifest))
    again = _demo(out, "--batch-size", "3")  # a batch size changes no result: the same run
    assert again.exit_code == 0, _output(again)
    assert "0 of 96 rows computed" in (out / "summary.md").read_text()  # read back
    assert not (out / "position_grafting.png").exists()  # --no-png: the old PNG is gone


def test_results_left_by_an_older_version_are_refused_and_cleared_on_overwrite(tmp_path, world):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.csv", "summary.md", "position_grafting.png", "notes.txt"):
        (out / name).write_text("old")
    refused = _demo(out)
    assert refused.exit_code == 1 and "left no report.json" in _output(refused)
    assert _demo(out, "--overwrite").exit_code == 0
    assert not (out / "position_grafting.png").exists()
    assert (out / "notes.txt").read_text() == "old"  # not a report's file: kept


def test_an_empty_out_is_refused(tmp_path, monkeypatch, world):
    monkeypatch.chdir(tmp_path)
    for command in (["demo", "--out", ""], ["run", "position", "--out", ""]):
        result = invoke(command)
        assert result.exit_code == 1 and "--out is an empty path" in _output(result)
    assert not list(tmp_path.iterdir())  # nothing written into the working directory


def test_an_unwritable_out_is_found_before_anything_is_built(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(toy, "build_toy_world", lambda *a, **k: pytest.fail("built a toy world"))
    out = tmp_path / "read-only"
    out.mkdir()
    out.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: refuse as a read-only mount would
        real = tempfile.mkstemp

        def read_only(*args, dir=None, **kwargs):
            if str(dir).startswith(str(out)):
                raise PermissionError(13, "Permission denied")
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", read_only)
    for target in (out, out / "new" / "dir"):
        result = invoke(["demo", "--out", str(target)])
        assert result.exit_code == 1
        assert f"--out {target} cannot be written" in _output(result)
        assert "Permission denied" in _output(result)


@pytest.mark.parametrize(
    "option", [["--seed", "5"], ["--dataset", "x"], ["--n-relations", "3"], ["--relations", "task"]]
)
def test_relation_options_are_refused_with_the_toy_world(tmp_path, monkeypatch, capsys, option):
    # The toy world asks about its own relations: the option would change nothing.
    monkeypatch.setattr(toy, "build_toy_world", lambda *a, **k: pytest.fail("built a toy world"))
    assert cli.main(["run", "position", "--out", str(tmp_path / "out"), *option]) == 1
    assert f"{option[0]} chooses the relations of --model runs" in capsys.readouterr().err


def test_help_wraps_at_80_columns_instead_of_cutting_words_off(monkeypatch):
    """Every option's help is there in full on a narrow terminal, wrapped, never cut."""
    monkeypatch.setenv("COLUMNS", "80")
    result = invoke(["demo", "--help"])
    assert result.exit_code == 0
    assert "…" not in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    flat = " ".join(result.output.split())
    assert "grafting_lens.worlds.data.DATASETS" in flat
    assert "(default: only when standard error is a terminal)" in flat


@pytest.mark.parametrize(("flag", "drawn"), [(None, False), ("--progress", True)])
def test_progress_bars_stay_out_of_a_log_unless_asked_for(tmp_path, checkpoints, flag, drawn):
    """The runner's stderr here is not a terminal: no bar by default, one with --progress."""
    arguments = ["demo", "--out", str(tmp_path / "out"), "--model", str(checkpoints / "base")]
    arguments += ["--donor", str(checkpoints / "sft"), "--n-relations", "5", "--n-examples", "3"]
    arguments += ["--batch-size", "2", "--no-png", *([flag] if flag else [])]
    result = invoke(arguments)
    assert result.exit_code == 0, _output(result)
    bar = re.search(r"\d+/\d+ \[\d\d:\d\d", _output(result))  # tqdm's "3/48 [00:01"
    assert (bar is not None) is drawn


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([], "usage: grafting-lens"),
        (["--bogus"], "no such option: '--bogus'"),
        (["nosuch"], "no such command: 'nosuch'"),
        (["demo"], "the following arguments are required: --out"),
        (["demo", "--out"], "argument --out: expected one argument"),
        (["demo", "--out", "x", "--n-examples", "0"], "argument --n-examples: must be >= 1, got 0"),
        (["demo", "--out", "x", "--bogus"], "unrecognized arguments: --bogus"),
        (["world", "build"], "the following arguments are required: name"),
    ],
)
def test_usage_errors_return_status_2_with_the_message_never_a_traceback(
    arguments, message, capsys
):
    """A command line that does not parse prints the usage and why, and returns 2."""
    assert cli.main(arguments) == 2
    captured = capsys.readouterr()
    assert message in captured.out + captured.err
    assert "Traceback" not in captured.out + captured.err


def test_python_m_grafting_lens_cli_runs_the_command():
    import subprocess
    import sys

    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    bad = subprocess.run(
        [sys.executable, "-m", "grafting_lens.study.cli", "--bogus"],
        capture_output=True,
        text=True,
        env=environment,
    )
    assert bad.returncode == 2 and "no such option: '--bogus'" in bad.stderr
    assert "Traceback" not in bad.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "grafting_lens.study.cli", "run"],
        capture_output=True,
        text=True,
        env=environment,
    )
    assert "Experiments:" in listed.stdout and "demo" in listed.stdout


ANSWERS = (" movie", " the film", " actor")
"""Answers whose first token under the tiny tokenizer holds a word: it splits the space
off most names (" Sandra" is " ", "S", ...), which a run on your own prompts refuses."""


def test_own_prompts_from_a_file_run_through_the_command(tmp_path, world, capfd):
    from grafting_lens.worlds import data

    examples = data.make_examples(world.relations[:3], prompt="headline")
    prompts = tmp_path / "mine.csv"
    lines = ["prompt,target,first_entity,name"]
    for example, answer in zip(examples, ANSWERS):
        start, end = example.spans["first_entity"]
        lines.append(f'"{example.text}","{answer}","{example.text[start:end]}",ours')
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    result = invoke(["demo", "--out", str(out), "--prompts", str(prompts), "--no-progress"])
    assert result.exit_code == 0, _output(result)
    results = pd.read_csv(out / "results.csv")
    paper = results[results.part == "paper"]
    assert len(results) == len(paper) == 3 * len(experiments.PAPER_POSITION_CONFIGS)
    assert set(results.dataset) == {"mine"} and set(results.prompt) == {"ours"}
    assert sorted(results.text.unique()) == sorted(e.text for e in examples)
    summary = (out / "summary.md").read_text()
    # Three rows per bar: no interval is claimed, and the table says so.
    assert "(no interval, n < 10)" in summary and "[100%, 100%]" not in summary
    # What was typed, and no more; a thread is a thread; TransformerLens's dtype line once
    # at most (none: the bridges are cast quietly).
    assert "--batch-size" not in summary
    assert " on 1 CPU thread " in summary or " on 1 CPU thread." in summary
    assert "Changing model dtype" not in capfd.readouterr().out + result.output


def test_a_prompts_file_with_a_mistake_is_refused_naming_the_row_and_the_fix(tmp_path, world):
    prompts = tmp_path / "mine.json"
    prompts.write_text('[{"prompt": "Keanu Reeves starred alongside", "target": "Sandra"}]')
    result = invoke(["demo", "--out", str(tmp_path / "out"), "--prompts", str(prompts)])
    assert result.exit_code == 1
    assert "mine.json, row 1" in _output(result) and "write ' Sandra'" in _output(result)
    assert not (tmp_path / "out" / "results.csv").exists()


def test_the_summary_says_where_a_run_computed():
    import torch

    threads = torch.get_num_threads()
    assert run_command._where(torch.device("cpu")) == f"{threads} CPU thread" + "s" * (threads > 1)
    # Not "CPU threads" for a device that is not the CPU.
    assert run_command._where(torch.device("meta")) == "meta"


def _prompts_file(path, world, names=("custom",) * 3, answers=ANSWERS, **changes):
    """A JSON prompts file: the world's first headline prompts (first entity marked),
    ``answers``, ``names``."""
    from grafting_lens.worlds import data

    examples = data.make_examples(world.relations[: len(answers)], prompt="headline")
    rows = [
        {
            "prompt": example.text,
            "target": answer,
            "first_entity": example.text[slice(*example.spans["first_entity"])],
            "name": name,
            **changes,
        }
        for example, answer, name in zip(examples, answers, names)
    ]
    path.write_text(json.dumps(rows))
    return path


HOSTILE = "a|b\n<script>alert(1)</script> <img src=x onerror=alert(1)> `x` [l](javascript:x)"


def _table_shapes(markdown: str) -> list[int]:
    """The number of cells of every table line (split at ``|`` not escaped by ``\\``)."""
    return [
        len(re.split(r"(?<!\\)\|", line)) for line in markdown.splitlines() if line.startswith("|")
    ]


def test_names_from_a_prompts_file_stay_text_in_summary_md(tmp_path, world):
    """A prompt name (and a file name) holding a table's ``|``, a newline and HTML lands in
    summary.md as the characters typed: the table keeps its shape, no tag is left for a
    Markdown viewer to run."""
    folder = tmp_path / "in|<b>"
    folder.mkdir()
    prompts = _prompts_file(folder / "x|<i>y.json", world, names=(HOSTILE,) * 3)
    out = tmp_path / "out"
    result = invoke(["demo", "--out", out, "--prompts", prompts, "--no-progress", "--no-png"])
    assert result.exit_code == 0, _output(result)
    summary = (out / "summary.md").read_text()
    # The command is shown verbatim in a fenced block, where nothing is markup.
    fenced = re.fullmatch(r"(.*?)\n(`{3,})\n.*?\n\2\n(.*)", summary, flags=re.S)
    assert fenced is not None and "--prompts" in summary
    outside = fenced[1] + fenced[3]
    assert not re.search(r"<[A-Za-z/!?]", outside)  # every tag escaped (&lt;), none raw
    shapes = _table_shapes(summary)
    assert len(shapes) == 2 + len(experiments.PAPER_POSITION_CONFIGS)  # header, rule, rows
    assert set(shapes) == {shapes[0]}, summary
    assert "a\\|b\\n&lt;script&gt;" in summary  # shown, escaped, on one line
    # The summary on the terminal shows the newline too, rather than breaking its row.
    assert "a|b\\n<script>" in result.output and "\n<script>" not in result.output


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        # The tiny tokenizer splits the space off digits: both answers are scored by " ".
        ({"answers": (" 1999", " 2001")}, r"' 1999' \(.*mine.json, row 1\).*only whitespace"),
        (
            {"answers": (" movie",), "prompt": {"text": "Who?"}},
            r"mine.json, row 1: prompt is a JSON object",
        ),
        ({"answers": (" movie",), "target": [" a", " b"]}, r"row 1: target is a JSON array"),
        (
            {
                "answers": (" movie",),
                "prompt": "Keanu Reeves starred in a" + " movie" * 80,
                "first_entity": None,
            },
            r"mine.json, row 1 \('Keanu.*is \d+ tokens, longer than the model's context \(n_ctx\) of 64",
        ),
        (
            {"answers": (" movie",), "first_entity": None},
            r"mine.json has no first_entity column, and configuration 'FE' grafts at the first",
        ),
    ],
    ids=[
        "bare-space answers",
        "object as prompt",
        "array as target",
        "past the context",
        "no first entity for FE",
    ],
)
def test_own_prompts_the_models_cannot_score_are_refused_naming_the_row(
    tmp_path, world, rows, message
):
    """Refused after the models load (the tokenizer and the context are theirs), before
    any forward pass: the row named, the fix said, nothing written."""
    answers = rows.pop("answers")
    prompts = _prompts_file(tmp_path / "mine.json", world, names=("custom",) * 3, answers=answers)
    if rows:
        table = json.loads(prompts.read_text())
        table[0].update(rows)
        prompts.write_text(json.dumps(table))
    result = invoke(["demo", "--out", tmp_path / "out", "--prompts", prompts, "--no-progress"])
    assert result.exit_code == 1, _output(result)
    assert re.search(message, _output(result)), _output(result)
    assert "Traceback" not in result.output
    assert not (tmp_path / "out" / "results.csv").exists()


def test_a_csv_with_a_byte_order_mark_reads_and_shared_first_tokens_are_noted(
    tmp_path, world, monkeypatch
):
    """Excel's UTF-8 CSV starts with a byte-order mark: its first column is still
    'prompt'. Two answers scored by one token are run, and the report says so."""
    from grafting_lens.worlds import data

    examples = data.make_examples(world.relations[:3], prompt="headline")
    answers = (" movie", " movie star", " actor")
    lines = ["prompt,target,first_entity"] + [
        f'"{e.text}",{answer},{e.text[slice(*e.spans["first_entity"])]}'
        for e, answer in zip(examples, answers)
    ]
    prompts = tmp_path / "excel.csv"
    prompts.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    out = tmp_path / "out"
    monkeypatch.setenv("HOME", str(tmp_path))  # and a path written with ~
    home = ["--prompts", "~/excel.csv"]
    result = invoke(["demo", "--out", out, *home, "--no-progress", "--no-png"])
    assert result.exit_code == 0, _output(result)
    summary = (out / "summary.md").read_text()
    assert "share their first token" in summary and "movie star" in summary


@pytest.mark.parametrize(
    ("arguments", "patched", "line"),
    [
        (["demo"], "run_spec", "Interrupted; run the same command to resume."),
        (["run", "patching_vs_grafting", "--quick"], "run_spec", "this run does not resume"),
        (["world", "build", "toy"], "build_toy_world", "Interrupted; run the same command"),
    ],
    ids=["a resumable run", "a run that does not resume", "a world build"],
)
def test_ctrl_c_prints_one_line_and_exits_130(
    tmp_path, world, monkeypatch, arguments, patched, line
):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    target = toy if patched == "build_toy_world" else experiments.named
    monkeypatch.setattr(target, patched, interrupt)
    out = [] if arguments[0] == "world" else ["--out", tmp_path / "out", "--no-progress"]
    try:
        result = invoke([*arguments, *out])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the command as a traceback")
    assert result.exit_code == 130
    assert result.output.strip().splitlines()[-1].startswith("Interrupted;")
    assert line in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    "world, given, expected",
    [("gemma3", None, "1"), ("gemma3", "0", "0"), ("smollm2", None, "None")],
)
def test_gemmas_build_asks_torch_for_huge_pages_unless_told_otherwise(
    tmp_path, world, given, expected
):
    """`world build gemma3` sets THP_MEM_ALLOC_ENABLE before torch is imported (torch reads it
    once): its large tensors then sit in huge pages. A value the user set is kept; SmolLM2's
    build, which measured no faster with them, leaves torch's default."""
    import subprocess
    import sys

    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "GRAFTING_LENS_CACHE": str(tmp_path)}
    environment.pop("THP_MEM_ALLOC_ENABLE", None)
    if given is not None:
        environment["THP_MEM_ALLOC_ENABLE"] = given
    not_a_directory = tmp_path / "cache-is-a-file"
    not_a_directory.write_text("")  # the build stops at the cache check, before any fetch
    script = (
        "import os, sys\n"
        "from grafting_lens.study import cli\n"
        f"status = cli.main(['world', 'build', {world!r}, '--cache-dir', {str(not_a_directory)!r}])\n"
        "print(status, 'torch' in sys.modules, os.environ.get('THP_MEM_ALLOC_ENABLE'))\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment
    )
    assert "cache-is-a-file" in shown.stderr, shown.stderr[-2000:]
    assert shown.stdout.split() == ["1", "True", expected], shown.stderr[-2000:]


def test_scores_beyond_the_first_token_run_through_the_command(tmp_path, world):
    """--score kl recovers 0 at the base's rows and 1 at the donor's; --score logit_diff takes
    --counter, which is part of the run (another counter is another run)."""
    out = tmp_path / "kl"
    assert _demo(out, "--score", "kl").exit_code == 0
    results = pd.read_csv(out / "results.csv")
    paper = results[results.part == "paper"]
    whole = {config: paper[paper.config == config] for config in ("clean", "sft")}
    assert (whole["clean"].kl_recovered == 0).all() and (whole["sft"].kl_recovered == 1).all()
    assert (whole["sft"].kl.abs() < 1e-6).all() and (whole["clean"].kl > 0).all()
    summary = pd.read_csv(out / "summary.csv")
    assert {"kl", "kl_low", "kl_high", "kl_recovered"} <= set(summary.columns)

    out = tmp_path / "logit_diff"
    assert _demo(out, "--score", "logit_diff", "--counter", " starred").exit_code == 0
    logit_diff = pd.read_csv(out / "results.csv").logit_diff
    assert logit_diff.notna().all() and logit_diff.nunique() > 1
    other = _demo(out, "--score", "logit_diff", "--counter", " movie")
    assert other.exit_code == 1 and "differs in options (counter)" in _output(other)
    for arguments, message in (
        (("--score", "logit_diff"), "--score logit_diff needs --counter TEXT"),
        (("--counter", "x"), "--counter is --score logit_diff's"),
    ):
        refused = _demo(tmp_path / "refused", *arguments)
        assert refused.exit_code == 1 and message in _output(refused)
