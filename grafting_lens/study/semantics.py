"""What a configuration means: the paper's released code, or this library's clean reading.

The paper's figures were made by the authors' released code
(``toddnief/dynamic-weight-grafting``, ``src/kg/scripts/run_experiment.py``), and that
code does not always do what the paper's text says, nor what a graft in this library
does by default. Where they part, a run must say which it follows. A
:class:`Semantics` holds one switch per difference; two named instances cover the
two readings:

* :data:`REFERENCE` does what the released code does, on every point: on a model with
  tied embeddings a position whose embedding is grafted is also decoded through the
  donor's unembedding (``load_state_dict`` into a shared parameter); the final norm
  and GPT-2's position embedding are never grafted; the code's ``q`` target is the
  whole fused QKV matrix on GPT-2 and NeoX, where ``k`` and ``v`` name nothing;
  layer ranges are ``n // 4`` quarters; prompts carry the BOS only where the tokenizer
  adds one; the SFT (and every "whole donor") baseline is the finetuned model itself;
  the hybrid graft takes the code's hybrid model at the last token; the answer is the
  first token of ``" " + name`` tokenized on its own and ranked by probability, ties
  in its favour; models run in float32; the prompts are worded as the code's.
* :data:`CLEAN` is what this library did before the preset existed, and what its lens
  API (:class:`~grafting_lens.GraftMask`, :func:`~grafting_lens.grafting`, component
  groups) always does: every component grafted exactly as named, tied weights kept
  apart, the final norm and position embedding grafted with the other weights, round
  fractions of the depth, a BOS before every prompt, the answer's first token read in
  context and ranked by logit, ties against it.

Each switch can be flipped on its own, to ask what one difference does:
``dataclasses.replace(REFERENCE, unembed="base")`` is the code with the tie undone.
A semantics is named by its :attr:`~Semantics.label` (``"reference"``, ``"clean"``,
``"reference+unembed=base"``), which :func:`as_semantics` reads back, and which the
``semantics`` column of every results table records; the whole of it is part of a run's
fingerprint. docs/concepts/paper-code-library.md tells the differences in prose, with
what each moves on the toy world.

There is one default, :data:`DEFAULT_SEMANTICS`, which is :data:`REFERENCE`: whatever
takes a semantics and is given none runs as the paper's released code, so a configuration
name grafts the same weights everywhere. That is true of the command
(``grafting-lens run <experiment>``), :func:`~grafting_lens.study.named.run_named_experiment`,
:func:`~grafting_lens.study.runner.run_experiment`,
:func:`~grafting_lens.study.runner.run_position_grafting`, :class:`RunOptions
<grafting_lens.study.RunOptions>`, :func:`~grafting_lens.study.stacking.config_masks`,
:func:`~grafting_lens.study.stacking.resolve_configs`,
:func:`~grafting_lens.study.configs.resolve_components`,
:func:`~grafting_lens.study.specs.get_configs`, a new
:class:`~grafting_lens.study.specs.ExperimentSpec`, and of the wording of
:func:`~grafting_lens.study.testsets.make_test_sets` (the default semantics' ``prompts``,
the code's). Pass ``semantics="clean"`` (or :data:`CLEAN`) for the library's reading,
where a component means what it names. The lens's masks (:class:`~grafting_lens.GraftMask`,
:func:`~grafting_lens.grafting`) take no semantics and graft every component exactly as
named; its tokenization and scoring defaults are this default's
(``grafting_lens.core.defaults`` holds them, and :class:`Semantics` reads them there).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypedDict

from grafting_lens.analysis.batch import BOS_RULES, SPAN_RULES, TARGET_RULES
from grafting_lens.analysis.metrics import RANK_BY, TIE_RULES
from grafting_lens.core import defaults
from grafting_lens.core.errors import ExperimentError, did_you_mean
from grafting_lens.models.layers import LAYER_ARITHMETICS
from grafting_lens.worlds.data import TEMPLATE_SETS

__all__ = [
    "CLEAN",
    "DEFAULT_SEMANTICS",
    "PRESETS",
    "REFERENCE",
    "SEMANTICS_CHOICES",
    "Semantics",
    "as_semantics",
    "semantics_or_default",
]

SEMANTICS_CHOICES: dict[str, tuple[Any, ...]] = {
    "unembed": ("base", "donor", "follow_embed"),
    "lm_head": ("never", "always"),
    "final_norm": (True, False),
    "pos_embed": (True, False),
    "embed": (True, False),
    "fused_qkv": ("exact", "as_code"),
    "ffn_up_gate": (True, False),
    "layers": LAYER_ARITHMETICS,
    "bos": BOS_RULES,
    "target": TARGET_RULES,
    "spans": SPAN_RULES,
    "sft": ("grafted", "donor"),
    "hybrid": ("clean", "code"),
    "hybrid_last_token_layers": ("last_half", "all"),
    "rank_by": RANK_BY,
    "ties": TIE_RULES,
    "dtype": ("checkpoint", "float32", "bfloat16", "float16"),
    "prompts": TEMPLATE_SETS,
}
"""The values each field of :class:`Semantics` accepts."""


class TokenizationRules(TypedDict):
    """The arguments of :func:`~grafting_lens.analysis.batch.tokenize_examples` a semantics implies."""

    bos: str
    target: str
    spans: str


class ScoringRules(TypedDict):
    """The arguments of :class:`~grafting_lens.analysis.scoring.LastTokenScorer` a semantics implies."""

    rank_by: str
    ties: str


@dataclass(frozen=True)
class Semantics:
    """One switch per point where the paper's released code and this library part.

    The defaults are :data:`REFERENCE`'s, the code's on every switch (``Semantics()`` is
    :data:`DEFAULT_SEMANTICS`); :data:`CLEAN` sets every switch to the library's.
    Switches about *groups* (``all``, ``block``...) leave a component named on its own
    alone: ``Graft("LT", "all+unembed")`` takes the unembedding whatever ``unembed``
    says.

    Attributes:
        unembed: Which unembedding decodes a grafted position. ``"base"``: the base's,
            everywhere (groups leave ``unembed`` out). ``"donor"``: groups graft it, so
            a grafted position is decoded by its donor. ``"follow_embed"`` (the code):
            on a model whose embedding and unembedding are one matrix (GPT-2, Llama 3.2
            1B, Gemma; not Pythia) the unembedding follows the embedding, grafted
            wherever ``embed`` is, from the same source, because the code copies the
            donor's values into the shared parameter; on an untied model, the base's.
        lm_head: The code's ``patch_lm_head``: ``"never"`` (what its figures used) or
            ``"always"``, the donor's unembedding at the last token (after the base's
            final norm) for every configuration that grafts something, but not for the
            plain baselines (no graft; a whole donor). Its ``"last_token"`` value
            behaves as ``"never"`` there, so it is not offered.
        final_norm: Whether groups graft the final norm (``ln_final``); the code never does.
        pos_embed: Whether groups graft a learned position embedding (GPT-2's
            ``pos_embed``); the code never does.
        embed: Whether groups graft the token embedding (``embed``). The code does;
            ``False`` keeps the base's at grafted positions (and, with ``pos_embed``,
            is what ``--base-embeddings`` used to say).
        fused_qkv: ``"exact"``: ``q``, ``k`` and ``v`` are three components everywhere.
            ``"as_code"``: on an architecture whose Q, K and V are one fused matrix
            (GPT-2's ``c_attn``, NeoX's ``query_key_value``), ``q`` grafts all three
            and ``k``, ``v`` alone graft nothing, as the code's targets do. No paper
            configuration names ``q`` without ``k`` and ``v``.
        ffn_up_gate: Whether the paper's FFN-up takes the gate (``mlp_gate``) along
            with the up projection. The code's configuration files are not released,
            so this is a reading, not a fact: both presets say ``True``.
        layers: How named layer ranges are counted
            (:data:`~grafting_lens.models.layers.LAYER_ARITHMETICS`): ``"fractions"`` or the
            code's ``"quarters"`` (``n // 4``, remainder in the last quarter; "last
            half" = third and fourth quarters). They differ for depths that are not a
            multiple of four, e.g. Gemma 2B's 18 layers.
        bos: What precedes a prompt (:data:`~grafting_lens.analysis.batch.BOS_RULES`):
            ``"always"`` a BOS, or ``"tokenizer"``, what ``tokenizer(text)`` adds (a
            BOS for Llama 3 and Gemma, nothing for GPT-2 and Pythia), as the code.
        target: The answer's first token (:data:`~grafting_lens.analysis.batch.TARGET_RULES`):
            ``"in_context"`` or ``"standalone"`` (``" " + name`` alone, as the code).
        spans: How the first entity's (and the movie's) tokens are found
            (:data:`~grafting_lens.analysis.batch.SPAN_RULES`): ``"characters"`` or the code's
            ``"search"`` for the name's tokens; the same on the paper's prompts with
            byte-level tokenizers.
        sft: What a *whole-donor* configuration is, one grafting ``all`` at ``ALL``
            positions over ``all`` layers (``SFT``, ``DONOR``, ``TASK``,
            ``RELATION``): ``"grafted"``, a graft like any other (the group switches
            apply: with ``unembed="base"`` it is the donor decoded through the base's
            unembedding), or ``"donor"``, the donor model itself, as the code runs it
            (a plain forward pass of the finetuned model).
        hybrid: The hybrid graft (figure 5, the ``hybrid`` registry): ``"clean"``, the
            library's (task ATTN at LT over all layers, relation O+FFN there over the
            last half), or ``"code"``, the code's: at the last token every ATTN, O and
            FFN weight of its *hybrid model*, the task model with the relation model's
            O, FFN-up and FFN-down (not the gate) in layers ``n // 2`` onwards.
        hybrid_last_token_layers: Over which layers the code's hybrid grafts at the last
            token: ``"last_half"`` (the third and fourth quarters, as the authors'
            sweep overrode it when it ran the hybrid: commits ``14fb97a`` and
            ``4b085ae``) or ``"all"``. The configuration file itself is not released.
        rank_by: What the answer's rank compares
            (:data:`~grafting_lens.analysis.metrics.RANK_BY`): ``"logit"`` or ``"probability"``
            (the code's float32 softmax).
        ties: Who wins a tie (:data:`~grafting_lens.analysis.metrics.TIE_RULES`):
            ``"pessimistic"`` (the other token) or ``"optimistic"`` (the answer; the code).
        dtype: The models' precision: ``"checkpoint"`` (as stored) or a dtype's name.
            The code ran transformers 4.45, which loads float32 unless told otherwise.
            Models loaded here (the command, ``setup_experiment``) are loaded so; a
            run given models of another dtype refuses to start.
        prompts: Whose wording the test prompts have (:data:`~grafting_lens.worlds.data.TEMPLATE_SETS`):
            ``"library"`` ("X starred in a movie alongside") or ``"code"`` ("X stars
            in in a movie alongside", :data:`~grafting_lens.worlds.data.CODE_TEST_TEMPLATES`).
            Applies where test sets are made (:func:`~grafting_lens.study.testsets.make_test_sets`,
            the named experiments); a run refuses test sets of the other wording.

    Raises:
        ExperimentError: A value a field does not accept (:data:`SEMANTICS_CHOICES`).
    """

    # The code's value of every switch: Semantics() is the one default, REFERENCE.
    unembed: str = "follow_embed"
    lm_head: str = "never"
    final_norm: bool = False
    pos_embed: bool = False
    embed: bool = True
    fused_qkv: str = "as_code"
    ffn_up_gate: bool = True
    layers: str = "quarters"
    bos: str = defaults.BOS
    target: str = defaults.TARGET
    spans: str = defaults.SPANS
    sft: str = "donor"
    hybrid: str = "code"
    hybrid_last_token_layers: str = "last_half"
    rank_by: str = defaults.RANK_BY
    ties: str = defaults.TIES
    dtype: str = "float32"
    prompts: str = defaults.PROMPTS

    def __post_init__(self) -> None:
        for name, allowed in SEMANTICS_CHOICES.items():
            value = getattr(self, name)
            if isinstance(allowed[0], bool):
                if not isinstance(value, bool):
                    raise ExperimentError(f"Semantics.{name} must be True or False, got {value!r}.")
            elif value not in allowed:
                raise ExperimentError(
                    f"Semantics.{name} must be one of {', '.join(map(repr, allowed))}, got "
                    f"{value!r}.{did_you_mean(str(value), [str(a) for a in allowed])}"
                )

    @property
    def label(self) -> str:
        """The name of this semantics: ``"reference"``, ``"clean"``, or the nearer preset
        followed by what differs from it (``"reference+unembed=base"``)."""
        best = min(PRESETS, key=lambda name: len(self.differences(PRESETS[name])))
        changed = self.differences(PRESETS[best])
        return "+".join([best, *(f"{name}={_text(value)}" for name, value in changed.items())])

    def differences(self, other: Semantics) -> dict[str, Any]:
        """The fields where this semantics differs from ``other``, with this one's values."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(other, field.name)
        }

    def describe(self) -> dict[str, Any]:
        """Every switch and the label, JSON-ready (what a run's fingerprint records)."""
        return {"label": self.label, **dataclasses.asdict(self)}

    def tokenization(self) -> TokenizationRules:
        """The arguments of :func:`~grafting_lens.analysis.batch.tokenize_examples` it implies."""
        return {"bos": self.bos, "target": self.target, "spans": self.spans}

    def scoring(self) -> ScoringRules:
        """The arguments of :class:`~grafting_lens.analysis.scoring.LastTokenScorer` it implies."""
        return {"rank_by": self.rank_by, "ties": self.ties}


REFERENCE = Semantics()
"""The paper's released code, on every point (see :class:`Semantics`): the default."""

CLEAN = Semantics(
    unembed="base",
    lm_head="never",
    final_norm=True,
    pos_embed=True,
    embed=True,
    fused_qkv="exact",
    ffn_up_gate=True,
    layers="fractions",
    bos="always",
    target="in_context",
    spans="characters",
    sft="grafted",
    hybrid="clean",
    hybrid_last_token_layers="last_half",
    rank_by="logit",
    ties="pessimistic",
    dtype="checkpoint",
    prompts="library",
)
"""This library's own reading: components as named, tied weights apart (see :class:`Semantics`)."""

DEFAULT_SEMANTICS = REFERENCE
"""The semantics of everything that takes one and is given none (``semantics=None``), and
whose ``prompts`` is the default wording of
:func:`~grafting_lens.study.testsets.make_test_sets`: the paper's released code. The one
place that names the default; every entry point reads it (:func:`semantics_or_default`)."""

PRESETS: dict[str, Semantics] = {"reference": REFERENCE, "clean": CLEAN}
"""The named semantics, by name."""


def semantics_or_default(value: Semantics | str | None) -> Semantics:
    """``value`` read by :func:`as_semantics`, or :data:`DEFAULT_SEMANTICS` for ``None``.

    What every entry point calls with its ``semantics`` argument, so that all of them
    have the one default.

    Raises:
        ExperimentError, TypeError: As :func:`as_semantics`.
    """
    return as_semantics(DEFAULT_SEMANTICS if value is None else value)


def as_semantics(value: Semantics | str) -> Semantics:
    """A :class:`Semantics` from itself or its label.

    A label is a preset's name, optionally followed by ``+field=value`` changes:
    ``"reference"``, ``"clean"``, ``"reference+unembed=base"``,
    ``"reference+final_norm=true+bos=always"`` (what :attr:`Semantics.label` writes).

    Raises:
        ExperimentError: An unknown preset or field, or a value the field does not take.
        TypeError: Neither a Semantics nor a string.
    """
    if isinstance(value, Semantics):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"semantics must be a Semantics or its label ('reference', 'clean', "
            f"'reference+unembed=base'), got {type(value).__name__}."
        )
    preset, *changes = [part.strip() for part in value.split("+")]
    if preset not in PRESETS:
        raise ExperimentError(
            f"Unknown semantics {preset!r}.{did_you_mean(preset, PRESETS)} Known: "
            f"{', '.join(PRESETS)} (optionally followed by +field=value)."
        )
    updates: dict[str, Any] = {}
    for change in changes:
        name, equals, text = change.partition("=")
        name = name.strip().replace("-", "_")
        if not equals or name not in SEMANTICS_CHOICES:
            raise ExperimentError(
                f"Cannot read {change!r} in the semantics {value!r}: write +field=value with a "
                f"field of {', '.join(SEMANTICS_CHOICES)}.{did_you_mean(name, SEMANTICS_CHOICES)}"
            )
        updates[name] = _value(name, text.strip())
    return dataclasses.replace(PRESETS[preset], **updates)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _value(name: str, text: str) -> Any:
    """A field's value from its text (``true``/``false`` for switches, dashes allowed)."""
    allowed = SEMANTICS_CHOICES[name]
    if isinstance(allowed[0], bool):
        lowered = text.lower()
        if lowered in ("true", "yes", "1"):
            return True
        if lowered in ("false", "no", "0"):
            return False
        raise ExperimentError(f"Semantics.{name} is true or false, got {text!r}.")
    return text.replace("-", "_") if text.replace("-", "_") in allowed else text
