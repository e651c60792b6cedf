"""Lazily loaded donors against the same checkpoints loaded whole; declarations; memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import no_forward_pass, random_mask, random_model, random_tokens
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import grafting_lens as gl

_DIRECTORIES: dict[str, tuple] = {}


@pytest.fixture
def checkpoints(family, tokenizer, tmp_path_factory):
    """A base and a donor directory of the family (safetensors, with the tokenizer)."""
    if family not in _DIRECTORIES:
        root = tmp_path_factory.mktemp(f"lazy_{family}")
        for name, seed in (("base", 0), ("donor", 1)):
            random_model(family, seed).save_pretrained(root / name)
            tokenizer.save_pretrained(root / name)
        _DIRECTORIES[family] = (root / "base", root / "donor")
    return _DIRECTORIES[family]


def stored_bytes(directory, names) -> int:
    """Bytes of the named tensors in a directory's safetensors file, read from the file."""
    with safe_open(str(directory / "model.safetensors"), framework="pt") as files:
        return sum(files.get_tensor(name).nbytes for name in names)


def test_a_lazy_donor_grafts_as_the_donor_loaded_whole(checkpoints):
    base, donor = checkpoints
    eager = gl.load_models(base, donor)
    lazy = gl.load_models(base, donor, lazy=True)
    assert [source.kind for source in lazy.sources] == ["checkpoint", "lazy"]
    assert lazy.sources[1].loaded == ()  # nothing read yet
    tokens = random_tokens(3, 8, seed=1)
    mask = random_mask(eager, tokens.shape, seed=2)
    grafted = gl.graft_forward(lazy, tokens, mask, logits="all")
    assert (grafted - gl.graft_forward(eager, tokens, mask, logits="all")).abs().max() <= 1e-6
    assert (grafted - gl.graft_forward_reference(lazy, tokens, mask)).abs().max() <= 1e-4
    assert (grafted - lazy.base(tokens)).abs().max() > 1.0


def test_a_graft_reads_only_the_components_its_mask_names_once(checkpoints, family):
    base, donor = checkpoints
    models = gl.load_models(base, donor, lazy=True, components="o+ffn", layers="last_half")
    tokens = random_tokens(2, 7, seed=3)
    mask = gl.GraftMask.build(models, tokens, positions="last", layers="last_half", components="o")
    gl.graft_forward(models, tokens, mask, logits="all")
    # Three layers: the last half is layer 2 (with an odd depth the first half is larger).
    assert models.sources[1].loaded == ("blocks.2.attn.o",)
    memory = models.memory()
    names = {
        "gpt2": ["transformer.h.2.attn.c_proj.weight", "transformer.h.2.attn.c_proj.bias"],
        "neox": [
            "gpt_neox.layers.2.attention.dense.weight",
            "gpt_neox.layers.2.attention.dense.bias",
        ],
        "llama": ["model.layers.2.self_attn.o_proj.weight"],
        "gemma": ["model.layers.2.self_attn.o_proj.weight"],
    }[family]
    assert memory.loc[1, "resident_bytes"] == stored_bytes(donor, names)
    loaded = models.sources[1].module(models.slots("o", 2)[0])
    full = gl.GraftMask.build(models, tokens, layers="last_half", components="o+ffn")
    gl.graft_forward(models, tokens, full, logits="all")
    assert models.sources[1].module(models.slots("o", 2)[0]) is loaded  # read once, kept
    memory = models.memory()
    assert memory.loc[1, "resident_bytes"] == memory.loc[1, "declared_bytes"]
    assert memory.loc[1, "declared_bytes"] < memory.loc[1, "full_bytes"] / 3
    assert memory.loc[1, "disk_bytes"] == (donor / "model.safetensors").stat().st_size


