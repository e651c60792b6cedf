"""The authors' released grafting procedure, done literally on plain Hugging Face models: a test oracle.

The numbers in the paper's figures come from the authors' released code
(``toddnief/dynamic-weight-grafting``, ``src/kg/scripts/run_experiment.py``), not from its prose.
This module re-does, step by step and in its own code, what that script does for one prompt, so
that grafting-lens's "reference" preset can be checked against it. It shares nothing with
grafting-lens (no bridge, no components, no masks, no graft engine): it moves weights between
``GPT2LMHeadModel``, ``GPTNeoXForCausalLM``, ``LlamaForCausalLM`` and ``GemmaForCausalLM``
objects the way the script does.

What the script does for one prompt, and so what :func:`authors_run` does:

1. Tokenize with ``tokenizer(text)``: a BOS is there only where the tokenizer adds one itself
   (Llama 3, Gemma), not for GPT-2 or Pythia.
2. Give each token at most one patch (:func:`token_patches`): an ``other`` patch fills every
   token, then each named span (found by searching its token ids in the prompt) replaces it on
   its tokens, then patches at token indices (``-1`` is the last token) replace those. A later
   patch replaces an earlier one on a token; nothing is merged.
3. For every token, take a fresh ``copy.deepcopy`` of the recipient. If the token has a patch
   with a non-empty layer list, load into the copy, with ``load_state_dict``, the donor's
   input embedding (if ``embeddings`` is a target) and, in each listed layer, the donor's module
   for each target, named as the script names them (:data:`LAYOUTS`). Then run that single
   token with the KV cache of the earlier tokens, each computed by its own copy.
4. Read the last token's logits; with ``patch_lm_head="always"``, apply the donor's ``lm_head``
   to the last token's final hidden state (after the recipient's final norm) instead.
5. Target: the first token of ``" " + name`` (``add_special_tokens=False``). Its probability is
   the softmax of those logits; its rank is the number of tokens with a strictly higher
   probability (0 = top-1).

Consequences a reader should know (they are what make this the *reference*, not a clean graft):

* ``load_state_dict`` copies values into the copy's own parameters, and ``deepcopy`` keeps a
  tied model's input embedding and ``lm_head`` as one parameter. So on a tied model (GPT-2,
  Gemma, Llama 3.2 1B; not Pythia) a token whose embeddings are grafted is also *decoded*
  through the donor's embedding matrix.
* ``q`` names GPT-2's fused ``c_attn`` and NeoX's ``query_key_value``: it loads Q, K and V
  together. ``k``, ``v`` and ``gate`` name nothing on those models, so they do nothing there.
  On Llama and Gemma ``q`` is ``q_proj`` alone.
* The final norm and GPT-2's position embedding are never loaded; the ``lm_head`` only with
  ``patch_lm_head="always"``; ``patch_lm_head="last_token"`` behaves as ``"never"``.
* A patch whose layer list is empty (or None) loads nothing, not even the embeddings.
* Layer groups: quarters are ``n // 4`` layers, the remainder going to the last quarter
  (:func:`layer_groups`); the hybrid model's "last half" is ``range(n // 2, n)``
  (:func:`hybrid_layers`).
* The baselines PRE and SFT are not patched runs: the script runs the recipient whole
  (``no_patching``), with the pretrained model as recipient for PRE and the finetuned one for
  SFT (:attr:`AuthorsConfig.plain`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

TARGETS: tuple[str, ...] = (
    "embeddings",
    "q",
    "k",
    "v",
    "o",
    "gate",
    "mlp_up",
    "mlp_down",
    "ln_1",
    "ln_2",
)
"""The script's patch targets (the fields of its ``PatchTargets``)."""

EVERY_TARGET: frozenset[str] = frozenset(TARGETS)
"""Every target: what a position-grafting configuration grafts ("all model weights")."""

PATCH_LM_HEAD = ("never", "always", "last_token")
"""The script's ``patch_lm_head`` values; ``last_token`` is dead code there and acts as ``never``."""


@dataclass(frozen=True)
class Layout:
    """Where the script finds each target in one model family.

    Attributes:
        layers: Path of the list of blocks.
        components: Target name -> module path inside a block. A target missing here names
            nothing in this family, so grafting it does nothing (``k``, ``v``, ``gate`` on GPT-2
            and NeoX, whose Q, K and V are one fused module loaded by ``q``).
        embeddings: Path of the input (token) embedding.
        lm_head: Path of the unembedding, used only with ``patch_lm_head="always"``.
    """

    layers: str
    components: Mapping[str, str]
    embeddings: str
    lm_head: str


