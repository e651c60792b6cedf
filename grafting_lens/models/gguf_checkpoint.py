"""A GGUF file, or any checkpoint, made into a ``save_pretrained`` directory once.

transformers dequantizes a GGUF on every load and leaves ``architectures`` empty, so it is
converted once into float32 safetensors, cached by content (:func:`converted_checkpoint`).
What is refused and why: the how-to "Load your own checkpoints" and the
:class:`~grafting_lens.core.errors.WorldSourceError` page.

Examples:
    >>> from grafting_lens.models.gguf_checkpoint import convert_checkpoint
    >>> convert_checkpoint("model.Q4_1.gguf", "converted")  # doctest: +SKIP
    >>> import grafting_lens as gl
    >>> models = gl.load_models("model.Q4_1.gguf", "donor")  # converted once, cached  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from grafting_lens.core.directories import (
    cache_errors,
    cache_location,
    check_apart,
    check_cache_dir,
    check_replaceable,
    is_sealed,
    make_directory,
    remove_abandoned,
    replace_directory,
    seal,
    sibling,
    waiting_lock,
)
from grafting_lens.core.errors import UnsupportedArchitectureError, WorldSourceError
from grafting_lens.core.files import cache_root

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""

TOKENIZER_FIELDS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")
"""The metadata without which a GGUF carries no tokenizer."""


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
        UnsupportedArchitectureError: An architecture transformers cannot read from GGUF.
    """
    path = Path(path)
    try:
        with open(path, "rb") as file:
            magic: bytes | OSError = file.read(4)
    except OSError as error:
        magic = error
    if magic != GGUF_MAGIC:
        raise WorldSourceError(
            f"Cannot read {path} ({magic}): pass the path of a GGUF file, or fetch it again."
            if isinstance(magic, OSError)
            else f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}): "
            "the download is damaged or this is another kind of file. Delete it and fetch it "
            "again, or pass a hub id or a save_pretrained directory instead."
        )
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        architecture = GGUFReader(path).fields["general.architecture"].contents()
    except (KeyError, ValueError, IndexError) as error:
        raise WorldSourceError(
            f"{path} starts like a GGUF file but its header is unreadable ({error!r}): the file "
            "is truncated or damaged. Delete it and fetch it again."
        ) from error
    known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
    # transformers' own spellings of llama.cpp's names (qwen2moe, gpt-oss, minimax-m2)
    spelled = re.sub(r"(?<=\d)moe$", "_moe", str(architecture).replace("-", "_"))
    if not isinstance(architecture, str) or spelled not in known:
        kind = "" if isinstance(architecture, str) else ", not a name"
        raise UnsupportedArchitectureError(
            f"{path} is a GGUF of an unknown architecture (general.architecture = "
            f"{architecture!r}{kind}), which transformers cannot read from a GGUF file; it "
            f"reads {', '.join(known)}. Pass the model's checkpoint directory or hub id "
            "instead, or a GGUF of one of those."
        )
    return architecture


