"""What a configuration means: the paper's released code, or this library's clean reading.

The paper's figures were made by the authors' released code
(``toddnief/dynamic-weight-grafting``), which does not always do what the paper's text
says, nor what a graft in this library does. A :class:`Semantics` holds one switch per
difference: :data:`REFERENCE` does what the released code does on every point (the one
default, :data:`DEFAULT_SEMANTICS`), :data:`CLEAN` grafts every component exactly as named.
A semantics is named by its :attr:`~Semantics.label` (``"reference+unembed=base"``), which
:func:`as_semantics` reads back and every results table records. The differences in prose:
docs/concepts/paper-code-library.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypedDict

from grafting_lens.analysis.batch import BOS_RULES, SPAN_RULES, TARGET_RULES
from grafting_lens.analysis.metrics import RANK_BY, TIE_RULES
from grafting_lens.core import defaults
from grafting_lens.core.errors import ArgumentTypeError, ExperimentError, check_known, did_you_mean
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

    The defaults are :data:`REFERENCE`'s, the code's (``Semantics()`` is
    :data:`DEFAULT_SEMANTICS`); :data:`CLEAN` sets every switch to the library's. Switches
    about *groups* (``all``, ``block``...) leave a component named on its own alone:
    ``Graft("LT", "all+unembed")`` takes the unembedding whatever ``unembed`` says.

    Attributes:
        unembed: Which unembedding decodes a grafted position: ``"base"`` (groups leave
            ``unembed`` out), ``"donor"`` (groups graft it), or ``"follow_embed"`` (the
            code): on a model whose embedding and unembedding are one matrix (GPT-2, Gemma;
            not Pythia), grafted wherever ``embed`` is, from the same source.
        lm_head: The code's ``patch_lm_head``: ``"never"`` (its figures) or ``"always"``,
            the donor's unembedding at the last token for every configuration that grafts
            something but is not a whole donor.
        final_norm: Whether groups graft the final norm (``ln_final``); the code never does.
        pos_embed: Whether groups graft a learned position embedding; the code never does.
        embed: Whether groups graft the token embedding (the code does).
        fused_qkv: ``"exact"``: ``q``, ``k`` and ``v`` are three components everywhere;
            ``"as_code"``: where Q, K and V are one fused matrix (GPT-2, NeoX), ``q``
            grafts all three and ``k``, ``v`` alone graft nothing.
        ffn_up_gate: Whether the paper's FFN-up takes the gate (``mlp_gate``) with the up
            projection (a reading: both presets say ``True``).
        layers: How named layer ranges are counted
            (:data:`~grafting_lens.models.layers.LAYER_ARITHMETICS`): ``"fractions"`` or the
            code's ``"quarters"`` (``n // 4``, remainder in the last quarter).
        bos: What precedes a prompt (:data:`~grafting_lens.analysis.batch.BOS_RULES`):
            ``"always"`` a BOS, or ``"tokenizer"``, what ``tokenizer(text)`` adds (the code).
        target: The answer's first token (:data:`~grafting_lens.analysis.batch.TARGET_RULES`):
            ``"in_context"`` or ``"standalone"`` (``" " + name`` alone, the code).
        spans: How the first entity's tokens are found
            (:data:`~grafting_lens.analysis.batch.SPAN_RULES`): ``"characters"`` or the code's
            ``"search"``.
        sft: What a *whole-donor* configuration (``all`` at ``ALL`` over ``all`` layers:
            ``SFT``, ``DONOR``, ``TASK``, ``RELATION``) is: ``"grafted"``, a graft like
            any other, or ``"donor"``, the donor model itself (the code).
        hybrid: The hybrid graft (figure 5): ``"clean"``
            (:data:`~grafting_lens.study.configs.HYBRID_CONFIGS`) or ``"code"``, the code's
            *hybrid model* (:func:`~grafting_lens.study.configs.code_hybrid_configs`).
        hybrid_last_token_layers: Over which layers the code's hybrid grafts at the last
            token: ``"last_half"`` (as the authors' sweep ran it) or ``"all"``.
        rank_by: What the answer's rank compares
            (:data:`~grafting_lens.analysis.metrics.RANK_BY`): ``"logit"`` or the code's
            ``"probability"``.
        ties: Who wins a tie (:data:`~grafting_lens.analysis.metrics.TIE_RULES`):
            ``"pessimistic"`` (the other token) or ``"optimistic"`` (the answer; the code).
        dtype: The models' precision: ``"checkpoint"`` (as stored) or a dtype's name (the
            code's: float32); a run given models of another dtype refuses to start.
        prompts: Whose wording the test prompts have
            (:data:`~grafting_lens.worlds.data.TEMPLATE_SETS`): ``"library"`` ("X starred in
            a movie alongside") or ``"code"`` ("X stars in in a movie alongside"); a run
            refuses test sets of the other wording.

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
            switch = isinstance(allowed[0], bool)
            if not (isinstance(value, bool) if switch else value in allowed):
                listed = ", ".join(map(repr, allowed))
                choices = (
                    "True or False (true or false in a label)" if switch else f"one of {listed}"
                )
                close = did_you_mean(str(value), [str(a) for a in allowed])
                raise ExperimentError(f"Semantics.{name} must be {choices}, got {value!r}.{close}")

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
"""The semantics of everything that takes one and is given none: the paper's released code.
The one place that names the default; every entry point reads it (:func:`semantics_or_default`)."""

PRESETS: dict[str, Semantics] = {"reference": REFERENCE, "clean": CLEAN}
"""The named semantics, by name."""


def semantics_or_default(value: Semantics | str | None) -> Semantics:
    """``value`` read by :func:`as_semantics`, or :data:`DEFAULT_SEMANTICS` for ``None``.

    Raises:
        ExperimentError, TypeError: As :func:`as_semantics`.
    """
    return as_semantics(DEFAULT_SEMANTICS if value is None else value)


def as_semantics(value: Semantics | str) -> Semantics:
    """A :class:`Semantics` from itself or its label: a preset's name, optionally followed by
    ``+field=value`` changes (``"reference+unembed=base"``, as :attr:`Semantics.label` writes).

    Raises:
        ExperimentError: An unknown preset or field, or a value the field does not take.
        TypeError: Neither a Semantics nor a string.
    """
    if isinstance(value, Semantics):
        return value
    if not isinstance(value, str):
        raise ArgumentTypeError(
            f"semantics must be a Semantics or its label ('reference', 'clean', "
            f"'reference+unembed=base'), got {type(value).__name__}."
        )
    preset, *changes = [part.strip() for part in value.split("+")]
    check_known(preset, PRESETS, "semantics", ExperimentError, " (optionally with +field=value)")
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
    if isinstance(allowed[0], bool):  # anything else is refused by Semantics, naming the field
        return {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(
            text.lower(), text
        )
    return text.replace("-", "_") if text.replace("-", "_") in allowed else text
