"""LoRA adapters as donors: the base's weights and the adapter's factors, never a merged copy.
What is refused, with an ``AdapterError`` naming the fix: the API page "Models", section "LoRA
adapters".
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

# Settings under which a module computes other than W x + B A x * scale (or not verified).
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

# Values of init_lora_weights under which PEFT leaves the base's W as it is when it loads the
# adapter; any other rewrites W (_REWRITING_INITS) or is unknown, and is refused.
_PLAIN_INITS = frozenset({"true", "false", "none", "gaussian", "eva", "orthogonal", "mica"})

# Initialisations that subtract the initial factors' product from W (or quantize it) on load.
_REWRITING_INITS = {
    "pissa": "PiSSA",
    "olora": "OLoRA",
    "corda": "CorDA",
    "loftq": "LoftQ",
    "lora_ga": "LoRA-GA",
}

# A model's own state_dict names factors with the adapter's name (lora_A.default.weight);
# save_pretrained's files do not (lora_A.weight).
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
        label: Where it came from (the directory's name, or ``"peft model (name)"``).
        config: PEFT's ``LoraConfig`` as a dictionary (``adapter_config.json``).
        tensors: Its tensors, named as PEFT saves them (``...q_proj.lora_A.weight``), without
            the adapter's name a model's own ``state_dict`` adds.
        saved_modules: Modules the file holds whole in PEFT's ``modules_to_save`` form,
            besides those the config names.
    """

    label: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(repr=False)
    saved_modules: frozenset[str] = frozenset()

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> LoraAdapter:
        """Read ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``).

        Raises:
            AdapterError: A file that cannot be read, no tensors, or not plain LoRA.
        """
        path = Path(path).expanduser()
        config = _read_config(path / "adapter_config.json")
        file = next(
            (path / name for name in ("adapter_model.safetensors", "adapter_model.bin")
             if (path / name).is_file()),
            None,
        )  # fmt: skip
        tensors = _read_weights(file, path)
        adapter = cls(path.name, config, *_without_adapter_names(tensors, str(file)))
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
        adapter = cls(label, config, *_without_adapter_names(tensors, label))
        adapter.check_supported()
        return adapter

    def check_supported(self) -> None:
        """Refuse what grafting-lens does not compute (other PEFT methods, LoRA variants,
        initialisations that rewrite the base's weights), or what PEFT would not load.

        Raises:
            AdapterError: Naming the method or setting, and the fix.
        """
        problem = _unsupported(self.config)
        if problem is not None:
            raise AdapterError(f"The adapter {self.label} {problem}")

    def rank(self, module: str) -> int:
        """The rank PEFT gives ``module``: its ``rank_pattern`` entry, else ``r``."""
        return int(_pattern_value(self.config.get("rank_pattern"), module, self.config.get("r", 8)))

    def scale(self, module: str, rank: int) -> float:
        """``lora_alpha / r`` for ``module`` (its ``alpha_pattern`` entry; ``/ sqrt(r)`` with
        rsLoRA)."""
        alpha = _pattern_value(
            self.config.get("alpha_pattern"), module, self.config.get("lora_alpha", 8)
        )
        return float(alpha) / (math.sqrt(rank) if self.config.get("use_rslora") else rank)

    def saved_whole(self, module: str) -> bool:
        """Whether PEFT holds ``module`` as a ``modules_to_save`` copy: that module's own,
        even where the base ties its weight to another's."""
        targets = self.config.get("modules_to_save") or []
        targets = [targets] if isinstance(targets, str) else targets
        # PEFT's own rule (peft.utils.other._set_trainable): the module's name ends with it.
        return module in self.saved_modules or any(module.endswith(str(t)) for t in targets)

    @property
    def base_name(self) -> str | None:
        """The base the adapter was trained on, as its config names it (or None)."""
        name = self.config.get("base_model_name_or_path")
        return str(name) if name else None


