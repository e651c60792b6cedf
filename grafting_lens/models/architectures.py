"""Which model architectures grafting-lens loads, and how a model's architecture is found:
:data:`VERIFIED_ARCHITECTURES` are checked end to end (``tests/models/test_architectures.py``);
another that TransformerLens bridges loads with a warning, one it cannot is refused.
"""

from __future__ import annotations

import difflib
import warnings
from importlib.metadata import version

from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES
from transformers import PreTrainedModel

from grafting_lens.core.errors import UnsupportedArchitectureError, UnverifiedArchitectureWarning

VERIFIED_ARCHITECTURES: dict[str, str] = {
    "ArceeForCausalLM": "arcee",
    "BloomForCausalLM": "bloom",
    "CodeGenForCausalLM": "codegen",
    "Cohere2ForCausalLM": "cohere2",
    "CohereForCausalLM": "cohere",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "Exaone4ForCausalLM": "exaone4",
    "FalconForCausalLM": "falcon",
    "FlexOlmoForCausalLM": "flex_olmo",
    "GPT2LMHeadModel": "gpt2",
    "GPTBigCodeForCausalLM": "gpt_bigcode",
    "GPTJForCausalLM": "gptj",
    "GPTNeoForCausalLM": "gpt_neo",
    "GPTNeoXForCausalLM": "gpt_neox",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "GemmaForCausalLM": "gemma",
    "Glm4ForCausalLM": "glm4",
    "Glm4MoeForCausalLM": "glm4_moe",
    "GlmForCausalLM": "glm",
    "GraniteForCausalLM": "granite",
    "GraniteMoeForCausalLM": "granitemoe",
    "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense",
    "Jais2ForCausalLM": "jais2",
    "LagunaForCausalLM": "laguna",
    "LlamaForCausalLM": "llama",
    "Ministral3ForCausalLM": "ministral3",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "MptForCausalLM": "mpt",
    "NemotronForCausalLM": "nemotron",
    "OPTForCausalLM": "opt",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "OlmoForCausalLM": "olmo",
    "OlmoeForCausalLM": "olmoe",
    "Phi3ForCausalLM": "phi3",
    "PhiForCausalLM": "phi",
    "PhiMoEForCausalLM": "phimoe",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "SeedOssForCausalLM": "seed_oss",
    "SmolLM3ForCausalLM": "smollm3",
    "StableLmForCausalLM": "stablelm",
    "Starcoder2ForCausalLM": "starcoder2",
    "VaultGemmaForCausalLM": "vaultgemma",
    "XGLMForCausalLM": "xglm",
}
"""Architecture (as TransformerLens names it) to its ``model_type``, for every verified one."""

_WHERE = "grafting_lens.models.architectures.VERIFIED_ARCHITECTURES; the documentation's Supported architectures page"


def resolve_architecture(model: PreTrainedModel, index: int = 0) -> str:
    """The architecture TransformerLens bridges ``model`` as (its class, or a supported class it
    derives from), recorded in ``model.config.architectures`` (of load_models' own copy).

    Raises:
        UnsupportedArchitectureError: TransformerLens has no bridge for the model's class
            (``index``: the source's, for the message).
    """
    config = model.config
    classes = [kind.__name__ for kind in type(model).__mro__]
    chosen = next((name for name in classes if name in SUPPORTED_ARCHITECTURES), None)
    if chosen is None:
        # TransformerLens spells a few names as their remote-code versions did
        # (PhiMoEForCausalLM for transformers' PhimoeForCausalLM).
        spelled = {name.lower(): name for name in SUPPORTED_ARCHITECTURES}
        chosen = next((spelled[n.lower()] for n in classes if n.lower() in spelled), None)
    if chosen is None:
        raise UnsupportedArchitectureError(_unsupported_message(model, index))
    if list(getattr(config, "architectures", None) or [])[:1] != [chosen]:
        config.architectures = [chosen]
    return chosen


def warn_if_unverified(architecture: str) -> None:
    """Warn (:class:`~grafting_lens.core.errors.UnverifiedArchitectureWarning`) that
    ``architecture`` is bridged by TransformerLens but not in :data:`VERIFIED_ARCHITECTURES`."""
    if architecture in VERIFIED_ARCHITECTURES:
        return
    warnings.warn(
        f"{architecture} is bridged by TransformerLens but grafting-lens has not verified it "
        f"({_WHERE}). Check models.coverage() for weights no component covers, and compare "
        "graft_forward with graft_forward_reference on your model before trusting its numbers.",
        UnverifiedArchitectureWarning,
        stacklevel=3,
    )


def _unsupported_message(model: PreTrainedModel, index: int) -> str:
    name = type(model).__name__
    model_type = getattr(model.config, "model_type", None)
    # The verified architectures of the same model_type first, then the closest names.
    same = [arch for arch, kind in VERIFIED_ARCHITECTURES.items() if kind == model_type]
    close = difflib.get_close_matches(name, list(VERIFIED_ARCHITECTURES), n=3, cutoff=0.0)
    nearest = ", ".join(list(dict.fromkeys(same + close))[:3])
    return (
        f"Source {index} is a {name} (model_type {model_type!r}), which TransformerLens "
        f"{version('transformer-lens')} cannot bridge, so grafting-lens cannot load it. "
        f"Nearest supported: {nearest}. Load a causal language model with its LM head "
        f"(AutoModelForCausalLM) of a supported architecture ({_WHERE}), or register a "
        "TransformerLens adapter for this one (ArchitectureAdapterFactory.register_adapter)."
    )
