"""LoRA adapters as donors: the base's weights and the adapter's factors, never a merged copy.

Most finetunes people study today are LoRA adapters (PEFT's ``save_pretrained``
directory: ``adapter_config.json`` and ``adapter_model.safetensors``). A LoRA adapter
adds, to a linear layer ``W`` of the base, a product of two thin matrices:
``y = W x + B A x * scale``, with ``A`` of shape ``[r, d_in]``, ``B`` of shape
``[d_out, r]`` and ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA).
Merging it (``W + B A * scale``) would make a second full model; grafting does not
need one. At a grafted position, the adapted component computes ``W x + B A x *
scale`` from the base's own weight and the factors; a component the adapter does
not touch is the base's module itself, so grafting it from the adapter changes
nothing.

How an adapter maps onto components
-----------------------------------
PEFT names the modules it adapts by their place in the Hugging Face model
(``model.layers.3.self_attn.q_proj``); the bridge names components (``q`` at layer
3). Each adapted module is found in the base by name and then, by identity, in the
bridge tree:

* a module that is a component's module (Llama's ``q_proj`` is ``q``) is replaced
  by its LoRA form;
* a fused projection the bridge splits (GPT-2's ``c_attn``, which PEFT adapts whole
  while the bridge computes Q, K and V apart) gives each split module the rows of
  ``B`` that produce its outputs. Which rows those are is read off the bridge's own
  split function, run once on a matrix whose entries are their row numbers, and
  checked against the base's split modules;
* a module inside a component's module (one expert's projection inside ``experts``)
  is replaced inside a copy of that module.

An adapted embedding (``lora_embedding_A``/``lora_embedding_B``) adds ``B A`` rows to
the lookup, scaled like the base's lookup (Gemma's ``sqrt(d_model)``) as PEFT does.
``modules_to_save`` (whole modules trained and saved with the adapter, often the
unembedding) replace the parameters of those modules only: PEFT trains a copy of
each, so on a model whose unembedding is tied to the embedding a saved ``lm_head``
changes the unembedding and leaves the lookup as the base's. Dropout is never
applied: a graft computes the model in eval mode. Anything else an adapter can be
(DoRA, LoRA biases, other PEFT methods) is refused with :class:`~grafting_lens.AdapterError`
naming it; merge such an adapter into a full checkpoint and load that.

An adapter is grafted only where PEFT computes ``W x + B A x * scale`` on the base's
own ``W``. Initialisations that rewrite ``W`` when PEFT creates or loads the adapter
(PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA: ``W`` minus the initial factors' product) are
refused, with PEFT's conversion to plain LoRA as the fix; so is a config whose rank
disagrees with the saved factors (PEFT refuses to load it, and the scale
``lora_alpha / r`` would be taken from the wrong ``r``), and a weights file without
tensors (PEFT would leave the factors as initialised). Files written from a PEFT
model's own ``state_dict`` name every tensor with the adapter's name
(``lora_A.default.weight``); they are read without it.

An adapter whose module names or shapes do not match the base was made for another
model, and is refused with :class:`~grafting_lens.AdapterError` (an
:class:`~grafting_lens.AlignmentError`).

Tied embeddings stay as PEFT computes them: an adapted ``embed`` changes the lookup,
not the unembedding (PEFT's ``merge_and_unload`` would change both, through the one
shared matrix).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError  # type: ignore[attr-defined, unused-ignore]
from safetensors.torch import load_file
from torch import nn
from transformer_lens.model_bridge import TransformerBridge
from transformers.pytorch_utils import Conv1D

from grafting_lens.components import (
    FusedProjection,
    Slot,
    checkpoint_modules,
    checkpoint_parameters,
    fused_projections,
)
from grafting_lens.errors import AdapterError, unsafe_pickle
from grafting_lens.sources import (
    CheckpointSource,
    Source,
    structural_copy,
    weights_fingerprint,
)

__all__ = [
    "LoraAdapter",
    "LoraEmbedding",
    "LoraLinear",
    "LoraSource",
    "is_adapter_directory",
    "is_peft_model",
]

# Settings of a PEFT LoRA config under which a module computes something other than
# W x + B A x * scale (or which grafting-lens has not verified), with what they are.
_REFUSED_SETTINGS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "a bias on LoRA's B (lora_bias=True)",
    "target_parameters": "LoRA of raw parameters (target_parameters), such as fused experts",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens), which depends on "
    "where invocation tokens occur",
    "arrow_config": "Arrow routing between adapters",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "BD-LoRA",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "ensure_weight_tying": "tied modules_to_save (ensure_weight_tying=True)",
}

# Values of init_lora_weights under which PEFT leaves the base's weights as they are
# when it creates (or loads) the adapter: the trained model is W x + B A x * scale on
# the base's own W. Every other value rewrites W (see _REWRITING_INITS), or is one
# grafting-lens does not know, and is refused.
_PLAIN_INITS = frozenset({"true", "false", "none", "gaussian", "eva", "orthogonal", "mica"})

# Initialisations that subtract the initial factors' product from the base's weight
# (or quantize it) when PEFT creates the adapter, and again when it loads one.
_REWRITING_INITS = {
    "pissa": "PiSSA",
    "olora": "OLoRA",
    "corda": "CorDA",
    "loftq": "LoftQ",
    "lora_ga": "LoRA-GA",
}

_PREFIX = "base_model.model."

# PEFT names a factor with the adapter's name inside a model (lora_A.default.weight)
# and without it in the files save_pretrained writes (lora_A.weight). A file written
# from the model's own state_dict keeps the name.
_NAMED_KEYS = (
    re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.(?P<adapter>[^.]+)\.weight$"),
    re.compile(
        r"^(?P<module>.+)\.(?P<part>lora_embedding_A|lora_embedding_B)\.(?P<adapter>[^.]+)$"
    ),
    re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<part>.+)$"),
)

_RESAVE = "Save the adapter again with PEFT (peft_model.save_pretrained(dir))."


def is_adapter_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a PEFT adapter directory (it holds ``adapter_config.json``)."""
    return (Path(path).expanduser() / "adapter_config.json").is_file()


