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
(DoRA, LoRA biases, other PEFT methods) is refused with :class:`~grafting_lens.core.errors.AdapterError`
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
model, and is refused with :class:`~grafting_lens.core.errors.AdapterError` (an
:class:`~grafting_lens.core.errors.AlignmentError`).

Tied embeddings stay as PEFT computes them: an adapted ``embed`` changes the lookup,
not the unembedding (PEFT's ``merge_and_unload`` would change both, through the one
shared matrix).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError  # type: ignore[attr-defined, unused-ignore]
from safetensors.torch import load_file

from grafting_lens.core.errors import AdapterError, unsafe_pickle

__all__ = [
    "LoraAdapter",
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

RESAVE = "Save the adapter again with PEFT (peft_model.save_pretrained(dir))."


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
                f"whole. {RESAVE}"
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
                '"peft_type": "LORA"). ' + RESAVE
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

        fix = "Set it as it was when the adapter was trained, or " + RESAVE[0].lower() + RESAVE[1:]
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
            f"(the file is truncated or damaged?). {RESAVE}"
        ) from None
    if not isinstance(config, dict):
        raise AdapterError(
            f"{file} holds a JSON {type(config).__name__}, not the object of LoraConfig fields "
            f"that PEFT's save_pretrained writes. {RESAVE}"
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
            f"tensors, as PEFT saves an adapter. {RESAVE}"
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
                f"holds each factor once. {RESAVE}"
            )
        names[name] = tensors[key]
    return names, frozenset(saved)


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
