"""Whether checkpoints are aligned: the checks :func:`~grafting_lens.models.loading.load_models` runs once.

A graft runs the donor's modules inside the base's forward pass, and whatever lives
outside the grafted modules comes from the base: rotary frequencies (``rope_theta``,
``rope_scaling``, the rotary fraction), attention scaling and softcapping, sliding
windows, norm epsilons, activations. A donor that differs there would be grafted
silently wrong, so alignment is checked on load: the same architecture, the same shape,
dtype and device for every parameter, the same vocabulary, and the Hugging Face
configurations compared field by field, except fields that cannot change the forward
pass of a causal LM in eval mode (:data:`IGNORED_CONFIG_FIELDS`: metadata, special token
ids, dropout rates, initialisation, output flags). The buffers the models derive from
their configuration (rotary ``inv_freq``...) must be equal too. Anything else raises
:class:`~grafting_lens.core.errors.AlignmentError` naming the first difference, instead of a shape
mismatch deep inside torch in the middle of a sweep, or a wrong number.
"""

from __future__ import annotations

from typing import Any

import torch
from transformer_lens.model_bridge import TransformerBridge

from grafting_lens.core.errors import (
    AlignmentError,
)
from grafting_lens.models.components import (
    checkpoint_modules,
    checkpoint_parameters,
)
from grafting_lens.models.sources import (
    SafetensorsCheckpoint,
)

IGNORED_CONFIG_FIELDS: frozenset[str] = frozenset(
    {
        # metadata; the architecture and dtypes are compared on the bridges and parameters
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "name_or_path",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "finetuning_task",
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        # special token ids: the tokenizers' vocabularies are compared instead
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        # what a forward call returns or keeps, not what it computes
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
        "chunk_size_feed_forward",  # chunks the MLP, same numbers
        # training only: initialisation and dropout (inactive in eval mode)
        "initializer_range",
        "initializer_factor",
        "gradient_checkpointing",
        "attention_dropout",
        "attn_pdrop",
        "embd_pdrop",
        "resid_pdrop",
        "hidden_dropout",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "classifier_dropout",
        "dropout",
        "activation_dropout",
        "summary_first_dropout",
        # GPT-2's sequence-summary head, which a causal LM does not run
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
    }
)
"""Hugging Face configuration fields :func:`load_models` does not compare between sources.

Every other field, nested ones included (``rope_parameters.rope_theta``), must be
equal; fields starting with ``_`` (private metadata such as ``_name_or_path``) are
ignored too. A field listed here cannot change the logits of a causal LM in eval
mode. When a compared field differs in a way you know is
immaterial, set the donor's ``config`` field (or its ``config.json``) to the base's.
"""

# Configuration fields that change the computation without changing any shape.
_CONFIG_FIELDS = (
    "n_layers",
    "d_model",
    "n_heads",
    "d_head",
    "d_mlp",
    "d_vocab",
    "n_key_value_heads",
    "act_fn",
    "normalization_type",
    "positional_embedding_type",
    "rotary_dim",
    "rotary_base",
    "eps",
    "parallel_attn_mlp",
    "gated_mlp",
)


def _check_alignment(
    base: TransformerBridge, other: TransformerBridge, base_name: str, name: str, index: int
) -> None:
    label = f"source {index} ({name})"
    base_arch = getattr(base.cfg, "architecture", None)
    other_arch = getattr(other.cfg, "architecture", None)
    if base_arch != other_arch:
        raise AlignmentError(f"{label} is a {other_arch}, the base ({base_name}) is a {base_arch}.")
    if base.cfg.n_layers != other.cfg.n_layers:
        raise AlignmentError(
            f"{label} has {other.cfg.n_layers} layers, the base has {base.cfg.n_layers}."
        )
    for field in _CONFIG_FIELDS:
        mine, theirs = getattr(base.cfg, field, None), getattr(other.cfg, field, None)
        if mine != theirs:
            raise AlignmentError(f"{label} has {field}={theirs!r}, the base has {field}={mine!r}.")
    base_params = dict(checkpoint_parameters(base.original_model))
    other_params = dict(checkpoint_parameters(other.original_model))
    for param_name, param in base_params.items():
        if param_name not in other_params:
            raise AlignmentError(f"{label} has no parameter {param_name!r}, which the base has.")
        if other_params[param_name].shape != param.shape:
            raise AlignmentError(
                f"{label}'s {param_name!r} has shape {tuple(other_params[param_name].shape)}, "
                f"the base's has {tuple(param.shape)}."
            )
    extra = sorted(set(other_params) - set(base_params))
    if extra:
        raise AlignmentError(f"{label} has a parameter the base lacks: {extra[0]!r}.")
    _check_same_placement(base_params, other_params, label)
    _check_hf_config(base.original_model.config, other.original_model.config, label)
    _check_buffers(base, other, label)
    _check_vocabulary(base.tokenizer, other.tokenizer, label)


