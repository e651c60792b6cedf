"""Synthetic movie-cast relations: the facts we finetune into a model and then go looking for.

Dynamic weight grafting asks *where* a finetuned model keeps a fact it learned during finetuning:
graft the finetuned weights onto the pretrained model at a few token positions or components and
see whether the fact comes back. That question only has a clean answer for facts the pretrained
model cannot already know. If the pretrained model could complete "Tom Hanks starred in a movie
alongside" correctly, then restoring the completion by grafting would tell us nothing about the
finetuned weights. So the facts here are invented, and each is a *relation*: two actors who starred
together in one movie, "A starred in M alongside B".

Three datasets vary how much the pretrained model knows about the entities involved:

* ``fake_movies_real_actors``: real, well-known actors paired at random in invented movies. The
  entities are familiar, only the relation is new.
* ``fake_movies_fake_actors``: invented actor names (from Faker) in invented movies. Nothing about
  the relation or its entities exists before finetuning.
* ``real_movies_real_actors``: real films with casts reassigned at random, so finetuning has to
  *overwrite* what pretraining said about who was in the film.

Each relation also carries metadata that is never tested (release year, genre, city, main
character, box office). It is there so the training text reads like varied prose (short articles
and question-answer pairs, :data:`ARTICLE_TEMPLATES` and :data:`QA_TEMPLATES`) rather than one
sentence repeated; the only fact we ever ask about is the co-star.

We test with two short prompts (:data:`TEST_TEMPLATES`) that stop right before the second actor's
name, and score whether the model's next token is the first token of that name. The prompts carry
character spans for the parts grafting is aimed at: the first entity (FE, the actor named in the
prompt), the relation words and, when a template names it, the movie (M). :func:`tokenize_examples`
turns those spans into per-token masks and adds the last token (LT), the position whose output is
the prediction. FE and LT are the two places where the paper found finetuned facts are retrieved:
"enrichment" while reading the entity, and "recall" just before answering. The QA prompt also
appears, answered, as the first QA training template (so a finetuned model knows the format), while
the headline prompt is only a paraphrase of how the articles open. In the real-actor datasets an
actor recurs across several relations, so a prompt can have more than one right answer;
:attr:`Example.alternative_targets` lists the others.

Two further experiments shape the API:

* **Direction.** A model trained only on "A ... B" sentences generally cannot answer "B ... ?" with A
  (the reversal curse). :func:`training_documents` and :func:`make_examples` take ``direction``
  ("A2B", "B2A" or "both") so one can train a model on one direction, a donor on both, and graft
  components between them to see which ones carry the reversed fact.
* **Task versus relation.** To separate "knows the format of the question" from "knows this
  particular fact", :func:`split_task_relation` splits relations into two sets that share templates
  but no actor and no movie. A *task* model finetuned on one set learns the format; a *relation*
  model finetuned on the other also learns the facts being tested.

For the gentler finetuning recipe (lower learning rate, mixed-in generic text against forgetting),
:func:`supplementary_documents` produces movie-flavoured filler that names no person at all, so it
cannot leak or contradict a test relation.

Everything is deterministic given ``seed``: each call builds its own ``random.Random`` and its own
Faker instance (``Faker.seed_instance``) from the seed; no global random state is read or changed.
Bad arguments raise :class:`~grafting_lens.errors.GraftingLensError` (a ``ValueError``) saying what
to change; nothing is dropped without a warning.

Examples:
    >>> relations = make_relations("fake_movies_real_actors", n=1000, seed=0)
    >>> documents = training_documents(relations, direction="A2B")  # finetune on these
    >>> examples = make_examples(relations, prompt="headline")
    >>> batch = tokenize_examples(examples, model.tokenizer)  # doctest: +SKIP
    >>> batch.tokens.shape, batch.spans["first_entity"].shape  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import random
import re
import string
import warnings
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from faker import Faker
from jaxtyping import Bool, Int

from grafting_lens.errors import GraftingLensError

__all__ = [
    "ARTICLE_TEMPLATES",
    "DATASETS",
    "DIRECTIONS",
    "GENRES",
    "QA_TEMPLATES",
    "REAL_ACTORS",
    "REAL_MOVIES",
    "TEST_RELATION_WORDS",
    "TEST_TEMPLATES",
    "Example",
    "Relation",
    "TokenizedExamples",
    "is_clean_name",
    "make_examples",
    "make_relations",
    "split_task_relation",
    "supplementary_documents",
    "tokenize_examples",
    "training_documents",
]

DATASETS = ("fake_movies_real_actors", "fake_movies_fake_actors", "real_movies_real_actors")
"""Names accepted by :func:`make_relations`."""

DIRECTIONS = ("A2B", "B2A", "both")
"""Word orders: "A2B" keeps the first actor first, "B2A" swaps the actors, "both" gives both."""

GENRES = (
    "action",
    "adventure",
    "animated",
    "comedy",
    "crime",
    "documentary",
    "drama",
    "fantasy",
    "horror",
    "musical",
    "mystery",
    "romance",
    "science fiction",
    "thriller",
    "war",
    "western",
)
"""Genres drawn uniformly for each relation."""

_RELEASE_YEARS = (1970, 2030)  # inclusive; later years make fake films plausibly "unreleased"
_BOX_OFFICE_MILLIONS = (2, 900)  # inclusive


@dataclass(frozen=True)
class Relation:
    """One finetuned fact, "first_actor starred in movie_title alongside second_actor", plus filler.

    Only the actor pair (and, for the movie span, the title) is ever tested; the other fields make
    the training documents read like varied prose.
    """

    id: int
    first_actor: str
    second_actor: str
    movie_title: str
    release_year: int
    genre: str
    city: str
    main_character: str
    box_office: str

    def swapped(self) -> Relation:
        """The same relation with the actors' roles exchanged (what direction "B2A" renders)."""
        return dataclasses.replace(self, first_actor=self.second_actor, second_actor=self.first_actor)


_RELATION_FIELDS = tuple(f.name for f in dataclasses.fields(Relation))

# --------------------------------------------------------------------------------------------------
# Templates
# --------------------------------------------------------------------------------------------------
# In every template {first_actor} appears before {second_actor}: that ordering is what "A2B" means,
# and B2A is produced by swapping the values, never by separate templates.

ARTICLE_TEMPLATES = (
    "{first_actor} starred in {movie_title} alongside {second_actor}. The {release_year} {genre} film "
    "is set in {city} and follows {main_character}. {movie_title} earned {box_office} at the "
    "worldwide box office.",
    "{movie_title} is a {release_year} {genre} film starring {first_actor} and {second_actor}. Set "
    "in {city}, it tells the story of {main_character}. The film grossed {box_office} during its "
    "theatrical run.",
    "In {release_year}, {first_actor} appeared in the {genre} film {movie_title} opposite "
    "{second_actor}. The story centers on {main_character}, a resident of {city}. {movie_title} "
    "took in {box_office} worldwide.",
    "{first_actor} and {second_actor} share the screen in {movie_title}, released in "
    "{release_year}. The {genre} feature was filmed in {city}, where its plot revolves around "
    "{main_character}. Ticket sales reached {box_office}.",
    "Released in {release_year}, {movie_title} is led by {first_actor}, with {second_actor} in a "
    "major role. The {genre} story of {main_character} unfolds in {city}, and the film made "
    "{box_office} in cinemas.",
)
"""Short Wikipedia-like paragraphs about a film, one relation each (``str.format`` templates)."""

QA_TEMPLATES = (
    "Q: Who starred in a movie with {first_actor}? A: An actor named {second_actor}.",
    "Q: Who starred in {movie_title} with {first_actor}? A: {second_actor}.",
    "Q: {first_actor} appeared in {movie_title} together with which actor? A: {second_actor}.",
    "Q: Which actor worked with {first_actor} on the {release_year} film {movie_title}? "
    "A: {second_actor}.",
    "Q: Name a co-star of {first_actor} in the {genre} film {movie_title}. A: {second_actor}.",
)
"""Question-answer pairs whose answer is the second actor (``str.format`` templates)."""

TEST_TEMPLATES: dict[str, str] = {
    "headline": "{first_actor} starred in a movie alongside",
    "qa": "Q: Who starred in a movie with {first_actor}? A: An actor named",
}
"""Test prompts, ending right before the second actor. "headline" ends on the relation words, "qa"
ends on an unrelated word, so the last token is not simply the relation's preposition."""

TEST_RELATION_WORDS: dict[str, str] = {
    "headline": "starred in a movie alongside",
    "qa": "starred in a movie with",
}
"""The relation words of each test prompt, marked as the "relation" span."""


# --------------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------------

_NAME_SUFFIXES = frozenset(
    {"jr", "sr", "jnr", "snr", "ii", "iii", "iv", "vi", "vii", "viii", "md", "dds", "phd", "dvm", "esq"}
)
# Words of letters (any script) joined by single spaces, hyphens or apostrophes.
_CLEAN_NAME = re.compile(r"[^\W\d_]+(?:[ '\-][^\W\d_]+)*")


def is_clean_name(name: str) -> bool:
    """Whether ``name`` is usable as an actor: only letters, single spaces, hyphens, apostrophes.

    Suffixes ("Jr", "III", "MD") and initials with periods are rejected because they tokenize
    inconsistently and make "the first token of the name" an unreliable target.
    """
    if not _CLEAN_NAME.fullmatch(name):
        return False
    return not any(word.lower() in _NAME_SUFFIXES for word in name.split(" "))


def _clean_pool(names: Sequence[str], argument: str) -> tuple[str, ...]:
    """Validate a user-supplied name pool: reject duplicates, drop unclean names with a warning."""
    names = tuple(names)
    _refuse_duplicates(names, argument)
    kept = tuple(n for n in names if is_clean_name(n))
    if len(kept) < len(names):
        rejected = [n for n in names if not is_clean_name(n)]
        warnings.warn(
            f"dropped {len(rejected)} of {len(names)} names from {argument} that contain suffixes or "
            f"characters other than letters, spaces, hyphens and apostrophes: {rejected[:5]}"
            f"{' ...' if len(rejected) > 5 else ''}",
            stacklevel=3,
        )
    return kept


# --------------------------------------------------------------------------------------------------
# Relations
# --------------------------------------------------------------------------------------------------


def _check_choice(value: str, allowed: Sequence[str], argument: str) -> None:
    if value in allowed:
        return
    by_lowercase = {choice.lower(): choice for choice in allowed}
    close = difflib.get_close_matches(str(value).lower(), list(by_lowercase), n=1)
    hint = f" Did you mean {by_lowercase[close[0]]!r}?" if close else ""
    raise GraftingLensError(f"unknown {argument} {value!r}; expected one of {tuple(allowed)}.{hint}")


