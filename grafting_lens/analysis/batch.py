"""The tokenized batch: the one form in which prompts reach every runner.

A :class:`TokenizedExamples` holds right-padded prompts, their attention mask, the answer's
first token per row and named ``[batch, pos]`` spans. :func:`tokenize_examples` builds it from
examples (a ``text``, a ``target`` and character ``spans``); every runner takes it through
:func:`as_batch`, the one place a batch is checked.

Examples:
    >>> batch = tokenize_examples(examples, models.tokenizer)
    >>> checked = as_batch(batch, models)  # what a runner does first
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Int

from grafting_lens.core import defaults
from grafting_lens.core.arguments import shown
from grafting_lens.core.errors import ArgumentTypeError, BatchError, refuse_first
from grafting_lens.engine.positions import row_lengths

if TYPE_CHECKING:
    from grafting_lens.models.model_set import ModelSet

__all__ = [
    "BATCH_PARTS",
    "BOS_RULES",
    "SPAN_RULES",
    "TARGET_RULES",
    "TokenizedExamples",
    "as_batch",
    "tokenize_examples",
]

BATCH_PARTS = ("tokens", "attention_mask", "target_ids", "spans")
"""What any object passed as a batch must have."""


@dataclass
class TokenizedExamples:
    """A padded batch of test prompts with token-position masks for grafting.

    Attributes:
        examples: The examples kept, one per row (``None`` for a batch built without).
        tokens: Token ids, right padded with the pad id (the EOS id if there is none).
        attention_mask: 1 on real tokens (including a prepended BOS), 0 on padding.
        target_ids: The first token of each example's target: the correct next token.
        target_full_ids: Every token of each target (``None`` for a batch built without).
        spans: Boolean position masks: the examples' ("first_entity", "relation"...) and
            "last_token" (LT). The BOS is never in a span.
        dropped: Examples that could not be used, each with the reason.
        rules: :func:`tokenize_examples`' ``bos``, ``target`` and ``spans`` (``None`` for a
            batch built by hand): a run whose semantics tokenizes otherwise refuses it.
    """

    examples: list[Any] | None
    tokens: Int[torch.Tensor, "batch pos"]
    attention_mask: Int[torch.Tensor, "batch pos"]
    target_ids: Int[torch.Tensor, " batch"]
    target_full_ids: list[list[int]] | None
    spans: dict[str, Bool[torch.Tensor, "batch pos"]]
    dropped: list[tuple[Any, str]] = field(default_factory=list)
    rules: dict[str, str] | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device | str) -> TokenizedExamples:
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(
            self,
            tokens=self.tokens.to(device),
            attention_mask=self.attention_mask.to(device),
            target_ids=self.target_ids.to(device),
            spans={name: mask.to(device) for name, mask in self.spans.items()},
        )

    def rows(self, index: Sequence[int] | torch.Tensor) -> TokenizedExamples:
        """The rows ``index``, cut to the longest of them (so a pass computes no extra padding)."""
        index = torch.as_tensor(index, dtype=torch.long)
        attention_mask = self.attention_mask[index]
        length = int(attention_mask.sum(dim=1).max())
        chosen = index.tolist()
        return TokenizedExamples(
            examples=None if self.examples is None else [self.examples[i] for i in chosen],
            tokens=self.tokens[index, :length],
            attention_mask=attention_mask[:, :length],
            target_ids=self.target_ids[index],
            target_full_ids=(
                None if self.target_full_ids is None else [self.target_full_ids[i] for i in chosen]
            ),
            spans={name: span[index, :length] for name, span in self.spans.items()},
            rules=self.rules,
        )


def as_batch(tokenized: Any, models: ModelSet) -> TokenizedExamples:
    """Check a tokenized batch against a model set, once, and return it on the CPU.

    Args:
        tokenized: A :class:`TokenizedExamples`, or anything with ``tokens``,
            ``attention_mask`` (``None``: no padding), ``target_ids`` and ``spans``
            (optionally ``examples``, ``target_full_ids``, ``dropped``, ``rules``).
        models: The model set the batch will run on (its vocabulary bounds the ids).

    Returns:
        A new :class:`TokenizedExamples` with ``long`` CPU tensors.

    Raises:
        BatchError: A missing part, parts that disagree with the tokens, bad rules.
        TokenError: Tokens or target ids outside the model's vocabulary.
        SelectionError: A mask that is not right padding, or a row without a real token.
    """
    missing = [name for name in BATCH_PARTS if not hasattr(tokenized, name)]
    if missing:  # none of them: not a batch at all, a wrong type
        raise (BatchError if len(missing) < len(BATCH_PARTS) else ArgumentTypeError)(
            f"Expected a tokenized batch with tokens, attention_mask, target_ids and spans; "
            f"{type(tokenized).__name__} lacks {missing}. Build one with "
            "grafting_lens.analysis.batch.tokenize_examples(examples, models.tokenizer)."
        )
    tokens = torch.as_tensor(tokenized.tokens).cpu()
    shape = models.check_tokens(tokens, "tokens")
    attention_mask = (
        torch.ones(shape, dtype=torch.long)
        if tokenized.attention_mask is None
        else torch.as_tensor(tokenized.attention_mask).cpu().long()
    )
    target_ids = torch.as_tensor(tokenized.target_ids).cpu()
    spans = {name: torch.as_tensor(value).cpu() for name, value in dict(tokenized.spans).items()}
    examples = getattr(tokenized, "examples", None)
    parts = {
        "attention_mask": (tuple(attention_mask.shape), shape),
        "target_ids": (tuple(target_ids.shape), (shape[0],)),
        **{f"span {name!r}": (tuple(value.shape), shape) for name, value in spans.items()},
        "examples": ((shape[0] if examples is None else len(examples),), (shape[0],)),
    }
    wrong = [f"{name} {got}, expected {want}" for name, (got, want) in parts.items() if got != want]
    if wrong:
        raise BatchError(f"Parts of the batch do not fit its tokens {shape}: {'; '.join(wrong)}.")
    row_lengths(shape, attention_mask)  # right padding, no empty row
    models.check_tokens(target_ids[:, None], "target_ids")
    return TokenizedExamples(
        examples=None if examples is None else list(examples),
        tokens=tokens,
        attention_mask=attention_mask,
        target_ids=target_ids.long(),
        target_full_ids=getattr(tokenized, "target_full_ids", None),
        spans=spans,
        dropped=list(getattr(tokenized, "dropped", None) or []),
        rules=_rules(getattr(tokenized, "rules", None)),
    )


def _rules(rules: Any) -> dict[str, str] | None:
    """A batch's recorded tokenization rules, checked and copied (``None``: not recorded)."""
    if rules is None:
        return None
    if not isinstance(rules, Mapping) or set(rules) != {"bos", "target", "spans"}:
        raise BatchError(
            f"A batch's rules are tokenize_examples' bos, target and spans, e.g. "
            f"{{'bos': 'always', 'target': 'in_context', 'spans': 'characters'}}, got "
            f"{rules!r}; set rules=None for a batch built by hand."
        )
    return {name: str(rules[name]) for name in ("bos", "target", "spans")}