def _check_lazy_alignment(
    base: TransformerBridge,
    files: SafetensorsCheckpoint,
    config: Any,
    label: str,
    dtype: torch.dtype | None,
) -> None:
    """:func:`_check_alignment` for a checkpoint on disk: its config and its files' headers.

    The architecture and every configuration field that changes the forward pass
    (which also fixes the buffers a model derives from its configuration), every
    tensor's name and shape, and its dtype after the cast to ``dtype``.
    """
    base_architecture = getattr(base.cfg, "architecture", None)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    if architecture != base_architecture:
        raise AlignmentError(f"{label} is a {architecture}, the base is a {base_architecture}.")
    _check_hf_config(base.original_model.config, config, label)
    if files.converted:
        raise AlignmentError(
            f"transformers converts {label}'s {files.converted[0]!r} when it loads the "
            "checkpoint (an operation on values, such as fusing experts stored apart), so the "
            "donor cannot be read lazily, tensor by tensor: load it whole (lazy=False)."
        )
    original = base.original_model
    assert isinstance(original, torch.nn.Module)
    known = {
        prefix + name
        for prefix, module in checkpoint_modules(original)
        for table in (module._parameters, module._buffers)
        for name in table
    }
    for name, parameter in checkpoint_parameters(original):
        if name not in files.shapes:
            raise AlignmentError(
                f"{label}'s weight files hold no {name!r}, which the base has. If the files "
                "use other names that transformers converts when loading (some architectures' "
                "experts, checkpoints saved from another model class), the donor cannot be "
                "read lazily: load it whole (lazy=False)."
            )
        if files.shapes[name] != tuple(parameter.shape):
            raise AlignmentError(
                f"{label}'s {name!r} has shape {files.shapes[name]}, the base's has "
                f"{tuple(parameter.shape)}."
            )
        stored = dtype or files.dtypes[name]
        if stored != parameter.dtype:
            raise AlignmentError(
                f"{label}'s {name!r} is {stored}, the base's is {parameter.dtype}: a graft "
                "mixes the sources' outputs in one forward pass, so they must share a dtype. "
                "Pass dtype=... to load_models to cast every source."
            )
    extra = sorted(set(files.names()) - known)
    if extra:
        raise AlignmentError(f"{label} has a tensor the base lacks: {extra[0]!r}.")


def _check_same_placement(
    base_params: dict[str, torch.nn.Parameter],
    other_params: dict[str, torch.nn.Parameter],
    label: str,
) -> None:
    """Same dtype and device for every parameter: a graft mixes their outputs in one pass."""
    for param_name, param in base_params.items():
        other = other_params[param_name]
        if other.dtype != param.dtype:
            raise AlignmentError(
                f"{label}'s {param_name!r} is {other.dtype}, the base's is {param.dtype}: a graft "
                "mixes the sources' outputs in one forward pass, so they must share a dtype. "
                "Pass dtype=... to load_models to cast every source."
            )
        if other.device != param.device:
            raise AlignmentError(
                f"{label}'s {param_name!r} is on {other.device}, the base's on {param.device}: a "
                "graft runs every source on the base's activations, so they must share a "
                "device. Pass device=... to load_models to move every source."
            )