def is_peft_model(source: object) -> bool:
    """Whether ``source`` is a PEFT model object (``PeftModel``...), without importing PEFT."""
    return type(source).__module__.startswith("peft.") and hasattr(source, "peft_config")


@dataclass
class LoraAdapter:
    """A LoRA adapter's settings and tensors, read from a PEFT directory or PEFT model.

    Attributes:
        label: Where it came from (the directory's name, or ``"peft model"``).
        config: PEFT's ``LoraConfig`` as a dictionary (``adapter_config.json``).
        tensors: Its tensors, named as PEFT saves them without the
            ``base_model.model.`` prefix (``model.layers.0.self_attn.q_proj.lora_A.weight``);
            names that carry the adapter's name (``lora_A.default.weight``, as in a
            PEFT model's own ``state_dict``) are read without it.
        saved_modules: Modules the file holds whole under PEFT's ``modules_to_save``
            form (``lm_head.modules_to_save.default.weight``), besides those the
            config's ``modules_to_save`` names.
    """

    label: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(repr=False)
    saved_modules: frozenset[str] = frozenset()

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> LoraAdapter:
        """Read ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``).

        Raises:
            AdapterError: A config or weights file that cannot be read (naming the
                file), no adapter weights beside the config, a weights file with no
                tensors, or not a plain LoRA adapter.
        """
        path = Path(path).expanduser()
        config = _read_config(path / "adapter_config.json")
        safetensors_file = path / "adapter_model.safetensors"
        bin_file = path / "adapter_model.bin"
        if safetensors_file.is_file():
            tensors = _read_weights(safetensors_file)
        elif bin_file.is_file():
            tensors = _read_weights(bin_file)
        else:
            dangling = [f.name for f in (safetensors_file, bin_file) if f.is_symlink()]
            raise AdapterError(
                f"{str(path)!r} has an adapter_config.json but no adapter_model.safetensors "
                "(or .bin) beside it"
                + (f" ({dangling[0]} is a link to a file that does not exist)" if dangling else "")
                + ". Point to the directory PEFT's save_pretrained wrote."
            )
        file = safetensors_file if safetensors_file.is_file() else bin_file
        if not tensors:
            raise AdapterError(
                f"{file} holds no tensors, so as a donor it would be the base itself (PEFT "
                "would leave the adapter's factors as initialised): the adapter was not saved "
                f"whole. {_RESAVE}"
            )
        named, saved = _without_adapter_names(tensors, str(file))
        adapter = cls(path.name, config, named, saved)
        adapter.check_supported()
        return adapter

    @classmethod
    def from_peft_model(cls, model: Any) -> LoraAdapter:
        """The active adapter of a PEFT model (its factors copied, as they are now).

        Raises:
            AdapterError: Several active adapters, or not a plain LoRA adapter.
        """
        from peft import get_peft_model_state_dict  # the caller has PEFT: it made the model

        active = model.active_adapter
        if not isinstance(active, str):
            if len(active) != 1:
                raise AdapterError(
                    f"The PEFT model has {len(active)} active adapters ({list(active)}); a "
                    "donor is one adapter. Call model.set_adapter(name) first."
                )
            active = active[0]
        config = model.peft_config[active].to_dict()
        state = get_peft_model_state_dict(model, adapter_name=active)
        tensors = {name: tensor.detach().clone() for name, tensor in state.items()}
        label = f"peft model ({active})"
        named, saved = _without_adapter_names(tensors, label)
        adapter = cls(label, config, named, saved)
        adapter.check_supported()
        return adapter

    def check_supported(self) -> None:
        """Refuse what grafting-lens does not compute, or what PEFT would not load.

        Other PEFT methods, LoRA variants, initialisations that rewrite the base's
        weights (PiSSA, OLoRA...), and settings PEFT refuses (a rank or alpha that is
        not a number, a rank below 1).

        Raises:
            AdapterError: Naming the method or setting, and the fix (merge the
                adapter into a full checkpoint and load that, or save it again).
        """
        merge = (
            "Merge it into a full checkpoint instead (model = peft_model.merge_and_unload(); "
            "model.save_pretrained(dir)) and load that directory as the donor."
        )
        raw_type = self.config.get("peft_type")
        if raw_type is None:
            raise AdapterError(
                f"The adapter {self.label}'s config has no peft_type, so it does not say what "
                "kind of adapter it is (PEFT's save_pretrained always writes one, e.g. "
                '"peft_type": "LORA"). ' + _RESAVE
            )
        peft_type = str(getattr(raw_type, "value", raw_type))
        if peft_type.upper() != "LORA":
            raise AdapterError(
                f"The adapter {self.label} is a {peft_type} adapter; grafting-lens computes "
                f"LoRA adapters only. {merge}"
            )
        for setting, what in _REFUSED_SETTINGS.items():
            if self.config.get(setting):
                raise AdapterError(
                    f"The adapter {self.label} uses {what}; grafting-lens computes plain LoRA "
                    f"(W x + B A x * scale) only. {merge}"
                )
        if self.config.get("bias", "none") != "none":
            raise AdapterError(
                f"The adapter {self.label} trained biases (bias={self.config['bias']!r}); "
                f"grafting-lens computes LoRA with the base's biases only. {merge}"
            )
        self._check_initialisation(merge)
        self._check_numbers()

    def _check_initialisation(self, merge: str) -> None:
        init = self.config.get("init_lora_weights", True)
        if str(init).lower() in _PLAIN_INITS:
            return
        key = str(init).lower()
        known = next(
            (name for prefix, name in _REWRITING_INITS.items() if key.startswith(prefix)), None
        )
        if known is None:
            raise AdapterError(
                f"The adapter {self.label} was initialised with init_lora_weights={init!r}, an "
                "initialisation grafting-lens does not know, so it cannot tell whether PEFT "
                "rewrites the base's weights when it loads the adapter. " + merge
            )
        raise AdapterError(
            f"The adapter {self.label} was initialised with init_lora_weights={init!r} "
            f"({known}), which rewrites the base's weights when PEFT creates or loads it (W "
            "becomes W minus the initial factors' product), so the trained model is not "
            "W x + B A x * scale on this base's own weights. Save it converted to plain LoRA "
            "(peft_model.save_pretrained(dir, path_initial_model_for_weight_conversion="
            "<the adapter saved before training>)) and load that directory, or "
            + merge[0].lower()
            + merge[1:]
        )

    def _check_numbers(self) -> None:
        def number(value: Any) -> bool:
            return (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )

        def rank(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        fix = (
            "Set it as it was when the adapter was trained, or " + _RESAVE[0].lower() + _RESAVE[1:]
        )
        if not rank(self.config.get("r", 8)):
            raise AdapterError(
                f"The adapter {self.label} has r={self.config['r']!r}; a LoRA rank is an "
                f"integer >= 1 (PEFT refuses anything else). {fix}"
            )
        if not number(self.config.get("lora_alpha", 8)):
            raise AdapterError(
                f"The adapter {self.label} has lora_alpha={self.config['lora_alpha']!r}; the LoRA "
                f"scale is lora_alpha / r, so lora_alpha must be a finite number. {fix}"
            )
        for setting, valid, what in (
            ("rank_pattern", rank, "ranks (integers >= 1)"),
            ("alpha_pattern", number, "alphas (finite numbers)"),
        ):
            pattern = self.config.get(setting) or {}
            if not isinstance(pattern, dict):
                raise AdapterError(
                    f"The adapter {self.label} has {setting}={pattern!r}; it must map module "
                    f"names to {what}. {fix}"
                )
            for key, value in pattern.items():
                try:
                    re.compile(str(key))
                except re.error as error:
                    raise AdapterError(
                        f"The adapter {self.label}'s {setting} key {key!r} is not a regular "
                        f"expression ({error}); PEFT matches module names with it. {fix}"
                    ) from None
                if not valid(value):
                    raise AdapterError(
                        f"The adapter {self.label}'s {setting} gives {key!r} the value "
                        f"{value!r}; it must map module names to {what}. {fix}"
                    )

    def rank(self, module: str) -> int:
        """The rank PEFT gives ``module``: its ``rank_pattern`` entry, else ``r``.

        Keys are matched as PEFT matches them: a key matches a module name that ends
        with it after a dot.
        """
        return int(_pattern_value(self.config.get("rank_pattern"), module, self.config.get("r", 8)))

    def scale(self, module: str, rank: int) -> float:
        """``lora_alpha / r`` for ``module`` (``lora_alpha / sqrt(r)`` with rsLoRA).

        Per-module alphas (``alpha_pattern``) are matched as PEFT matches them: a key
        matches a module name that ends with it after a dot.
        """
        alpha = float(
            _pattern_value(
                self.config.get("alpha_pattern"), module, self.config.get("lora_alpha", 8)
            )
        )
        if self.config.get("use_rslora"):
            return alpha / math.sqrt(rank)
        return alpha / rank

    def saved_whole(self, module: str) -> bool:
        """Whether PEFT holds ``module`` as a ``modules_to_save`` copy of the base's module.

        Such a copy is that module's own: on a model whose unembedding is tied to the
        embedding, a saved ``lm_head`` changes the unembedding and not the lookup.
        """
        if module in self.saved_modules:
            return True
        targets = self.config.get("modules_to_save") or []
        if isinstance(targets, str):
            targets = [targets]
        # PEFT's own rule (peft.utils.other._set_trainable): the module's name ends with it.
        return any(module.endswith(str(target)) for target in targets)

    @property
    def base_name(self) -> str | None:
        """The base the adapter was trained on, as its config names it (or None)."""
        name = self.config.get("base_model_name_or_path")
        return str(name) if name else None


def _pattern_value(pattern: Any, module: str, default: Any) -> Any:
    r"""The value of the first key of ``pattern`` that ``module`` ends with after a dot.

    PEFT's ``get_pattern_key``: ``re.match(rf"(.*\.)?({key})$", module)``.
    """
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(file: Path) -> dict[str, Any]:
    """``adapter_config.json`` as a dictionary, or an error naming the file and the fix."""
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise AdapterError(
            f"{file} cannot be read as an adapter config ({type(error).__name__}: {error}); it "
            "must be the JSON object of LoraConfig fields that PEFT's save_pretrained writes "
            f"(the file is truncated or damaged?). {_RESAVE}"
        ) from None
    if not isinstance(config, dict):
        raise AdapterError(
            f"{file} holds a JSON {type(config).__name__}, not the object of LoraConfig fields "
            f"that PEFT's save_pretrained writes. {_RESAVE}"
        )
    return config


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    """An adapter's weights file, or an error naming the file and the fix."""
    damaged = (
        "the file is truncated or damaged (an interrupted download or save). Save or "
        "download the adapter again."
    )
    try:
        if file.suffix == ".safetensors":
            tensors = load_file(str(file))
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights only" in str(error).lower():
            raise AdapterError(unsafe_pickle(str(file))) from None
        raise AdapterError(f"{file} cannot be read ({error}): {damaged}") from None
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError) as error:
        raise AdapterError(
            f"{file} cannot be read ({type(error).__name__}: {error}): {damaged}"
        ) from None
    if not isinstance(tensors, dict) or not all(
        isinstance(name, str) and isinstance(tensor, torch.Tensor)
        for name, tensor in tensors.items()
    ):
        raise AdapterError(
            f"{file} holds a {type(tensors).__name__} that is not a mapping of names to "
            f"tensors, as PEFT saves an adapter. {_RESAVE}"
        )
    return tensors