def test_a_mask_beyond_the_declaration_is_refused_before_anything_runs(checkpoints):
    base, donor = checkpoints
    models = gl.load_models(base, donor, lazy=True, components="o+ffn", layers="last_half")
    tokens = random_tokens(2, 6, seed=4)
    outside = [
        gl.GraftMask.build(models, tokens, components="q"),
        gl.GraftMask.build(models, tokens, layers=0, components="o"),
    ]
    for mask in outside:
        with no_forward_pass(models), pytest.raises(gl.errors.GraftMaskError, match="declar"):
            gl.graft_forward(models, tokens, mask, logits="all")
        with pytest.raises(gl.errors.GraftMaskError, match="components= / layers="):
            gl.graft_forward_reference(models, tokens, mask)
    assert models.sources[1].loaded == ()
    # The base may compute anything: a mask naming source 0 there is no graft from a donor.
    base_only = gl.GraftMask.build(models, tokens, components="q", source=0)
    assert torch.equal(
        gl.graft_forward(models, tokens, base_only, logits="all"), models.base(tokens)
    )


def test_a_declaration_binds_donors_loaded_whole_too(tokenizer):
    models = gl.load_models(
        random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer, components="attn"
    )
    assert models.graftable == frozenset(
        (component, layer) for component in ("q", "k", "v") for layer in range(3)
    )
    tokens = random_tokens(1, 5)
    with pytest.raises(gl.errors.GraftMaskError, match="o at layer 0"):
        gl.graft_forward(
            models, tokens, gl.GraftMask.build(models, tokens, components="o"), logits="all"
        )


def test_a_lazy_donor_runs_alone_once_read_whole(checkpoints):
    base, donor = checkpoints
    eager = gl.load_models(base, donor)
    lazy = gl.load_models(base, donor, lazy=True)
    tokens = random_tokens(2, 6, seed=5)
    with pytest.warns(gl.errors.LazyLoadWarning, match="loads it whole"):
        alone = lazy[1](tokens)
    assert torch.equal(alone, eager[1](tokens))
    assert lazy.memory().loc[1, "resident_bytes"] == eager.memory().loc[1, "resident_bytes"]
    # Patching runs each checkpoint alone, so it works on the donor read whole.
    patched = gl.patch_forward(lazy, tokens, site="resid_pre", layers=1, positions="last")
    assert (
        patched - gl.patch_forward(eager, tokens, site="resid_pre", layers=1, positions="last")
    ).abs().max() <= 1e-6


def test_walking_a_model_set_never_reads_a_lazy_donor_whole(checkpoints):
    base, donor = checkpoints
    lazy = gl.load_models(base, donor, lazy=True)
    for walk in (list, lambda models: lazy.base in models, lambda models: [m for m in models]):
        with pytest.raises(gl.GraftingLensError, match="would read its lazily loaded"):
            walk(lazy)
    assert lazy.sources[1].loaded == () and lazy.memory().loc[1, "resident_bytes"] == 0
    assert len(lazy) == 2 and [s.kind for s in lazy.sources] == ["checkpoint", "lazy"]
    with pytest.warns(gl.errors.LazyLoadWarning):
        lazy[1]  # noqa: B018, read whole on purpose
    assert len(list(lazy)) == 2  # once read, walking it costs nothing more


def test_a_declared_lazy_donor_cannot_run_alone(checkpoints):
    base, donor = checkpoints
    models = gl.load_models(base, donor, lazy=True, components="ffn")
    with pytest.raises(gl.GraftingLensError, match="cannot run alone"):
        models[1]
    with pytest.raises(gl.GraftingLensError, match="cannot run alone"):
        gl.patch_forward(models, random_tokens(1, 4), site="resid_pre", layers=0)


def test_weight_diff_and_fingerprints_read_without_keeping(checkpoints):
    base, donor = checkpoints
    eager = gl.load_models(base, donor)
    lazy = gl.load_models(base, donor, lazy=True)
    assert eager.weight_diff().equals(lazy.weight_diff())
    assert lazy.sources[1].loaded == ()
    assert lazy.sources[1].fingerprint() == eager.sources[1].fingerprint()
    assert lazy.sources[1].fingerprint() != eager.sources[0].fingerprint()
    assert lazy.memory().loc[1, "resident_bytes"] == 0