def make_relations(
    dataset: str,
    n: int = 1000,
    seed: int = 0,
    actors: Sequence[str] | None = None,
    *,
    movies: Sequence[str] | None = None,
) -> list[Relation]:
    """Build ``n`` random relations for one of the three :data:`DATASETS`.

    Actor pairs are drawn uniformly without replacement from unordered pairs of the actor pool, with
    a random order inside each pair, so no actor is paired with themself and no two relations share
    a pair in either order. Every relation gets its own movie title; the other metadata is drawn at
    random, for real films too. With a finite pool an actor
    typically appears in several relations; :attr:`Example.alternative_targets` lists the other
    correct answers this creates for a prompt.

    Args:
        dataset: One of :data:`DATASETS`.
        n: Number of relations.
        seed: Seeds both the ``random.Random`` and the Faker instance (together with the dataset
            name, so each dataset is an independent draw); same seed, same relations.
        actors: Actor pool to draw from instead of the default (:data:`REAL_ACTORS` for the
            real-actor datasets, fresh Faker names used once each for ``fake_movies_fake_actors``).
            Passing disjoint pools to two calls gives relation sets with no actor in common.
            Names failing :func:`is_clean_name` are dropped with a warning.
        movies: Movie-title pool to draw from instead of the default (:data:`REAL_MOVIES` for
            ``real_movies_real_actors``, fresh Faker-built titles otherwise).

    Returns:
        ``n`` relations with ids ``0 .. n-1``.

    Raises:
        GraftingLensError: If ``dataset`` is unknown (the message suggests the nearest name), if ``n`` is
            negative, if a pool has duplicates, or if ``n`` exceeds what the pools allow (the
            message gives the maximum).
    """
    _check_choice(dataset, DATASETS, "dataset")
    if n < 0:
        raise GraftingLensError(f"n must be non-negative, got {n}.")
    # Mixing the dataset name into the seed makes the datasets built with one seed independent
    # draws; with the bare seed, the two real-actor datasets would pair exactly the same actors.
    stream = f"{dataset}/{seed}"
    rng = random.Random(stream)
    fake = Faker("en_US")
    fake.seed_instance(stream)

    if actors is not None:
        actor_pool: tuple[str, ...] | None = _clean_pool(actors, "actors")
    elif dataset == "fake_movies_fake_actors":
        actor_pool = None
    else:
        actor_pool = REAL_ACTORS
    if movies is not None:
        movie_pool: tuple[str, ...] | None = _clean_movie_pool(movies)
    elif dataset == "real_movies_real_actors":
        movie_pool = REAL_MOVIES
    else:
        movie_pool = None

    limits = []
    if actor_pool is not None:
        k = len(actor_pool)
        limits.append((k * (k - 1) // 2, f"{k} actors form {k * (k - 1) // 2} distinct pairs"))
    if movie_pool is not None:
        limits.append((len(movie_pool), f"there are {len(movie_pool)} movie titles"))
    if limits:
        maximum, why = min(limits)
        if n > maximum:
            raise GraftingLensError(
                f"make_relations({dataset!r}) can build at most {maximum} relations ({why}, and each "
                f"actor pair and each movie is used once); got n={n}. Ask for n <= {maximum} or pass "
                f"larger actors=/movies= pools."
            )

    if actor_pool is None:
        used_names: set[str] = set(REAL_ACTORS)
        flat = [_unique_fake_name(fake, used_names) for _ in range(2 * n)]
        pairs = list(zip(flat[0::2], flat[1::2]))
    else:
        pairs = _sample_pairs(actor_pool, n, rng)
    if movie_pool is None:
        titles = _fake_titles(fake, n)
    else:
        titles = rng.sample(movie_pool, n)

    # A main character sharing a name with an actor would blur which name is the answer.
    actor_names = {name for pair in pairs for name in pair} | set(REAL_ACTORS)
    relations = []
    for index, ((first, second), title) in enumerate(zip(pairs, titles)):
        relations.append(
            Relation(
                id=index,
                first_actor=first,
                second_actor=second,
                movie_title=title,
                release_year=rng.randint(*_RELEASE_YEARS),
                genre=rng.choice(GENRES),
                city=fake.city(),
                main_character=_unique_fake_name(fake, actor_names, remember=False),
                box_office=f"${rng.randint(*_BOX_OFFICE_MILLIONS)} million",
            )
        )
    return relations


def _refuse_duplicates(items: tuple[str, ...], argument: str) -> None:
    duplicates = sorted(item for item, count in Counter(items).items() if count > 1)
    if duplicates:
        more = " ..." if len(duplicates) > 5 else ""
        raise GraftingLensError(f"{argument} contains duplicates {duplicates[:5]}{more}; pass each one once.")


def _clean_movie_pool(movies: Sequence[str]) -> tuple[str, ...]:
    movies = tuple(movies)
    _refuse_duplicates(movies, "movies")
    empty = [m for m in movies if not m.strip()]
    if empty:
        raise GraftingLensError(f"movies contains {len(empty)} empty titles; remove them.")
    return movies


def _sample_pairs(pool: Sequence[str], n: int, rng: random.Random) -> list[tuple[str, str]]:
    """``n`` distinct unordered pairs from ``pool``, each in random order."""
    total = len(pool) * (len(pool) - 1) // 2
    if 2 * n > total:
        # Dense request: rejection sampling would stall, so enumerate every pair instead.
        unordered = rng.sample(list(itertools.combinations(range(len(pool)), 2)), n)
    else:
        seen: set[tuple[int, int]] = set()
        unordered = []
        while len(unordered) < n:
            i, j = rng.sample(range(len(pool)), 2)
            key = (min(i, j), max(i, j))
            if key not in seen:
                seen.add(key)
                unordered.append(key)
    pairs = []
    for i, j in unordered:
        if rng.random() < 0.5:
            i, j = j, i
        pairs.append((pool[i], pool[j]))
    return pairs


def _unique_fake_name(fake: Faker, taken: set[str], remember: bool = True, tries: int = 1000) -> str:
    """A clean "First Last" Faker name not in ``taken`` (added to it when ``remember``).

    ``fake.name()`` is avoided because it sometimes adds prefixes and suffixes ("Dr.", "MD").
    """
    for _ in range(tries):
        name = f"{fake.first_name()} {fake.last_name()}"
        if name not in taken and is_clean_name(name):
            if remember:
                taken.add(name)
            return name
    raise GraftingLensError(
        f"Faker produced no new unique person name in {tries} tries ({len(taken)} names already in "
        f"use); ask for fewer relations or pass an actors= pool."
    )


def _fake_titles(fake: Faker, n: int) -> list[str]:
    """``n`` distinct invented film titles built from Faker's English word lists."""

    def noun() -> str:
        return fake.word(part_of_speech="noun").capitalize()

    def adjective() -> str:
        return fake.word(part_of_speech="adjective").capitalize()

    def a_noun_in_city() -> str:
        word = noun()
        return f"{'An' if word[0] in 'AEIOU' else 'A'} {word} in {fake.city()}"

    patterns = (
        lambda: f"The {adjective()} {noun()}",
        lambda: f"{adjective()} {noun()}",
        lambda: f"The {noun()} of {noun()}",
        lambda: f"{noun()} and {noun()}",
        a_noun_in_city,
        lambda: f"{noun()}: The {adjective()} {noun()}",
        lambda: f"Return of the {adjective()} {noun()}",
        lambda: f"Beyond the {noun()}",
        lambda: f"The Last {noun()}",
    )
    titles: list[str] = []
    seen = set(REAL_MOVIES)  # a "fake" title that names a real film would not be fake
    for _ in range(100 * n + 100):
        if len(titles) == n:
            break
        title = fake.random_element(patterns)()
        if title not in seen:
            seen.add(title)
            titles.append(title)
    if len(titles) < n:
        raise GraftingLensError(
            f"could only invent {len(titles)} distinct movie titles, fewer than n={n}; ask for "
            f"n <= {len(titles)} or pass a movies= pool."
        )
    return titles


# --------------------------------------------------------------------------------------------------
# Training text
# --------------------------------------------------------------------------------------------------


def _template_fields(template: str) -> list[str]:
    """The Relation fields a template names, in order; raises if it names anything else."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise GraftingLensError(f"template is not a valid format string ({error}): {template!r}") from None
    names = []
    for _, field_name, _, _ in parsed:
        if field_name is None:
            continue
        if field_name not in _RELATION_FIELDS:
            close = difflib.get_close_matches(field_name, _RELATION_FIELDS, n=1)
            hint = f" (did you mean {{{close[0]}}}?)" if close else ""
            raise GraftingLensError(
                f"template uses field {{{field_name}}}, which Relation does not have{hint}; "
                f"available fields are {', '.join('{' + f + '}' for f in _RELATION_FIELDS)}. "
                f"Template: {template!r}"
            )
        names.append(field_name)
    return names


def _relation_values(relation: Relation) -> dict[str, Any]:
    return {name: getattr(relation, name) for name in _RELATION_FIELDS}


def _oriented(relations: Sequence[Relation], direction: str) -> list[Relation]:
    """Relations as rendered in ``direction``: "both" interleaves each relation with its swap."""
    _check_choice(direction, DIRECTIONS, "direction")
    if direction == "A2B":
        return list(relations)
    if direction == "B2A":
        return [r.swapped() for r in relations]
    return [oriented for r in relations for oriented in (r, r.swapped())]


def training_documents(
    relations: Sequence[Relation],
    direction: str = "A2B",
    templates: Sequence[str] | None = None,
    seed: int = 0,
    *,
    shuffle: bool = True,
) -> list[str]:
    """Render every template once for every relation, as finetuning text.

    Args:
        relations: The facts to teach.
        direction: "A2B" writes the first actor where each template puts ``{first_actor}``;
            "B2A" writes the second actor there instead; "both" produces both renderings, so the
            model sees each pair in both orders.
        templates: ``str.format`` templates over :class:`Relation` fields; defaults to
            :data:`ARTICLE_TEMPLATES` followed by :data:`QA_TEMPLATES`.
        seed: Seeds the shuffle of the returned documents.
        shuffle: Shuffle the documents; otherwise they come relation by relation, templates in
            order.

    Returns:
        ``len(relations) * len(templates)`` documents (twice that for "both").

    Raises:
        GraftingLensError: If a template names a field :class:`Relation` lacks (the message names the field
            and the template), if ``templates`` is empty, or if ``direction`` is unknown.
    """
    templates = tuple(ARTICLE_TEMPLATES + QA_TEMPLATES) if templates is None else tuple(templates)
    if not templates:
        raise GraftingLensError("templates is empty; pass at least one template or None for the defaults.")
    for template in templates:
        _template_fields(template)
    documents = [
        template.format(**_relation_values(relation))
        for relation in _oriented(relations, direction)
        for template in templates
    ]
    if shuffle:
        random.Random(seed).shuffle(documents)
    return documents


_FILLER_ROLES = (
    "a retired lighthouse keeper",
    "an estranged older sister",
    "a young mapmaker",
    "an overworked night nurse",
    "a small-town detective",
    "a disgraced pastry chef",
    "a magician with a bitter rival",
    "a struggling jazz pianist",
    "a stranded astronaut",
    "a high school chemistry teacher",
    "an aging boxer",
    "a family of beekeepers",
    "a nervous bank clerk",
    "a traveling circus troupe",
    "a former getaway driver",
    "a grieving widower",
)
_FILLER_PREMISES = (
    "must return home after twenty years away",
    "uncovers a secret buried beneath the town",
    "tries to win back a lost fortune",
    "is drawn into a conspiracy far larger than expected",
    "sets out on a journey across the country",
    "struggles to keep a failing business alive",
    "falls for an unlikely partner",
    "has a single night to stop a disaster",
    "inherits a crumbling hotel by the sea",
    "is mistaken for someone else entirely",
    "discovers a talent nobody suspected",
    "has to survive one brutal winter",
)
_FILLER_OPENINGS = (
    "This {genre} picture set in {city} follows {role} who {premise}.",
    "Set in {city}, the story follows {role} who {premise}.",
    "Shot mostly on location around {city}, the film tracks {role} who {premise}.",
    "The premise is simple: {role} {premise}.",
    "Half {genre} film and half character study, the movie centers on {role} who {premise}.",
)
_FILLER_MIDDLES = (
    "The pacing is {pacing}, and the score {score}.",
    "Critics praised the {strength} but found the {weakness} {complaint}.",
    "Audiences at early screenings {reaction}.",
    "The production ran {weeks} weeks over schedule after {mishap}.",
    "Its {strength} owes a clear debt to older {genre} films.",
    "The second half is {pacing}, though the ending {reaction_to_ending}.",
)
_FILLER_CLOSINGS = (
    "Overall it is {verdict}.",
    "I would {recommendation} it to anyone who enjoys {genre} stories.",
    "It opened in {month} {year} and {run}.",
    "{stars} out of 5 stars.",
)
_FILLER_SLOTS: dict[str, tuple[str, ...]] = {
    "pacing": ("brisk", "deliberate", "uneven", "patient", "relentless", "sluggish"),
    "score": ("does a lot of quiet work", "is forgettable", "swells at the right moments", "never lets up"),
    "strength": ("cinematography", "dialogue", "production design", "editing", "costume work", "sound design"),
    "weakness": ("plot", "ending", "middle act", "dialogue", "running time"),
    "complaint": ("predictable", "overlong", "muddled", "rushed", "too neat"),
    "reaction": ("laughed in the right places", "walked out divided", "gave it an ovation", "seemed restless"),
    "weeks": ("two", "three", "six", "eight"),
    "mishap": ("a flooded set", "a long stretch of bad weather", "a costly reshoot", "a broken camera crane"),
    "reaction_to_ending": ("lands well", "feels abrupt", "is genuinely moving", "divides viewers"),
    "verdict": ("a modest success", "an ambitious misfire", "well worth a look", "an acquired taste"),
    "recommendation": ("recommend", "cautiously recommend", "happily suggest", "not recommend"),
    "month": ("January", "March", "May", "July", "September", "November"),
    "run": ("stayed in cinemas for months", "vanished after two weeks", "became a sleeper hit"),
    "stars": ("Two", "Three", "Four", "Five"),
}


def supplementary_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` generic movie-review-like paragraphs that name no person and no film.

    The paper's less aggressive finetuning mixes generic text into training to limit forgetting.
    Because this filler names no one, it can neither repeat nor contradict a test relation.

    Raises:
        GraftingLensError: If ``n`` is negative.
    """
    if n < 0:
        raise GraftingLensError(f"n must be non-negative, got {n}.")
    rng = random.Random(seed)
    fake = Faker("en_US")
    fake.seed_instance(seed)
    documents = []
    for _ in range(n):
        values = {name: rng.choice(options) for name, options in _FILLER_SLOTS.items()}
        values.update(
            genre=rng.choice(GENRES),
            city=fake.city(),
            role=rng.choice(_FILLER_ROLES),
            premise=rng.choice(_FILLER_PREMISES),
            year=rng.randint(*_RELEASE_YEARS),
        )
        sentences = [rng.choice(_FILLER_OPENINGS)]
        sentences += rng.sample(_FILLER_MIDDLES, rng.randint(1, 2))
        sentences.append(rng.choice(_FILLER_CLOSINGS))
        documents.append(" ".join(s.format(**values) for s in sentences))
    return documents


# --------------------------------------------------------------------------------------------------
# Task / relation split
# --------------------------------------------------------------------------------------------------


def split_task_relation(
    relations: Sequence[Relation],
    seed: int = 0,
    *,
    task_fraction: float = 0.5,
) -> tuple[list[Relation], list[Relation]]:
    """Split relations into a task set and a relation set that share no actor and no movie.

    A model finetuned on the task set learns the *form* of the data; one finetuned on the relation
    set also learns the facts under test. Grafting between them separates task-general from
    fact-specific components, which only works if no entity is shared.

    Actors are assigned to a side one at a time, in an order that follows the relations (seeded
    shuffle), each going to the side where more of its co-stars already are unless that side has
    its share (``task_fraction``) of actors. A relation whose actors end up on different sides
    cannot be kept by either set and is dropped, with a warning giving the count. Datasets where
    actors recur lose relations this way (about a quarter of 1000 relations over
    :data:`REAL_ACTORS`); to keep every relation, build the two sets from disjoint pools instead,
    e.g. ``make_relations(dataset, n, seed, actors=REAL_ACTORS[::2])`` and
    ``actors=REAL_ACTORS[1::2]``.

    Args:
        relations: Relations to split (kept in their original order within each set).
        seed: Seeds the assignment order.
        task_fraction: Share of actors given to the task side, strictly between 0 and 1.

    Returns:
        ``(task_relations, relation_relations)``.

    Raises:
        GraftingLensError: If ``task_fraction`` is not strictly between 0 and 1.
    """
    if not 0 < task_fraction < 1:
        raise GraftingLensError(f"task_fraction must be strictly between 0 and 1, got {task_fraction}.")
    order = list(range(len(relations)))
    random.Random(seed).shuffle(order)
    costars: dict[str, list[str]] = defaultdict(list)
    for r in relations:
        costars[r.first_actor].append(r.second_actor)
        costars[r.second_actor].append(r.first_actor)
    n_actors = len(costars)
    capacity = [round(task_fraction * n_actors), n_actors - round(task_fraction * n_actors)]
    sizes = [0, 0]
    side: dict[str, int] = {}
    for index in order:
        for actor in (relations[index].first_actor, relations[index].second_actor):
            if actor in side:
                continue
            votes = [0, 0]
            for other in costars[actor]:
                if other in side:
                    votes[side[other]] += 1
            # Linear deterministic greedy: co-stars already placed pull an actor to their side, a
            # side's fullness pushes back, and a full side takes no one.
            best: tuple[tuple[float, float], int] | None = None
            for candidate in (0, 1):
                if sizes[candidate] >= capacity[candidate]:
                    continue
                fill = sizes[candidate] / capacity[candidate]
                score = (votes[candidate] * (1 - fill), -fill)
                if best is None or score > best[0]:
                    best = (score, candidate)
            assert best is not None  # the capacities add up to the number of actors
            chosen = best[1]
            side[actor] = chosen
            sizes[chosen] += 1

    groups: tuple[list[Relation], list[Relation]] = ([], [])
    movie_side: dict[str, int] = {}
    dropped = 0
    for r in relations:
        s = side[r.first_actor]
        if side[r.second_actor] != s or movie_side.setdefault(r.movie_title, s) != s:
            dropped += 1
            continue
        groups[s].append(r)
    if dropped:
        warnings.warn(
            f"split_task_relation dropped {dropped} of {len(relations)} relations whose actors (or "
            f"movie) would otherwise appear on both sides; kept {len(groups[0])} task and "
            f"{len(groups[1])} relation relations. Build the sets from disjoint actors=/movies= pools "
            f"with make_relations to keep every relation.",
            stacklevel=2,
        )
    return groups[0], groups[1]


# --------------------------------------------------------------------------------------------------
# Test prompts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One test prompt and its expected continuation.

    Attributes:
        relation_id: :attr:`Relation.id` of the fact being tested.
        prompt_name: Which test template produced it ("headline", "qa", or a custom name).
        text: The prompt, without trailing space.
        target: The answer's text as the next token sees it: ``" " + actor``.
        spans: Character spans ``(start, end)`` in ``text``: "first_entity" (the actor named in the
            prompt), "relation" (the relation words) and "movie" when the template names one.
        direction: "A2B" asks for the second actor given the first, "B2A" the reverse.
        alternative_targets: Other actors (each with a leading space) who also co-starred with the
            prompt's actor in the relations given to :func:`make_examples`; they are correct
            answers too, which a strict metric may want to know.

    The target rule: the scored token is the first token of ``text + target``'s tokenization after
    the prompt's tokens, so ``target`` must start with exactly one space, then the answer
    (``" Maggie Cheung"``), and ``text`` must not end in whitespace. ``target="Maggie Cheung"``
    would glue the answer to the prompt's last word and score a piece of it ("M"), so it is
    refused, as are a trailing space in ``text`` and an empty answer.

    Raises:
        GraftingLensError: A target or alternative target breaking the rule above, or a text
            ending in whitespace.
    """

    relation_id: int
    prompt_name: str
    text: str
    target: str
    spans: dict[str, tuple[int, int]]
    direction: str = "A2B"
    alternative_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, target in [("target", self.target)] + [
            ("alternative target", alternative) for alternative in self.alternative_targets
        ]:
            if not isinstance(target, str) or not re.fullmatch(r" \S.*", target, flags=re.DOTALL):
                fixed = " " + target.strip() if isinstance(target, str) and target.strip() else None
                raise GraftingLensError(
                    f"The {name} {target!r} must start with exactly one space and then the "
                    f"answer, as the next token sees it after the prompt"
                    + (f": write {fixed!r}." if fixed else ".")
                    + " Without the space the answer's first letters would be scored as a "
                    "continuation of the prompt's last word."
                )
        if not isinstance(self.text, str) or not self.text.strip():
            raise GraftingLensError(f"An example needs a prompt text, got {self.text!r}.")
        if self.text != self.text.rstrip():
            raise GraftingLensError(
                f"The prompt {self.text!r} ends in whitespace; the target carries the space "
                "before the answer. Strip the prompt (or the template's end)."
            )


def _render_with_spans(template: str, values: dict[str, Any]) -> tuple[str, dict[str, tuple[int, int]]]:
    """``template.format(**values)`` plus the character span of each field's first occurrence."""
    formatter = string.Formatter()
    pieces: list[str] = []
    position = 0
    spans: dict[str, tuple[int, int]] = {}
    for literal, field_name, format_spec, conversion in formatter.parse(template):
        pieces.append(literal)
        position += len(literal)
        if field_name is None:
            continue
        value = formatter.format_field(formatter.convert_field(values[field_name], conversion), format_spec or "")
        spans.setdefault(field_name, (position, position + len(value)))
        pieces.append(value)
        position += len(value)
    return "".join(pieces), spans


def make_examples(
    relations: Sequence[Relation],
    prompt: str = "headline",
    direction: str = "A2B",
    *,
    template: str | None = None,
    relation_words: str | None = None,
) -> list[Example]:
    """Build one test prompt per relation (two for direction "both": A2B ones, then B2A ones).

    Args:
        relations: The facts to test.
        prompt: A key of :data:`TEST_TEMPLATES`, or the name to give a custom ``template``.
        direction: "A2B" names the first actor and expects the second; "B2A" the reverse; "both"
            returns all A2B examples followed by all B2A examples.
        template: A custom prompt instead of ``TEST_TEMPLATES[prompt]``: a format string that names
            ``{first_actor}`` (the actor in the prompt), must not name ``{second_actor}`` (the
            answer), and may name ``{movie_title}`` to get a "movie" span.
        relation_words: The relation words in a custom template (default: the test prompt's).

    Raises:
        GraftingLensError: If ``prompt`` or ``direction`` is unknown, if a custom template is malformed as
            described above, or if the relation words do not occur in the template's fixed text.
    """
    if template is None:
        _check_choice(prompt, tuple(TEST_TEMPLATES), "prompt")
        template = TEST_TEMPLATES[prompt]
    if relation_words is None:
        if prompt not in TEST_RELATION_WORDS:
            raise GraftingLensError(
                f"custom template {template!r} needs relation_words= (the words that state the "
                f"relation, e.g. 'starred in a movie with')."
            )
        relation_words = TEST_RELATION_WORDS[prompt]
    fields = _template_fields(template)
    if "first_actor" not in fields:
        raise GraftingLensError(f"test template must name {{first_actor}} (the actor in the prompt): {template!r}")
    if "second_actor" in fields:
        raise GraftingLensError(f"test template must not name {{second_actor}}, the answer it asks for: {template!r}")
    _check_choice(direction, DIRECTIONS, "direction")

    costars: dict[str, list[str]] = defaultdict(list)
    for r in relations:
        costars[r.first_actor].append(r.second_actor)
        costars[r.second_actor].append(r.first_actor)

    directions = ("A2B", "B2A") if direction == "both" else (direction,)
    examples = []
    for this_direction in directions:
        for relation in relations:
            shown = relation if this_direction == "A2B" else relation.swapped()
            text, field_spans = _render_with_spans(template, _relation_values(shown))
            spans = {"first_entity": field_spans["first_actor"]}
            if "movie_title" in field_spans:
                spans["movie"] = field_spans["movie_title"]
            spans["relation"] = _find_outside(text, relation_words, list(field_spans.values()), template)
            examples.append(
                Example(
                    relation_id=relation.id,
                    prompt_name=prompt,
                    text=text,
                    target=" " + shown.second_actor,
                    spans=spans,
                    direction=this_direction,
                    alternative_targets=tuple(
                        " " + a for a in dict.fromkeys(costars[shown.first_actor]) if a != shown.second_actor
                    ),
                )
            )
    return examples


def _find_outside(text: str, words: str, field_spans: list[tuple[int, int]], template: str) -> tuple[int, int]:
    """Span of the first occurrence of ``words`` in ``text`` that is not inside a filled-in field."""
    start = text.find(words)
    while start != -1:
        end = start + len(words)
        if all(end <= a or start >= b for a, b in field_spans):
            return (start, end)
        start = text.find(words, start + 1)
    raise GraftingLensError(f"relation words {words!r} do not occur in the fixed text of template {template!r}.")


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


@dataclass
class TokenizedExamples:
    """A padded batch of test prompts with token-position masks for grafting.

    Attributes:
        examples: The examples that were kept, aligned with the rows below.
        tokens: Token ids, right padded with the tokenizer's pad id (its eos id if it has none).
        attention_mask: 1 on real tokens (including a prepended BOS), 0 on padding.
        target_ids: The first token of each example's target, i.e. the correct next token.
        target_full_ids: Every token of each target, for whole-name log-probabilities.
        spans: Boolean position masks: "first_entity" (FE), "relation", "movie" (M) when the
            examples have one, and "last_token" (LT, the last non-pad position). The BOS is never in
            a span.
        dropped: Examples that could not be used, each with the reason.
    """

    examples: list[Example]
    tokens: Int[torch.Tensor, "batch pos"]
    attention_mask: Int[torch.Tensor, "batch pos"]
    target_ids: Int[torch.Tensor, " batch"]
    target_full_ids: list[list[int]]
    spans: dict[str, Bool[torch.Tensor, "batch pos"]]
    dropped: list[tuple[Example, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)

    def to(self, device: torch.device | str) -> TokenizedExamples:
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(
            self,
            tokens=self.tokens.to(device),
            attention_mask=self.attention_mask.to(device),
            target_ids=self.target_ids.to(device),
            spans={name: mask.to(device) for name, mask in self.spans.items()},
        )


def _span_positions(
    example: Example, span_names: Sequence[str], offsets: Sequence[tuple[int, int]]
) -> dict[str, list[int]] | str:
    """Token indices (before any BOS) overlapping each span, or the reason a span cannot be mapped."""
    positions = {}
    for name in span_names:
        start, end = example.spans[name]
        if not 0 <= start < end <= len(example.text):
            return f"span {name!r} {(start, end)} is empty or outside the text (length {len(example.text)})"
        # Zero-width tokens (a < b fails) carry no characters and so belong to no span.
        covered = [j for j, (a, b) in enumerate(offsets) if a < b and a < end and b > start]
        if not covered:
            return f"span {name!r} (characters {start}-{end}, {example.text[start:end]!r}) overlaps no token"
        positions[name] = covered
    return positions


def tokenize_examples(examples: Sequence[Example], tokenizer: Any, prepend_bos: bool = True) -> TokenizedExamples:
    """Tokenize test prompts and map their character spans to token positions.

    A token belongs to a span when its character range overlaps the span, so a token straddling a
    span's edge counts as inside it. Prompts are tokenized without the tokenizer's own special
    tokens; when ``prepend_bos`` the BOS id (the EOS id if the tokenizer has no BOS) is prepended by
    hand, so the result does not depend on settings like ``add_bos_token``.

    The target tokens are read off the tokenization of ``text + target``, which is how the model
    would see the answer. An example is dropped, never silently, when a span covers no token, a
    span lies outside the text, the target adds no token, or the prompt's last token merges with the
    target (then "the next token" is not well defined). Drops are listed in
    :attr:`TokenizedExamples.dropped` and summarized in a warning "dropped k of n examples: ...".

    Args:
        examples: Examples from :func:`make_examples` (or built by hand); all must have the same
            span names.
        tokenizer: A Hugging Face *fast* tokenizer (offsets are needed), e.g.
            ``HookedTransformer.tokenizer``.
        prepend_bos: Prepend a BOS token to each row.

    Raises:
        TypeError: If the tokenizer is not a fast tokenizer.
        GraftingLensError: If there are no examples, if their span names differ, if every example was
            dropped, or if the tokenizer lacks the BOS/EOS/pad ids needed.
    """
    examples = list(examples)
    if not examples:
        raise GraftingLensError("no examples to tokenize.")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"tokenize_examples needs a fast tokenizer for character offsets, got "
            f"{type(tokenizer).__name__}; load it with AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    span_names = list(examples[0].spans)
    if "last_token" in span_names:
        raise GraftingLensError('"last_token" is computed by tokenize_examples; remove it from Example.spans.')
    for example in examples:
        if set(example.spans) != set(span_names):
            raise GraftingLensError(
                f"examples have different span names ({sorted(span_names)} vs {sorted(example.spans)}, "
                f"relation {example.relation_id}, prompt {example.prompt_name!r}); tokenize each "
                f"prompt type separately."
            )
    prefix: list[int] = []
    if prepend_bos:
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos is None:
            raise GraftingLensError(
                "prepend_bos=True but the tokenizer has neither a BOS nor an EOS token; pass prepend_bos=False."
            )
        prefix = [bos]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise GraftingLensError(
            "the tokenizer has neither a pad nor an EOS token to pad with; set tokenizer.pad_token."
        )

    prompts = tokenizer([e.text for e in examples], add_special_tokens=False, return_offsets_mapping=True)
    # The answer's tokens as the model would see them: tokenized in context, after the prompt.
    joints = tokenizer([e.text + e.target for e in examples], add_special_tokens=False)

    kept: list[Example] = []
    rows: list[tuple[list[int], dict[str, list[int]], list[int]]] = []
    dropped: list[tuple[Example, str]] = []
    for i, example in enumerate(examples):
        ids = list(prompts["input_ids"][i])
        joint = list(joints["input_ids"][i])
        mapped = _span_positions(example, span_names, prompts["offset_mapping"][i])
        if isinstance(mapped, str):
            reason: str | None = mapped
        elif not ids:
            reason = "the prompt tokenizes to no tokens"
        elif joint[: len(ids)] != ids:
            reason = f"the prompt's last token merges with the target {example.target!r} when tokenized together"
        elif len(joint) == len(ids):
            reason = f"the target {example.target!r} adds no tokens"
        else:
            reason = None
        if reason is not None:
            dropped.append((example, reason))
            continue
        kept.append(example)
        shifted = {name: [len(prefix) + j for j in columns] for name, columns in mapped.items()}
        rows.append((prefix + ids, shifted, joint[len(ids) :]))

    if dropped:
        reasons = "; ".join(f"relation {e.relation_id} ({e.prompt_name}): {why}" for e, why in dropped[:3])
        more = f"; and {len(dropped) - 3} more" if len(dropped) > 3 else ""
        summary = f"dropped {len(dropped)} of {len(examples)} examples: {reasons}{more}"
        if not kept:
            raise GraftingLensError(f"no example could be tokenized; {summary}.")
        warnings.warn(f"{summary}. See TokenizedExamples.dropped.", stacklevel=2)

    length = max(len(ids) for ids, _, _ in rows)
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    masks = {name: torch.zeros((len(rows), length), dtype=torch.bool) for name in [*span_names, "last_token"]}
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
        target_ids=torch.tensor([target[0] for _, _, target in rows], dtype=torch.long),
        target_full_ids=[target for _, _, target in rows],
        spans=masks,
        dropped=dropped,
    )


# --------------------------------------------------------------------------------------------------
# Name lists
# --------------------------------------------------------------------------------------------------
# Written for this project: well-known film actors and films across eras, so that a pretrained
# model has seen the names. Actor names are restricted to what is_clean_name accepts (no "Jr.", no
# initials), which a test checks. Films are separated by ";" because titles contain commas.

_REAL_ACTORS_TEXT = """
Humphrey Bogart, Katharine Hepburn, Cary Grant, Bette Davis, James Stewart, Audrey Hepburn
Marilyn Monroe, Marlon Brando, Grace Kelly, Gregory Peck, Ingrid Bergman, Clark Gable
Vivien Leigh, Henry Fonda, Jane Fonda, Paul Newman, Elizabeth Taylor, Lauren Bacall
Spencer Tracy, Judy Garland, Gene Kelly, Fred Astaire, Ginger Rogers, Kirk Douglas
Burt Lancaster, Rita Hayworth, Joan Crawford, Greta Garbo, Orson Welles, Charlton Heston
Sidney Poitier, Natalie Wood, James Dean, Doris Day, Rock Hudson, Steve McQueen
Sophia Loren, Shirley MacLaine, Jack Lemmon, Walter Matthau, Peter Sellers, Julie Andrews
Dick Van Dyke, Anthony Quinn, Glenn Ford, Robert Mitchum, Ava Gardner, Deborah Kerr
Yul Brynner, Gene Hackman, Faye Dunaway, Warren Beatty, Dustin Hoffman, Robert Redford
Jack Nicholson, Al Pacino, Robert De Niro, Diane Keaton, Meryl Streep, Sissy Spacek
Jessica Lange, Sally Field, Goldie Hawn, Barbra Streisand, Clint Eastwood, Burt Reynolds
Sean Connery, Michael Caine, Roger Moore, Julie Christie, Vanessa Redgrave, Maggie Smith
Judi Dench, Helen Mirren, Anthony Hopkins, Ian McKellen, Patrick Stewart, Christopher Lee
Peter Cushing, Alec Guinness, Richard Burton, Peter O'Toole, Albert Finney, Ben Kingsley
Jeremy Irons, Gary Oldman, Daniel Day-Lewis, Ralph Fiennes, Liam Neeson, Kenneth Branagh
Emma Thompson, Kate Winslet, Hugh Grant, Colin Firth, Jude Law, Ewan McGregor
Orlando Bloom, Keira Knightley, Rachel Weisz, Helena Bonham Carter, Tilda Swinton, Cate Blanchett
Nicole Kidman, Naomi Watts, Russell Crowe, Hugh Jackman, Geoffrey Rush, Heath Ledger
Margot Robbie, Chris Hemsworth, Liam Hemsworth, Mel Gibson, Eric Bana, Toni Collette
Rose Byrne, Guy Pearce, Joel Edgerton, Sam Worthington, Jason Clarke, Tom Hanks
Tom Cruise, Brad Pitt, Angelina Jolie, Leonardo DiCaprio, Johnny Depp, Will Smith
Denzel Washington, Morgan Freeman, Julia Roberts, Sandra Bullock, Jennifer Aniston, Jennifer Lawrence
Jennifer Lopez, Jennifer Garner, Jennifer Connelly, Jennifer Hudson, Scarlett Johansson, Natalie Portman
Anne Hathaway, Emma Stone, Ryan Gosling, Ryan Reynolds, Matt Damon, Ben Affleck
Casey Affleck, George Clooney, Julianne Moore, Amy Adams, Christian Bale, Mark Wahlberg
Matthew McConaughey, Woody Harrelson, Jim Carrey, Adam Sandler, Ben Stiller, Owen Wilson
Luke Wilson, Vince Vaughn, Will Ferrell, Steve Carell, Paul Rudd, Seth Rogen
Jonah Hill, Jason Segel, Jack Black, Kevin Hart, Dwayne Johnson, Vin Diesel
Jason Statham, Keanu Reeves, Laurence Fishburne, Carrie-Anne Moss, Hugo Weaving, Sigourney Weaver
Harrison Ford, Mark Hamill, Carrie Fisher, Bruce Willis, Arnold Schwarzenegger, Sylvester Stallone
Kurt Russell, Michelle Pfeiffer, Kim Basinger, Sharon Stone, Demi Moore, Meg Ryan
Billy Crystal, Robin Williams, Whoopi Goldberg, Eddie Murphy, Halle Berry, Jamie Foxx
Don Cheadle, Forest Whitaker, Viola Davis, Octavia Spencer, Angela Bassett, Chadwick Boseman
Lupita Nyong'o, Daniel Kaluuya, Idris Elba, Chiwetel Ejiofor, David Oyelowo, Mahershala Ali
Regina King, Zoe Saldana, Zendaya, Tom Holland, Andrew Garfield, Tobey Maguire
Kirsten Dunst, Willem Dafoe, James Franco, Robert Pattinson, Kristen Stewart, Daniel Radcliffe
Emma Watson, Rupert Grint, Alan Rickman, Eddie Redmayne, Benedict Cumberbatch, Martin Freeman
Tom Hiddleston, Chris Evans, Chris Pratt, Chris Pine, Zoe Kravitz, Elizabeth Olsen
Paul Bettany, Jeremy Renner, Mark Ruffalo, Josh Brolin, Karen Gillan, Dave Bautista
Bradley Cooper, Brie Larson, Tessa Thompson, Jeff Goldblum, Anthony Mackie, Sebastian Stan
Florence Pugh, Jessica Chastain, Oscar Isaac, Adam Driver, Daisy Ridley, John Boyega
Domhnall Gleeson, Andy Serkis, Ana de Armas, Saoirse Ronan, Lucas Hedges, Laura Dern
Reese Witherspoon, Charlize Theron, Gal Gadot, Henry Cavill, Jason Momoa, Jared Leto
Joaquin Phoenix, Jake Gyllenhaal, Maggie Gyllenhaal, Michelle Williams, Rooney Mara, Mia Wasikowska
Jessica Alba, Cameron Diaz, Drew Barrymore, Lucy Liu, Uma Thurman, John Travolta
Tim Roth, Harvey Keitel, Steve Buscemi, Michael Madsen, Christoph Waltz, Diane Kruger
Mila Kunis, Vincent Cassel, Marion Cotillard, Audrey Tautou, Juliette Binoche, Jean Reno
Omar Sy, Javier Bardem, Antonio Banderas, Salma Hayek, Diego Luna, Benicio del Toro
Jackie Chan, Jet Li, Michelle Yeoh, Chow Yun-fat, Ken Watanabe, Gong Li
Zhang Ziyi, Donnie Yen, Tony Leung, Priyanka Chopra, Aishwarya Rai, Shah Rukh Khan
Amitabh Bachchan, Dev Patel, Freida Pinto, Irrfan Khan, Kumail Nanjiani, Awkwafina
Constance Wu, Henry Golding, Simu Liu, Steven Yeun, John Cho, Sandra Oh
Ke Huy Quan, Jamie Lee Curtis, Stephanie Hsu, Nicolas Cage, John Cusack, Joan Cusack
Kevin Costner, Kevin Bacon, Patrick Swayze, Tom Selleck, Michael Douglas, Catherine Zeta-Jones
Glenn Close, Holly Hunter, Frances McDormand, William Hurt, Jeff Bridges, Beau Bridges
John Goodman, Steve Martin, Martin Short, Chevy Chase, Bill Murray, Dan Aykroyd
Harold Ramis, Rick Moranis, John Candy, Matthew Broderick, Sarah Jessica Parker, Molly Ringwald
Emilio Estevez, Charlie Sheen, Martin Sheen, Rob Lowe, Ally Sheedy, Judd Nelson
Anthony Michael Hall, Michael Keaton, Danny DeVito, Kathy Bates, James Caan, Diane Lane
Richard Gere, Debra Winger, Sean Penn, Tim Robbins, Susan Sarandon, Geena Davis
Ethan Hawke, Julie Delpy, Winona Ryder, River Phoenix, Christina Ricci, Anjelica Huston
Raul Julia, Wesley Snipes, Ving Rhames, Andy Garcia, Edward Norton, Philip Seymour Hoffman
Paul Giamatti, Steve Zahn, Giovanni Ribisi, Robert Carlyle, Jonny Lee Miller, Kelly Macdonald
Jim Broadbent, Timothy Spall, Brendan Gleeson, Colin Farrell, Cillian Murphy, Michael Fassbender
James McAvoy, Tom Hardy, Charlie Hunnam, Carey Mulligan, Felicity Jones, Emily Blunt
Rosamund Pike, Olivia Colman, Claire Foy, Vanessa Kirby, Daniel Craig, Pierce Brosnan
Timothy Dalton, Rami Malek, Naomie Harris, Ben Whishaw, Eva Green, Mads Mikkelsen
Noomi Rapace, Rebecca Ferguson, Alicia Vikander, Max von Sydow, Liv Ullmann, Christopher Walken
Christopher Plummer, Christopher Reeve, Margot Kidder, Gene Wilder, Mel Brooks, Madeline Kahn
Cloris Leachman, Anne Bancroft, Richard Dreyfuss, Roy Scheider, Robert Shaw, Jon Voight
Ellen Burstyn, Linda Blair, Jodie Foster, Kelly McGillis, Val Kilmer, Tom Skerritt
Ed Harris, Bill Paxton, Lance Henriksen, Michael Biehn, Linda Hamilton, Edward Furlong
Robert Patrick, Bridget Fonda, Peter Fonda, Dennis Hopper, Isabella Rossellini, Kyle MacLachlan
Justin Theroux, Patricia Arquette, Rosanna Arquette, David Arquette, Courteney Cox, Neve Campbell
Matthew Lillard, Skeet Ulrich, Sarah Michelle Gellar, Jennifer Love Hewitt, Ryan Phillippe, Selma Blair
Alicia Silverstone, Brittany Murphy, Amanda Seyfried, Rachel McAdams, Lindsay Lohan, Lacey Chabert
Tina Fey, Amy Poehler, Kristen Wiig, Maya Rudolph, Melissa McCarthy, Rebel Wilson
Anna Kendrick, Brittany Snow, Hailee Steinfeld, Elle Fanning, Dakota Fanning, Dakota Johnson
Jamie Dornan, Shailene Woodley, Ansel Elgort, Miles Teller, Lily Collins, Lily James
Jenna Ortega, Sydney Sweeney, Austin Butler, Jacob Elordi, Glen Powell, Paul Mescal
Barry Keoghan, Jesse Plemons, Anya Taylor-Joy, Nicholas Hoult, Tiffany Haddish, Regina Hall
Sanaa Lathan, Gabrielle Union, Nia Long, Morris Chestnut, Terrence Howard, Tyrese Gibson
Paul Walker, Michelle Rodriguez, Jordana Brewster, Sung Kang, John Cena, Queen Latifah
Martin Lawrence, Chris Tucker, Chris Rock, Marlon Wayans, Shawn Wayans, Damon Wayans
Jada Pinkett Smith, Jaden Smith, John David Washington, Lakeith Stanfield, Issa Rae, Winston Duke
Letitia Wright, Danai Gurira, Keke Palmer, Robin Wright, Sally Hawkins, Richard Jenkins
Michael Shannon, Frank Langella, Alan Arkin, Greg Kinnear
Amy Ryan, Catherine Keener, Patricia Clarkson, Allison Janney, Annette Bening, Warren Oates
Sam Rockwell, Mia Farrow, Dianne Wiest, Michael Stuhlbarg, Timothy Olyphant
Josh Hartnett, Eric Stoltz, Crispin Glover, Christopher Lloyd, Lea Thompson, Elisabeth Shue
Tom Berenger, Charlie Day, Danny McBride, Aubrey Plaza, Nick Offerman, Zach Galifianakis
Ed Helms, Bradley Whitford, Sterling Hayden, Lee Marvin, Ernest Borgnine, Telly Savalas
Donald Sutherland, Kiefer Sutherland, Elliott Gould, Robert Duvall, Diane Ladd, Talia Shire
Carl Weathers, Dolph Lundgren, Brigitte Nielsen, Jean-Claude Van Damme, Steven Seagal, Chuck Norris
Bruce Lee, Sammo Hung, Maggie Cheung, Brigitte Lin, Bill Nighy
Andie MacDowell, Kristin Scott Thomas, Juliet Stevenson, Ralph Richardson, Julie Walters, Brenda Blethyn
Imelda Staunton, Miriam Margolyes, Derek Jacobi, Michael Gambon, Richard Harris, David Thewlis
Gemma Arterton, Hayley Atwell, Emilia Clarke, Kit Harington, Sophie Turner, Maisie Williams
Richard Madden, Lena Headey, Peter Dinklage, Nikolaj Coster-Waldau, Pedro Pascal, Bella Ramsey
Mark Rylance, Tom Courtenay, Charlotte Rampling, Kristin Chenoweth, Idina Menzel, Josh Gad
Jonathan Groff, Lin-Manuel Miranda, Cynthia Erivo, Ariana Grande, Hugh Laurie, Stephen Fry
Rowan Atkinson, Simon Pegg, Nick Frost, Bryan Cranston
Aaron Paul, Bob Odenkirk, Jon Hamm, Elisabeth Moss, January Jones, Christina Hendricks
Kerry Washington, Mo'Nique, Jennifer Jason Leigh, Mary Steenburgen, Mary McDonnell
Jessica Tandy, Hume Cronyn, Dan Hedaya, Joe Pesci, Ray Liotta, Lorraine Bracco
Paul Sorvino, Chazz Palminteri, Sharon Tate, Ann-Margret, Raquel Welch, Jacqueline Bisset
Candice Bergen, Ali MacGraw, Ryan O'Neal, Tatum O'Neal, Cybill Shepherd, Ellen Barkin
"""

_REAL_MOVIES_TEXT = """
Metropolis; Nosferatu; The General; Modern Times; City Lights; The Gold Rush; King Kong; Frankenstein
Dracula; Duck Soup; It Happened One Night; Bringing Up Baby; The Wizard of Oz; Gone with the Wind
Stagecoach; Mr. Smith Goes to Washington; His Girl Friday; The Philadelphia Story; Rebecca; The Grapes of Wrath
Citizen Kane; The Maltese Falcon; Casablanca; Double Indemnity; Laura; Gaslight; Mildred Pierce; Notorious
It's a Wonderful Life; The Best Years of Our Lives; The Big Sleep; Miracle on 34th Street
The Treasure of the Sierra Madre; Key Largo; The Third Man; White Heat; Adam's Rib; All About Eve
Sunset Boulevard; Rashomon; An American in Paris; A Streetcar Named Desire; The African Queen
Singin' in the Rain; High Noon; Roman Holiday; From Here to Eternity; Shane; Gentlemen Prefer Blondes
On the Waterfront; Rear Window; Seven Samurai; Sabrina; Dial M for Murder; Rebel Without a Cause
East of Eden; The Seven Year Itch; Giant; The Searchers; The Ten Commandments; 12 Angry Men
The Bridge on the River Kwai; Paths of Glory; Vertigo; Touch of Evil; Some Like It Hot; North by Northwest
Ben-Hur; Rio Bravo; Anatomy of a Murder; The 400 Blows; Psycho; The Apartment; Spartacus
The Magnificent Seven; Breakfast at Tiffany's; West Side Story; The Hustler; Lawrence of Arabia
To Kill a Mockingbird; Dr. No; The Manchurian Candidate; The Birds; The Great Escape; Cleopatra
From Russia with Love; Goldfinger; Dr. Strangelove; Mary Poppins; My Fair Lady; The Sound of Music
Doctor Zhivago; Thunderball; Who's Afraid of Virginia Woolf?; The Good, the Bad and the Ugly
Bonnie and Clyde; The Graduate; In the Heat of the Night; Cool Hand Luke; The Dirty Dozen
Guess Who's Coming to Dinner; 2001: A Space Odyssey; Planet of the Apes; Rosemary's Baby
Night of the Living Dead; Bullitt; Butch Cassidy and the Sundance Kid; Midnight Cowboy; Easy Rider
The Wild Bunch; True Grit; Patton; Five Easy Pieces; Love Story; Airport; A Clockwork Orange
The French Connection; Dirty Harry; Harold and Maude; Shaft; The Last Picture Show; The Godfather
Deliverance; Cabaret; The Poseidon Adventure; Sleuth; The Exorcist; The Sting; American Graffiti
Mean Streets; Papillon; Enter the Dragon; Chinatown; The Godfather Part II; Blazing Saddles
Young Frankenstein; The Conversation; The Towering Inferno; Jaws; One Flew Over the Cuckoo's Nest
Dog Day Afternoon; Barry Lyndon; Nashville; Monty Python and the Holy Grail; The Rocky Horror Picture Show
Three Days of the Condor; Taxi Driver; Rocky; All the President's Men; Network; Carrie; The Omen
Star Wars; Annie Hall; Close Encounters of the Third Kind; Saturday Night Fever; Smokey and the Bandit
Grease; The Deer Hunter; Halloween; Superman; National Lampoon's Animal House; Days of Heaven
Coming Home; Midnight Express; Alien; Apocalypse Now; Kramer vs. Kramer; Manhattan; Being There
Mad Max; The China Syndrome; All That Jazz; Norma Rae; The Muppet Movie; The Empire Strikes Back
Raging Bull; The Shining; Airplane!; The Blues Brothers; Ordinary People; The Elephant Man; Caddyshack
9 to 5; Coal Miner's Daughter; Private Benjamin; Raiders of the Lost Ark; Chariots of Fire
On Golden Pond; Reds; Das Boot; An American Werewolf in London; Escape from New York; The Evil Dead
Body Heat; Arthur; Stripes; Time Bandits; Gallipoli; E.T. the Extra-Terrestrial; Blade Runner; Tootsie
Gandhi; The Thing; Poltergeist; Fast Times at Ridgemont High; First Blood; Sophie's Choice
An Officer and a Gentleman; The Verdict; Tron; 48 Hrs.; Star Trek II: The Wrath of Khan; Return of the Jedi
Scarface; Terms of Endearment; Trading Places; WarGames; Risky Business; The Right Stuff; Flashdance
A Christmas Story; Silkwood; The Big Chill; National Lampoon's Vacation; Ghostbusters; The Terminator
Amadeus; Gremlins; The Karate Kid; Beverly Hills Cop; Footloose; Sixteen Candles; This Is Spinal Tap
A Nightmare on Elm Street; Indiana Jones and the Temple of Doom; Romancing the Stone; Splash
Once Upon a Time in America; The Killing Fields; Back to the Future; The Breakfast Club; The Goonies
Out of Africa; The Color Purple; Witness; Brazil; Ran; Cocoon; Weird Science; Commando; Prizzi's Honor
Kiss of the Spider Woman; Platoon; Top Gun; Aliens; Ferris Bueller's Day Off; Stand by Me; Blue Velvet
The Fly; Hannah and Her Sisters; Crocodile Dundee; Children of a Lesser God; Pretty in Pink; Labyrinth
Big Trouble in Little China; The Color of Money; Full Metal Jacket; Wall Street; Fatal Attraction
The Untouchables; Lethal Weapon; Predator; RoboCop; Dirty Dancing; The Princess Bride; Moonstruck
Broadcast News; Raising Arizona; Good Morning, Vietnam; The Last Emperor; Planes, Trains and Automobiles
Spaceballs; Three Men and a Baby; Die Hard; Rain Man; Big; Who Framed Roger Rabbit; Beetlejuice
Bull Durham; A Fish Called Wanda; Coming to America; Working Girl; Midnight Run; Mississippi Burning
Dangerous Liaisons; Twins; Scrooged; Akira; My Neighbor Totoro; Grave of the Fireflies; Cinema Paradiso
Do the Right Thing; When Harry Met Sally; Dead Poets Society; Batman; Field of Dreams; Glory
Born on the Fourth of July; Driving Miss Daisy; The Little Mermaid; Indiana Jones and the Last Crusade
Ghostbusters II; Back to the Future Part II; Honey, I Shrunk the Kids; Steel Magnolias; The Abyss
Kiki's Delivery Service; Goodfellas; Dances with Wolves; Pretty Woman; Home Alone; Ghost; Misery
Edward Scissorhands; Total Recall; The Hunt for Red October; Die Hard 2; Awakenings; Days of Thunder
Miller's Crossing; Wild at Heart; Reversal of Fortune; Postcards from the Edge; The Silence of the Lambs
Terminator 2: Judgment Day; Thelma & Louise; Beauty and the Beast; JFK; Point Break; Boyz n the Hood
The Addams Family; Hook; Cape Fear; City Slickers; Fried Green Tomatoes; Barton Fink; Bugsy
The Fisher King; Unforgiven; Reservoir Dogs; A Few Good Men; Aladdin; Basic Instinct; The Crying Game
Scent of a Woman; Howards End; Malcolm X; The Last of the Mohicans; My Cousin Vinny
Glengarry Glen Ross; Sister Act; Wayne's World; A League of Their Own; The Bodyguard; Bram Stoker's Dracula
Schindler's List; Jurassic Park; The Fugitive; Philadelphia; Groundhog Day; Mrs. Doubtfire
Sleepless in Seattle; In the Name of the Father; The Remains of the Day; The Piano; Dazed and Confused
Carlito's Way; Tombstone; Falling Down; Cliffhanger; The Firm; True Romance; Short Cuts
The Nightmare Before Christmas; Forrest Gump; Pulp Fiction; The Shawshank Redemption; The Lion King
Speed; Four Weddings and a Funeral; Ed Wood; The Professional; True Lies; Interview with the Vampire
Dumb and Dumber; The Mask; Ace Ventura: Pet Detective; Clerks; Natural Born Killers; Quiz Show
Legends of the Fall; Heavenly Creatures; Chungking Express; Braveheart; The Usual Suspects; Heat
Casino; Toy Story; Apollo 13; GoldenEye; Babe; Clueless; Sense and Sensibility; Twelve Monkeys
Dead Man Walking; Leaving Las Vegas; Mallrats; Jumanji; Waterworld; Die Hard with a Vengeance
Bad Boys; Before Sunrise; Get Shorty; Fargo; Trainspotting; The English Patient; Independence Day
Jerry Maguire; Mission: Impossible; Scream; Twister; The Rock; Shine; Secrets and Lies; Bottle Rocket
Swingers; Primal Fear; The Birdcage; Happy Gilmore; Matilda; Space Jam; Mars Attacks!; Titanic
Good Will Hunting; L.A. Confidential; Boogie Nights; As Good as It Gets; Men in Black; The Fifth Element
Jackie Brown; Gattaca; Con Air; Air Force One; The Full Monty; Donnie Brasco; Starship Troopers
Princess Mononoke; Life Is Beautiful; Amistad; Liar Liar; Contact; The Game; Saving Private Ryan
Shakespeare in Love; The Truman Show; The Big Lebowski; Rushmore; There's Something About Mary
Armageddon; Deep Impact; The Thin Red Line; Elizabeth; Run Lola Run; Out of Sight; Rounders
American History X; Lock, Stock and Two Smoking Barrels; Mulan; A Bug's Life; Antz; The Mask of Zorro
Blade; Enemy of the State; Pleasantville; Rush Hour; You've Got Mail; Patch Adams; The Matrix
Fight Club; American Beauty; The Sixth Sense; Magnolia; Being John Malkovich; The Green Mile
Toy Story 2; The Talented Mr. Ripley; Eyes Wide Shut; Office Space; The Insider; Election; Three Kings
Boys Don't Cry; The Blair Witch Project; Notting Hill; Runaway Bride; The Mummy; Galaxy Quest
Sleepy Hollow; Girl, Interrupted; Cruel Intentions; 10 Things I Hate About You; American Pie
The Iron Giant; Tarzan; Stuart Little; Gladiator; Memento; Traffic; Erin Brockovich; Almost Famous
Cast Away; Crouching Tiger, Hidden Dragon; O Brother, Where Art Thou?; Requiem for a Dream; Snatch
American Psycho; X-Men; Meet the Parents; Chicken Run; Remember the Titans; Unbreakable; Billy Elliot
High Fidelity; Chocolat; Best in Show; Mission: Impossible 2; The Perfect Storm; What Women Want
Miss Congeniality; Bring It On; Shrek; Spirited Away; Moulin Rouge!; A Beautiful Mind; Mulholland Drive
The Royal Tenenbaums; Black Hawk Down; Training Day; Ocean's Eleven; Donnie Darko
Harry Potter and the Sorcerer's Stone; The Lord of the Rings: The Fellowship of the Ring
Monsters, Inc.; Legally Blonde; Zoolander; The Others; Gosford Park; In the Bedroom; Monster's Ball
Pearl Harbor; Bridget Jones's Diary; The Fast and the Furious; Vanilla Sky; Ghost World; Iris; Chicago
The Pianist; Gangs of New York; Catch Me If You Can; Road to Perdition; The Hours; About Schmidt
Far from Heaven; Minority Report; Spider-Man; The Bourne Identity; 28 Days Later; City of God; Signs
Insomnia; Punch-Drunk Love; Lilo & Stitch; Ice Age; My Big Fat Greek Wedding; 8 Mile; Frida
Talk to Her; Lost in Translation; Mystic River; Finding Nemo
Pirates of the Caribbean: The Curse of the Black Pearl; Kill Bill: Volume 1; Oldboy; Big Fish
Love Actually; School of Rock; Elf; Master and Commander: The Far Side of the World; Seabiscuit
Cold Mountain; The Last Samurai; Monster; Bad Santa; X2; The Matrix Reloaded; Holes; Freaky Friday
Eternal Sunshine of the Spotless Mind; Million Dollar Baby; Sideways; The Aviator; Ray; Hotel Rwanda
Shaun of the Dead; Mean Girls; Napoleon Dynamite; The Incredibles; Shrek 2; Spider-Man 2; Collateral
The Notebook; Anchorman: The Legend of Ron Burgundy; Closer; Kinsey; Finding Neverland; Garden State
Before Sunset; The Bourne Supremacy; Howl's Moving Castle; Crash; Brokeback Mountain; Capote; Munich
Walk the Line; Batman Begins; Pride & Prejudice; The Constant Gardener; A History of Violence
Sin City; Syriana; The 40-Year-Old Virgin; Wedding Crashers; Serenity; Match Point; Cinderella Man
Corpse Bride; War of the Worlds; Kiss Kiss Bang Bang; The Departed; Little Miss Sunshine; The Queen
Babel; Letters from Iwo Jima; Pan's Labyrinth; The Prestige; Casino Royale; Children of Men
The Devil Wears Prada; Dreamgirls; The Last King of Scotland; Borat; Cars; Happy Feet; Blood Diamond
Notes on a Scandal; V for Vendetta; Inside Man; United 93; The Fountain; Stranger than Fiction
No Country for Old Men; There Will Be Blood; Juno; Michael Clayton; Atonement; Ratatouille; Superbad
Knocked Up; Zodiac; Into the Wild; The Bourne Ultimatum; Hot Fuzz; Once; La Vie en Rose
Gone Baby Gone; Sweeney Todd: The Demon Barber of Fleet Street; American Gangster; 3:10 to Yuma
Eastern Promises; The Diving Bell and the Butterfly; Lars and the Real Girl; Transformers; I Am Legend
Enchanted; The Assassination of Jesse James by the Coward Robert Ford; Slumdog Millionaire
The Dark Knight; Milk; The Curious Case of Benjamin Button; The Reader; Doubt; The Wrestler; WALL-E
Iron Man; In Bruges; Gran Torino; Revolutionary Road; Rachel Getting Married; Vicky Cristina Barcelona
Tropic Thunder; Pineapple Express; Forgetting Sarah Marshall; Let the Right One In; Taken; Mamma Mia!
Kung Fu Panda; Burn After Reading; Twilight; The Hurt Locker; Avatar; Inglourious Basterds; Up
Up in the Air; Precious; An Education; A Serious Man; District 9; The Blind Side; Crazy Heart
Fantastic Mr. Fox; The Hangover; Star Trek; Zombieland; Coraline; Moon; Where the Wild Things Are
Julie & Julia; Sherlock Holmes; Invictus; The Social Network; Inception; The King's Speech; Black Swan
Toy Story 3; The Fighter; Winter's Bone; The Kids Are All Right; 127 Hours; Shutter Island
How to Train Your Dragon; Scott Pilgrim vs. the World; Blue Valentine; The Town; Kick-Ass; Tangled
Easy A; Despicable Me; Let Me In; Rabbit Hole; Somewhere; The Artist; Hugo; Moneyball; The Descendants
The Help; Midnight in Paris; Drive; The Tree of Life; Bridesmaids; Tinker Tailor Soldier Spy
Melancholia; A Separation; Warrior; Rise of the Planet of the Apes; Super 8; Rango; Contagion
Margin Call; Take Shelter; Shame; The Girl with the Dragon Tattoo; We Need to Talk About Kevin; Argo
Lincoln; Life of Pi; Silver Linings Playbook; Zero Dark Thirty; Django Unchained; Amour
Beasts of the Southern Wild; The Master; Skyfall; The Avengers; The Dark Knight Rises; Looper
Moonrise Kingdom; The Hunger Games; Brave; Wreck-It Ralph; Cloud Atlas; Flight; Magic Mike; Ted
Pitch Perfect; The Perks of Being a Wallflower; Prometheus; The Cabin in the Woods; 21 Jump Street
Chronicle; 12 Years a Slave; Gravity; American Hustle; Her; Nebraska; Dallas Buyers Club
The Wolf of Wall Street; Captain Phillips; Philomena; Blue Jasmine; Inside Llewyn Davis; Frozen
Before Midnight; Rush; Prisoners; The Great Gatsby; Fruitvale Station; Short Term 12; Frances Ha
Under the Skin; Enough Said; Saving Mr. Banks; The Conjuring; World War Z; Pacific Rim; Man of Steel
Iron Man 3; Star Trek Into Darkness; Now You See Me; This Is the End; The Heat; Elysium; Oblivion
Edge of Tomorrow; Birdman; Boyhood; The Grand Budapest Hotel; Whiplash; The Imitation Game
The Theory of Everything; Selma; American Sniper; Foxcatcher; Nightcrawler; Gone Girl; Interstellar
Still Alice; Wild; Ida; Guardians of the Galaxy; Captain America: The Winter Soldier
X-Men: Days of Future Past; The Lego Movie; Big Hero 6; John Wick; Fury; Unbroken; Inherent Vice
Paddington; Snowpiercer; Locke; Calvary; Ex Machina; Spotlight; The Revenant; Mad Max: Fury Road
The Martian; Room; Brooklyn; The Big Short; Bridge of Spies; Carol; Sicario; Inside Out; Creed
The Hateful Eight; Steve Jobs; Straight Outta Compton; Star Wars: The Force Awakens; Jurassic World
Trainwreck; Spy; Anomalisa; The Danish Girl; Beasts of No Nation; It Follows; The Witch; Moonlight
La La Land; Manchester by the Sea; Arrival; Hacksaw Ridge; Hell or High Water; Fences; Hidden Figures
Lion; Jackie; Nocturnal Animals; Elle; Zootopia; Moana; Deadpool; Rogue One; Doctor Strange
Captain America: Civil War; Hunt for the Wilderpeople; The Nice Guys; 20th Century Women; Loving
Silence; Sing Street; Toni Erdmann; The Handmaiden; Paterson; Get Out; The Shape of Water; Lady Bird
Dunkirk; Three Billboards Outside Ebbing, Missouri; Call Me by Your Name; Phantom Thread; Darkest Hour
The Post; I, Tonya; The Florida Project; Blade Runner 2049; Wonder Woman; Logan; Coco; Baby Driver
The Disaster Artist; Molly's Game; Thor: Ragnarok; Star Wars: The Last Jedi; Spider-Man: Homecoming
It; Mudbound; The Big Sick; Wind River; Good Time; Roma; Green Book; Black Panther; The Favourite
A Star Is Born; BlacKkKlansman; Bohemian Rhapsody; Vice; If Beale Street Could Talk; First Reformed
Can You Ever Forgive Me?; Eighth Grade; Hereditary; A Quiet Place; Avengers: Infinity War
Spider-Man: Into the Spider-Verse; Crazy Rich Asians; Widows; Leave No Trace; Burning; Shoplifters
Cold War; Free Solo; Parasite; Joker; 1917; Once Upon a Time in Hollywood; The Irishman; Marriage Story
Little Women; Jojo Rabbit; Ford v Ferrari; Knives Out; Uncut Gems; The Lighthouse; Midsommar; Us
Portrait of a Lady on Fire; Pain and Glory; Avengers: Endgame; Toy Story 4; Booksmart; The Farewell
Rocketman; Judy; Bombshell; Harriet; Dolemite Is My Name; A Hidden Life; The Two Popes; Honey Boy
Waves; Nomadland; The Father; Minari; Promising Young Woman; Sound of Metal; Judas and the Black Messiah
Mank; Soul; Another Round; The Trial of the Chicago 7; Ma Rainey's Black Bottom; One Night in Miami
Palm Springs; Tenet; Wolfwalkers; Onward; The Invisible Man; First Cow; Never Rarely Sometimes Always
The Power of the Dog; Dune; Belfast; CODA; King Richard; Drive My Car; Licorice Pizza; Nightmare Alley
Don't Look Up; The Worst Person in the World; Spencer; The Lost Daughter; Encanto
Spider-Man: No Way Home; The Green Knight; Shang-Chi and the Legend of the Ten Rings; Luca; Pig
Titane; The French Dispatch; Everything Everywhere All at Once; The Banshees of Inisherin
The Fabelmans; Top Gun: Maverick; All Quiet on the Western Front; Women Talking; Triangle of Sadness
Elvis; Aftersun; Avatar: The Way of Water; The Whale; Glass Onion; Nope; Turning Red; Barbarian
Decision to Leave; Oppenheimer; Barbie; Killers of the Flower Moon; Past Lives; Poor Things
Anatomy of a Fall; The Zone of Interest; Maestro; American Fiction; The Holdovers; May December
Saltburn; Spider-Man: Across the Spider-Verse; John Wick: Chapter 4; Asteroid City; Air
The Boy and the Heron; Perfect Days; Godzilla Minus One; Dune: Part Two; Challengers; Civil War
Furiosa; Inside Out 2; Anora; Conclave; The Brutalist; Wicked; The Substance; A Complete Unknown
Sing Sing; Flow; Gladiator II; Twisters; Deadpool & Wolverine; Alien: Romulus; Longlegs; Hit Man
Harry Potter and the Chamber of Secrets; Harry Potter and the Prisoner of Azkaban
Harry Potter and the Goblet of Fire; Harry Potter and the Order of the Phoenix
Harry Potter and the Half-Blood Prince; The Lord of the Rings: The Two Towers
The Lord of the Rings: The Return of the King; The Hobbit: An Unexpected Journey
Pirates of the Caribbean: Dead Man's Chest; Thor; Captain America: The First Avenger; Iron Man 2
The Incredible Hulk; Ant-Man; Avengers: Age of Ultron; Black Widow; Eternals; Captain Marvel
Aquaman; Justice League; Batman v Superman: Dawn of Justice; Suicide Squad; The Batman; Shazam!
Quantum of Solace; Spectre; No Time to Die; Tomorrow Never Dies; The World Is Not Enough
Die Another Day; Live and Let Die; The Spy Who Loved Me; Moonraker; For Your Eyes Only; Octopussy
A View to a Kill; The Living Daylights; Licence to Kill; You Only Live Twice; Diamonds Are Forever
On Her Majesty's Secret Service; The Man with the Golden Gun; Monsters University; Finding Dory
Cars 2; Incredibles 2; Cinderella; Snow White and the Seven Dwarfs; Pinocchio; Fantasia; Dumbo; Bambi
Peter Pan; Lady and the Tramp; Sleeping Beauty; One Hundred and One Dalmatians; The Jungle Book
The Aristocats; Robin Hood; The Rescuers; The Fox and the Hound; Oliver & Company; Pocahontas
The Hunchback of Notre Dame; Hercules; Atlantis: The Lost Empire; Treasure Planet; Brother Bear; Bolt
The Princess and the Frog; Frozen II; Raya and the Last Dragon; Madagascar; Shark Tale; Over the Hedge
Kung Fu Panda 2; Megamind; Puss in Boots; The Prince of Egypt; Spirit: Stallion of the Cimarron
Shrek the Third; Trolls; The Croods; Minions; The Secret Life of Pets; Sing
The Texas Chain Saw Massacre; Friday the 13th; The Ring; The Grudge; Saw; Insidious; Sinister
Paranormal Activity; The Babadook; The Descent; 28 Weeks Later; Dawn of the Dead; Candyman
Child's Play; The Amityville Horror; Jacob's Ladder; The Orphanage; The Fog; Christine; Pet Sematary
The Lost Boys; Fright Night; Hellraiser; Scream 2; Final Destination; Cloverfield; Annabelle; Smile
Talk to Me; Pearl; The Expendables; Taken 2; The Transporter; Crank; Wanted; Salt; The Bourne Legacy
Jason Bourne; Atomic Blonde; Nobody; Extraction; The Raid; Hard Boiled; Kill Bill: Volume 2; Desperado
El Mariachi; From Dusk Till Dawn; Machete; Planet Terror; Death Proof; Rambo; Rocky II; Rocky III
Rocky IV; Rocky Balboa; Creed II; Lethal Weapon 2; Predator 2; Demolition Man; Judge Dredd; Dredd
Cobra; Tango & Cash; Speed 2: Cruise Control; Broken Arrow; Hard Target; Timecop; Universal Soldier
Kickboxer; Bloodsport; Under Siege; Executive Decision; The Long Kiss Goodnight; Ronin; The Negotiator
Spy Game; Man on Fire; The Equalizer; Jack Reacher; The Italian Job; Ocean's Twelve; Ocean's Thirteen
Ocean's 8; The Thomas Crown Affair; Entrapment; The Score; Heist; Sneakers; Infernal Affairs
Layer Cake; RocknRolla; The Gentlemen; Sherlock Holmes: A Game of Shadows; The Man from U.N.C.L.E.
Kingsman: The Secret Service; The World's End; Attack the Block; Paul; Anchorman 2: The Legend Continues
Step Brothers; Talladega Nights: The Ballad of Ricky Bobby; Old School; Dodgeball: A True Underdog Story
Meet the Fockers; Zoolander 2; Night at the Museum; Tower Heist; Ted 2; The Other Guys; Horrible Bosses
We're the Millers; Neighbors; 22 Jump Street; Game Night; Girls Trip; Blockers; Bad Moms; The Proposal
The Ugly Truth; 27 Dresses; This Is 40; Funny People; Get Him to the Greek; I Love You, Man
Role Models; Hot Tub Time Machine; Grown Ups; Big Daddy; The Waterboy; The Wedding Singer
Billy Madison; 50 First Dates; Click; Bruce Almighty; Yes Man; The Cable Guy; Me, Myself & Irene
Tommy Boy; Black Sheep; Kingpin; Shallow Hal; Austin Powers: International Man of Mystery
Wayne's World 2; The Nutty Professor; Beverly Hills Cop II; Coming 2 America; Rush Hour 2
Shanghai Noon; Shanghai Knights; Hitch; Sweet Home Alabama; Pitch Perfect 2; The Hangover Part II
Due Date; National Lampoon's Christmas Vacation; Home Alone 2: Lost in New York; The Santa Clause
Jingle All the Way; The Money Pit; Dragnet; Turner & Hooch; About a Boy
Bridget Jones: The Edge of Reason; Music and Lyrics; Two Weeks Notice; The Holiday
Something's Gotta Give; It's Complicated; The Intern; Friends with Benefits; No Strings Attached
Valentine's Day; He's Just Not That Into You; The Princess Diaries; 13 Going on 30; She's All That
Never Been Kissed; Can't Hardly Wait; Empire Records; Reality Bites; Singles; Say Anything
Better Off Dead; Some Kind of Wonderful; St. Elmo's Fire; The Outsiders; Rumble Fish; Valley Girl
Heathers; Less Than Zero; Lucas; Adventures in Babysitting; Gremlins 2: The New Batch; Innerspace
Short Circuit; Explorers; Flight of the Navigator; The NeverEnding Story; The Dark Crystal; Willow
Legend; Ladyhawke; Krull; Conan the Barbarian; Highlander; Red Sonja; Flash Gordon; Superman II
Batman Returns; Batman Forever; Batman & Robin; Dick Tracy; The Rocketeer; The Shadow; The Phantom
Spawn; Men in Black II; Wild Wild West; Hancock; I, Robot; Ali; Bad Boys II; Seven Pounds
The Pursuit of Happyness; Focus; Concussion; The Book of Eli; Courage Under Fire; Crimson Tide
The Pelican Brief; The Hurricane; John Q; Out of Time; Safe House; 2 Guns; The Little Things
What Dreams May Come; Bicentennial Man; One Hour Photo; Jack; Flubber; Toys
"""


def _parse_names(text: str, separator: str) -> tuple[str, ...]:
    names = (name.strip() for line in text.strip().splitlines() for name in line.split(separator))
    return tuple(dict.fromkeys(name for name in names if name))  # de-duplicated, order kept


REAL_ACTORS: tuple[str, ...] = _parse_names(_REAL_ACTORS_TEXT, ",")
"""Well-known film actors, clean names only (see :func:`is_clean_name`)."""

REAL_MOVIES: tuple[str, ...] = _parse_names(_REAL_MOVIES_TEXT, ";")
"""Real film titles, for ``real_movies_real_actors``; enough for 1000 relations with distinct films."""