def _pattern_value(pattern: Any, module: str, default: Any) -> Any:
    r"""The value of the first key of ``pattern`` that ``module`` ends with after a dot, as
    PEFT's ``get_pattern_key`` matches: ``re.match(rf"(.*\.)?({key})$", module)``."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


_MERGE = (
    "Merge it into a full checkpoint (peft_model.merge_and_unload().save_pretrained(dir)) and "
    "load that directory as the donor."
)


def _unsupported(config: Mapping[str, Any]) -> str | None:
    """Why an adapter config is not plain LoRA PEFT would load (a sentence and its fix), or None."""
    raw_type = config.get("peft_type")
    peft_type = str(getattr(raw_type, "value", raw_type))
    init = str(config.get("init_lora_weights", True)).lower()
    rewriting = next((name for key, name in _REWRITING_INITS.items() if init.startswith(key)), None)
    refused = next(
        (what for setting, what in _REFUSED_SETTINGS.items() if config.get(setting)), None
    )
    if raw_type is None:
        return f"has no peft_type in its config, which PEFT always writes. {RESAVE}"
    if peft_type.upper() != "LORA":
        return f"is a {peft_type} adapter; grafting-lens computes LoRA only. {_MERGE}"
    if refused is not None or config.get("bias", "none") != "none":
        what = refused or f"trained biases (bias={config['bias']!r})"
        return f"uses {what}; grafting-lens computes plain LoRA (W x + B A x * scale). {_MERGE}"
    if rewriting is not None:
        return (
            f"was initialised with {rewriting} (init_lora_weights={init!r}), which rewrites the "
            "base's weights when PEFT loads it. Save it converted to plain LoRA (save_pretrained("
            "dir, path_initial_model_for_weight_conversion=...)), or merge it. " + _MERGE
        )
    if init not in _PLAIN_INITS:
        return (
            f"was initialised with init_lora_weights={init!r}, unknown here, so whether PEFT "
            f"rewrites the base's weights when loading it cannot be told. {_MERGE}"
        )
    for setting, default, valid, what in (
        ("r", 8, _is_rank, "an integer >= 1"),
        ("lora_alpha", 8, _is_number, "a finite number"),
    ):
        if not valid(config.get(setting, default)):
            return f"has {setting}={config[setting]!r}, which must be {what}. {RESAVE}"
    for setting, valid, what in (
        ("rank_pattern", _is_rank, "ranks (integers >= 1)"),
        ("alpha_pattern", _is_number, "alphas (finite numbers)"),
    ):
        pattern = config.get(setting) or {}
        if not isinstance(pattern, dict) or not all(
            _is_pattern(key) and valid(value) for key, value in pattern.items()
        ):
            return (
                f"has {setting}={pattern!r}; it must map module names (regular expressions) to "
                f"{what}. {RESAVE}"
            )
    return None


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_pattern(key: Any) -> bool:
    try:
        re.compile(str(key))
    except re.error:
        return False
    return True


def _read_config(file: Path) -> dict[str, Any]:
    """``adapter_config.json`` as a dictionary, or an error naming the file and the fix."""
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
        problem = None if isinstance(config, dict) else f"a JSON {type(config).__name__}"
    except (OSError, UnicodeDecodeError, ValueError) as error:
        problem = f"{type(error).__name__}: {error}"
    if problem is not None:
        raise AdapterError(
            f"{file} is not the JSON object of LoraConfig fields PEFT's save_pretrained writes "
            f"({problem}). {RESAVE}"
        )
    return config


def _read_weights(file: Path | None, directory: Path) -> dict[str, torch.Tensor]:
    """An adapter's weights file (``None``: none in ``directory``), or an error naming the fix."""
    tensors: Any = {}
    problem, unsafe = None, False
    try:
        if file is not None and file.suffix == ".safetensors":
            tensors = load_file(str(file))
        elif file is not None:
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(tensors, dict) or not all(
            isinstance(name, str) and isinstance(t, torch.Tensor) for name, t in tensors.items()
        ):
            problem = f"a {type(tensors).__name__}, not names mapped to tensors"
    except (pickle.UnpicklingError, SafetensorError, OSError, RuntimeError, EOFError, ValueError) as error:  # fmt: skip
        problem = f"{type(error).__name__}: {error}"
        unsafe = isinstance(error, pickle.UnpicklingError) and "weights only" in str(error).lower()
    if unsafe:
        message = unsafe_pickle(str(file))
    elif problem is not None:
        message = (
            f"{file} cannot be read as adapter weights ({problem}): it is truncated or damaged "
            "(an interrupted download or save). Save or download the adapter again."
        )
    elif not tensors:  # no factors: PEFT would leave the base itself
        message = (
            f"{file or directory} holds no adapter tensors (adapter_model.safetensors or .bin "
            f"beside adapter_config.json, a link to nothing?). {RESAVE}"
        )
    else:
        return tensors
    raise AdapterError(message)


def _without_adapter_names(
    tensors: Mapping[str, torch.Tensor], where: str
) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    """Tensors named as PEFT's files name them (no ``base_model.model.``, no adapter name), and
    the modules held whole as ``modules_to_save`` copies; several adapters in one are refused."""
    names: dict[str, torch.Tensor] = {}
    adapters: set[str] = set()
    saved: set[str] = set()
    for key, tensor in tensors.items():
        name = key.removeprefix("base_model.model.")
        match = next(filter(None, (pattern.match(name) for pattern in _NAMED_KEYS)), None)
        if match is not None:
            adapters.add(match["adapter"])
            if match.re is _NAMED_KEYS[2]:
                saved.add(match["module"])
            name = f"{match['module']}.{match['part']}"
            name += ".weight" if match.re is _NAMED_KEYS[0] else ""
        if name in names or len(adapters) > 1:
            what = f"two tensors named {name}"
            if len(adapters) > 1:
                what = f"the factors of several adapters ({', '.join(sorted(adapters))})"
            raise AdapterError(
                f"{where} holds {what}; a donor is one adapter, each factor once. Save one: "
                "peft_model.save_pretrained(dir, selected_adapters=[name])."
            )
        names[name] = tensor
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