BOS_RULES: tuple[str, ...] = ("always", "tokenizer", "never")
"""What goes before a prompt: ``"always"`` a BOS (the EOS without one); ``"tokenizer"`` what
``tokenizer(text)`` adds by itself, as the paper's code (a BOS for Llama 3 and Gemma,
nothing for GPT-2 and Pythia); ``"never"`` nothing."""

TARGET_RULES: tuple[str, ...] = ("in_context", "standalone")
"""The answer's first token: ``"in_context"`` from the tokenization of ``text + target``
(how the model reads it); ``"standalone"`` from ``target`` tokenized alone (the paper's code)."""

SPAN_RULES: tuple[str, ...] = ("characters", "search")
"""How a character span becomes positions: ``"characters"`` the tokens overlapping it;
``"search"`` the first occurrence of its tokens (as given, then with a leading space added
or removed), as the paper's code; an example whose span is not found is dropped."""


def _span_positions(
    example: Any,
    span_names: Sequence[str],
    offsets: Sequence[tuple[int, int]] | None,
    ids: Sequence[int],
    tokenizer: Any,
) -> dict[str, list[int]] | str:
    """Token indices (before any BOS) of each span, or why a span cannot be mapped."""
    positions = {}
    for name in span_names:
        start, end = example.spans[name]
        if not 0 <= start < end <= len(example.text):
            return f"span {name!r} {(start, end)} is empty or outside the text (length {len(example.text)})"
        piece = example.text[start:end]
        if offsets is not None:
            # Zero-width tokens (a < b fails) carry no characters and so belong to no span.
            found = [j for j, (a, b) in enumerate(offsets) if a < b and a < end and b > start]
            if not found:
                return f"span {name!r} (characters {start}-{end}, {piece!r}) overlaps no token"
        else:
            variants = [piece, piece.lstrip()] if piece.startswith(" ") else [piece, " " + piece]
            for needle in tokenizer(variants, add_special_tokens=False)["input_ids"]:
                matches = [
                    first
                    for first in range(len(ids) - len(needle) + 1)
                    if needle and list(ids[first : first + len(needle)]) == list(needle)
                ]
                if matches:
                    found = list(range(matches[0], matches[0] + len(needle)))
                    break
            else:
                return f"span {name!r} ({piece!r}): its tokens, as or without a leading space, do not occur in the prompt's"
        positions[name] = found
    return positions


