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