_LLAMA_LIKE = Layout(
    layers="model.layers",
    components={
        "ln_1": "input_layernorm",
        "ln_2": "post_attention_layernorm",
        "mlp_up": "mlp.up_proj",
        "mlp_down": "mlp.down_proj",
        "gate": "mlp.gate_proj",
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
    },
    embeddings="model.embed_tokens",
    lm_head="lm_head",
)

LAYOUTS: dict[str, Layout] = {
    # The script's "gpt2-xl" entry (its plain "gpt2" entry lacks embeddings and norms).
    "GPT2LMHeadModel": Layout(
        layers="transformer.h",
        components={
            "ln_1": "ln_1",
            "ln_2": "ln_2",
            "mlp_up": "mlp.c_fc",
            "mlp_down": "mlp.c_proj",
            "q": "attn.c_attn",  # fused: Q, K and V with their biases
            "o": "attn.c_proj",
        },
        embeddings="transformer.wte",  # never transformer.wpe
        lm_head="lm_head",
    ),
    # The script's "pythia-2.8b" entry. Its lm_head is "embed_out" in the transformers 4.45 the
    # authors used; transformers 5 calls the same module "lm_head".
    "GPTNeoXForCausalLM": Layout(
        layers="gpt_neox.layers",
        components={
            "ln_1": "input_layernorm",
            "ln_2": "post_attention_layernorm",
            "mlp_up": "mlp.dense_h_to_4h",
            "mlp_down": "mlp.dense_4h_to_h",
            "q": "attention.query_key_value",  # fused, interleaved per head
            "o": "attention.dense",
        },
        embeddings="gpt_neox.embed_in",
        lm_head="lm_head",
    ),
    "LlamaForCausalLM": _LLAMA_LIKE,  # the script's "llama3" entry
    "GemmaForCausalLM": _LLAMA_LIKE,  # the script's "gemma" entry
}
"""The script's module names per model class (its ``MODEL_CONFIGS``), for transformers 5."""

HYBRID_TARGETS: tuple[str, ...] = ("o", "mlp_up", "mlp_down")
"""What the hybrid model takes from the relation model (never the gate)."""

LayerSpec = None | str | int | range | Sequence[str | int | range]
"""A layer specification as the script's patch configs write one (see :func:`resolve_layers`)."""


def layout_of(model: nn.Module) -> Layout:
    """The :class:`Layout` of a model, by its class."""
    name = type(model).__name__
    if name not in LAYOUTS:
        raise TypeError(f"No layout for {name}; the oracle knows {', '.join(LAYOUTS)}.")
    return LAYOUTS[name]


def n_layers(model: nn.Module) -> int:
    """Number of blocks, counted the way the script counts them."""
    return len(model.get_submodule(layout_of(model).layers))


def layer_groups(n: int) -> dict[str, list[int]]:
    """The script's named layer groups for an ``n``-layer model.

    Quarters have ``n // 4`` layers each and the last quarter takes the remainder: for 18
    layers, 0-3, 4-7, 8-11, 12-17. (The script also defines "eighths", by formulas that leave
    some empty; no published configuration uses them, so they are left out.)
    """
    quarter = n // 4
    return {
        "all": list(range(n)),
        "first_quarter": list(range(quarter)),
        "second_quarter": list(range(quarter, 2 * quarter)),
        "third_quarter": list(range(2 * quarter, 3 * quarter)),
        "fourth_quarter": list(range(3 * quarter, n)),
    }