def _tokenizer_prefix(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """The special tokens ``tokenizer(text)`` puts before each text (none after it)."""
    with_special = tokenizer(list(texts))["input_ids"]
    plain = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    prefixes = []
    for text, full, bare in zip(texts, with_special, plain):
        full, bare = list(full), list(bare)
        cut = len(full) - len(bare)
        if cut < 0 or full[cut:] != bare:
            raise BatchError(
                f"The tokenizer adds tokens after (or inside) the text {text!r} "
                f"({full} against {bare} without special tokens), so the prompt would not end "
                "on its own last token; tokenize with bos='always' or bos='never'."
            )
        prefixes.append(full[:cut])
    return prefixes


def tokenize_examples(
    examples: Sequence[Any],
    tokenizer: Any,
    *,
    bos: str = defaults.BOS,
    target: str = defaults.TARGET,
    spans: str = defaults.SPANS,
) -> TokenizedExamples:
    """Tokenize test prompts and map their character spans to token positions.

    The defaults are the paper's code's. An example is dropped, never silently
    (:attr:`TokenizedExamples.dropped` and a warning), when a span is not found or outside
    the text, the target adds no token or holds the unknown token, or (in context) the
    prompt's last token merges with the target, so that "the next token" is not defined.

    Args:
        examples: Examples (``make_examples``, or by hand), all with the same span names.
        tokenizer: A Hugging Face *fast* tokenizer (offsets are needed).
        bos: What comes before each prompt, one of :data:`BOS_RULES`.
        target: Which token is the answer's first, one of :data:`TARGET_RULES`.
        spans: How spans become token positions, one of :data:`SPAN_RULES`.

    Raises:
        TypeError: A tokenizer that is not fast.
        BatchError: No examples, different span names, every example dropped, a tokenizer
            without the ids needed or adding tokens after a text, an unknown rule.
    """
    for name, value, allowed in (
        ("bos", bos, BOS_RULES),
        ("target", target, TARGET_RULES),
        ("spans", spans, SPAN_RULES),
    ):
        if value not in allowed:
            raise BatchError(
                f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}."
            )
    examples = list(examples)
    stray = next((i for i, e in enumerate(examples) if not hasattr(e, "spans")), -1)
    refuse_first(
        ArgumentTypeError,
        [
            (
                stray >= 0,
                f"examples[{stray}] is {shown(examples[stray] if examples else None)}: "
                "tokenize_examples takes Example objects (make_examples, read_prompts); for "
                "prompts as text, use gl.graft.",
            ),
            (
                not getattr(tokenizer, "is_fast", False),
                "tokenize_examples needs a fast tokenizer for character offsets, got "
                f"{type(tokenizer).__name__}; load it with AutoTokenizer.from_pretrained(..., "
                "use_fast=True).",
            ),
        ],
    )
    span_names = list(examples[0].spans) if examples else []
    odd = [e for e in examples if set(e.spans) != set(span_names) or "last_token" in e.spans]
    if not examples or odd:
        raise BatchError(
            f"tokenize_examples needs examples, none with different span names or "
            f'"last_token" (it computes it): got {len(examples)} examples, spans '
            f"{[sorted(e.spans) for e in odd[:2]]} against {sorted(span_names)}. Tokenize "
            "each prompt type separately."
        )
    texts = [e.text for e in examples]
    eos = tokenizer.eos_token_id
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    refuse_first(
        BatchError,
        [
            (
                bos == "always" and first is None,
                "bos='always' but the tokenizer has neither a BOS nor an EOS token; pass "
                "bos='never'.",
            ),
            (
                pad_id is None,
                "the tokenizer has neither a pad nor an EOS token to pad with; set "
                "tokenizer.pad_token.",
            ),
        ],
    )
    if bos == "always":
        prefixes = [[first]] * len(examples)
    elif bos == "tokenizer":
        prefixes = _tokenizer_prefix(tokenizer, texts)
    else:
        prefixes = [[]] * len(examples)

    prompts = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    # In context, the answer's tokens as the model would see them: after the prompt.
    answer_texts = [e.text + e.target if target == "in_context" else e.target for e in examples]
    answers = [list(ids) for ids in tokenizer(answer_texts, add_special_tokens=False)["input_ids"]]

    unknown = getattr(tokenizer, "unk_token_id", None)
    kept: list[Any] = []
    rows: list[tuple[list[int], dict[str, list[int]], list[int]]] = []
    dropped: list[tuple[Any, str]] = []
    for i, example in enumerate(examples):
        ids = list(prompts["input_ids"][i])
        offsets = prompts["offset_mapping"][i] if spans == "characters" else None
        mapped = _span_positions(example, span_names, offsets, ids, tokenizer)
        answer = answers[i]
        reason: str | None = None
        if isinstance(mapped, str):
            reason = mapped
        elif not ids:
            reason = "the prompt tokenizes to no tokens"
        elif target == "in_context":
            if answer[: len(ids)] != ids:
                reason = f"the prompt's last token merges with the target {example.target!r} when tokenized together"
            elif len(answer) == len(ids):
                reason = f"the target {example.target!r} adds no tokens"
            answer = answer[len(ids) :]
        elif not answer:
            reason = f"the target {example.target!r} tokenizes to no tokens"
        if reason is None and unknown is not None and unknown in answer:
            reason = (
                f"the target {example.target!r} tokenizes to the unknown token "
                f"{tokenizer.unk_token!r} (id {unknown}), which stands for every word the "
                "tokenizer does not know, so the answer could not be told from another"
            )
        if reason is not None:
            dropped.append((example, reason))
            continue
        assert not isinstance(mapped, str)  # a reason was recorded above
        kept.append(example)
        prefix = list(prefixes[i])
        shifted = {name: [len(prefix) + j for j in columns] for name, columns in mapped.items()}
        rows.append((prefix + ids, shifted, answer))

    if dropped:
        reasons = "; ".join(
            f"relation {e.relation_id} ({e.prompt_name}): {why}" for e, why in dropped[:3]
        )
        more = f"; and {len(dropped) - 3} more" if len(dropped) > 3 else ""
        summary = f"dropped {len(dropped)} of {len(examples)} examples: {reasons}{more}"
        if not kept:
            raise BatchError(f"no example could be tokenized; {summary}.")
        warnings.warn(f"{summary}. See TokenizedExamples.dropped.", stacklevel=2)

    length = max(len(ids) for ids, _, _ in rows)
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    masks = {
        name: torch.zeros((len(rows), length), dtype=torch.bool)
        for name in [*span_names, "last_token"]
    }
    for row, (ids, positions, _) in enumerate(rows):
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
        for name, columns in positions.items():
            masks[name][row, columns] = True
        masks["last_token"][row, len(ids) - 1] = True
    return TokenizedExamples(
        examples=kept,
        tokens=tokens,
        attention_mask=attention_mask,
        target_ids=torch.tensor([answer[0] for _, _, answer in rows], dtype=torch.long),
        target_full_ids=[answer for _, _, answer in rows],
        spans=masks,
        dropped=dropped,
        rules={"bos": bos, "target": target, "spans": spans},
    )
