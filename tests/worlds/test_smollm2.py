"""The real-model world's recipe, on a tiny Llama written as a GGUF (no 93 MB file needed)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import subprocess
import sys

import pytest
from tiny_gguf import tiny_llama, write_gguf

import grafting_lens as gl
import grafting_lens.worlds.finetune as finetune_module
from grafting_lens.core.errors import GraftingLensError, RunError
from grafting_lens.worlds.smollm2 import (
    MODEL_NAMES,
    SmolLM2WorldConfig,
    build_smollm2_world,
    known_actors,
)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    gguf = write_gguf(tiny_llama(), tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return SmolLM2WorldConfig(
        base=str(gguf),
        n_relations=12,
        epochs=2,
        batch_size=4,
        lr=1e-3,
        max_length=256,
        known_actor_top_k=None,  # a random tiny model knows no actor
    )


def _weights(world):
    return {
        name: (world.model_dir(name) / "model.safetensors").read_bytes() for name in MODEL_NAMES
    }


@pytest.fixture(scope="module")
def world(config, tmp_path_factory):
    return build_smollm2_world(config, cache_dir=tmp_path_factory.mktemp("cache"), progress=False)


def test_the_world_holds_full_finetunes_that_learned_their_facts(world):
    assert sorted(p.name for p in world.root.iterdir() if not p.name.startswith(".")) == [
        "base",
        "manifest.json",
        "relation",
        "relations.json",
        "sft",
        "task",
    ]
    weights = _weights(world)
    assert len(set(weights.values())) == len(MODEL_NAMES)  # every donor moved off the base
    manifest = world.manifest
    assert manifest["training"]["sft"]["settings"]["lr"] == 1e-3
    for name in ("sft", "task", "relation"):
        training = manifest["training"][name]
        assert training["val_losses"][training["best_epoch"] - 1] < training["initial_val_loss"]
    # task and relation get as many optimizer steps as sft from half the relations
    steps = {n: manifest["training"][n]["settings"]["total_steps"] for n in ("sft", "task")}
    assert steps["task"] == pytest.approx(steps["sft"], rel=0.25)
    assert set(manifest["evaluation"]) == set(MODEL_NAMES)
    assert not {r.first_actor for r in world.task_relations} & {
        r.first_actor for r in world.relation_relations
    }


def test_the_world_loads_as_checkpoints(world):
    models = gl.load_models(world.base_dir, world.sft_dir)
    assert models.base.cfg.n_layers == 2


def test_a_built_world_is_opened_not_rebuilt(world, config):
    again = build_smollm2_world(config, cache_dir=world.root.parent, progress=False)
    assert again.root == world.root
    assert again.manifest["created"] == world.manifest["created"]


def test_a_killed_build_resumes_to_the_same_bytes(world, config, tmp_path, monkeypatch):
    real_save = finetune_module._EpochCheckpoint.save
    saved = []

    def killed_in_the_task_model(self, state):
        real_save(self, state)
        saved.append(self.path.parent.name)
        if self.path.parent.name == ".task.epochs" and state["epoch"] == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(finetune_module._EpochCheckpoint, "save", killed_in_the_task_model)
    with pytest.raises(KeyboardInterrupt):
        build_smollm2_world(config, cache_dir=tmp_path, progress=False)
    building = [p for p in tmp_path.iterdir() if p.name.endswith(".building")]
    assert len(building) == 1 and (building[0] / "sft" / "config.json").exists()
    assert (building[0] / ".task.epochs" / "epoch.pt").exists()

    monkeypatch.setattr(finetune_module._EpochCheckpoint, "save", real_save)
    resumed = build_smollm2_world(config, cache_dir=tmp_path, progress=False)

    assert _weights(resumed) == _weights(world)
    assert resumed.manifest["training"] == world.manifest["training"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".building")]


def test_a_second_build_of_the_same_world_is_refused(config, tmp_path):
    from grafting_lens.worlds.smollm2 import _world_key

    building = tmp_path / f".{_world_key(config)}.building"
    building.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from grafting_lens.core.files import DirectoryLock; "
            "lock = DirectoryLock(sys.argv[1]).acquire(); print('held', flush=True); "
            "time.sleep(60)",
            str(building),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunError, match="another process"):
            build_smollm2_world(config, cache_dir=tmp_path, progress=False)
    finally:
        holder.kill()
        holder.wait()


def test_known_actors_keeps_the_names_the_model_completes(tmp_path):
    from transformers import AutoTokenizer

    from grafting_lens.worlds.gguf_checkpoint import convert_checkpoint

    model = tiny_llama()
    directory = convert_checkpoint(write_gguf(model, tmp_path / "t.gguf"), tmp_path / "c")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    everyone = known_actors(model, tokenizer, ("Ann Bee", "Cy Dee"), top_k=len(tokenizer))
    nobody = known_actors(model, tokenizer, ("Ann Bee", "Cy Dee"), top_k=0)
    assert everyone == ["Ann Bee", "Cy Dee"]
    assert nobody == []


def test_a_bad_configuration_names_the_field():
    with pytest.raises(GraftingLensError, match=r"n_relations=2: must be >= 4"):
        SmolLM2WorldConfig(n_relations=2)
    with pytest.raises(GraftingLensError, match=r"epochs=0"):
        SmolLM2WorldConfig(epochs=0)


def test_the_estimate_counts_three_finetunes_of_sft_steps():
    config = SmolLM2WorldConfig()
    steps = -(-round(config.n_relations * 10 * 0.8) // config.batch_size) * config.epochs
    assert config.estimated_minutes(1.0) == pytest.approx(3 * steps / 60)
    # The default is the measured whole build's time per step: 80 minutes for the default
    # recipe on a shared 2-core CPU (docs/results.md), not the 42 of its steps alone.
    assert 75 <= config.estimated_minutes() <= 85


def test_the_command_names_the_worlds_and_refuses_a_base_that_knows_no_actor(config, tmp_path):
    from conftest import invoke

    unknown = invoke(["world", "build", "smolm2", "--cache-dir", str(tmp_path)])
    assert unknown.exit_code == 1
    assert "No world 'smolm2'" in unknown.output and "Did you mean 'smollm2'?" in unknown.output

    ignorant = invoke(
        ["world", "build", "smollm2", "--base", config.base, "--cache-dir", str(tmp_path)]
    )
    assert ignorant.exit_code == 1
    assert "The base knows 0 of the" in ignorant.output and "Lower n_relations" in ignorant.output


def test_the_position_experiment_runs_on_the_world(world, config):
    from grafting_lens.study import run_named_experiment
    from grafting_lens.study.named import smollm2_setup

    models, relations, info = smollm2_setup(
        "position", config=config, cache_dir=world.root.parent, progress=False
    )
    results = run_named_experiment("position", models, relations, n_examples=4, batch_size=4)

    assert info["root"] == str(world.root)
    assert set(results["config"]) >= {"PRE", "SFT", "FE", "LT"}
    sft = results[results["config"] == "SFT"]
    assert sft["top5"].mean() > results[results["config"] == "PRE"]["top5"].mean()
