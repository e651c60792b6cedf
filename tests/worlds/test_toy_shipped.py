"""The toy world shipped in the package: the recipe's world, intact, unpacked in seconds, refused if damaged.

No accuracy is asserted here: the world's numbers are measurements
(``experiments/toy_targets.py``, ``docs/results.md``, the manifest's ``targets``).
"""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file
from test_toy import TINY, forbid_building
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import grafting_lens.worlds.toy as toy
from grafting_lens.core.errors import ToyWorldError
from grafting_lens.study.verdicts import verdict
from grafting_lens.worlds import data, toy_shipped
from grafting_lens.worlds.toy import MODEL_NAMES, ToyWorldConfig, build_toy_world


@pytest.fixture(scope="module")
def shipped_world(tmp_path_factory):
    """The default world, unpacked from the package into an empty cache (never built)."""
    cache = tmp_path_factory.mktemp("shipped")
    patch = pytest.MonkeyPatch()
    patch.setattr(toy, "_build", lambda *a, **k: pytest.fail("built instead of unpacking"))
    try:
        world = build_toy_world(cache_dir=cache, progress=False)
    finally:
        patch.undo()
    return world


def test_the_shipped_world_is_the_recipes_default():
    """Its key hashes today's recipe: a change to the recipe or its data needs a re-ship."""
    manifest = toy_shipped.shipped_manifest()
    config = ToyWorldConfig()
    relations = data.make_relations(config.dataset, n=config.n_relations, seed=config.seed)
    assert manifest["key"] == toy._world_key(config, relations), (
        "the recipe changed: rebuild and re-ship (experiments/toy_world.py --force --ship)"
    )
    assert manifest["config"] == json.loads(json.dumps(config.__dict__))
    assert manifest["build_version"] == toy.BUILD_VERSION


