"""Whether checkpoints are aligned: the checks :func:`~grafting_lens.load_models` runs once,
and the one placement check every run repeats. A graft runs the donor's modules with
everything else the base's, so every donor must have the base's architecture, configuration,
tensors, buffers, vocabulary, dtypes and devices; an ``AlignmentError`` names the difference.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from transformer_lens.model_bridge import TransformerBridge

from grafting_lens.core.errors import AlignmentError, refuse_first
from grafting_lens.models.components import checkpoint_modules, checkpoint_parameters
from grafting_lens.models.sources import SafetensorsCheckpoint

IGNORED_CONFIG_FIELDS: frozenset[str] = frozenset(
    (
        # metadata; the architecture and dtypes are compared on the models and tensors
        "architectures transformers_version dtype torch_dtype name_or_path tokenizer_class "
        "prefix task_specific_params finetuning_task id2label label2id num_labels problem_type "
        # special token ids: the tokenizers' vocabularies are compared instead
        "bos_token_id eos_token_id pad_token_id sep_token_id unk_token_id decoder_start_token_id "
        # what a forward call returns or keeps, not what it computes (chunks: same numbers)
        "use_cache return_dict output_attentions output_hidden_states torchscript "
        "chunk_size_feed_forward "
        # training only: initialisation and dropout, inactive in eval mode
        "initializer_range initializer_factor gradient_checkpointing attention_dropout "
        "attn_pdrop embd_pdrop resid_pdrop hidden_dropout hidden_dropout_prob "
        "attention_probs_dropout_prob classifier_dropout dropout activation_dropout "
        "summary_first_dropout "
        # GPT-2's sequence-summary head, which a causal LM does not run
        "summary_type summary_use_proj summary_activation summary_proj_to_labels"
    ).split()
)
"""Hugging Face configuration fields that cannot change a causal LM's logits in eval mode, not
compared; every other field (nested ones too, ``rope_parameters.rope_theta``) must be equal."""


def check_alignment(base: TransformerBridge, other: TransformerBridge, label: str) -> None:
    """Refuse a donor loaded whole that is not the base's network (see the module docstring)."""
    config = other.original_model.config
    _refuse_first_problem(
        _check_architecture(base, config, label),
        _check_hf_config(base.original_model.config, config, label),
        _check_tensors(_shapes(base), _shapes(other), label),
        _placement_problem(base.original_model, other.original_model, label),
        _check_buffers(base, other, label),
    )
    check_vocabulary(base.tokenizer, other.tokenizer, label)


def _refuse_first_problem(*problems: str | None) -> None:
    """Refuse with the first of the checks' problems (each ``None`` when the check passes)."""
    refuse_first(AlignmentError, ((problem, problem or "") for problem in problems))


def check_lazy_alignment(
    base: TransformerBridge,
    files: SafetensorsCheckpoint,
    config: Any,
    label: str,
    dtype: torch.dtype | None,
) -> None:
    """:func:`check_alignment` for a checkpoint on disk: its config and its files' headers (a
    tensor transformers converts on load, such as experts stored apart, is missing)."""
    buffers = {p + name for p, m in checkpoint_modules(base.original_model) for name in m._buffers}
    # dtype= casts every tensor to the base's dtype; otherwise the files' must be the base's.
    found = {
        name: f"{files.shapes[name]}" + ("" if dtype else f" in {files.dtypes[name]}")
        for name in files.names()
        if name not in buffers
    }
    expected = {
        name: f"{tuple(p.shape)}" + ("" if dtype else f" in {p.dtype}")
        for name, p in checkpoint_parameters(base.original_model)
    }
    _refuse_first_problem(
        _check_architecture(base, config, label),
        _check_hf_config(base.original_model.config, config, label),
        _check_tensors(expected, found, label, lazy=True),
    )


def check_placement(base: nn.Module, other: nn.Module, label: str) -> None:
    """Refuse ``other`` unless its floating tensors share the base's dtypes and devices (a
    tensor the base lacks, such as a LoRA factor: one of its devices). The one placement
    check, on load and before every run
    (:meth:`~grafting_lens.models.model_set.ModelSet.check_placement`).

    Raises:
        AlignmentError: Naming the first tensor placed otherwise, and the fix.
    """
    _refuse_first_problem(_placement_problem(base, other, label))


def _placement_problem(base: nn.Module, other: nn.Module, label: str) -> str | None:
    mine = dict(_floating(base))
    devices = {tensor.device for tensor in mine.values()}
    for name, tensor in _floating(other):
        expected = mine.get(name)
        if expected is None:
            if tensor.device in devices:
                continue
            base_is = "on " + ", ".join(map(str, devices))
        elif (expected.dtype, expected.device) != (tensor.dtype, tensor.device):
            base_is = f"{expected.dtype} on {expected.device}"
        else:
            continue
        return (
            f"{label}'s {name} is {tensor.dtype} on {tensor.device}, the base's {base_is}: "
            "sources must share a dtype and a device. Cast and move them all with "
            "load_models(..., dtype=..., device=...), not one model after loading."
        )
    return None