def test_a_lazy_donor_is_aligned_from_its_files(tmp_path, tokenizer):
    def save(name, model, **options):
        model.save_pretrained(tmp_path / name, **options)
        tokenizer.save_pretrained(tmp_path / name)
        return tmp_path / name

    base = save("base", random_model("llama", 0))
    other_rope = random_model("llama", 1)
    other_rope.config.rope_parameters["rope_theta"] = 500000.0
    with pytest.raises(gl.errors.AlignmentError, match="rope_theta"):
        gl.load_models(base, save("rope", other_rope), lazy=True)
    with pytest.raises(gl.errors.AlignmentError, match="is a GPT2LMHeadModel, the base is a Llama"):
        gl.load_models(base, save("gpt2", random_model("gpt2", 1)), lazy=True)
    half = save("half", random_model("llama", 1).to(torch.bfloat16))
    with pytest.raises(
        gl.errors.AlignmentError,
        match="is \\(300, 32\\) in torch.bfloat16, the base's .*float32.*dtype=",
    ):
        gl.load_models(base, half, lazy=True)
    cast = gl.load_models(base, half, lazy=True, dtype=torch.float32)
    whole = gl.load_models(base, half, dtype=torch.float32)
    tokens = random_tokens(1, 6)
    mask = gl.GraftMask.build(cast, tokens, components="all")
    assert torch.equal(
        gl.graft_forward(cast, tokens, mask, logits="all"),
        gl.graft_forward(whole, tokens, mask, logits="all"),
    )
    # A file that lacks a tensor under the model's name (here: renamed by hand).
    renamed = save("renamed", random_model("llama", 1))
    tensors = load_file(str(renamed / "model.safetensors"))
    tensors["model.layers.0.mlp.up.weight"] = tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        gl.errors.AlignmentError, match="holds no 'model.layers.0.mlp.up_proj.weight'.*lazy=False"
    ):
        gl.load_models(base, renamed, lazy=True)


def test_lazy_loading_needs_a_directory_of_safetensors(tmp_path, tokenizer):
    random_model("llama", 0).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    # transformers 5 writes safetensors only; an older checkpoint may hold a .bin.
    random_model("llama", 1).save_pretrained(tmp_path / "bin")
    weights = load_file(str(tmp_path / "bin" / "model.safetensors"))
    torch.save(weights, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "model.safetensors").unlink()
    with pytest.raises(
        gl.GraftingLensError,
        match=r"model.safetensors: it is missing \(only \['pytorch_model.bin'\]\).*lazy=False",
    ):
        gl.load_models(tmp_path / "base", tmp_path / "bin", lazy=True, tokenizer=tokenizer)
    with pytest.raises(gl.GraftingLensError, match="is a hub id, and lazy=True.*snapshot_download"):
        gl.load_models(tmp_path / "base", "someone/some-model", lazy=True)
    with pytest.raises(gl.GraftingLensError, match="without a config.json"):
        gl.load_models(tmp_path / "base", tmp_path, lazy=True)