def _without_adapter_names(
    tensors: Mapping[str, torch.Tensor], where: str
) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    """Tensors named as PEFT's files name them: no ``base_model.model.``, no adapter name.

    Returns the tensors and the modules held whole as ``modules_to_save`` copies.

    Raises:
        AdapterError: Factors of several adapters in one file, or two names that
            become one.
    """
    renamed: dict[str, str] = {}
    adapters: set[str] = set()
    saved: set[str] = set()
    for key in tensors:
        name = key.removeprefix(_PREFIX)
        for pattern in _NAMED_KEYS:
            match = pattern.match(name)
            if match is None:
                continue
            adapters.add(match["adapter"])
            module, part = match["module"], match["part"]
            if pattern is _NAMED_KEYS[2]:
                saved.add(module)
                name = f"{module}.{part}"
            else:
                name = f"{module}.{part}" + (".weight" if pattern is _NAMED_KEYS[0] else "")
            break
        renamed[key] = name
    if len(adapters) > 1:
        raise AdapterError(
            f"{where} holds the factors of several adapters ({', '.join(sorted(adapters))}); a "
            "donor is one adapter. Save one: peft_model.save_pretrained(dir, "
            "selected_adapters=[name])."
        )
    names: dict[str, torch.Tensor] = {}
    for key, name in renamed.items():
        if name in names:
            raise AdapterError(
                f"{where} holds {key} and another tensor that both name {name}; an adapter "
                f"holds each factor once. {_RESAVE}"
            )
        names[name] = tensors[key]
    return names, frozenset(saved)