def convert_checkpoint(
    source: Union[str, os.PathLike],
    target: Union[str, os.PathLike],
    *,
    gguf_file: Optional[str] = None,
    sha256: Optional[str] = None,
    architectures: Optional[Sequence[str]] = None,
) -> Path:
    """Convert a GGUF file, a hub id or a checkpoint directory into a float32 checkpoint.

    Every parameter must come from the source: a tensor missing, misshapen or beyond the
    declared blocks is refused by name, not left random. The source is never changed.

    Args:
        source: A ``.gguf`` file; a directory holding ``gguf_file``; or a hub id or
            ``save_pretrained`` directory of a model of one of ``architectures``.
        target: The directory to create (``save_pretrained`` layout, ``architectures``
            set), absent, empty or an earlier conversion (replaced); not the source's.
        gguf_file: The GGUF file's name inside the directory ``source``.
        sha256: The GGUF file's expected SHA-256 (hex, any case); ``None`` skips the check.
        architectures: The architectures accepted (``model_type`` / GGUF
            ``general.architecture``); ``None`` accepts any that transformers loads.

    Returns:
        ``target``.

    Raises:
        WorldSourceError: A damaged or foreign file, missing or misshapen weights, no
            tokenizer, another architecture, or a hub id that cannot be loaded.
        UnsupportedArchitectureError: A GGUF of an architecture transformers cannot read.
        WorldCacheError: A target that is, holds or lies in the source, or holds others' files.
    """
    from transformers import AutoModelForCausalLM

    expected = _checked_sha256(sha256)
    target = Path(target).expanduser()
    if gguf_file is None:  # transformers would say "Should have a `model_type` key"
        _check_checkpoint(source)
    path = Path(source).expanduser()
    gguf = path / gguf_file if gguf_file is not None else None
    if gguf is None and (path.suffix.lower() == ".gguf" or path.is_file()):
        gguf = path
    check_apart(gguf if gguf is not None else source, target)
    check_replaceable(target, "The target")
    if gguf is not None:
        actual = None if expected is None else sha256_of(gguf)
        if actual != expected:
            raise WorldSourceError(
                f"{gguf} has SHA-256 {actual}, not the expected {expected}: the file is "
                "damaged or is another release. Delete it and fetch it again."
            )
        _check_architecture(gguf_architecture(gguf), architectures, gguf)
        options: dict[str, Any] = {"gguf_file": gguf.name}
        location, named = str(gguf.parent), str(gguf)
    else:
        options, location, named = {}, str(source), str(source)
    tokenizer = _tokenizer(location, options, named)
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            location,
            dtype=torch.float32,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below, naming the tensor
            **options,
        )
        model, info = loaded
    except OSError as error:
        raise WorldSourceError(
            f"Cannot load {named} ({str(error).splitlines()[0]}): pass a GGUF file, a "
            "save_pretrained directory, or a hub id this machine can reach (offline: one in "
            "the Hugging Face cache)."
        ) from None
    _check_architecture(model.config.model_type, architectures, source)
    _check_complete(model, info, named, gguf)
    if gguf is not None:
        model = _plain_copy(model)
    # TransformerLens picks its adapter by this field, which the GGUF loader leaves empty.
    model.config.architectures = [type(model).__name__]
    partial = make_directory(sibling(target))
    try:
        with cache_errors("The target", target):
            model.save_pretrained(partial, safe_serialization=True)
            tokenizer.save_pretrained(partial)
        seal(partial)
        replace_directory(partial, target, "The target")
    finally:  # gone once renamed into place; what a failure left
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _checked_sha256(sha256: Optional[str]) -> Optional[str]:
    """The expected SHA-256 in lower case; a value that is not one is refused."""
    if sha256 is None:
        return None
    if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
        raise WorldSourceError(
            f"sha256={sha256!r} is not a SHA-256 (64 hexadecimal digits): pass the file's "
            "checksum as sha256sum prints it, or None to skip the check."
        )
    return sha256.lower()


def _tokenizer(location: str, options: dict[str, Any], named: str) -> Any:
    """The source's tokenizer; one missing, or one transformers cannot build, is refused by name."""
    from transformers import AutoTokenizer

    lacking: list[str] = []
    if "gguf_file" in options:
        from gguf import GGUFReader

        fields = GGUFReader(Path(location) / options["gguf_file"]).fields
        lacking = [k for k in TOKENIZER_FIELDS if k not in fields]
    if not lacking:
        try:
            return AutoTokenizer.from_pretrained(location, **options)
        except (OSError, ValueError, KeyError) as error:
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
    raise WorldSourceError(
        f"{named} holds no tokenizer (its metadata lacks {', '.join(lacking)}): the file was "
        "written without one. Use a GGUF converted with its tokenizer."
        if lacking
        else f"Cannot load the tokenizer of {named} ({first}): pass a GGUF file with its "
        "tokenizer, a save_pretrained directory with its tokenizer, or a hub id this machine "
        "can reach."
    ) from None