def test_sharded_checkpoints_are_read_through_their_index(tmp_path, tokenizer):
    random_model("llama", 0).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    random_model("llama", 1).save_pretrained(tmp_path / "donor", max_shard_size="60KB")
    index = json.loads((tmp_path / "donor" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    lazy = gl.load_models(tmp_path / "base", tmp_path / "donor", lazy=True, tokenizer=tokenizer)
    eager = gl.load_models(tmp_path / "base", tmp_path / "donor", tokenizer=tokenizer)
    tokens = random_tokens(2, 6)
    mask = random_mask(eager, tokens.shape)
    assert torch.equal(
        gl.graft_forward(lazy, tokens, mask, logits="all"),
        gl.graft_forward(eager, tokens, mask, logits="all"),
    )


def test_declarations_and_lazy_are_checked(checkpoints):
    base, donor = checkpoints
    with pytest.raises(gl.errors.ComponentError, match="Unknown component 'ofn'"):
        gl.load_models(base, donor, lazy=True, components="ofn")
    with pytest.raises(gl.errors.SelectionError):
        gl.load_models(base, donor, lazy=True, layers=7)
    with pytest.raises(gl.errors.AlignmentError, match="base .* must be a checkpoint loaded whole"):
        gl.ModelSet([gl.load_models(base, donor, lazy=True).sources[1]], ["x"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # declaring is not loading: nothing to warn about
        models = gl.load_models(base, donor, lazy=True, layers="last_half")
    assert {layer for _, layer in models.graftable} == {None, 2}


def test_generation_and_the_grafting_context_read_lazily_too(checkpoints):
    base, donor = checkpoints
    eager = gl.load_models(base, donor)
    lazy = gl.load_models(base, donor, lazy=True, components="ffn")
    tokens = random_tokens(2, 5, seed=6)
    mask = gl.GraftMask.build(eager, tokens, positions="last", components="ffn")
    assert torch.equal(
        gl.graft_generate(lazy, tokens, mask, max_new_tokens=3),
        gl.graft_generate(eager, tokens, mask, max_new_tokens=3),
    )
    with gl.grafting(lazy, mask) as model, torch.no_grad():  # as graft_forward runs
        logits, cache = model.run_with_cache(tokens)
    assert torch.equal(logits, gl.graft_forward(eager, tokens, mask, logits="all"))
    assert all(path.startswith("blocks.") and ".mlp." in path for path in lazy.sources[1].loaded)


def test_fingerprints_agree_across_a_cast(tmp_path, tokenizer):
    random_model("llama", 0).save_pretrained(tmp_path / "base")
    random_model("llama", 1).to(torch.bfloat16).save_pretrained(tmp_path / "half")
    options = dict(tokenizer=tokenizer, dtype=torch.float32)
    lazy = gl.load_models(tmp_path / "base", tmp_path / "half", lazy=True, **options)
    eager = gl.load_models(tmp_path / "base", tmp_path / "half", **options)
    assert lazy.sources[1].fingerprint() == eager.sources[1].fingerprint()
    assert lazy.memory().loc[1, "resident_bytes"] == 0


def test_a_relaxed_graft_reads_a_lazy_donor_by_its_declaration(checkpoints):
    base, donor = checkpoints
    eager = gl.load_models(base, donor)
    lazy = gl.load_models(base, donor, lazy=True, components="ffn")
    tokens = random_tokens(2, 5, seed=7)
    layer = lazy.base.cfg.n_layers - 1
    ones = torch.ones(tokens.shape)
    with torch.no_grad(), gl.engine.relaxation.relaxing(lazy, {("mlp_out", layer): ones}) as model:
        relaxed = model(tokens)
    # A weight of 1 is the graft; only that slot was read, no whole donor was built.
    mask = gl.GraftMask.build(eager, tokens, layers=layer, components="mlp_out")
    assert (relaxed - gl.graft_forward(eager, tokens, mask, logits="all")).abs().max() <= 1e-5
    assert lazy.sources[1].loaded == tuple(slot.path for slot in lazy.slots("mlp_out", layer))
    with pytest.raises(gl.errors.GraftMaskError, match="components= / layers="):
        with gl.engine.relaxation.relaxing(lazy, {("o", layer): ones}):
            pass


@pytest.mark.parametrize("lazy", [True, False])
def test_a_shard_index_naming_files_outside_the_checkpoint_is_refused(tmp_path, tokenizer, lazy):
    random_model("llama", 0).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    donor = tmp_path / "donor"
    random_model("llama", 1).save_pretrained(donor, max_shard_size="60KB")
    index_path = donor / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    # The shard moved beside the checkpoint, and the index pointing at it there.
    (donor / shard).rename(tmp_path / shard)
    index["weight_map"] = {
        name: (f"../{file}" if file == shard else file)
        for name, file in index["weight_map"].items()
    }
    index_path.write_text(json.dumps(index))
    with pytest.raises(gl.GraftingLensError, match=rf"it lists the shard '\.\./{shard}', outside"):
        gl.load_models(tmp_path / "base", donor, lazy=lazy, tokenizer=tokenizer)
    # The Hugging Face cache's layout: every shard a link into blobs/ outside the snapshot
    # directory. The index names entries of the directory itself, so it loads.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for file in sorted(set(index["weight_map"].values())):
        if file != f"../{shard}":
            (donor / file).rename(blobs / file)
            (donor / file).symlink_to(blobs / file)
    (donor / shard).symlink_to(tmp_path / shard)
    index["weight_map"] = {
        name: file.removeprefix("../") for name, file in index["weight_map"].items()
    }
    index_path.write_text(json.dumps(index))
    linked = gl.load_models(tmp_path / "base", donor, lazy=lazy, tokenizer=tokenizer)
    assert len(linked) == 2
    index_path.write_text("{not json")
    with pytest.raises(gl.GraftingLensError, match="cannot be used as a shard index"):
        gl.load_models(tmp_path / "base", donor, lazy=lazy, tokenizer=tokenizer)


def test_a_pickled_checkpoint_holding_code_is_refused_as_unsafe(tmp_path, tokenizer):
    random_model("gpt2", 0).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    pickled = tmp_path / "pickled"
    model = random_model("gpt2", 1)
    model.config.save_pretrained(pickled)
    state = dict(model.state_dict())
    state["not a tensor"] = print  # a global the weights-only loader refuses
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(gl.GraftingLensError, match="refused as unsafe") as caught:
        gl.load_models(tmp_path / "base", pickled, tokenizer=tokenizer)
    assert "weights_only=False" not in str(caught.value)
    assert "truncated" not in str(caught.value)


# ------------------------------------------------------------------ files that change or break


def _lazy_pair(tmp_path, tokenizer, **options):
    """A base, a donor and another donor of the same shapes, saved under tmp_path."""
    for name, seed in (("base", 0), ("donor", 1), ("other", 2)):
        random_model("llama", seed).save_pretrained(tmp_path / name, **options)
        tokenizer.save_pretrained(tmp_path / name)
    return tmp_path / "base", tmp_path / "donor", tmp_path / "other"


def _rewrite(donor, other):
    # Same header, other values: the bytes of another donor written over the file.
    data = (other / "model.safetensors").read_bytes()
    assert len(data) == (donor / "model.safetensors").stat().st_size
    with open(donor / "model.safetensors", "r+b") as handle:
        handle.write(data)


def _replace(donor, other):
    # An atomic swap, as a download or save_pretrained to a temporary name does.
    os.replace(other / "model.safetensors", donor / "model.safetensors")


@pytest.mark.parametrize(
    "change, what",
    [(_rewrite, "it was written to"), (_replace, "another file now has its name")],
    ids=["rewritten_in_place", "replaced"],
)
def test_a_donor_file_changed_after_a_graft_is_refused_not_read(tmp_path, tokenizer, change, what):
    base, donor, other = _lazy_pair(tmp_path, tokenizer)
    tokens = random_tokens(2, 6, seed=8)
    eager = gl.load_models(base, donor)
    first = gl.GraftMask.build(eager, tokens, components="o")
    expected = gl.graft_forward(eager, tokens, first, logits="all").clone()
    models = gl.load_models(base, donor, lazy=True)
    assert torch.equal(gl.graft_forward(models, tokens, first, logits="all"), expected)
    change(donor, other)
    refused = rf"model.safetensors changed after load_models opened it: {what}.*load the model"
    # What was read is not used again either: the checkpoint on disk is another now.
    for use in (
        lambda: gl.graft_forward(models, tokens, first),
        lambda: gl.graft_forward(
            models, tokens, gl.GraftMask.build(models, tokens, components="ffn")
        ),
        lambda: models.sources[1].fingerprint(),
        lambda: models.weight_diff(),
    ):
        with pytest.raises(gl.GraftingLensError, match=refused):
            use()
    with pytest.raises(gl.GraftingLensError, match=refused):
        models[1]  # read whole: the same checkpoint, or nothing


def _edit_in_place(donor, other):
    """Other values written over the file, its size, inode and modification time kept."""
    file = donor / "model.safetensors"
    status = file.stat()
    _rewrite(donor, other)
    os.utime(file, ns=(status.st_atime_ns, status.st_mtime_ns))


def test_a_file_edited_in_place_is_seen_by_the_content_check_only(tmp_path, tokenizer):
    base, donor, other = _lazy_pair(tmp_path, tokenizer)
    tokens = random_tokens(2, 6, seed=8)
    mask = gl.GraftMask.build(gl.load_models(base, donor), tokens, components="ffn")
    checked = gl.load_models(base, donor, lazy="verify")
    unchecked = gl.load_models(base, donor, lazy=True)
    expected = gl.graft_forward(gl.load_models(base, donor), tokens, mask)
    _edit_in_place(donor, other)
    # The identity (size, inode, time) cannot see this edit: the other donor's weights come in.
    edited = gl.graft_forward(unchecked, tokens, mask)
    assert torch.equal(edited, gl.graft_forward(gl.load_models(base, other), tokens, mask))
    assert not torch.equal(edited, expected)
    with pytest.raises(gl.GraftingLensError, match="bytes of .* differ .*edited in place"):
        gl.graft_forward(checked, tokens, mask)
    with pytest.raises(gl.GraftingLensError, match="edited in place"):
        checked.sources[1].fingerprint()


_TRUNCATE_AFTER_A_GRAFT = """
import os, sys, torch
import grafting_lens as gl
from conftest import random_tokens
base, donor = sys.argv[1:3]
models = gl.load_models(base, donor, lazy=True)
tokens = random_tokens(2, 6, seed=8)
first = gl.GraftMask.build(models, tokens, components="o")
before = gl.graft_forward(models, tokens, first, logits="all")
file = os.path.join(donor, "model.safetensors")
os.truncate(file, os.path.getsize(file) // 2)
for components in ("o", "ffn"):  # what was read, then what was not
    try:
        gl.graft_forward(models, tokens, gl.GraftMask.build(models, tokens, components=components))
    except gl.GraftingLensError as error:
        print(error)
    else:
        sys.exit(3)
"""


def test_a_donor_file_truncated_after_a_graft_is_an_error_not_a_crash(tmp_path, tokenizer):
    # A memory-mapped tensor whose file is cut short kills the process with SIGBUS
    # when touched; run where that cannot take the test session with it.
    base, donor, _ = _lazy_pair(tmp_path, tokenizer)
    tests = str(Path(__file__).parents[1])  # where conftest.py is
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_AFTER_A_GRAFT, str(base), str(donor)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "model.safetensors changed after load_models opened it: its size went" in result.stdout
    assert result.stdout.count("load the model set again") == 2


def _no_weight_map(donor):
    (donor / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


def _missing_shard(donor):
    index = json.loads((donor / "model.safetensors.index.json").read_text())
    (donor / sorted(set(index["weight_map"].values()))[-1]).unlink()


def _dangling_link(donor):
    (donor / "model.safetensors").unlink()
    (donor / "model.safetensors").symlink_to(donor / "blobs" / "deleted")


def _truncated(donor):
    file = donor / "model.safetensors"
    os.truncate(file, file.stat().st_size // 2)


@pytest.mark.parametrize(
    "sharded, damage, named",
    [
        (True, _no_weight_map, r"index.json cannot be used as a shard index.*again"),
        (True, _missing_shard, r"model-\S+.safetensors: it is missing.*again"),
        (False, _dangling_link, r"model.safetensors: it is a link to '.*deleted', which does not"),
        (False, _truncated, r"model.safetensors: it is not a whole safetensors file .*again"),
    ],
    ids=["no_weight_map", "missing_shard", "dangling_link", "truncated"],
)
def test_malformed_lazy_checkpoints_name_the_file_and_the_fix(
    tmp_path, tokenizer, sharded, damage, named
):
    options = {"max_shard_size": "60KB"} if sharded else {}
    base, donor, _ = _lazy_pair(tmp_path, tokenizer, **options)
    damage(donor)
    with pytest.raises(gl.GraftingLensError, match=named):
        gl.load_models(base, donor, lazy=True)