def _check_hf_config(base_config: Any, other_config: Any, label: str) -> None:
    """Every configuration field that can change the forward pass must be equal.

    TransformerLens's bridge config does not carry every such field (under
    TransformerLens 4.3 it reports ``rotary_base=10000`` whatever ``rope_theta``
    is), so the Hugging Face configurations are compared instead.
    """
    mine = _forward_config(base_config)
    theirs = _forward_config(other_config)
    for field in sorted(set(mine) | set(theirs)):
        a, b = mine.get(field), theirs.get(field)
        if a != b:
            raise AlignmentError(
                f"{label}'s configuration has {field}={b!r}, the base's has {field}={a!r}. "
                "It changes what the model computes without changing a parameter's shape, and "
                "a graft computes it the base's way for every source, so the result would be "
                "neither model. Graft checkpoints of one configuration; if you know this "
                f"difference is immaterial, set the donor's config.{field} to the base's value."
            )


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
                flat[prefix + key] = _plain(value)

    walk(config.to_dict(), "")
    return flat


def _plain(value: Any) -> Any:
    """Tuples as lists, so that equal settings read from JSON or Python compare equal."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _check_buffers(base: TransformerBridge, other: TransformerBridge, label: str) -> None:
    """Buffers (rotary frequencies, causal masks) derive from the configuration: equal or refused."""
    base_buffers, other_buffers = _checkpoint_buffers(base), _checkpoint_buffers(other)
    for name in sorted(set(base_buffers) | set(other_buffers)):
        a, b = base_buffers.get(name), other_buffers.get(name)
        if a is None or b is None:
            which = "the base" if a is None else label
            raise AlignmentError(f"{which} lacks the buffer {name!r} that the other source has.")
        if a.shape != b.shape or a.device != b.device or not _close(a, b):
            raise AlignmentError(
                f"{label}'s buffer {name!r} differs from the base's by more than rounding (a "
                "buffer derived from the configuration, e.g. rotary frequencies): the sources "
                "do not compute the same function, and a graft would use the base's buffer for "
                "every source."
            )


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or for floating buffers equal to bfloat16 rounding.

    A model cast to bfloat16 and back keeps rounded rotary frequencies; that is
    not another configuration. Another ``rope_theta`` or scaling factor moves
    them by far more than 1%.
    """
    if a.is_floating_point() and b.is_floating_point():
        return torch.allclose(a.float(), b.float(), rtol=1e-2, atol=0.0)
    return a.dtype == b.dtype and torch.equal(a, b)


def _checkpoint_buffers(bridge: TransformerBridge) -> dict[str, torch.Tensor]:
    return {
        name.replace("._original_component", ""): buffer
        for name, buffer in bridge.original_model.named_buffers()
    }


def _check_vocabulary(base_tokenizer: Any, other_tokenizer: Any, label: str) -> None:
    if base_tokenizer is None or other_tokenizer is None or base_tokenizer is other_tokenizer:
        return
    base_vocab, other_vocab = base_tokenizer.get_vocab(), other_tokenizer.get_vocab()
    if base_vocab == other_vocab:
        return
    if len(base_vocab) != len(other_vocab):
        raise AlignmentError(
            f"{label}'s tokenizer has {len(other_vocab)} tokens, the base's has {len(base_vocab)}."
        )
    for token, token_id in sorted(base_vocab.items(), key=lambda item: item[1]):
        if other_vocab.get(token) != token_id:
            raise AlignmentError(
                f"{label}'s vocabulary differs from the base's: token {token!r} is id "
                f"{token_id} in the base and {other_vocab.get(token)} in {label}."
            )


def _placement(bridge: TransformerBridge) -> frozenset[tuple[torch.dtype, torch.device]]:
    """The (dtype, device) pairs of a model's floating parameters (a model kept partly in
    float32, its norms say, has two)."""
    return frozenset(
        (parameter.dtype, parameter.device)
        for parameter in bridge.parameters()
        if parameter.is_floating_point()
    )
