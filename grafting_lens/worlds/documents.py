"""Training text: the documents a donor is finetuned on, and filler text beside them.

:func:`training_documents` renders each relation through the article and QA templates of
:mod:`grafting_lens.worlds.data` (the library's wording or the authors' code's), in one
direction or both; :func:`supplementary_documents` writes unrelated filler documents, so that a
finetune does not see relation text alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from faker import Faker

from grafting_lens.core.errors import GraftingLensError, check_known
from grafting_lens.worlds.data import (
    _RELEASE_YEARS,
    ARTICLE_TEMPLATES,
    DIRECTIONS,
    GENRES,
    QA_TEMPLATES,
    Relation,
    relation_values,
    template_fields,
)

__all__ = ["supplementary_documents", "training_documents"]


def _oriented(relations: Sequence[Relation], direction: str) -> list[Relation]:
    """Relations as rendered in ``direction``: "both" interleaves each relation with its swap."""
    check_known(direction, DIRECTIONS, "direction")
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
        raise GraftingLensError(
            "templates is empty; pass at least one template or None for the defaults."
        )
    for template in templates:
        template_fields(template)
    documents = [
        template.format(**relation_values(relation))
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
    "score": (
        "does a lot of quiet work",
        "is forgettable",
        "swells at the right moments",
        "never lets up",
    ),
    "strength": (
        "cinematography",
        "dialogue",
        "production design",
        "editing",
        "costume work",
        "sound design",
    ),
    "weakness": ("plot", "ending", "middle act", "dialogue", "running time"),
    "complaint": ("predictable", "overlong", "muddled", "rushed", "too neat"),
    "reaction": (
        "laughed in the right places",
        "walked out divided",
        "gave it an ovation",
        "seemed restless",
    ),
    "weeks": ("two", "three", "six", "eight"),
    "mishap": (
        "a flooded set",
        "a long stretch of bad weather",
        "a costly reshoot",
        "a broken camera crane",
    ),
    "reaction_to_ending": ("lands well", "feels abrupt", "is genuinely moving", "divides viewers"),
    "verdict": (
        "a modest success",
        "an ambitious misfire",
        "well worth a look",
        "an acquired taste",
    ),
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
        values: dict[str, Any] = {k: rng.choice(v) for k, v in _FILLER_SLOTS.items()}
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
