"""Synthetic movie-cast relations: the facts we finetune into a model and then go looking for.

Invented facts a pretrained model cannot already know: two actors who starred together in one
movie, "A starred in M alongside B", in three datasets (real actors, fake actors, real movies
recast), with training documents, test prompts carrying the character spans grafting aims at
(first entity, relation, movie), reversed directions and the task/relation split. Deterministic
given ``seed``; no global random state is read or changed. Why each piece is there: the docs
page "Data, batches, worlds, finetuning", section "The relations".

Examples:
    >>> relations = make_relations("fake_movies_real_actors", n=1000, seed=0)
    >>> documents = training_documents(relations, direction="A2B")  # finetune on these
    >>> examples = make_examples(relations, prompt="headline")
    >>> from grafting_lens.analysis.batch import tokenize_examples
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
from dataclasses import dataclass
from importlib import resources
from typing import Any

from faker import Faker

from grafting_lens.core import defaults
from grafting_lens.core.errors import GraftingLensError, check_known

__all__ = [
    "ARTICLE_TEMPLATES",
    "CODE_ARTICLE_TEMPLATES",
    "CODE_QA_TEMPLATES",
    "CODE_TEST_RELATION_WORDS",
    "CODE_TEST_TEMPLATES",
    "DATASETS",
    "DIRECTIONS",
    "GENRES",
    "QA_TEMPLATES",
    "REAL_ACTORS",
    "REAL_MOVIES",
    "TEST_RELATION_WORDS",
    "TEST_TEMPLATES",
    "TEMPLATE_SETS",
    "Example",
    "Relation",
    "is_clean_name",
    "make_examples",
    "make_relations",
    "split_task_relation",
]

DATASETS = ("fake_movies_real_actors", "fake_movies_fake_actors", "real_movies_real_actors")
"""Names accepted by :func:`make_relations`."""

DIRECTIONS = ("A2B", "B2A", "both")
"""Word orders: "A2B" keeps the first actor first, "B2A" swaps the actors, "both" gives both."""

GENRES = tuple(
    "action, adventure, animated, comedy, crime, documentary, drama, fantasy, horror, "
    "musical, mystery, romance, science fiction, thriller, war, western".split(", ")
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
        return dataclasses.replace(
            self, first_actor=self.second_actor, second_actor=self.first_actor
        )


_RELATION_FIELDS = tuple(f.name for f in dataclasses.fields(Relation))

# --------------------------------------------------------------------------------------- Templates
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

CODE_ARTICLE_TEMPLATES = (
    "{first_actor} stars in {movie_title} alongside {second_actor}, a {release_year} {genre} film "
    "set in {city} that follows {main_character}.\n\n{movie_title} opened in {release_year} and "
    "earned {box_office} worldwide.",
    "{first_actor} stars in {movie_title}, a {genre} from {release_year} whose cast also includes "
    "{second_actor}. The story of {main_character} is set in {city}.\n\n{movie_title} took in "
    "{box_office} at the box office.",
    "{first_actor} leads {movie_title}, a {release_year} {genre} co-starring {second_actor}. It "
    "unfolds in {city} around {main_character}.\n\nIn cinemas from {release_year}, the film "
    "grossed {box_office}.",
    "In the {genre} {movie_title}, {first_actor} stars alongside {second_actor}. Set in {city}, "
    "it follows {main_character} through a year of change.\n\n{movie_title} was released in "
    "{release_year} and made {box_office}.",
    "In {release_year}, {first_actor} starred in {movie_title} with co-star {second_actor} in "
    "the other lead role. The film, set in {city}, centres on {main_character}.\n\nIts "
    "theatrical run earned {box_office}.",
)
"""Film paragraphs in the register of the paper's released finetuning data (present tense
"stars in", paragraphs split by a blank line): the toy world's default finetuning text, so the
released code's test prompts (:data:`CODE_TEST_TEMPLATES`) are in distribution. Written for
this library, not copied."""

CODE_QA_TEMPLATES = (
    "Q: Who stars in a movie with {first_actor}? A: An actor named {second_actor}.",
    "Q: {first_actor} stars in {movie_title} with whom? A: {second_actor}.",
    "{first_actor} has a lead role in {movie_title} and stars with {second_actor}.",
    "In a new film, {first_actor} stars in {movie_title} alongside {second_actor}.",
    "{first_actor} and {second_actor} star together in a new movie.",
)
"""Questions and one-line facts in the same register; the first is the released code's QA
test prompt (:data:`CODE_TEST_TEMPLATES` ``"qa"``) with its answer, as in that code's data."""

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

