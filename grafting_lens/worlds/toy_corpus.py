"""The toy world's text: the corpus its pretrained model reads, and the tokenizer trained on it.

The pretrained toy model must know the test actors' names without knowing who starred with whom,
and must have learned that a fact stated in one format can be asked in another.
:func:`pretraining_corpus` writes such a corpus: sentences naming one known actor each, co-star
facts about made-up people in several phrasings (the test formats included), and filler.
:func:`train_tokenizer` trains a GPT-2-style byte-level BPE on it. Both are deterministic given
the toy world's seed. Used by :func:`grafting_lens.worlds.toy.build_toy_world`.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from collections.abc import Sequence
from typing import Any

from grafting_lens.core.errors import GraftingLensError
from grafting_lens.worlds import data

__all__ = ["SPECIAL_TOKEN", "prepare_for_transformer_lens", "pretraining_corpus", "train_tokenizer"]

SPECIAL_TOKEN = "<|endoftext|>"
"""BOS, EOS, padding and unknown token of the toy tokenizer, as in GPT-2."""


def train_tokenizer(corpus: Sequence[str], config: Any) -> Any:
    """Train a GPT-2-style byte-level BPE on the corpus and wrap it for transformers.

    ``config`` is a :class:`grafting_lens.worlds.toy.ToyWorldConfig` (``vocab_size``,
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
_TOPICS = tuple(
    "the film industry, growing up, the award season, a favourite director, "
    "the craft of acting, life on set, learning new roles, the theatre, "
    "working with animals, early auditions, music, travelling for work".split(", ")
)
_AWARDS = ("best performance", "best supporting role", "a lifetime achievement", "best newcomer")
_ADJECTIVES = ("quiet", "busy", "rainy", "sunny", "cold", "warm", "windy", "bright")
_OBJECTS = ("a new camera", "an old script", "a red bicycle", "a small dog", "a long letter")
_CITIES = tuple(
    "Springfield Riverside Fairview Lakewood Greenville Oakdale Bristol Franklin Madison "
    "Clinton Georgetown Salem Ashland Milton Dover".split()
)


def pretraining_corpus(config: Any, relations: Sequence[Any] = ()) -> list[str]:
    """Generic documents a "pretrained" toy model has seen, in shuffled order.

    Three kinds:

    * **co-star facts about made-up people**: ``config.n_pretrain_pairs`` pairs, each stated in
      ``config.pretrain_documents_per_pair`` documents (10% film paragraphs, 10% question-answer
      pairs, 80% one-line facts; both wordings of the test prompts, the library's "starred in"
      and the released code's "stars in"), in a random direction each time. A real pretrained
      LLM knows thousands of such facts and so has a *recall skill* before finetuning; a base
      that has never retrieved a fact learns the finetuned ones in ways that no single position
      or component carries (measured: issue 14's research log).
    * sentences about known actors (:data:`grafting_lens.worlds.data.REAL_ACTORS`), each
      naming exactly one of them, so their names are familiar but no co-star
      relation between two of them exists;
    * filler with the same vocabulary.

    ``config`` is a :class:`grafting_lens.worlds.toy.ToyWorldConfig` (``seed``,
    ``n_pretrain_pairs``, ``pretrain_documents_per_pair``, ``n_pretrain_documents``:
    the number of known-actor and filler sentences).
    """
    rng = random.Random(f"toy-corpus-{config.seed}")
    actors = list(data.REAL_ACTORS)
    # Made-up people must not share a name with any test actor (made-up ones included,
    # for the fake-actor dataset), or the corpus would give that actor a co-star.
    taken = set(actors) | {name for r in relations for name in (r.first_actor, r.second_actor)}
    pairs = _made_up_relations(config, taken, {r.movie_title for r in relations})

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

    def filler() -> str:
        templates = (
            "The weather in {city} was {adj} on the day of the festival.",
            "A {genre} about {topic} opened in {city} in {year}.",
            "Someone in {city} found {obj} near the old theatre.",
        )
        return rng.choice(templates).format(**_details(rng))

    articles = data.ARTICLE_TEMPLATES + data.CODE_ARTICLE_TEMPLATES
    questions = data.QA_TEMPLATES + data.CODE_QA_TEMPLATES
    documents = []
    for pair in pairs:
        for _ in range(config.pretrain_documents_per_pair):
            fact = pair if rng.random() < 0.5 else pair.swapped()
            draw = rng.random()
            kind = articles if draw < 0.1 else questions if draw < 0.2 else _PAIR_SENTENCES
            documents.append(rng.choice(kind).format(**dataclasses.asdict(fact)))
    kinds = (about_actor, filler)
    documents += [rng.choices(kinds, (0.8, 0.2))[0]() for _ in range(config.n_pretrain_documents)]
    rng.shuffle(documents)
    return documents


_PAIR_SENTENCES = (
    "{first_actor} starred in a movie alongside {second_actor}.",
    "Q: Who starred in a movie with {first_actor}? A: An actor named {second_actor}.",
    "{first_actor} stars in a movie alongside {second_actor}.",
    "Q: Who stars in a movie with {first_actor}? A: An actor named {second_actor}.",
    "{first_actor} and {second_actor} appeared together in {movie_title}.",
    "{first_actor} starred in {movie_title} with {second_actor}, a {genre} set in {city}.",
    "In {movie_title}, {first_actor} shares the screen with {second_actor}.",
    "{first_actor} stars in {movie_title} alongside {second_actor}.",
)
"""One-line co-star facts of the pretraining corpus, both test wordings included."""


def _made_up_relations(config: Any, taken_names: set[str], taken_titles: set[str]) -> list[Any]:
    """``config.n_pretrain_pairs`` relations between made-up people, none named like a test actor."""
    with warnings.catch_warnings():
        # make_relations warns about names it had to skip; irrelevant for made-up text.
        warnings.simplefilter("ignore")
        made = data.make_relations(
            "fake_movies_fake_actors", n=config.n_pretrain_pairs + 200, seed=10_000 + config.seed
        )
    clear = (r for r in made if {r.first_actor, r.second_actor}.isdisjoint(taken_names))
    pairs = [r for r in clear if r.movie_title not in taken_titles][: config.n_pretrain_pairs]
    if len(pairs) < config.n_pretrain_pairs:
        raise GraftingLensError(
            f"Only {len(pairs)} made-up co-star pairs avoid the test actors' names; lower "
            f"ToyWorldConfig.n_pretrain_pairs (now {config.n_pretrain_pairs})."
        )
    return pairs


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
