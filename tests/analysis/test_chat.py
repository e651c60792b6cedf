"""Chat prompts: rendered by the tokenizer's own template, each place exactly its tokens."""

from __future__ import annotations

import pytest
from conftest import make_tokenizer
from tokenizers import processors

from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.analysis.chat import chat_examples, is_chat
from grafting_lens.core.errors import ArgumentTypeError, BatchError, SelectionError
from grafting_lens.engine.positions import select_positions

CHATML = (  # SmolLM2-Instruct's template, without its default system prompt
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WITH_BOS = "{{ bos_token }}" + CHATML.replace("message['content']", "message['content'] | trim")

CONVERSATION = [
    {"role": "system", "content": "Answer with a name."},
    {"role": "user", "content": "Who starred in a movie with Sandra Bullock?"},
    {"role": "assistant", "content": "Keanu Reeves."},
    {"role": "user", "content": "And with Keanu?"},
]


def chat_tokenizer(template: str | None = CHATML, adds_bos: bool = False):
    tokenizer = make_tokenizer()
    if adds_bos:  # as Llama 3's and Gemma's: tokenizer(text) starts with the BOS
        tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
        )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    return tokenizer


def by_hand(text: str, tokenizer, start: int, end: int) -> set[int]:
    """The tokens overlapping characters ``start:end``, from the tokenizer's own offsets."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return {j for j, (a, b) in enumerate(offsets["offset_mapping"]) if a < end and b > start}


def positions(batch, expression: str) -> set[int]:
    chosen = select_positions(expression, batch.spans, batch.attention_mask)
    return set(chosen[0].nonzero()[:, 0].tolist())


@pytest.mark.parametrize(
    "template, bos, adds_bos",
    [
        (CHATML, "never", False),
        (CHATML, "tokenizer", False),  # SmolLM2: no BOS written, none added
        (WITH_BOS, "never", False),
        (WITH_BOS, "always", False),
        (WITH_BOS, "tokenizer", True),  # Llama 3, Gemma: written and added, kept once
    ],
)
def test_a_conversation_is_the_templates_tokens_and_each_place_exactly_its_own(
    template, bos, adds_bos
):
    tokenizer = chat_tokenizer(template, adds_bos)
    [prompt] = chat_examples(CONVERSATION, "Sandra", tokenizer, bos=bos, spans="characters")
    batch = tokenize_examples([prompt], tokenizer, bos=bos, spans="characters")
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    expected = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=True
    )
    expected = list(getattr(expected, "input_ids", expected))
    assert prompt.text == (rendered.removeprefix("<|endoftext|>") if bos != "never" else rendered)
    assert batch.tokens[0].tolist() == expected  # the template's tokens, one BOS
    contents = set()
    cursor = 0
    for name, index in [("system", 0), ("user_0", 1), ("assistant", 2), ("user", 3)]:
        content = CONVERSATION[index]["content"]
        cursor = rendered.index(content, cursor)
        wanted = by_hand(rendered, tokenizer, cursor, cursor + len(content))
        assert positions(batch, prompt.places[name]) == wanted, name
        contents |= wanted
    opening = rendered.rindex("<|im_start|>assistant\n")
    assert positions(batch, "assistant_start") == by_hand(
        rendered, tokenizer, opening, len(rendered)
    )
    assert positions(batch, prompt.places["template"]) == set(range(len(expected))) - contents
    assert batch.target_ids[0] == tokenizer("Sandra", add_special_tokens=False)["input_ids"][0]


def test_a_prefilled_reply_is_continued_and_conversations_share_their_places():
    tokenizer = chat_tokenizer()
    prefilled = [CONVERSATION[1], {"role": "assistant", "content": "The actor is"}]
    other = [{"role": "user", "content": "And with Keanu?"}, prefilled[1]]
    prompts = chat_examples([prefilled, other], [" Keanu", " Hugh"], tokenizer)
    assert prompts[0].text.endswith("<|im_start|>assistant\nThe actor is")
    assert "assistant_start" not in prompts[0].spans
    batch = tokenize_examples(prompts, tokenizer)
    assert batch.tokens.shape[0] == 2 and set(batch.spans) == {
        "user",
        "user_0",
        "assistant",
        "assistant_0",
        "last_token",
    }
    assert is_chat(prefilled) and is_chat([prefilled]) and not is_chat(["a prompt"])


@pytest.mark.parametrize(
    "prompts, answer, change, error, message",
    [
        ([], "a", None, SelectionError, r"prompts=\[\] holds nothing"),
        ([[]], "a", None, SelectionError, r"prompts\[0\] is an empty conversation"),
        (["Hi"], "a", None, ArgumentTypeError, r"prompts\[0\] is 'Hi': a conversation is a list"),
        (
            [{"role": "user"}],
            "a",
            None,
            SelectionError,
            r"prompts\[0\]\[0\] is .*'role' and a 'content'",
        ),
        (
            [{"role": "bot", "content": "Hi"}],
            "a",
            None,
            SelectionError,
            r"Unknown prompts\[0\]\[0\] role 'bot'.*Known: system, user, assistant, tool",
        ),
        ([{"role": 1, "content": "Hi"}], "a", None, ArgumentTypeError, r"prompts\[0\]\[0\] role 1"),
        (
            [{"role": "user", "content": ["Hi"]}],
            "a",
            None,
            ArgumentTypeError,
            r"\['content'\] is \['Hi'\]: a content is a string",
        ),
        (
            [{"role": "user", "content": " "}],
            "a",
            None,
            SelectionError,
            r"content is empty: drop the message",
        ),
        (
            [[CONVERSATION[1]], CONVERSATION[:2]],
            "a",
            None,
            SelectionError,
            r"prompts\[1\] has the roles.*another call",
        ),
        ([CONVERSATION], ["a", "b"], None, SelectionError, r"2 answers for 1 conversations"),
        (CONVERSATION, "", None, SelectionError, r"answer\[0\] is ''"),
        (
            CONVERSATION,
            "a",
            {"chat_template": None},
            SelectionError,
            r"no chat template.*tokenizer.chat_template",
        ),
        (
            CONVERSATION,
            "a",
            {"chat_template": CHATML.replace("message['content']", "message['content'] | upper")},
            SelectionError,
            r"does not write prompts\[0\]\[0\]'s content",
        ),
        (
            CONVERSATION,
            "a",
            {"spans": "search"},
            SelectionError,
            r"'assistant_start'.*occurs earlier.*spans='characters'",
        ),
        (CONVERSATION, "a", {"bos": "first"}, BatchError, r"Unknown bos rule 'first'"),
    ],
)
def test_chat_examples_refuses_with_the_fix(prompts, answer, change, error, message):
    change = dict(change or {})
    tokenizer = chat_tokenizer(change.pop("chat_template", CHATML))
    with pytest.raises(error, match=message):
        chat_examples(prompts, answer, tokenizer, **{"spans": "characters", **change})