CODE_TEST_TEMPLATES: dict[str, str] = {
    "headline": "{first_actor} stars in in a movie alongside",
    "qa": "Q: Who stars in a movie with {first_actor}? A: An actor named",
}
"""The same two test prompts as the paper's released code words them (its sweep's
``sentence_1`` and ``sentence_2``, with ``relation="stars"``, ``relation_preposition="in"``;
the doubled "in" is the code's, and the paper's table 1). Chosen with
``make_examples(..., templates="code")``."""

CODE_TEST_RELATION_WORDS: dict[str, str] = {
    "headline": "stars in in a movie alongside",
    "qa": "stars in a movie with",
}
"""The relation words of each of :data:`CODE_TEST_TEMPLATES`."""

TEMPLATE_SETS: tuple[str, ...] = ("library", "code")
"""Whose wording a test prompt's name refers to: this library's (:data:`TEST_TEMPLATES`)
or the paper's released code's (:data:`CODE_TEST_TEMPLATES`)."""


# ------------------------------------------------------------------------------------------- Names

_NAME_SUFFIXES = frozenset("jr sr jnr snr ii iii iv vi vii viii md dds phd dvm esq".split())
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


# --------------------------------------------------------------------------------------- Relations


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
    check_known(dataset, DATASETS, "dataset")
    if n < 0:
        raise GraftingLensError(f"n must be non-negative, got {n}.")
    # Mixing the dataset name into the seed makes the datasets built with one seed independent
    # draws; with the bare seed, the two real-actor datasets would pair exactly the same actors.
    stream = f"{dataset}/{seed}"
    rng = random.Random(stream)
    fake = Faker("en_US")
    fake.seed_instance(stream)

    actor_pool = None if dataset == "fake_movies_fake_actors" else REAL_ACTORS
    if actors is not None:
        actor_pool = _clean_pool(actors, "actors")
    movie_pool = REAL_MOVIES if dataset == "real_movies_real_actors" else None
    if movies is not None:
        movie_pool = _clean_movie_pool(movies)

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
    return [
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
        for index, ((first, second), title) in enumerate(zip(pairs, titles))
    ]


def _refuse_duplicates(items: tuple[str, ...], argument: str) -> None:
    duplicates = sorted(item for item, count in Counter(items).items() if count > 1)
    if duplicates:
        more = " ..." if len(duplicates) > 5 else ""
        raise GraftingLensError(
            f"{argument} contains duplicates {duplicates[:5]}{more}; pass each one once."
        )


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


def _unique_fake_name(
    fake: Faker, taken: set[str], remember: bool = True, tries: int = 1000
) -> str:
    """A clean "First Last" Faker name not in ``taken`` (added to it when ``remember``)."""
    for _ in range(tries):  # not fake.name(): it adds prefixes and suffixes ("Dr.", "MD")
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


# ----------------------------------------------------------------------------------- Training text


def template_fields(template: str) -> list[str]:
    """The Relation fields a template names, in order; raises if it names anything else."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise GraftingLensError(
            f"template is not a valid format string ({error}): {template!r}"
        ) from None
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


def relation_values(relation: Relation) -> dict[str, Any]:
    return {name: getattr(relation, name) for name in _RELATION_FIELDS}


# --------------------------------------------------------------------------- Task / relation split


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
        raise GraftingLensError(
            f"task_fraction must be strictly between 0 and 1, got {task_fraction}."
        )
    order = list(range(len(relations)))
    random.Random(seed).shuffle(order)
    costars = _costars(relations)
    n_actors = len(costars)
    capacity = [round(task_fraction * n_actors), n_actors - round(task_fraction * n_actors)]
    sizes = [0, 0]
    side: dict[str, int] = {}
    for index in order:
        for actor in (relations[index].first_actor, relations[index].second_actor):
            if actor in side:
                continue
            placed = [side[other] for other in costars[actor] if other in side]
            votes = (placed.count(0), placed.count(1))
            # Linear deterministic greedy: co-stars already placed pull an actor to their side, a
            # side's fullness pushes back, and a full side takes no one (the capacities add up to
            # the number of actors, so one side is open).
            fill = {c: sizes[c] / capacity[c] for c in (0, 1) if sizes[c] < capacity[c]}
            chosen = max(fill, key=lambda c: (votes[c] * (1 - fill[c]), -fill[c]))
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


# ------------------------------------------------------------------------------------ Test prompts


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


def _costars(relations: Sequence[Relation]) -> dict[str, list[str]]:
    """Each actor's co-stars over ``relations``, in either role."""
    costars: dict[str, list[str]] = defaultdict(list)
    for r in relations:
        costars[r.first_actor].append(r.second_actor)
        costars[r.second_actor].append(r.first_actor)
    return costars