def hybrid_layers(n: int) -> list[int]:
    """The layers the hybrid model takes from the relation model: ``n // 2`` to ``n - 1``."""
    return list(range(n // 2, n))


def resolve_layers(spec: LayerSpec, n: int) -> list[int] | None:
    """Layer indices from a patch config's ``layers`` entry, as the script reads it.

    ``None`` stays None (the patch then does nothing); a group name gives the group; an int
    gives itself; a range or a list (of names, ints and ranges) gives the sorted union.

    Raises:
        ValueError: An unknown group name, or a layer outside ``0..n-1``.
        TypeError: An item that is not a name, an int or a range.
    """
    if spec is None:
        return None
    groups = layer_groups(n)
    items = [spec] if isinstance(spec, (str, int, range)) else list(spec)
    layers: set[int] = set()
    for item in items:
        if isinstance(item, str):
            if item not in groups:
                raise ValueError(f"Unknown layer group {item!r}; known: {', '.join(groups)}.")
            layers.update(groups[item])
        elif isinstance(item, range):
            layers.update(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            layers.add(item)
        else:
            raise TypeError(
                f"Cannot read a layer from {item!r}: give a group name, an int or a range."
            )
    for layer in layers:
        if not 0 <= layer < n:
            raise ValueError(f"Layer {layer} is outside a {n}-layer model.")
    return sorted(layers)


@dataclass(frozen=True)
class Patch:
    """One entry of a patch config: graft ``targets`` over ``layers`` at ``at``.

    Attributes:
        at: ``"other"`` (every token, applied first), the name of a span given to
            :func:`authors_run` (e.g. ``"first_actor"``), or a token index (``-1``: the last).
        targets: Names from :data:`TARGETS`.
        layers: See :func:`resolve_layers`. None (or an empty list) makes the patch a no-op on
            its tokens, which is how a complement leaves a span out.
    """

    at: str | int
    targets: frozenset[str] = frozenset()
    layers: LayerSpec = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", frozenset(self.targets))
        unknown = self.targets - EVERY_TARGET
        if unknown:
            raise ValueError(f"Unknown targets {sorted(unknown)}; known: {', '.join(TARGETS)}.")


@dataclass(frozen=True)
class AuthorsConfig:
    """One experiment configuration as the script runs it.

    Attributes:
        name: A label (the paper's: ``"FE+LT"``, ``"(FE+LT)^C"``...).
        patches: The patch config's entries; see :func:`token_patches` for their order.
        plain: ``None`` for a patched run; ``"recipient"`` or ``"donor"`` for the script's
            ``no_patching`` run, a whole forward pass of one model with nothing grafted and
            ``patch_lm_head`` ignored (PRE: the pretrained model, the ``sft2pre`` recipient;
            SFT: the finetuned model, the ``pre2sft`` recipient).
        patch_lm_head: One of :data:`PATCH_LM_HEAD`.
    """

    name: str
    patches: tuple[Patch, ...] = ()
    plain: str | None = None
    patch_lm_head: str = "never"

    def __post_init__(self) -> None:
        object.__setattr__(self, "patches", tuple(self.patches))
        if self.plain not in (None, "recipient", "donor"):
            raise ValueError(f"plain must be None, 'recipient' or 'donor', got {self.plain!r}.")
        if self.patch_lm_head not in PATCH_LM_HEAD:
            raise ValueError(
                f"patch_lm_head must be one of {PATCH_LM_HEAD}, got {self.patch_lm_head!r}."
            )
        names = [patch.at for patch in self.patches]
        if len(set(names)) != len(names):
            raise ValueError(f"A patch config has one entry per place; got {names}.")


@dataclass(frozen=True)
class TokenPatch:
    """What one token receives: the targets and the resolved layers (None: nothing)."""

    targets: frozenset[str]
    layers: list[int] | None

    @property
    def active(self) -> bool:
        """Whether the script loads anything at this token (it needs a non-empty layer list)."""
        return bool(self.layers)


@dataclass(frozen=True)
class AuthorsResult:
    """What the script records for one prompt, plus the whole distribution.

    Attributes:
        probability: Probability of the target token at the last position.
        rank: Number of tokens with a strictly higher probability (0 = top-1).
        top_ids: The ``top_k`` most likely token ids (``torch.topk`` order).
        top_probs: Their probabilities.
        target_id: The first token of ``" " + target``.
        input_ids: The prompt's token ids, as ``tokenizer(text)`` gives them.
        probs: The softmax over the vocabulary at the last position, ``[d_vocab]``.
        logits: The logits it came from, ``[d_vocab]``.
    """

    probability: float
    rank: int
    top_ids: list[int]
    top_probs: list[float]
    target_id: int
    input_ids: list[int]
    probs: torch.Tensor = field(repr=False)
    logits: torch.Tensor = field(repr=False)


# ------------------------------------------------------------------------------ positions


def find_span(input_ids: Sequence[int], tokenizer, text: str) -> tuple[int, int]:
    """``[start, end)`` of a span's first occurrence in the prompt's token ids.

    The script tries the span's text as given, then with its leading space removed (if it has
    one) or added (if not), each encoded with ``add_special_tokens=False``; the first variant
    whose ids occur wins, at its first occurrence.

    Raises:
        LookupError: No variant occurs (the script then skips the example with a warning).
    """
    variants = [text, text.lstrip()] if text.startswith(" ") else [text, " " + text]
    ids = list(input_ids)
    for variant in variants:
        needle = tokenizer.encode(variant, add_special_tokens=False)
        for start in range(len(ids) - len(needle) + 1):
            if ids[start : start + len(needle)] == needle:
                return start, start + len(needle)
    raise LookupError(f"None of {variants} occurs in the prompt's tokens {ids}.")


def token_patches(
    config: AuthorsConfig,
    input_ids: Sequence[int],
    tokenizer,
    spans: Mapping[str, str],
    n: int,
) -> dict[int, TokenPatch]:
    """The patch each token gets, in the script's order of precedence.

    First ``other`` on every token; then each named span on its tokens, in the config's order;
    then token indices. Each step replaces, on its tokens, whatever an earlier one set.

    Args:
        config: The configuration.
        input_ids: The prompt's token ids.
        tokenizer: Used to find spans.
        spans: Span name -> its text in the prompt (e.g. ``{"first_actor": "Keanu Reeves"}``).
        n: Number of layers of the model.

    Raises:
        KeyError: A patch names a span not in ``spans``.
        LookupError: A span's tokens do not occur in the prompt.
        IndexError: A token index outside the prompt.
    """
    length = len(input_ids)
    result: dict[int, TokenPatch] = {}

    def place(patch: Patch) -> TokenPatch:
        return TokenPatch(patch.targets, resolve_layers(patch.layers, n))

    for patch in config.patches:
        if patch.at == "other":
            for index in range(length):
                result[index] = place(patch)
    for patch in config.patches:
        if isinstance(patch.at, str) and patch.at != "other":
            if patch.at not in spans:
                raise KeyError(f"The config patches span {patch.at!r}; give its text in spans=.")
            start, end = find_span(input_ids, tokenizer, spans[patch.at])
            for index in range(start, end):
                result[index] = place(patch)
    for patch in config.patches:
        if isinstance(patch.at, int):
            index = patch.at + length if patch.at < 0 else patch.at
            if not 0 <= index < length:
                raise IndexError(f"Token index {patch.at} is outside a {length}-token prompt.")
            result[index] = place(patch)
    return result


# ------------------------------------------------------------------------------ the run


def _load(recipient: nn.Module, donor: nn.Module, path: str) -> None:
    """Copy the donor's module at ``path`` into the recipient's, in place (keeps ties)."""
    recipient.get_submodule(path).load_state_dict(donor.get_submodule(path).state_dict())


@torch.no_grad()
def build_hybrid(task: nn.Module, relation: nn.Module) -> nn.Module:
    """The hybrid model: a copy of the task model with the relation model's O, MLP up and MLP
    down in layers ``n // 2 .. n - 1`` (the gate and everything else stay the task model's)."""
    layout = layout_of(task)
    hybrid = copy.deepcopy(task)
    for layer in hybrid_layers(n_layers(task)):
        for target in HYBRID_TARGETS:
            _load(hybrid, relation, f"{layout.layers}.{layer}.{layout.components[target]}")
    return hybrid


@torch.no_grad()
def patched_logits(
    recipient: nn.Module,
    donor: nn.Module,
    input_ids: torch.Tensor,
    patches: Mapping[int, TokenPatch],
    patch_lm_head: str = "never",
    hybrid: nn.Module | None = None,
) -> torch.Tensor:
    """The last token's logits of the script's token-by-token grafted run, ``[d_vocab]``.

    Args:
        recipient: The model every token starts from (deep-copied per token).
        donor: Where grafted weights come from.
        input_ids: ``[1, pos]`` token ids.
        patches: Token index -> :class:`TokenPatch` (see :func:`token_patches`).
        patch_lm_head: See :data:`PATCH_LM_HEAD`.
        hybrid: For the hybrid experiment: at the last token, the layer targets are loaded
            from this model instead of ``donor`` (the embeddings still from ``donor``, as the
            script switches donors inside its layer loop).
    """
    if patch_lm_head not in PATCH_LM_HEAD:
        raise ValueError(f"patch_lm_head must be one of {PATCH_LM_HEAD}, got {patch_lm_head!r}.")
    layout = layout_of(recipient)
    length = input_ids.shape[1]
    head_source = donor
    cache = None
    output = None
    for index in range(length):
        patch = patches.get(index)
        # The script deep-copies the recipient for every token. A token without a patch would
        # run an untouched copy, which computes exactly what the recipient does, so only
        # patched tokens pay for the copy here.
        model = recipient
        if patch is not None and patch.active:
            model = copy.deepcopy(recipient)
            if "embeddings" in patch.targets:
                _load(model, donor, layout.embeddings)
            for layer in patch.layers:
                for target, path in layout.components.items():
                    if target not in patch.targets:
                        continue
                    source = donor
                    if hybrid is not None and index == length - 1:
                        source = head_source = hybrid
                    _load(model, source, f"{layout.layers}.{layer}.{path}")
        # transformers 5.24 renamed the cache argument and output `past_key_values` -> `cache`.
        name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else None
        name = name or "past_key_values"
        output = model(
            input_ids[:, index : index + 1],
            use_cache=True,
            output_hidden_states=True,
            **{name: cache},
        )
        cache = getattr(output, name)
    if patch_lm_head == "always":
        # hidden_states[-1] is after the final norm in every family here.
        head = head_source.get_submodule(layout_of(head_source).lm_head)
        return head(output.hidden_states[-1])[0, -1]
    return output.logits[0, -1]


@torch.no_grad()
def authors_run(
    recipient: nn.Module,
    donor: nn.Module,
    tokenizer,
    text: str,
    target: str,
    config: AuthorsConfig,
    *,
    spans: Mapping[str, str] | None = None,
    hybrid: nn.Module | None = None,
    top_k: int = 20,
) -> AuthorsResult:
    """Run one prompt the way the authors' script does and score the target.

    Args:
        recipient: The model grafted into (the pretrained model in the paper's ``sft2pre``).
        donor: The model grafted from (the finetuned model; the task model for the hybrid).
        tokenizer: A Hugging Face tokenizer; ``tokenizer(text)`` decides the BOS.
        text: The prompt, ending right before the answer.
        target: The answer's text without a leading space (the script adds one).
        config: What to graft (see :func:`position_config`, :func:`component_config`,
            :func:`hybrid_config`).
        spans: Span name -> its text in the prompt, for patches that name a span.
        hybrid: The hybrid model (:func:`build_hybrid`) for the hybrid experiment.
        top_k: Length of the top list (the script's sweeps use 20).

    Returns:
        The target's probability and rank, the top tokens, and the whole distribution.
    """
    input_ids = tokenizer(text, return_tensors="pt")["input_ids"]
    target_id = tokenizer.encode(" " + target, add_special_tokens=False)[0]
    if config.plain is not None:
        model = recipient if config.plain == "recipient" else donor
        logits = model(input_ids).logits[0, -1]
    else:
        patches = token_patches(
            config, input_ids[0].tolist(), tokenizer, spans or {}, n_layers(recipient)
        )
        logits = patched_logits(recipient, donor, input_ids, patches, config.patch_lm_head, hybrid)
    probs = torch.softmax(logits, dim=-1)
    probability = probs[target_id].item()
    top_probs, top_ids = torch.topk(probs, top_k)
    return AuthorsResult(
        probability=probability,
        rank=int((probs > probability).sum().item()),
        top_ids=top_ids.tolist(),
        top_probs=top_probs.tolist(),
        target_id=int(target_id),
        input_ids=input_ids[0].tolist(),
        probs=probs,
        logits=logits,
    )


# ------------------------------------------------------------------------------ configurations

FIRST_ENTITY = "first_actor"
"""The span the script's position configs name for FE (a template field)."""

POSITION_CONFIGS: tuple[str, ...] = ("PRE", "SFT", "FE", "LT", "FE+LT", "(FE+LT)^C", "FE^C", "LT^C")
"""The paper's position-grafting labels, in its figures' order."""

POSITION_FILES: dict[str, str] = {
    "PRE": "no_patching.yaml (sft2pre)",
    "SFT": "no_patching.yaml (pre2sft)",
    "FE": "fe.yaml",
    "LT": "lt.yaml",
    "FE+LT": "fe_lt.yaml",
    "(FE+LT)^C": "fe_lt_complement.yaml",
    "FE^C": "not_fe.yaml",
    "LT^C": "not_lt.yaml",
}
"""The script's patch-config file behind each label (the files themselves are not released)."""


def position_config(name: str, patch_lm_head: str = "never") -> AuthorsConfig:
    """A position-grafting configuration: every target over every layer at some tokens.

    Complements graft ``other`` and give the left-out places a patch without layers, which
    loads nothing there.
    """
    fe, lt = Patch(FIRST_ENTITY, EVERY_TARGET, "all"), Patch(-1, EVERY_TARGET, "all")
    other = Patch("other", EVERY_TARGET, "all")
    skip_fe, skip_lt = Patch(FIRST_ENTITY), Patch(-1)
    patches = {
        "FE": (fe,),
        "LT": (lt,),
        "FE+LT": (fe, lt),
        "(FE+LT)^C": (other, skip_fe, skip_lt),
        "FE^C": (other, skip_fe),
        "LT^C": (other, skip_lt),
    }
    if name == "PRE":
        return AuthorsConfig(name, plain="recipient", patch_lm_head=patch_lm_head)
    if name == "SFT":
        return AuthorsConfig(name, plain="donor", patch_lm_head=patch_lm_head)
    if name not in patches:
        raise ValueError(f"Unknown position config {name!r}; known: {', '.join(POSITION_CONFIGS)}.")
    return AuthorsConfig(name, patches[name], patch_lm_head=patch_lm_head)


COMPONENT_TARGETS: dict[str, frozenset[str]] = {
    "ATTN": frozenset({"q", "k", "v"}),
    "O": frozenset({"o"}),
    "FFN": frozenset({"gate", "mlp_up", "mlp_down"}),
}
"""The paper's component labels as targets. FFN includes the gate, as in the sweep script's
example override for O+FFN; a label's targets that a family lacks do nothing there."""


def targets_of(spec: str | Sequence[str]) -> frozenset[str]:
    """Targets from ``"O+FFN"``-style labels and/or target names (``"o+mlp_up+mlp_down"``)."""
    parts = spec.split("+") if isinstance(spec, str) else list(spec)
    targets: set[str] = set()
    for part in parts:
        part = part.strip()
        if part in COMPONENT_TARGETS:
            targets |= COMPONENT_TARGETS[part]
        elif part in EVERY_TARGET:
            targets.add(part)
        elif part == "all":
            targets |= EVERY_TARGET
        else:
            raise ValueError(
                f"Unknown component {part!r}: use {', '.join(COMPONENT_TARGETS)} or {TARGETS}."
            )
    return frozenset(targets)


def component_config(
    components: str | Sequence[str], layers: LayerSpec, patch_lm_head: str = "never"
) -> AuthorsConfig:
    """Component grafting at the last token: ``components`` over ``layers`` (e.g. ``"fourth_quarter"``)."""
    name = f"{components if isinstance(components, str) else '+'.join(components)}@{layers}"
    return AuthorsConfig(
        name, (Patch(-1, targets_of(components), layers),), patch_lm_head=patch_lm_head
    )


def hybrid_config(
    first_entity: str | Sequence[str] | None = None,
    last_token: str | Sequence[str] = "ATTN+O+FFN",
    last_token_layers: LayerSpec = "all",
    patch_lm_head: str = "never",
) -> AuthorsConfig:
    """A hybrid configuration: ``last_token`` targets at the last token (loaded from the hybrid
    model, see :func:`build_hybrid`) and ``first_entity`` targets at the first entity over every
    layer (loaded from the task model). Run it with ``donor=task, hybrid=build_hybrid(task, relation)``.
    """
    patches = [Patch(-1, targets_of(last_token), last_token_layers)]
    if first_entity is not None:
        patches.insert(0, Patch(FIRST_ENTITY, targets_of(first_entity), "all"))
    if first_entity is None:
        label = "none"
    else:
        label = first_entity if isinstance(first_entity, str) else "+".join(first_entity)
    return AuthorsConfig(f"hybrid FE:{label}", tuple(patches), patch_lm_head=patch_lm_head)