def _read_through(module: nn.Module, name: str) -> Any:
    """``module``'s attribute ``name``, or its base layer's (PEFT's LoRA layers do the same)."""
    try:
        return nn.Module.__getattr__(module, name)
    except AttributeError:
        base = module.__dict__.get("_modules", {}).get("base_layer")
        if base is None:
            raise
        return getattr(base, name)


class _LoraLayer(nn.Module):
    """A base layer and LoRA factors; attributes it lacks are read from the base layer."""

    def __init__(
        self, base_layer: nn.Module, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.Parameter(lora_A, requires_grad=False)
        self.lora_B = nn.Parameter(lora_B, requires_grad=False)
        self.scale = float(scale)

    def __getattr__(self, name: str) -> Any:
        return _read_through(self, name)

    def delta(self) -> torch.Tensor:
        """``B A * scale``, laid out like ``base_layer.weight``."""
        raise NotImplementedError


class LoraLinear(_LoraLayer):
    """A linear layer with a LoRA update: ``base_layer(x) + B A x * scale``.

    ``base_layer`` is the base's own module (``nn.Linear`` or GPT-2's ``Conv1D``), not a
    copy. Attributes it does not have (``in_features``, ``weight``...) are read from
    ``base_layer``, as PEFT's LoRA layers do, so code that inspects a module's shape or
    dtype keeps working; the weight read that way is the base's, without the update.

    Args:
        base_layer: The base's linear layer.
        lora_A: ``[r, d_in]``.
        lora_B: ``[d_out, r]``.
        scale: The LoRA scale.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        # The order of PEFT's own forward: base output plus B(A(x)) * scale.
        update = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B) * self.scale
        return result + update.to(result.dtype)

    def delta(self) -> torch.Tensor:
        """``B A * scale``, laid out like ``base_layer.weight`` (transposed for ``Conv1D``)."""
        delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale
        return delta.t() if isinstance(self.base_layer, Conv1D) else delta


class LoraEmbedding(_LoraLayer):
    """An embedding with a LoRA update: ``base_layer(ids) + (B A)^T[ids] * scale``.

    The update is multiplied by the base layer's ``embed_scale`` where it has one
    (Gemma scales its lookup by ``sqrt(d_model)``), as PEFT does, so that it equals
    the merged model's lookup.

    Args:
        base_layer: The base's embedding.
        lora_A: ``[r, vocab]``.
        lora_B: ``[d_model, r]``.
        scale: The LoRA scale.
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        base = self._modules["base_layer"]
        assert isinstance(base, nn.Embedding)
        result = base(ids)
        after_A = F.embedding(
            ids,
            self.lora_A.t(),
            padding_idx=base.padding_idx,
            max_norm=base.max_norm,
            norm_type=base.norm_type,
            scale_grad_by_freq=base.scale_grad_by_freq,
            sparse=base.sparse,
        )
        update = (after_A @ self.lora_B.t()) * self.scale
        embed_scale = getattr(base, "embed_scale", None)
        if embed_scale is not None:
            update = update * torch.as_tensor(embed_scale).to(update)
        return result + update.to(result.dtype)

    def delta(self) -> torch.Tensor:
        """``(B A)^T * scale``, laid out like the embedding's weight ``[vocab, d_model]``."""
        return ((self.lora_B.float() @ self.lora_A.float()) * self.scale).t()


@dataclass
class _Update:
    """What an adapter does to one module of the base: LoRA factors, and what they adapt."""

    name: str
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    embedding: bool = False


@dataclass
class _Replacement:
    """A parameter of the base that the adapter holds whole, with its new value.

    ``owner`` is the module whose copy PEFT trains (``modules_to_save``): only that
    module computes with the new value, even where the base ties the parameter to
    another module. ``None`` is a value PEFT loads into the base's parameter itself
    (an embedding layer saved beside an embedding adapter), which every module
    sharing it then computes with.
    """

    name: str
    parameter: nn.Parameter
    value: nn.Parameter
    owner: nn.Module | None


class LoraSource(Source):
    """A LoRA adapter on the base, as a donor: the base's modules plus the adapter's factors.

    Created by :func:`~grafting_lens.load_models` for an adapter directory or a PEFT
    model. Its module for an adapted slot is a :class:`LoraLinear` or
    :class:`LoraEmbedding` around the base's own module (or a copy of the base's
    module holding a ``modules_to_save`` replacement); for any other slot, the base's
    module itself. It runs alone (:attr:`bridge`) as a second bridge over the base's
    own tensors with the adapted modules in place, built on first use.

    Args:
        name: The source's label.
        adapter: The adapter.
        base: The base's bridge.
        slots: Every slot of the architecture.
        make_bridge: Builds a bridge over the base's own tensors (for :attr:`bridge`).

    Raises:
        AdapterError: A module the base lacks, a shape the base's module does not
            have, a module no component computes, or a fused projection whose split
            does not follow its output rows.
    """

    kind = "lora"

    def __init__(
        self,
        name: str,
        adapter: LoraAdapter,
        base: TransformerBridge,
        slots: Iterable[Slot],
        *,
        make_bridge: Callable[[], TransformerBridge],
    ) -> None:
        super().__init__(name)
        self.adapter = adapter
        self._base = base
        self._slots = {slot.path: slot for slot in slots}
        self._templates = {path: slot.module(base) for path, slot in self._slots.items()}
        self._make_bridge = make_bridge
        self._bridge: TransformerBridge | None = None
        self._modules = _AdaptedModules(adapter, base, self._templates).build()

    @property
    def adapted(self) -> tuple[str, ...]:
        """The slots the adapter changes, by bridge path."""
        return tuple(self._modules)

    @property
    def bridge(self) -> TransformerBridge:
        """The base with the adapter: a second bridge over the base's own tensors.

        Moving or casting it moves the base too (the tensors are the same): place
        the model set with ``device=`` / ``dtype=`` of :func:`~grafting_lens.load_models`.
        """
        if self._bridge is None:
            bridge = self._make_bridge()
            for path, module in self._modules.items():
                self._slots[path].replace(bridge, module)
            self._bridge = bridge
        return self._bridge

    def module(self, slot: Slot) -> nn.Module:
        module = self._modules.get(slot.path)
        return module if module is not None else self._templates[slot.path]

    def weights(self, slot: Slot) -> list[torch.Tensor]:
        return _merged_parameters(self.module(slot))

    def resident_tensors(self) -> list[torch.Tensor]:
        tensors = [p.detach() for m in self._modules.values() for p in m.parameters()]
        if self._bridge is not None:
            tensors += [p.detach() for p in self._bridge.parameters()]
            tensors += list(self._bridge.buffers())
        return tensors

    def full_bytes(self) -> int:
        return CheckpointSource(self._base, self.name).full_bytes()  # the merged model's

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        digest.update(
            weights_fingerprint(checkpoint_parameters(self._base.original_model)).encode()
        )
        for name in sorted(self.adapter.tensors):
            tensor = self.adapter.tensors[name]
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
        settings = {key: self.adapter.config.get(key) for key in ("lora_alpha", "alpha_pattern")}
        settings["use_rslora"] = self.adapter.config.get("use_rslora")
        digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
        return digest.hexdigest()[:16]


def _merged_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The parameters ``module`` computes with, LoRA updates merged, in the base's order."""
    if isinstance(module, _LoraLayer):
        base = module._modules["base_layer"]
        assert base is not None
        merged = _merged_parameters(base)
        own = [p for p in base._parameters.values() if p is not None]
        if not own or own[0] is not base.weight:
            raise AdapterError(f"Cannot merge the LoRA update into a {type(base).__name__}.")
        # The weight comes first among its parameters (nn.Linear, Conv1D, nn.Embedding).
        merged[0] = merged[0] + module.delta().to(merged[0])
        return merged
    values: list[torch.Tensor] = [p.detach() for p in module._parameters.values() if p is not None]
    return values + [
        p
        for child in module._modules.values()
        if child is not None
        for p in _merged_parameters(child)
    ]


class _AdaptedModules:
    """Builds, for every slot an adapter changes, the module that computes it."""

    def __init__(
        self, adapter: LoraAdapter, base: TransformerBridge, templates: Mapping[str, nn.Module]
    ) -> None:
        self.adapter = adapter
        self.base = base
        self.templates = templates
        self.architecture = type(base.original_model).__name__
        original = base.original_model
        assert isinstance(original, nn.Module)
        self.named = {prefix[:-1]: m for prefix, m in checkpoint_modules(original) if prefix}
        self.parameters = {
            prefix + name: p
            for prefix, m in checkpoint_modules(original)
            for name, p in m._parameters.items()
            if p is not None
        }
        self.slot_of = {id(m): path for path, m in templates.items()}
        self.inside: dict[int, str] = {}
        for path, template in templates.items():
            for sub in template.modules():
                self.inside.setdefault(id(sub), path)
        self.fused: dict[int, FusedProjection] = {
            id(f.fused(base)): f for f in fused_projections(base)
        }
        self.replacements: list[_Replacement] = []

    def _another_base(self, what: str) -> AdapterError:
        named = self.adapter.base_name
        made_for = f" (its config names the base {named!r})" if named else ""
        return AdapterError(
            f"The adapter {self.adapter.label}{made_for} {what}: it was made for another model "
            f"than this base ({self.architecture}). Load it on the base it was trained on."
        )

    def build(self) -> dict[str, nn.Module]:
        updates, self.replacements = self._read()
        modules = list(self.templates.values())
        modules += [f.fused(self.base) for f in self.fused.values()]
        for replacement in self.replacements:
            if not any(id(replacement.parameter) in self._replacing(m) for m in modules):
                raise AdapterError(
                    f"The adapter {self.adapter.label} replaces {replacement.name}, which no "
                    "component grafts (see ModelSet.coverage()). Merge it into a full "
                    "checkpoint (merge_and_unload) and load that."
                )
        donors: dict[str, nn.Module] = {}
        # Replaced parameters (modules_to_save, saved embedding layers) first: the
        # LoRA updates then apply to the replaced modules, as in PEFT.
        for path, template in self.templates.items():
            replacing = self._replacing(template)
            if replacing:
                donors[path] = structural_copy(template, replacing)
        for fused in self.fused.values():
            template = fused.fused(self.base)
            replacing = self._replacing(template)
            if replacing:
                parts = fused.split(self.base, structural_copy(template, replacing))
                for child, module in parts.items():
                    donors[f"{fused.node}.{child}"] = module
        nested: dict[str, dict[int, nn.Module]] = {}
        for update in updates.values():
            module = self.named[update.name]
            slot_path = self.slot_of.get(id(module))
            if slot_path is not None:
                donors[slot_path] = self._wrap(donors.get(slot_path, module), update)
            elif id(module) in self.fused:
                fused = self.fused[id(module)]
                rows = self._rows(fused, update)
                for child, index in rows.items():
                    child_path = f"{fused.node}.{child}"
                    inner = donors.get(child_path, self.templates[child_path])
                    assert update.lora_B is not None
                    part = _Update(update.name, update.lora_A, update.lora_B[index])
                    donors[child_path] = self._wrap(inner, part)
            elif id(module) in self.inside:
                path = self.inside[id(module)]
                inner = structural_copy(module, self._replacing(module))
                nested.setdefault(path, {})[id(module)] = self._wrap(inner, update)
            else:
                raise AdapterError(
                    f"The adapter {self.adapter.label} adapts {update.name} "
                    f"({type(module).__name__}), which no component of the bridge computes: "
                    "grafting-lens grafts adapters of the linear layers and embeddings that "
                    "components hold (q, k, v, o, the MLP matrices, embed, unembed)."
                )
        for path, inner_modules in nested.items():
            template = self.templates[path]
            donors[path] = structural_copy(template, self._replacing(template), inner_modules)
        return donors

    def _replacing(self, module: nn.Module) -> dict[int, nn.Parameter]:
        """The replacements that apply inside ``module``, by ``id`` of the base's parameter.

        A ``modules_to_save`` copy applies where its own module is inside ``module``;
        a value loaded into the base's parameter applies wherever that parameter is.
        """
        inside = {id(sub) for sub in module.modules()}
        held = {id(p) for _, p in module.named_parameters(remove_duplicate=False)}
        return {
            id(r.parameter): r.value
            for r in self.replacements
            if id(r.parameter) in held and (r.owner is None or id(r.owner) in inside)
        }

    def _read(self) -> tuple[dict[str, _Update], list[_Replacement]]:
        """The adapter's LoRA updates by module, and the base parameters it replaces."""
        updates: dict[str, _Update] = {}
        replacements: list[_Replacement] = []
        lora_keys = {
            ".lora_A.weight": ("lora_A", False),
            ".lora_B.weight": ("lora_B", False),
            ".lora_embedding_A": ("lora_A", True),
            ".lora_embedding_B": ("lora_B", True),
        }
        for key, tensor in self.adapter.tensors.items():
            for suffix, (part, embedding) in lora_keys.items():
                if key.endswith(suffix):
                    name = key[: -len(suffix)]
                    if name not in self.named:
                        raise self._another_base(f"adapts {name}, which the base lacks")
                    update = updates.setdefault(name, _Update(name, embedding=embedding))
                    setattr(update, part, tensor)
                    break
            else:
                if ".lora_" in key:
                    what = (
                        "DoRA's magnitude vector"
                        if ".lora_magnitude_vector" in key
                        else "not one of plain LoRA's A and B factors"
                    )
                    raise AdapterError(
                        f"The adapter {self.adapter.label} holds {key}, a LoRA tensor of a kind "
                        f"grafting-lens does not compute ({what}; plain LoRA A and B only). "
                        "Merge it into a full checkpoint (merge_and_unload) and load that."
                    )
                # A whole parameter: modules_to_save, the embedding layers PEFT saves
                # beside embedding adapters (as base_layer.weight), or PEFT's copy of
                # the base's own module beside a modules_to_save (original_module).
                original = ".original_module." in key
                name = key.replace(".base_layer.", ".").replace(".original_module.", ".")
                parameter = self.parameters.get(name)
                if parameter is None:
                    raise self._another_base(f"holds {key}, a parameter the base lacks")
                if tuple(tensor.shape) != tuple(parameter.shape):
                    raise self._another_base(
                        f"holds {key} of shape {tuple(tensor.shape)}, where the base's "
                        f"{name} has {tuple(parameter.shape)}"
                    )
                value = tensor.to(device=parameter.device, dtype=parameter.dtype)
                if torch.equal(value, parameter.detach()):
                    continue
                if original:
                    raise self._another_base(
                        f"holds {key}, its copy of the base's {name}, with other values than "
                        "this base's"
                    )
                module_name = name.rpartition(".")[0]
                owner = (
                    self.named.get(module_name)
                    if ".base_layer." not in key and self.adapter.saved_whole(module_name)
                    else None
                )
                replacements.append(
                    _Replacement(name, parameter, nn.Parameter(value, requires_grad=False), owner)
                )
        for update in updates.values():
            self._check(update)
        return updates, replacements

    def _check(self, update: _Update) -> None:
        module = self.named[update.name]
        if update.lora_A is None or update.lora_B is None:
            missing = "A" if update.lora_A is None else "B"
            raise AdapterError(
                f"The adapter {self.adapter.label} holds LoRA B without A (or A without B) for "
                f"{update.name} (no {missing}); its weights file is incomplete."
            )
        if update.lora_A.dim() != 2 or update.lora_B.dim() != 2:
            raise AdapterError(
                f"The adapter {self.adapter.label} adapts {update.name} with factors of "
                f"shapes {tuple(update.lora_A.shape)} and {tuple(update.lora_B.shape)}; "
                "grafting-lens computes LoRA of linear layers and embeddings (2-d factors)."
            )
        if update.embedding:
            if not isinstance(module, nn.Embedding):
                raise self._another_base(
                    f"adapts {update.name} as an embedding, which in the base is a "
                    f"{type(module).__name__}"
                )
            d_in, d_out = module.num_embeddings, module.embedding_dim
        elif isinstance(module, nn.Linear):
            d_in, d_out = module.in_features, module.out_features
        elif isinstance(module, Conv1D):
            d_in, d_out = module.weight.shape[0], module.weight.shape[1]
        else:
            raise AdapterError(
                f"The adapter {self.adapter.label} adapts {update.name}, a "
                f"{type(module).__name__}; grafting-lens computes LoRA of linear layers "
                "(nn.Linear, Conv1D) and embeddings."
            )
        rank = update.lora_A.shape[0]
        if tuple(update.lora_A.shape) != (rank, d_in) or tuple(update.lora_B.shape) != (
            d_out,
            rank,
        ):
            raise self._another_base(
                f"adapts {update.name} with A {tuple(update.lora_A.shape)} and B "
                f"{tuple(update.lora_B.shape)}, but the base's {update.name} maps {d_in} to "
                f"{d_out} features (A must be [r, {d_in}], B [{d_out}, r])"
            )
        expected = self.adapter.rank(update.name)
        if rank != expected:
            raise AdapterError(
                f"The adapter {self.adapter.label} adapts {update.name} with factors of rank "
                f"{rank} (A {tuple(update.lora_A.shape)}), but its config gives that module "
                f"rank {expected} (r, or its rank_pattern entry), and the LoRA scale is "
                "lora_alpha / rank: the config does not belong to these weights, and PEFT "
                f"refuses to load them. {_RESAVE}"
            )
        weight = module.weight
        update.lora_A = update.lora_A.to(device=weight.device, dtype=weight.dtype)
        update.lora_B = update.lora_B.to(device=weight.device, dtype=weight.dtype)

    def _wrap(self, module: nn.Module, update: _Update) -> nn.Module:
        assert update.lora_A is not None and update.lora_B is not None
        scale = self.adapter.scale(update.name, int(update.lora_A.shape[0]))
        kind = LoraEmbedding if update.embedding else LoraLinear
        return kind(module, update.lora_A, update.lora_B, scale)

    def _rows(self, fused: FusedProjection, update: _Update) -> dict[str, torch.Tensor]:
        """Which rows of ``B`` (outputs of the fused module) each split module computes.

        The bridge's split function runs on a stand-in whose weight holds each
        output's row number in every entry; a split module's row ``i`` then holds the
        fused output it computes. Checked against the base's own split modules.
        """
        template = fused.fused(self.base)
        weight = template.weight
        bias = getattr(template, "bias", None)
        assert isinstance(weight, torch.Tensor) and update.lora_B is not None
        d_out = update.lora_B.shape[0]
        numbers = torch.arange(d_out, dtype=torch.float32)
        by_rows = weight.shape[0] == d_out and not isinstance(template, Conv1D)
        probe = (numbers[:, None] if by_rows else numbers[None, :]).expand(weight.shape)
        replacements = {id(weight): nn.Parameter(probe.contiguous(), requires_grad=False)}
        if bias is not None:
            replacements[id(bias)] = nn.Parameter(numbers.clone(), requires_grad=False)
        parts = fused.split(self.base, structural_copy(template, replacements))
        matrix = weight.detach() if by_rows else weight.detach().t()  # [d_out, d_in]
        rows = {}
        for child, module in parts.items():
            split = getattr(module, "weight", None)
            base_child = self.templates[f"{fused.node}.{child}"]
            index = None
            if isinstance(module, nn.Linear) and isinstance(split, torch.Tensor):
                first = split[:, 0]
                if torch.equal(split, first[:, None].expand_as(split)) and torch.equal(
                    first, first.round()
                ):
                    index = first.long()
            if (
                index is None
                or not isinstance(base_child, nn.Linear)
                or not torch.equal(base_child.weight.detach(), matrix[index.to(matrix.device)])
            ):
                raise AdapterError(
                    f"The adapter {self.adapter.label} adapts {update.name}, which the bridge "
                    f"splits into {', '.join(fused.children)} in a way that does not select "
                    "whole output rows, so the adapter's B cannot be split with it. Merge the "
                    "adapter into a full checkpoint (merge_and_unload) and load that, and "
                    "please report the architecture."
                )
            rows[child] = index.to(update.lora_B.device)
        return rows


def warn_if_other_base(adapter: LoraAdapter, base_name: str) -> None:
    """Warn when the adapter's config names a base other than ``base_name`` (by last path part)."""
    named = adapter.base_name
    if not named or not base_name:
        return
    if Path(named.rstrip("/")).name != Path(base_name.rstrip("/")).name:
        warnings.warn(
            f"The adapter {adapter.label} was trained on {named!r} (its adapter_config.json "
            f"says so), and is loaded on {base_name!r}. Its modules and shapes match; make "
            "sure this is the base it was trained on.",
            UserWarning,
            stacklevel=3,
        )
