"""A GGUF file given to load_models: converted once, cached by content, and the model it holds.

The expected logits come from transformers' own GGUF route (``from_pretrained(dir,
gguf_file=...)``), which shares nothing with grafting-lens's conversion but the file.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from tiny_gguf import tiny_llama, write_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

import grafting_lens as gl
from grafting_lens.core import directories
from grafting_lens.models import gguf_checkpoint

PROMPT = "the hat in the tin at the hut"


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The cache in ``tmp_path``, and the conversions made, counted."""
    monkeypatch.setenv("GRAFTING_LENS_CACHE", str(tmp_path / "cache"))
    made = []
    convert = gguf_checkpoint.convert_checkpoint

    def counting(*args, **kwargs):
        made.append(args[0])
        return convert(*args, **kwargs)

    monkeypatch.setattr(gguf_checkpoint, "convert_checkpoint", counting)
    return made


def test_a_gguf_loads_as_the_model_transformers_reads_from_it_once(tmp_path, counted):
    (tmp_path / "user").mkdir()
    gguf = write_gguf(tiny_llama(), tmp_path / "user" / "tiny.gguf")
    donor = write_gguf(tiny_llama(seed=1), tmp_path / "user" / "donor.gguf")
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    tokens = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)(
        PROMPT, return_tensors="pt"
    ).input_ids

    models = gl.load_models(gguf, donor)
    again = gl.load_models(str(gguf), donor)  # the same content: not converted again

    assert models.names == ("tiny.gguf", "donor.gguf")
    with torch.no_grad():
        expected = hf(tokens).logits
        assert torch.allclose(models.base(tokens), expected, atol=1e-5, rtol=0)
        assert torch.allclose(again.base(tokens), expected, atol=1e-5, rtol=0)
    assert sorted(counted) == sorted([gguf, donor])
    cached = sorted(p.name for p in (tmp_path / "cache" / "worlds").iterdir())
    assert [name for name in cached if not name.startswith(".")] == sorted(
        f"base-{gguf_checkpoint.checkpoint_key(path)}" for path in (gguf, donor)
    )
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["donor.gguf", "tiny.gguf"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda d: (d / "model.safetensors").write_bytes(b"{}"),
            r"'.*model\.safetensors'\) is a \.safetensors weight file alone.*config\.json.*"
            r"a \.gguf file, or a hub id",
        ),
        (
            lambda d: (d / "notes.txt").write_text("notes"),
            r"notes\.txt'\) is a file that is neither a checkpoint directory nor a GGUF file",
        ),
    ],
    ids=["a weight file", "another file"],
)
def test_a_file_that_is_no_checkpoint_is_refused_saying_what_to_give(tmp_path, make, message):
    make(tmp_path)
    given = next(p for p in tmp_path.iterdir())
    with pytest.raises(gl.GraftingLensError, match=message):
        gl.load_models(given, given)


def test_a_directory_holding_a_gguf_names_the_file_to_pass(tmp_path):
    write_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    with pytest.raises(gl.GraftingLensError, match=r"it holds tiny\.gguf: pass that file itself"):
        gl.load_models(tmp_path, tmp_path)


# Read-only directories are made with chmod and chattr, which Windows lacks; runs on Linux CI.
@pytest.mark.skipif(os.name != "posix", reason="chmod and chattr")
def test_a_read_only_cache_holding_the_conversions_is_read(tmp_path, counted, read_only):
    base = write_gguf(tiny_llama(), tmp_path / "base.gguf")
    donor = write_gguf(tiny_llama(seed=1), tmp_path / "donor.gguf")
    gl.load_models(base, donor)
    read_only(tmp_path / "cache")
    tokens = torch.tensor([[5, 9, 30]])

    models = gl.load_models(base, donor)  # read, not converted again
    with pytest.raises(gl.errors.WorldCacheError, match=r"where other\.gguf is to be converted"):
        gl.load_models(base, write_gguf(tiny_llama(seed=2), tmp_path / "other.gguf"))

    assert len(counted) == 2
    with torch.no_grad():
        assert not torch.equal(models.base(tokens), models[1](tokens))


def test_a_conversion_killed_midway_is_removed_by_the_next(tmp_path, counted):
    gguf = write_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    target = gguf_checkpoint.conversion_cache() / f"base-{gguf_checkpoint.checkpoint_key(gguf)}"
    # What a conversion killed before its rename leaves: a hidden, full-size working directory.
    killed = directories.make_directory(directories.sibling(target))
    (killed / "model.safetensors").write_bytes(bytes(1 << 16))
    stale = directories.make_directory(directories.sibling(target, "stale"))
    other = directories.make_directory(directories.sibling(target.with_name("base-other")))
    mine = target.with_name(f".{target.name}.partial-notes")  # no marker: not the library's
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")

    gl.load_models(gguf, gguf)

    assert not killed.exists() and not stale.exists()
    assert other.exists() and (mine / "notes.txt").exists()
    assert directories.is_sealed(target) and counted == [gguf]


def test_a_directory_of_a_model_takes_its_gguf_as_a_donor(tmp_path):
    # GGUF keeps metadata in float32: an rms_norm_eps of 1e-5 comes back as 9.999999747e-06.
    gguf = write_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name).save_pretrained(base)
    tokens = torch.tensor([[5, 9, 30]])

    models = gl.load_models(base, gguf)

    with torch.no_grad():
        assert torch.allclose(models.base(tokens), models[1](tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("architecture", ["mamba9", 7], ids=["a name", "a number"])
def test_an_unknown_gguf_architecture_is_named_with_those_known(tmp_path, architecture):
    gguf = write_gguf(tiny_llama(), tmp_path / "odd.gguf", architecture)

    with pytest.raises(
        gl.errors.UnsupportedArchitectureError,
        match=rf"odd\.gguf is a GGUF of an unknown architecture \(general\.architecture = "
        rf"{architecture!r}.*; it reads .*gemma3, .*llama, .*Pass the model's checkpoint",
    ):
        gl.load_models(gguf, gguf)
