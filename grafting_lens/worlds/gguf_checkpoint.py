"""A GGUF file, or any Llama checkpoint, made into a ``save_pretrained`` directory once.

A real pretrained model can reach a machine without the Hugging Face hub as a single
GGUF file (llama.cpp's format, quantized): the real-model world's base
(:mod:`grafting_lens.worlds.smollm2`) arrives that way. transformers reads such a file
(``from_pretrained(dir, gguf_file=name)``, through the ``gguf`` package), dequantizing
every weight, but it does so on every load (about 30 s for SmolLM2-135M), its config
names no ``architectures`` (TransformerLens chooses its adapter by that field), and
grafting-lens's lazy donors and checkpoint digests expect a directory of safetensors.
So the file is converted once, here, into a plain checkpoint directory: float32
safetensors, the tokenizer, and a config naming its architecture. From then on every
part of grafting-lens reads it as it reads a hub model.

The same function takes a hub id or a ``save_pretrained`` directory instead of a GGUF
file (``HuggingFaceTB/SmolLM2-135M``, a local Llama): it is loaded the way transformers
loads it and saved the same way, so a world built on either stands on the same kind of
directory.

What is refused, before the slow load, with the file and the fix named
(:class:`~grafting_lens.core.errors.WorldSourceError`): a file that is not a GGUF, one whose
SHA-256 is not the expected one (a damaged download), and one of another architecture
than those allowed (the world's recipe and the lens's verified Llama path assume one).

The directory appears complete or not at all: it is written into a temporary sibling
and renamed into place, as :mod:`grafting_lens.worlds.toy` builds its worlds.

Examples:
    >>> from grafting_lens.worlds.gguf_checkpoint import convert_checkpoint
    >>> convert_checkpoint("model.Q4_1.gguf", "converted")  # doctest: +SKIP
    >>> import grafting_lens as gl
    >>> models = gl.load_models("converted", "converted")  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from grafting_lens.core.errors import WorldSourceError

__all__ = ["GGUF_MAGIC", "convert_checkpoint", "gguf_architecture", "sha256_of"]

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""


def sha256_of(path: Union[str, os.PathLike], chunk: int = 1 << 20) -> str:
    """SHA-256 of a file, read in chunks (a 100 MB file never sits in memory whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def gguf_architecture(path: Union[str, os.PathLike]) -> str:
    """The ``general.architecture`` of a GGUF file, read from its header alone.

    Raises:
        WorldSourceError: The file is missing, not a GGUF, or its header is unreadable.
    """
    path = Path(path)
    try:
        with open(path, "rb") as file:
            magic = file.read(4)
    except OSError as error:
        raise WorldSourceError(
            f"Cannot read {path} ({error}): pass the path of a GGUF file, or fetch it again."
        ) from error
    if magic != GGUF_MAGIC:
        raise WorldSourceError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}): the "
            "download is damaged or this is another kind of file. Delete it and fetch it again, "
            "or pass a hub id or a save_pretrained directory instead."
        )
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields["general.architecture"]
        return str(field.contents())
    except (KeyError, ValueError, IndexError) as error:
        raise WorldSourceError(
            f"{path} starts like a GGUF file but its header is unreadable ({error!r}): the file "
            "is truncated or damaged. Delete it and fetch it again."
        ) from error


def convert_checkpoint(
    source: Union[str, os.PathLike],
    target: Union[str, os.PathLike],
    *,
    gguf_file: Optional[str] = None,
    sha256: Optional[str] = None,
    architectures: Sequence[str] = ("llama",),
) -> Path:
    """Convert a GGUF file, a hub id or a checkpoint directory into a float32 checkpoint.

    Args:
        source: A ``.gguf`` file; a directory holding ``gguf_file``; or a hub id or
            ``save_pretrained`` directory of a model of one of ``architectures``.
        target: The directory to create (``save_pretrained`` layout: ``config.json``
            with ``architectures`` set, ``model.safetensors`` in float32, the tokenizer).
            Replaced if it exists.
        gguf_file: The GGUF file's name inside the directory ``source``.
        sha256: The GGUF file's expected SHA-256; ``None`` skips the check.
        architectures: The architectures accepted (``model_type`` / GGUF
            ``general.architecture``).

    Returns:
        ``target``.

    Raises:
        WorldSourceError: A GGUF that is not one, has another checksum, or another
            architecture; a checkpoint of another architecture.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(target).expanduser()
    gguf = _gguf_path(Path(source).expanduser(), gguf_file)
    if gguf is not None:
        if sha256 is not None:
            actual = sha256_of(gguf)
            if actual != sha256:
                raise WorldSourceError(
                    f"{gguf} has SHA-256 {actual}, not the expected {sha256}: the file is damaged "
                    "or is another release. Delete it and fetch it again."
                )
        architecture = gguf_architecture(gguf)
        _check_architecture(architecture, architectures, gguf)
        options: dict[str, Any] = {"gguf_file": gguf.name}
        location = str(gguf.parent)
    else:
        options, location = {}, str(source)
    tokenizer = AutoTokenizer.from_pretrained(location, **options)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **options)
    _check_architecture(model.config.model_type, architectures, source)
    if gguf is not None:
        model = _plain_copy(model)
    # TransformerLens picks its adapter by this field, which the GGUF loader leaves empty.
    model.config.architectures = [type(model).__name__]
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        partial.mkdir(parents=True)
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        replace_directory(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


def _plain_copy(model: Any) -> Any:
    """The same weights in a model transformers will save.

    A model loaded from a GGUF file stays marked as quantized (``hf_quantizer``,
    ``quantization_config``) although its weights are dequantized float32, and
    ``save_pretrained`` refuses it; a fresh model of the same config without that mark
    takes its weights.
    """
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.random.fork_rng(devices=[]):  # its random init is overwritten at once
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


def replace_directory(partial: Path, target: Path) -> None:
    """Rename a finished directory into place, replacing (then deleting) an old one."""
    stale = None
    if target.exists():
        stale = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex[:8]}")
        os.replace(target, stale)
    os.replace(partial, target)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def _gguf_path(source: Path, gguf_file: Optional[str]) -> Optional[Path]:
    """The GGUF file ``source`` (and ``gguf_file``) name, or ``None`` for a checkpoint."""
    if gguf_file is not None:
        return source / gguf_file
    if source.suffix.lower() == ".gguf" or (source.is_file() and not source.is_dir()):
        return source
    return None


def _check_architecture(found: str, allowed: Sequence[str], where: Any) -> None:
    if found not in allowed:
        raise WorldSourceError(
            f"{where} holds a {found!r} model, not one of {tuple(allowed)}: the real-model "
            "world's recipe is written for a Llama (SmolLM2). Pass a SmolLM2 or Llama checkpoint "
            "(e.g. HuggingFaceTB/SmolLM2-135M), or leave the source out to use the pinned one."
        )