def _check_complete(model: Any, info: dict[str, Any], named: str, gguf: Optional[Path]) -> None:
    """Refuse a model whose parameters did not all come from the source, naming the tensors:
    transformers fills them randomly, in a report TransformerLens's logging hides."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    beyond: list[str] = []
    layers = model.config.num_hidden_layers if gguf is not None else 0
    if gguf is not None and not (missing or mismatched):
        from gguf import GGUFReader

        beyond = sorted(
            tensor.name
            for tensor in GGUFReader(gguf).tensors
            if (block := re.match(r"blk\.(\d+)\.", tensor.name)) and int(block[1]) >= layers
        )
    if mismatched:
        name, found, wanted = mismatched[0]
        problem = (
            f"{named}: the tensor for {name} has shape {tuple(found)}, the model's is "
            f"{tuple(wanted)} ({len(mismatched)} such tensors): the file is damaged or its "
            "header does not describe its tensors. Fetch it again."
        )
    elif missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        problem = (
            f"{named} lacks {len(missing)} of the model's weights ({', '.join(missing[:3])}"
            f"{more}): the file is truncated, or declares more layers than it holds. Fetch it "
            "again."
        )
    elif beyond:
        problem = (
            f"{gguf} holds {len(beyond)} tensors of blocks beyond the {layers} its header "
            f"declares (e.g. {beyond[0]}): the header is damaged. Fetch the file again."
        )
    else:
        return
    raise WorldSourceError(problem)


def _plain_copy(model: Any) -> Any:
    """The same weights in a fresh model transformers will save: one loaded from a GGUF stays
    marked as quantized although dequantized, and ``save_pretrained`` refuses it."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.random.fork_rng(devices=[]):  # its random init is overwritten at once
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


def _check_architecture(found: str, allowed: Optional[Sequence[str]], where: Any) -> None:
    if allowed is not None and found not in allowed:
        raise WorldSourceError(
            f"{where} holds a {found!r} model, not one of {tuple(allowed)}: pass a checkpoint of "
            "one of those, or widen architectures= to one the bridge supports."
        )


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
"""Files that hold weights but not the config a model is built from."""

CHECKPOINT_FIX = (
    "Give the directory save_pretrained wrote (with its config.json), a .gguf file, or a hub id."
)
"""What every door that takes a checkpoint path takes, in one sentence."""


