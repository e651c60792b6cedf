"""Chat prompts: conversations through the tokenizer's own chat template, places named by role.

A prompt given as messages (``[{"role": "user", "content": "..."}]``) is rendered by
``tokenizer.apply_chat_template``, never by a template of ours, so the model sees what it was
trained on. Its places (spans of a :class:`ChatPrompt`) are the contents by role (``"user"``,
``"user_0"``...), ``"assistant_start"`` (the generation prompt) and ``"template"`` (every token
no content overlaps); :func:`chat_examples` makes examples that
:func:`~grafting_lens.analysis.batch.tokenize_examples` takes. See ``docs/how-to/own-prompts.md``.

Examples:
    >>> prompts = chat_examples([[{"role": "user", "content": "Who starred in Speed?"}]],
    ...                         "Keanu", tokenizer)
    >>> batch = tokenize_examples(prompts, tokenizer, spans="characters")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from grafting_lens.analysis.batch import BOS_RULES, SPAN_RULES
from grafting_lens.core import defaults
from grafting_lens.core.arguments import as_list, as_texts, shown
from grafting_lens.core.errors import (
    ArgumentTypeError,
    BatchError,
    SelectionError,
    check_known,
    refuse_first,
)

__all__ = ["ASSISTANT_START", "ROLES", "TEMPLATE", "ChatPrompt", "chat_examples", "is_chat"]

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have."""

ASSISTANT_START = "assistant_start"
"""The place of the tokens that open the assistant's turn (the generation prompt)."""

TEMPLATE = "template"
"""The place of the template's own tokens: every token no message's content overlaps."""

# Private-use characters: no content or template holds them, and trim leaves them be.
_MARKER = "\ue000grafting-lens-content-{}\ue000"


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A conversation as :func:`~grafting_lens.analysis.batch.tokenize_examples` takes it.

    Attributes:
        text: The rendered conversation (a BOS the tokenization adds cut from its start).
        target: The start of the assistant's reply, scored after ``text``.
        spans: Characters ``(start, end)`` of each place but ``"template"``: the roles'
            contents (``"user"``, ``"user_0"``...) and ``"assistant_start"``.
        relation_id: The conversation's index, labelling its rows.
        prompt_name: ``"chat"``.
        places: Every place as a span expression over ``spans``, ``"template"`` included
            (``"(system_0+user_0)^C"``).
    """

    text: str
    target: str
    spans: dict[str, tuple[int, int]]
    relation_id: int
    prompt_name: str = "chat"
    places: dict[str, str] = dataclasses.field(default_factory=dict)


def is_chat(prompts: Any) -> bool:
    """Whether ``prompts`` are messages: one conversation (a list or tuple of dicts, the
    first with a ``"role"``: records of prompts, ``{"text": ...}``, are not), or a list or
    tuple whose first item is one."""
    return _is_conversation(prompts) or (
        isinstance(prompts, (list, tuple)) and bool(prompts) and _is_conversation(prompts[0])
    )


def _is_conversation(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(message, Mapping) for message in value)
        and "role" in value[0]
    )


def chat_examples(
    prompts: Any,
    answer: str | Sequence[str],
    tokenizer: Any,
    *,
    bos: str = defaults.BOS,
    spans: str = defaults.SPANS,
) -> list[ChatPrompt]:
    """Render conversations through the tokenizer's chat template, as examples with places.

    A conversation ending in an assistant message is continued (a prefilled reply, without
    ``"assistant_start"``); any other is rendered with the generation prompt. A BOS the
    template writes (``{{ bos_token }}``) and the ``bos`` rule adds too is cut from
    :attr:`ChatPrompt.text`, so the rule puts it back rather than doubling it.

    Args:
        prompts: A conversation, a list of ``{"role": ..., "content": ...}`` (:data:`ROLES`),
            or a list of conversations with the same roles in the same order.
        answer: The start of the assistant's reply, one for all or one per conversation.
        tokenizer: A Hugging Face tokenizer with a chat template.
        bos: The ``bos`` rule the examples will be tokenized with (:data:`BOS_RULES`).
        spans: The ``spans`` rule they will be tokenized with (:data:`SPAN_RULES`; under
            ``"search"`` a place whose text occurs earlier in its prompt is refused).

    Returns:
        One :class:`ChatPrompt` per conversation.

    Raises:
        ArgumentTypeError: Something that is not a conversation where one is expected, a
            role or content that is not a string.
        SelectionError: No conversation, an empty one or content, a message without role or
            content, an unknown role, conversations with different roles, answers that do
            not match them, no chat template, one that rewrites a content, a place found
            earlier (``spans="search"``).
        BatchError: An unknown ``bos`` or ``spans`` rule.
    """
    check_known(bos, BOS_RULES, "bos rule", BatchError)
    check_known(spans, SPAN_RULES, "spans rule", BatchError)
    forms = "a conversation [{'role': 'user', 'content': '...'}] or a list of them"
    items = [prompts] if _is_conversation(prompts) else as_list(prompts, "prompts", forms)
    conversations = [_messages(item, f"prompts[{i}]") for i, item in enumerate(items)]
    answers = as_texts(answer, "answer", "the reply's start for all, or one per conversation")
    answers = answers * len(conversations) if isinstance(answer, str) else answers
    roles = [[message["role"] for message in messages] for messages in conversations]
    odd = next((i for i, these in enumerate(roles) if these != roles[0]), 0)
    refuse_first(
        SelectionError,
        [
            (
                getattr(tokenizer, "chat_template", None) is None,
                "The tokenizer has no chat template, so messages cannot be rendered: give the "
                "prompts as text, or set tokenizer.chat_template (e.g. the instruct model's, "
                "AutoTokenizer.from_pretrained(instruct_model).chat_template).",
            ),
            (
                odd,
                f"prompts[{odd}] has the roles {roles[odd]}, prompts[0] {roles[0]}: "
                "conversations asked together have the same roles in the same order, so that "
                "their places have the same names; ask the others in another call.",
            ),
            (
                len(answers) != len(conversations),
                f"answer= gives {len(answers)} answers for {len(conversations)} conversations: "
                "give one for all, or one per conversation.",
            ),
        ],
    )
    return [
        _example(messages, reply, index, tokenizer, bos, spans)
        for index, (messages, reply) in enumerate(zip(conversations, answers))
    ]


def _messages(conversation: Any, name: str) -> list[dict[str, str]]:
    """One conversation's messages as plain dicts, checked."""
    if not isinstance(conversation, (list, tuple)) or not all(
        isinstance(message, Mapping) for message in conversation
    ):
        raise ArgumentTypeError(
            f"{name} is {shown(conversation)}: a conversation is a list of messages, "
            "{'role': 'user', 'content': '...'}."
        )
    lacking = next(
        (i for i, m in enumerate(conversation) if not {"role", "content"} <= set(m)), None
    )
    refuse_first(
        SelectionError,
        [
            (not conversation, f"{name} is an empty conversation: give at least a user message."),
            (
                lacking is not None,
                f"{name}[{lacking}] is {shown(None if lacking is None else conversation[lacking])}: "
                "each message has a 'role' and a 'content'.",
            ),
        ],
    )
    for i, message in enumerate(conversation):
        check_known(message["role"], ROLES, f"{name}[{i}] role", SelectionError)
        if not isinstance(message["content"], str):
            raise ArgumentTypeError(
                f"{name}[{i}]['content'] is {shown(message['content'])}: a content is a string "
                "(write structured content as text)."
            )
        if not message["content"].strip():
            raise SelectionError(f"{name}[{i}]'s content is empty: drop the message or write one.")
    return [{"role": message["role"], "content": message["content"]} for message in conversation]


