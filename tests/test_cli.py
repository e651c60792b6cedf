"""Tests for the grafting-lens command line: bad input fails clearly, runs write complete files."""

from __future__ import annotations

import types

import pandas as pd
import pytest
from conftest import make_tokenizer, random_model
from typer.testing import CliRunner

from grafting_lens import cli, toy
from grafting_lens.experiments import POSITION_CONFIGS

runner = CliRunner()


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


def test_out_pointing_at_a_file_fails_with_a_clear_message(tmp_path):
    target = tmp_path / "results.csv"
    target.write_text("already here")
    result = runner.invoke(cli.app, ["demo", "--out", str(target)])
    assert result.exit_code != 0
    assert "is an existing file" in _output(result) and "--out" in _output(result)
    assert target.read_text() == "already here"


def test_unknown_model_fails_with_a_clear_message(tmp_path):
    result = runner.invoke(
        cli.app,
        ["demo", "--out", str(tmp_path / "out"), "--model", "no-such-org/no-such-model-xyz"],
    )
    assert result.exit_code == 1
    assert "Unknown model 'no-such-org/no-such-model-xyz'" in _output(result)
    assert not (tmp_path / "out").exists()


def test_donor_without_model_is_refused(tmp_path):
    result = runner.invoke(cli.app, ["demo", "--out", str(tmp_path), "--donor", str(tmp_path)])
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


def test_demo_on_a_toy_world_writes_results_summary_and_figure(tmp_path, monkeypatch, checkpoints):
    from grafting_lens import data

    world = types.SimpleNamespace(  # what the experiments read of a toy world
        root=checkpoints,
        base_dir=checkpoints / "base",
        sft_dir=checkpoints / "sft",
        model_dir=lambda name: checkpoints / name,
        relations=data.make_relations("fake_movies_real_actors", n=6, seed=0),
        load_tokenizer=make_tokenizer,
        config=types.SimpleNamespace(seed=0, dataset="fake_movies_real_actors"),
        manifest={},
    )
    monkeypatch.setattr(toy, "build_toy_world", lambda **kwargs: world)
    out = tmp_path / "new" / "dir"
    result = runner.invoke(
        cli.app, ["demo", "--out", str(out), "--n-examples", "3", "--no-progress"]
    )
    assert result.exit_code == 0, _output(result)
    assert "top-5" in result.output and "FE+LT" in result.output
    results = _check_outputs(out, n_relations=3)
    assert set(results.relation_id) <= {0, 1, 2}
    # A PNG, or a line saying why there is none (no Chrome in CI).
    assert (out / "position_grafting.png").exists() or "No PNG:" in result.output


def test_demo_with_model_and_donor_directories(tmp_path, checkpoints):
    out = tmp_path / "out"
    result = runner.invoke(
        cli.app,
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


def test_demo_finetunes_a_model_given_without_donor(tmp_path, checkpoints):
    out = tmp_path / "out"
    result = runner.invoke(
        cli.app,
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
    result = runner.invoke(
        cli.app, ["demo", "--out", str(tmp_path / "out"), "--model", str(tmp_path)]
    )
    assert result.exit_code == 1 and "config.json" in _output(result)


def _demo(out, checkpoints, *flags):
    return runner.invoke(
        cli.app,
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


def _donor_ranks(checkpoints, semantics):
    """The finetuned model's own ranks of the headline answers, tokenized as ``semantics`` says."""
    import grafting_lens as gl
    from grafting_lens import data, metrics

    models = gl.load_models(checkpoints / "base", checkpoints / "sft")
    relations = data.make_relations("fake_movies_real_actors", n=5, seed=0)[:3]
    examples = data.make_examples(relations, prompt="headline", templates=semantics.prompts)
    batch = data.tokenize_examples(examples, models.tokenizer, **semantics.tokenization())
    final = metrics.last_token_logits(models[1](batch.tokens), batch.attention_mask)
    ranks = metrics.target_rank(final, batch.target_ids, by=semantics.rank_by, ties=semantics.ties)
    return [e.text for e in batch.examples], ranks.tolist()


def test_demo_runs_the_reference_semantics_by_default_and_sft_is_the_donor(tmp_path, checkpoints):
    import grafting_lens as gl

    result = _demo(tmp_path / "out", checkpoints)
    assert result.exit_code == 0, _output(result)
    assert "Semantics: reference" in _output(result)
    rows = pd.read_csv(tmp_path / "out" / "results.csv")
    assert set(rows.semantics) == {"reference"}
    sft = rows[(rows.config == "SFT") & (rows.prompt == "headline")].sort_values("example")
    texts, ranks = _donor_ranks(checkpoints, gl.REFERENCE)
    assert sft.text.tolist() == texts and all("stars in in a movie" in t for t in texts)
    assert sft.target_rank.tolist() == ranks


def test_unembed_donor_makes_the_clean_sft_rows_the_donor_itself(tmp_path, checkpoints):
    import grafting_lens as gl

    result = _demo(tmp_path / "out", checkpoints, "--semantics", "clean", "--unembed", "donor")
    assert result.exit_code == 0, _output(result)
    assert "Semantics: clean+unembed=donor" in _output(result)
    rows = pd.read_csv(tmp_path / "out" / "results.csv")
    assert set(rows.semantics) == {"clean+unembed=donor"}
    sft = rows[(rows.config == "SFT") & (rows.prompt == "headline")].sort_values("example")
    assert sft.target_rank.tolist() == _donor_ranks(checkpoints, gl.CLEAN)[1]


def test_the_deprecated_include_unembed_still_means_clean_with_the_donors_unembedding(
    tmp_path, checkpoints
):
    result = _demo(tmp_path / "out", checkpoints, "--include-unembed")
    assert result.exit_code == 0, _output(result)
    assert "--include-unembed is deprecated" in _output(result)
    assert set(pd.read_csv(tmp_path / "out" / "results.csv").semantics) == {"clean+unembed=donor"}


def test_single_switch_flags_change_one_field_of_the_experiments_semantics():
    import dataclasses

    from grafting_lens.experiments import CLEAN, REFERENCE, get_experiment

    def semantics(experiment, *flags):
        args = cli.experiment_parser(experiment).parse_args(["--out", "x", *flags])
        return cli._semantics(get_experiment(experiment), args)

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


def test_a_bad_device_fails_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(toy, "build_toy_world", lambda *a, **k: pytest.fail("built a toy world"))
    result = runner.invoke(cli.app, ["demo", "--out", str(tmp_path / "out"), "--device", "banana"])
    assert result.exit_code == 1
    assert "device='banana' cannot be used" in _output(result)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--device", "banana"], "device='banana' cannot be used"),
        (["--semantics", "referense"], "Unknown semantics 'referense'"),
        (["--semantics", "reference+unembed=nowhere"], "Semantics.unembed must be one of"),
        (["--semantics", "clean+colour=red"], "Cannot read 'colour=red'"),
    ],
)
def test_script_options_are_checked_before_loading(
    tmp_path, monkeypatch, capsys, arguments, message
):
    monkeypatch.setattr(toy, "build_toy_world", lambda *a, **k: pytest.fail("built a toy world"))
    status = cli.main(["run", "position", "--out", str(tmp_path), *arguments])
    assert status == 1
    assert message in capsys.readouterr().err
