"""The one default: how prompts become tokens and logits become scores when nobody says.

Every function that tokenizes prompts, scores an answer, words the test prompts or runs an
experiment (the ``REFERENCE`` semantics, :mod:`grafting_lens.study.semantics`) takes its
default from here, so two public calls chained with their defaults agree (the batch
:func:`~grafting_lens.analysis.batch.tokenize_examples` makes is the one ``run_experiment``
expects). The values are the paper's released code's choices, which its figures used.
"""

BOS = "tokenizer"
"""Before a prompt: what ``tokenizer(text)`` adds by itself (a BOS for Llama 3 and Gemma,
nothing for GPT-2 and SmolLM2), as every Hugging Face pipeline does."""

TARGET = "standalone"
"""The answer's first token: the answer (``" " + name``) tokenized on its own."""

SPANS = "search"
"""A named span's tokens: its text's tokens searched for in the prompt's."""

RANK_BY = "probability"
"""The answer's rank compares float32 probabilities."""

TIES = "optimistic"
"""A token tied with the answer does not push it down the ranking."""

PROMPTS = "code"
"""The test prompts' wording: the released code's ("X stars in in a movie alongside")."""