def is_gguf(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a file named ``*.gguf`` or starting with the GGUF magic."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


def checkpoint_problem(path: Union[str, os.PathLike]) -> Optional[str]:
    """Why the local ``path`` is not a checkpoint (every door says it so, then
    :data:`CHECKPOINT_FIX`), or ``None`` for a checkpoint, a GGUF file or a hub id."""
    path = Path(path).expanduser()
    if not path.exists() or is_gguf(path) or (path / "config.json").is_file():
        return None
    if path.is_dir():
        held = sorted(child.name for child in path.iterdir())
        gguf = [name for name in held if name.lower().endswith(".gguf")]
        if gguf:
            return f"a directory without a config.json; it holds {gguf[0]}: pass that file itself"
        return f"a directory without a config.json (it holds {held[:8] or 'nothing'})"
    if path.suffix.lower() in WEIGHT_SUFFIXES:
        return (
            f"a {path.suffix} weight file alone: a model is built from its config.json, which "
            "save_pretrained writes beside the weights"
        )
    return "a file that is neither a checkpoint directory nor a GGUF file"


def _check_checkpoint(source: Union[str, os.PathLike]) -> None:
    """Refuse a local path that is no checkpoint (:func:`checkpoint_problem`)."""
    problem = checkpoint_problem(source)
    if problem is not None:
        raise WorldSourceError(f"{source} is {problem}. {CHECKPOINT_FIX}")


def conversion_cache() -> Path:
    """Where converted checkpoints are cached: ``<cache root>/worlds``, shared with the
    real-model worlds (whose bases are converted checkpoints) and their fetched files."""
    return cache_root() / "worlds"


def checkpoint_key(source: Union[str, os.PathLike]) -> str:
    """What names a converted checkpoint in the cache: a hash of its content (a GGUF file's
    SHA-256, :func:`directory_digest` of a directory or a hub id's snapshot), never its path.

    Raises:
        WorldSourceError: A path that is no checkpoint, or a hub id that cannot be resolved
            (offline and not cached).
    """
    return _located(source)[1]


def converted_checkpoint(
    source: Union[str, os.PathLike, Callable[[], Path]],
    *,
    cache_dir: Union[str, os.PathLike, None] = None,
    key: Optional[str] = None,
    sha256: Optional[str] = None,
    architectures: Optional[Sequence[str]] = None,
) -> Path:
    """``source`` as a float32 checkpoint directory, converted once and cached by content.

    Two processes converting one source take turns; a cached conversion is read even from a
    read-only cache; what a killed conversion left is removed.

    Args:
        source: A GGUF file, a ``save_pretrained`` directory or a hub id; or a function
            that fetches a GGUF file, called only when ``key`` is not converted yet.
        cache_dir: The cache (default :func:`conversion_cache`).
        key: The content key, required with a function (default :func:`checkpoint_key`).
        sha256: As :func:`convert_checkpoint` takes it.
        architectures: As :func:`convert_checkpoint` takes them.

    Returns:
        ``<cache_dir>/base-<key>``, as :func:`convert_checkpoint` writes it.

    Raises:
        WorldSourceError: See :func:`convert_checkpoint` and :func:`checkpoint_key`.
        WorldCacheError: The cache cannot be written, and ``key`` is not converted yet.
    """
    root = cache_location(cache_dir, conversion_cache)
    location: Any = source
    if key is None:
        location, key = _located(source)  # type: ignore[arg-type]  # a path when no key
    target = root / f"base-{key}"
    # Renamed into place when complete: read without the lock (a read-only cache has none).
    if is_sealed(target):
        return target
    named = f"base-{key}" if callable(source) else Path(source).name
    check_cache_dir(root, f"The cache directory, where {named} is to be converted,")
    with waiting_lock(root / f".base-{key}.lock"):
        if is_sealed(target):
            return target
        remove_abandoned(target)  # every writer of target holds this lock: they are no one's
        if callable(location):
            location = location()
        return convert_checkpoint(location, target, sha256=sha256, architectures=architectures)


def _located(source: Union[str, os.PathLike]) -> tuple[Path, str]:
    """``(where to read the checkpoint, its content key)``."""
    path = Path(source).expanduser()
    _check_checkpoint(source)
    if not path.exists():
        path = _hub_snapshot(str(source))
    return path, (sha256_of(path) if path.is_file() else directory_digest(path))[:16]


def directory_digest(directory: Union[str, os.PathLike]) -> str:
    """SHA-256 over every file of ``directory`` (its relative path and its content's SHA-256),
    hidden ones (a lock, the marker, the Hugging Face cache's ``.cache``) left out."""
    directory = Path(directory)
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if not path.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        digest.update(f"{relative.as_posix()}\0{sha256_of(path)}\n".encode())
    return digest.hexdigest()


def _hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of a hub id (downloaded if the hub is reachable)."""
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:  # noqa: BLE001, offline, no such repo, an invalid name: one answer
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise WorldSourceError(
            f"{repo_id!r} is neither a file, nor a directory, nor a hub id this machine can "
            f"reach ({first}). Pass a GGUF file or a checkpoint directory, or fetch the model "
            "where the hub is reachable (HF_HUB_OFFLINE=1 forbids downloads)."
        ) from None