def test_the_package_files_match_their_checksums_and_fit_the_budget():
    manifest = toy_shipped.check_shipped()
    root = toy_shipped.shipped_root()
    listed = set(manifest["package_files"])
    on_disk = {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert listed == on_disk
    for name in toy_shipped.SHIPPED_MODELS:
        assert f"{name}/model.safetensors" in listed
    assert "relations.json" in listed and "tokenizer/tokenizer.json" in listed
    size = sum((root / relative).stat().st_size for relative in listed)
    assert size <= 25 * 2**20


def test_the_shipped_manifest_documents_recipe_evaluation_and_targets():
    manifest = toy_shipped.shipped_manifest()
    assert manifest["weights_dtype"] == "float16"
    for name in ("base", "sft", "task", "relation", "both"):
        assert manifest["evaluation"][name]
        assert name in manifest["training"] or name == "base"
    targets = manifest["targets"]
    assert targets["semantics"] == "reference"
    names = [row["target"] for row in targets["targets"]]
    assert "SFT top-5" in names and "hybrid LT+FE:ATTN top-5" in names
    for row in targets["targets"]:
        low, high = row["pooled"]["ci95"]
        assert low <= row["pooled"]["estimate"] <= high
        # The verdict is the interval's under the library's rule, not an older word.
        sign, threshold = row["threshold"].split()
        expected = verdict(low, high, float(threshold), at_least=sign == ">=")
        assert row["verdict"] == expected, row["target"]


def test_loading_the_shipped_world_gives_the_documented_manifest(shipped_world):
    shipped = toy_shipped.shipped_manifest()
    manifest = shipped_world.manifest
    assert manifest["source"] == "shipped"
    assert shipped_world.root.name == shipped["key"]
    assert {k: v for k, v in manifest.items() if k not in ("source", "files")} == shipped
    assert toy._check_world(shipped_world.root, shipped["key"]) is None


def test_the_shipped_worlds_shape(shipped_world):
    config = ToyWorldConfig()
    assert len(shipped_world.relations) == config.n_relations
    assert shipped_world.task_relations and shipped_world.relation_relations
    tokenizer = shipped_world.load_tokenizer()
    lm_head = None
    for name in MODEL_NAMES:
        model = AutoModelForCausalLM.from_pretrained(shipped_world.model_dir(name))
        assert isinstance(model, LlamaForCausalLM)
        assert model.config.num_hidden_layers == config.n_layers
        assert model.config.hidden_size == config.d_model
        assert model.config.intermediate_size == config.d_mlp
        assert not model.config.tie_word_embeddings
        assert model.config.vocab_size == len(tokenizer)
        weights = model.state_dict()
        assert all(tensor.dtype == torch.float32 for tensor in weights.values())
        lm_head = weights["lm_head.weight"] if lm_head is None else lm_head
        assert torch.equal(weights["lm_head.weight"], lm_head), name  # frozen in finetuning


def test_unpacking_is_exact(shipped_world):
    """float32 in the cache, exactly the float16 values in the package."""
    root = toy_shipped.shipped_root()
    for name in toy_shipped.SHIPPED_MODELS:
        packed = load_file(str(root / name / "model.safetensors"))
        unpacked = load_file(str(shipped_world.model_dir(name) / "model.safetensors"))
        assert packed.keys() == unpacked.keys()
        for key, tensor in packed.items():
            assert tensor.dtype == torch.float16
            assert torch.equal(tensor.float(), unpacked[key])
    sft = load_file(str(shipped_world.sft_dir / "model.safetensors"))
    a2b = load_file(str(shipped_world.a2b_dir / "model.safetensors"))
    assert all(torch.equal(sft[k], a2b[k]) for k in sft)


def test_a_damaged_cache_entry_is_unpacked_again(shipped_world, tmp_path, monkeypatch):
    root = tmp_path / shipped_world.root.name
    shutil.copytree(shipped_world.root, root)
    (root / "sft" / "model.safetensors").unlink()
    forbid_building(monkeypatch)

    with pytest.warns(UserWarning, match="unusable.*rebuilding"):
        again = build_toy_world(cache_dir=tmp_path, progress=False)

    assert again.manifest["source"] == "shipped"
    assert toy._check_world(root, root.name) is None


@pytest.mark.parametrize("damage", ["flip_weights", "delete_weights", "garbage_manifest"])
def test_a_damaged_package_is_refused(tmp_path, monkeypatch, damage):
    package = tmp_path / "package"
    shutil.copytree(toy_shipped.shipped_root(), package)
    weights = package / "task" / "model.safetensors"
    if damage == "flip_weights":
        raw = bytearray(weights.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        weights.write_bytes(bytes(raw))
    elif damage == "delete_weights":
        weights.unlink()
    else:
        (package / "manifest.json").write_text("{not json")
    monkeypatch.setattr(toy_shipped, "shipped_root", lambda: package)
    forbid_building(monkeypatch)
    cache = tmp_path / "cache"

    with pytest.raises(ToyWorldError, match="(damaged|manifest).*Reinstall.*force=True"):
        build_toy_world(cache_dir=cache, progress=False)

    # nothing half-unpacked left, only the lock file that kept unpackers apart
    assert not cache.exists() or [p.suffix for p in cache.iterdir()] == [".lock"]


def test_force_runs_the_recipe_instead_of_unpacking(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(toy, "_build", lambda *args: built.append(args))
    monkeypatch.setattr(toy, "replace_directory", lambda *args: None)
    monkeypatch.setattr(toy, "_open_world", lambda root, config: root)
    build_toy_world(cache_dir=tmp_path, force=True, progress=False)
    assert len(built) == 1


def test_export_then_unpack_round_trips_a_built_world(tmp_path):
    world = build_toy_world(TINY, cache_dir=tmp_path / "cache", progress=False)
    package = tmp_path / "package"
    manifest = toy_shipped.export_world(world.root, package, {"targets": {"note": "none"}})
    assert manifest["targets"] == {"note": "none"} and "files" not in manifest
    toy_shipped.check_shipped(package)

    unpacked = tmp_path / "unpacked"
    toy_shipped.materialize(unpacked, root=package)

    for name in MODEL_NAMES:
        before = load_file(str(world.model_dir(name) / "model.safetensors"))
        after = load_file(str(unpacked / name / "model.safetensors"))
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
    assert toy._check_world(unpacked, world.root.name) is None


def test_export_refuses_weights_float16_would_change(tmp_path):
    world = build_toy_world(TINY, cache_dir=tmp_path / "cache", progress=False)
    path = world.sft_dir / "model.safetensors"
    weights = load_file(str(path))
    key = next(iter(weights))
    weights[key] = weights[key] + 1e-7
    from safetensors.torch import save_file

    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ToyWorldError, match="float16"):
        toy_shipped.export_world(world.root, tmp_path / "package")


_UNPACKER = """
import sys, time
import grafting_lens.worlds.toy as toy
from grafting_lens.worlds import toy_shipped

real = toy_shipped.materialize
log = open(sys.argv[2], "a")

def slow(destination, root=None):
    log.write(f"unpacking {sys.argv[3]}\\n"); log.flush()
    written = real(destination, root)
    time.sleep(float(sys.argv[4]))  # the other process arrives while this one unpacks
    return written

toy.materialize = slow
world = toy.build_toy_world(cache_dir=sys.argv[1], progress=False)
models = [(world.root / name / "model.safetensors").read_bytes()[:8] for name in toy.MODEL_NAMES]
print(world.root)
"""


def test_two_processes_unpacking_into_one_empty_cache_both_get_the_world(tmp_path):
    import subprocess
    import sys
    import time

    cache, log = tmp_path / "cache", tmp_path / "log.txt"
    log.write_text("")

    def start(name, pause):
        return subprocess.Popen(
            [sys.executable, "-c", _UNPACKER, str(cache), str(log), name, str(pause)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    first = start("first", 4)
    deadline = time.time() + 60
    while "unpacking first" not in log.read_text() and time.time() < deadline:
        time.sleep(0.1)
    second = start("second", 0)
    outputs = [process.communicate(timeout=120) for process in (first, second)]

    assert [process.returncode for process in (first, second)] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0]  # the same world
    assert log.read_text() == "unpacking first\n"  # the second waited and opened it


def test_an_export_never_replaces_a_folder_of_the_users(tmp_path):
    from grafting_lens.core.errors import WorldCacheError

    world = build_toy_world(TINY, cache_dir=tmp_path / "cache", progress=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")

    with pytest.raises(WorldCacheError, match=r"mine holds files grafting-lens did not write"):
        toy_shipped.export_world(world.root, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    package = tmp_path / "package"
    toy_shipped.export_world(world.root, package)
    toy_shipped.export_world(world.root, package)  # an earlier export is replaced
    toy_shipped.check_shipped(package)
    (package / "notes.txt").write_text("added by hand")
    with pytest.raises(WorldCacheError, match=r"did not write"):
        toy_shipped.export_world(world.root, package)
    assert (package / "notes.txt").exists()
