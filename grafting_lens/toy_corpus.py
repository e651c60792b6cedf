"""The toy world's text: the corpus its pretrained model reads, and the tokenizer trained on it.

The pretrained toy model must know the test actors' names without knowing who starred
with whom, and must have learned that a fact stated in one format can be asked in
another. :func:`pretraining_corpus` writes such a corpus: sentences naming one known
actor each, co-star facts about made-up people in several phrasings (the test formats
included), and filler. :func:`train_tokenizer` trains a GPT-2-style byte-level BPE on
it. Both are deterministic given the toy world's seed. Used by
:func:`grafting_lens.toy.build_toy_world`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from grafting_lens import data

__all__ = ["SPECIAL_TOKEN", "prepare_for_transformer_lens", "pretraining_corpus", "train_tokenizer"]

SPECIAL_TOKEN = "<|endoftext|>"
"""BOS, EOS, padding and unknown token of the toy tokenizer, as in GPT-2."""


def train_tokenizer(corpus: Sequence[str], config: Any) -> Any:
    """Train a GPT-2-style byte-level BPE on the corpus and wrap it for transformers.

    ``config`` is a :class:`grafting_lens.toy.ToyWorldConfig` (``vocab_size``,
    ``max_length``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        unk_token=SPECIAL_TOKEN,
        model_max_length=config.max_length,
        padding_side="right",
    )
    return prepare_for_transformer_lens(tokenizer, "grafting-lens-toy")


def prepare_for_transformer_lens(tokenizer: Any, name: str) -> Any:
    """What TransformerLens 4.3 reads of an in-memory tokenizer (see ``models._prepare_tokenizer``)."""
    tokenizer.init_kwargs["name_or_path"] = name
    tokenizer.init_kwargs["add_bos_token"] = True
    return tokenizer


# -------------------------------------------------------------------- corpus

_GENRES = ("drama", "comedy", "thriller", "horror", "romance", "western", "musical", "action film")
_TOPICS = (
    "the film industry",
    "growing up",
    "the award season",
    "a favourite director",
    "the craft of acting",
    "life on set",
    "learning new roles",
    "the theatre",
    "working with animals",
    "early auditions",
    "music",
    "travelling for work",
)
_AWARDS = ("best performance", "best supporting role", "a lifetime achievement", "best newcomer")
_ADJECTIVES = ("quiet", "busy", "rainy", "sunny", "cold", "warm", "windy", "bright")
_OBJECTS = ("a new camera", "an old script", "a red bicycle", "a small dog", "a long letter")
_CITIES = (
    "Springfield",
    "Riverside",
    "Fairview",
    "Lakewood",
    "Greenville",
    "Oakdale",
    "Bristol",
    "Franklin",
    "Madison",
    "Clinton",
    "Georgetown",
    "Salem",
    "Ashland",
    "Milton",
    "Dover",
)


def pretraining_corpus(config: Any, relations: Sequence[Any] = ()) -> list[str]:
    """Generic sentences a "pretrained" toy model has seen.

    Three kinds, mixed in shuffled order:

    * sentences about known actors (:data:`grafting_lens.data.REAL_ACTORS`), each
      naming exactly one of them, with random details, so the names and their
      tokens are familiar but no co-star relation between actors exists;
    * co-star facts about made-up people, each pair stated consistently in several
      phrasings, including the two test formats, so that querying a fact in a
      format it was not stated in is a learned skill, as in real LLMs;
    * filler sentences with the same vocabulary.

    ``config`` is a :class:`grafting_lens.toy.ToyWorldConfig` (``seed``,
    ``n_pretrain_pairs``, ``n_pretrain_documents``).
    """
    rng = random.Random(f"toy-corpus-{config.seed}")
    actors = list(data.REAL_ACTORS)
    # Made-up people must not share a name with any test actor (made-up ones included,
    # for the fake-actor dataset), or the corpus would give that actor a co-star.
    taken = set(actors) | {name for r in relations for name in (r.first_actor, r.second_actor)}
    pairs = _made_up_pairs(config.n_pretrain_pairs, taken, rng)

    def about_actor() -> str:
        actor = rng.choice(actors)
        templates = (
            "In an interview, {a} talked about {topic}.",
            "{a} won an award for {award} in {year}.",
            "Fans waited for hours to meet {a} at the premiere in {city}.",
            "{a} has worked in {genre}s for {n} years.",
            "Critics praised {a} for a role in a {genre} set in {city}.",
            "{a} was seen in {city} on a {adj} day with {obj}.",
            "Q: Who won an award for {award} in {year}? A: An actor named {a}.",
            "Q: Who gave an interview about {topic}? A: An actor named {a}.",
            "Q: Who was seen in {city} with {obj}? A: An actor named {a}.",
        )
        return rng.choice(templates).format(a=actor, **_details(rng))

    def about_pair() -> str:
        first, second, title = rng.choice(pairs)
        if rng.random() < 0.5:
            first, second = second, first
        templates = (
            "{a} starred in a movie alongside {b}.",
            "Q: Who starred in a movie with {a}? A: An actor named {b}.",
            "{a} and {b} appeared together in {title}.",
            "{a} starred in {title} with {b}, a {genre} set in {city}.",
            "In {title}, {a} shares the screen with {b}.",
            "Q: {a} is featured in {title} with who? A: {b}.",
        )
        return rng.choice(templates).format(a=first, b=second, title=title, **_details(rng))

    def filler() -> str:
        templates = (
            "The weather in {city} was {adj} on the day of the festival.",
            "A {genre} about {topic} opened in {city} in {year}.",
            "Someone in {city} found {obj} near the old theatre.",
        )
        return rng.choice(templates).format(**_details(rng))

    kinds = (about_actor, about_pair, filler)
    weights = (0.4, 0.5, 0.1)
    return [rng.choices(kinds, weights)[0]() for _ in range(config.n_pretrain_documents)]


def _details(rng: random.Random) -> dict[str, Any]:
    return {
        "topic": rng.choice(_TOPICS),
        "award": rng.choice(_AWARDS),
        "year": rng.randint(1970, 2024),
        "city": rng.choice(_CITIES),
        "genre": rng.choice(_GENRES),
        "n": rng.randint(2, 40),
        "adj": rng.choice(_ADJECTIVES),
        "obj": rng.choice(_OBJECTS),
    }


def _made_up_pairs(n: int, exclude: set[str], rng: random.Random) -> list[tuple[str, str, str]]:
    """Co-star pairs of made-up people (never a known actor) with a made-up title."""
    from faker import Faker

    fake = Faker("en_US")
    fake.seed_instance(rng.randint(0, 2**31))
    people: list[str] = []
    seen = set(exclude)
    while len(people) < 2 * n:
        name = f"{fake.first_name()} {fake.last_name()}"
        if name not in seen:
            seen.add(name)
            people.append(name)
    titles = [fake.catch_phrase().title() for _ in range(n)]
    return [(people[2 * i], people[2 * i + 1], titles[i]) for i in range(n)]