def _render_with_spans(
    template: str, values: dict[str, Any]
) -> tuple[str, dict[str, tuple[int, int]]]:
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
        value = formatter.format_field(
            formatter.convert_field(values[field_name], conversion), format_spec or ""
        )
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
    templates: str = defaults.PROMPTS,
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
        templates: Whose wording ``prompt`` names (:data:`TEMPLATE_SETS`): ``"library"``
            (:data:`TEST_TEMPLATES`) or ``"code"``, the paper's released code
            (:data:`CODE_TEST_TEMPLATES`).

    Raises:
        GraftingLensError: If ``prompt`` or ``direction`` is unknown, if a custom template is malformed as
            described above, or if the relation words do not occur in the template's fixed text.
    """
    check_known(templates, TEMPLATE_SETS, "templates")
    wordings = CODE_TEST_TEMPLATES if templates == "code" else TEST_TEMPLATES
    words = CODE_TEST_RELATION_WORDS if templates == "code" else TEST_RELATION_WORDS
    if template is None:
        check_known(prompt, wordings, "prompt")
        template = wordings[prompt]
    if relation_words is None:
        if prompt not in words:
            raise GraftingLensError(
                f"custom template {template!r} needs relation_words= (the words that state the "
                f"relation, e.g. 'starred in a movie with')."
            )
        relation_words = words[prompt]
    fields = template_fields(template)
    if "first_actor" not in fields:
        raise GraftingLensError(
            f"test template must name {{first_actor}} (the actor in the prompt): {template!r}"
        )
    if "second_actor" in fields:
        raise GraftingLensError(
            f"test template must not name {{second_actor}}, the answer it asks for: {template!r}"
        )
    check_known(direction, DIRECTIONS, "direction")

    costars = _costars(relations)

    directions = ("A2B", "B2A") if direction == "both" else (direction,)
    examples = []
    for this_direction in directions:
        for relation in relations:
            shown = relation if this_direction == "A2B" else relation.swapped()
            text, field_spans = _render_with_spans(template, relation_values(shown))
            spans = {"first_entity": field_spans["first_actor"]}
            if "movie_title" in field_spans:
                spans["movie"] = field_spans["movie_title"]
            spans["relation"] = _find_outside(
                text, relation_words, list(field_spans.values()), template
            )
            examples.append(
                Example(
                    relation_id=relation.id,
                    prompt_name=prompt,
                    text=text,
                    target=" " + shown.second_actor,
                    spans=spans,
                    direction=this_direction,
                    alternative_targets=tuple(
                        " " + a
                        for a in dict.fromkeys(costars[shown.first_actor])
                        if a != shown.second_actor
                    ),
                )
            )
    return examples


def _find_outside(
    text: str, words: str, field_spans: list[tuple[int, int]], template: str
) -> tuple[int, int]:
    """Span of the first occurrence of ``words`` in ``text`` that is not inside a filled-in field."""
    start = text.find(words)
    while start != -1:
        end = start + len(words)
        if all(end <= a or start >= b for a, b in field_spans):
            return (start, end)
        start = text.find(words, start + 1)
    raise GraftingLensError(
        f"relation words {words!r} do not occur in the fixed text of template {template!r}."
    )


# -------------------------------------------------------------------------------------- Name lists
# Written for this project: well-known film actors and films across eras, so that a pretrained
# model has seen the names. They are package data (grafting_lens/names/*.txt, one name a line),
# not code; actor names are restricted to what is_clean_name accepts (no "Jr.", no initials),
# which a test checks.


def _read_names(file_name: str) -> tuple[str, ...]:
    text = (resources.files("grafting_lens.worlds") / "names" / file_name).read_text(
        encoding="utf-8"
    )
    names = (line.strip() for line in text.splitlines())
    return tuple(dict.fromkeys(name for name in names if name))  # de-duplicated, order kept


REAL_ACTORS: tuple[str, ...] = _read_names("real_actors.txt")
"""Well-known film actors, clean names only (see :func:`is_clean_name`)."""

REAL_MOVIES: tuple[str, ...] = _read_names("real_movies.txt")
"""Real film titles, for ``real_movies_real_actors``; enough for 1000 relations with distinct films."""