def _render(messages: list[dict[str, str]], tokenizer: Any, generation_prompt: bool) -> str:
    """The template's text: a last reply continued, else the generation prompt if asked."""
    continued = messages[-1]["role"] == "assistant"
    return str(
        tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=generation_prompt and not continued,
            continue_final_message=continued,
        )
    )


def _example(
    messages: list[dict[str, str]], reply: str, index: int, tokenizer: Any, bos: str, spans: str
) -> ChatPrompt:
    """One conversation rendered, its contents found between the template's pieces."""
    # Rendered with markers for contents, the template's own text; as given, those pieces
    # with the contents (perhaps stripped) between them, else the template rewrote a content.
    text = _render(messages, tokenizer, True)
    marked = [{**message, "content": _MARKER.format(i)} for i, message in enumerate(messages)]
    rest = _render(marked, tokenizer, True)
    generation = rest.removeprefix(_render(marked, tokenizer, False))
    pieces = []  # the template's text before each content, then after the last
    for i in range(len(messages)):
        head, found, rest = rest.partition(_MARKER.format(i))
        pieces.append(head if found else None)
    pieces.append(rest)

    named: dict[str, tuple[int, int]] = {}
    contents = []
    cursor = 0
    for i, message in enumerate(messages):
        content, piece, after = message["content"], pieces[i], pieces[i + 1]
        forms = (content, content.strip(), content.lstrip(), content.rstrip())
        written = next(
            (
                form
                for form in forms
                if piece is not None and text.startswith(piece + form + (after or ""), cursor)
            ),
            None,
        )
        if piece is None or written is None:
            raise SelectionError(
                f"The chat template does not write prompts[{index}][{i}]'s content "
                f"{shown(content)} as given (it rewrites, moves or drops it), so its place is "
                "unknown: give the rendered prompt as text, with places as pieces of it."
            )
        start = cursor + len(piece) + len(written) - len(written.lstrip())
        role = message["role"]
        indexed = f"{role}_{sum(m['role'] == role for m in messages[:i])}"
        named[indexed] = named[role] = (start, start + len(written.strip()))
        contents.append(indexed)
        cursor += len(piece) + len(written)
    if generation and text.endswith(generation):
        named[ASSISTANT_START] = (len(text) - len(generation), len(text))

    cut = _written_bos(text, tokenizer, bos)
    text = text[cut:]
    named = {name: (start - cut, end - cut) for name, (start, end) in named.items()}
    earlier = [name for name, (a, b) in named.items() if text.find(text[a:b]) < a]
    if spans == "search" and earlier:
        raise SelectionError(
            f"prompts[{index}]'s place {earlier[0]!r} "
            f"({shown(text[slice(*named[earlier[0]])])}) also occurs earlier in the prompt, "
            "where spans='search' finds it: tokenize with spans='characters' (in gl.graft, "
            "semantics=gl.study.CLEAN or a semantics with spans='characters')."
        )
    places = {name: name for name in named} | {TEMPLATE: f"({'+'.join(contents)})^C"}
    return ChatPrompt(text, reply, named, index, places=places)


def _written_bos(text: str, tokenizer: Any, bos: str) -> int:
    """How many leading characters of ``text`` are the BOS the ``bos`` rule adds as well."""
    written = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(written["input_ids"])
    if bos == "always":
        added = [
            tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ]
    elif bos == "tokenizer":
        full = list(tokenizer(text)["input_ids"])
        added = full[: len(full) - len(ids)]
    else:
        added = []
    if not added or ids[: len(added)] != added:
        return 0
    return int(written["offset_mapping"][len(added) - 1][1])