def check_vocabulary(base_tokenizer: Any, other_tokenizer: Any, label: str) -> None:
    """Refuse a tokenizer whose vocabulary is not the base's, token for token."""
    if base_tokenizer is None or other_tokenizer is None or base_tokenizer is other_tokenizer:
        return
    mine, theirs = base_tokenizer.get_vocab(), other_tokenizer.get_vocab()
    if mine != theirs:
        differing = [t for t in sorted(mine, key=mine.__getitem__) if theirs.get(t) != mine[t]]
        token = (differing or sorted(theirs.keys() - mine.keys()))[0]
        raise AlignmentError(
            f"{label}'s vocabulary ({len(theirs)} tokens) is not the base's ({len(mine)}): "
            f"token {token!r} is {_id(mine, token)} in the base and {_id(theirs, token)} in "
            f"{label}. Graft checkpoints trained with one tokenizer."
        )


def _id(vocabulary: dict[str, int], token: str) -> str:
    return f"id {vocabulary[token]}" if token in vocabulary else "absent"


def _floating(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        if tensor.is_floating_point():
            yield name.replace("._original_component", ""), tensor


def _shapes(bridge: TransformerBridge) -> dict[str, str]:
    return {name: f"{tuple(p.shape)}" for name, p in checkpoint_parameters(bridge.original_model)}


def _check_architecture(base: TransformerBridge, config: Any, label: str) -> str | None:
    mine = str(getattr(base.cfg, "architecture", None))
    theirs = str((getattr(config, "architectures", None) or [None])[0])
    # TransformerLens spells a few names as their remote-code versions did (PhiMoE).
    same = mine.lower() == theirs.lower()
    return None if same else f"{label} is a {theirs}, the base is a {mine}."


def _check_tensors(
    expected: Mapping[str, Any], found: Mapping[str, Any], label: str, lazy: bool = False
) -> str | None:
    """Why a source's tensors are not the base's: one missing, extra or of other shape."""
    missing = sorted(expected.keys() - found.keys())
    extra = sorted(found.keys() - expected.keys())
    other = sorted(name for name in expected.keys() & found.keys() if expected[name] != found[name])
    if missing:
        detail = f"it holds no {missing[0]!r}, which the base has"
    elif extra:
        detail = f"it holds {extra[0]!r}, which the base lacks"
    elif other:
        detail = f"its {other[0]!r} is {found[other[0]]}, the base's {expected[other[0]]}"
    else:
        return None
    fix = "Graft checkpoints of one architecture and size"
    if lazy:
        fix += (
            "; read whole (lazy=False) a donor whose tensors transformers converts on load "
            "(experts stored apart), and pass dtype=... for one stored in another dtype"
        )
    return f"{label} does not hold the base's tensors: {detail}. {fix}."


def _check_hf_config(base_config: Any, other_config: Any, label: str) -> str | None:
    """The first configuration field that can change the forward pass and differs, in words.

    The HF configurations, not the bridge's: TransformerLens 4.3 reports ``rotary_base=10000``
    whatever ``rope_theta`` is."""
    mine, theirs = _forward_config(base_config), _forward_config(other_config)
    for field in sorted(set(mine) | set(theirs)):
        if not _same(mine.get(field), theirs.get(field)):
            return (
                f"{label}'s configuration has {field}={theirs.get(field)!r}, the base's {field}="
                f"{mine.get(field)!r}: a graft computes it the base's way for every source. Graft "
                "checkpoints of one configuration (or, if the difference is immaterial, give the "
                f"donor the base's {field}: in its config.json, or for a GGUF or hub id in "
                f"config.{field} of the model transformers loads, passed in memory)."
            )
    return None


def _same(mine: Any, theirs: Any) -> bool:
    """Equal; two floats also when equal in float32, the precision of a GGUF's metadata (which
    stores an ``rms_norm_eps`` of 1e-5 as 9.999999747e-06)."""
    if isinstance(mine, float) and isinstance(theirs, float):
        mine, theirs = np.float32(mine), np.float32(theirs)
    return bool(mine == theirs)


def _forward_config(config: Any) -> dict[str, Any]:
    """The configuration's fields, nested ones as ``a.b``, without the ignored ones."""
    flat: dict[str, Any] = {}

    def walk(values: dict[str, Any], prefix: str) -> None:
        for key, value in values.items():
            if key.startswith("_") or key in IGNORED_CONFIG_FIELDS:
                continue
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif value is not None:  # a missing field and None mean the same default
                # Tuples as lists: equal settings read from JSON or Python compare equal.
                flat[prefix + key] = list(value) if isinstance(value, tuple) else value

    walk(config.to_dict(), "")
    return flat


def _check_buffers(base: TransformerBridge, other: TransformerBridge, label: str) -> str | None:
    """Buffers (rotary frequencies...) derive from the configuration: equal, up to rounding."""
    mine, theirs = (
        {n.replace("._original_component", ""): b for n, b in bridge.original_model.named_buffers()}
        for bridge in (base, other)
    )
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name), theirs.get(name)
        if a is None or b is None or a.shape != b.shape or a.device != b.device or not _close(a, b):
            return (
                f"{label}'s buffer {name!r} is not the base's (a buffer derived from the "
                "configuration, such as rotary frequencies): the sources compute different "
                "functions. Graft checkpoints of one configuration."
            )
    return None


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or for floating buffers equal to bfloat16 rounding (a model cast to bfloat16 and
    back keeps rounded rotary frequencies; another configuration moves them by far more)."""
    if a.is_floating_point() and b.is_floating_point():
        return torch.allclose(a.float(), b.float(), rtol=1e-2, atol=0.0)
    return a.dtype == b.dtype and torch.equal(a, b)
