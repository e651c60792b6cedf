"""Test sets: the questions a run asks, one dataset under one prompt.

A :class:`TestSet` holds examples (:class:`grafting_lens.worlds.data.Example` s, tokenized by
the runner with each model set's own tokenizer) or an already tokenized batch, and the
labels that become columns of the results (``dataset``, ``prompt``, ``data_seed``).
:func:`make_test_sets` makes one per prompt over a list of relations, from the test
templates of :mod:`grafting_lens.worlds.data` or the prompts naming the movie
(:data:`MOVIE_PROMPTS`) that the movie-title configurations need, worded as this
the paper's released code words them (``templates="code"``, the default, the wording of
:data:`~grafting_lens.study.DEFAULT_SEMANTICS`:
:data:`~grafting_lens.worlds.data.CODE_TEST_TEMPLATES`, :data:`CODE_MOVIE_PROMPTS`) or as this
library does (``templates="library"``, what ``semantics="clean"`` asks for).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grafting_lens.analysis.batch import TokenizedExamples, as_batch
from grafting_lens.core.errors import ExperimentError, did_you_mean
from grafting_lens.models.model_set import ModelSet
from grafting_lens.study.semantics import DEFAULT_SEMANTICS, Semantics, semantics_or_default
from grafting_lens.worlds import data

__all__ = ["CODE_MOVIE_PROMPTS", "MOVIE_PROMPTS", "TestSet", "make_test_sets"]

MOVIE_PROMPTS: dict[str, tuple[str, str]] = {
    "headline_movie": ("{first_actor} starred in {movie_title} alongside", "starred in"),
    "qa_movie": ("Q: Who starred in {movie_title} with {first_actor}? A:", "starred in"),
}
"""Test prompts naming the movie: ``name -> (template, relation words)``. The headline one
is the first article template cut before the answer; the QA one is the second QA template's."""

CODE_MOVIE_PROMPTS: dict[str, tuple[str, str]] = {
    "headline_movie": ("{first_actor} stars in in {movie_title} alongside", "stars in in"),
    "qa_movie": (
        "In a new film, {first_actor} appears in {movie_title} with the other lead actor, "
        "whose name is:",
        "appears in",
    ),
}
"""The prompts naming the movie as the paper's released code words them (its sweep's
``sentence_3``, the one its movie configurations ran on, and ``sentence_4``)."""


@dataclass(frozen=True)
class TestSet:
    """The examples of one dataset asked with one prompt.

    Attributes:
        examples: :class:`grafting_lens.worlds.data.Example` s (tokenized by the runner with each
            model set's tokenizer), or an already tokenized batch (used as is).
        dataset: Label of the dataset (a column of the results).
        prompt: Label of the prompt (default: the examples' ``prompt_name``).
        seed: Seed the relations were made with (the ``data_seed`` column).
        templates: Whose wording the prompts have, ``"library"`` or ``"code"``
            (:data:`~grafting_lens.worlds.data.TEMPLATE_SETS`; set by :func:`make_test_sets`),
            or ``None`` for prompts of your own; a run refuses test sets whose wording
            is not its semantics'.

    Raises:
        ExperimentError: No examples, something that is neither examples nor a batch, or
            unknown ``templates``.
    """

    __test__ = False  # not a pytest class

    examples: Any
    dataset: str = "custom"
    prompt: str | None = None
    seed: int | None = None
    templates: str | None = None

    def __post_init__(self) -> None:
        if self.is_tokenized:
            n = int(torch.as_tensor(self.examples.tokens).shape[0])
            first = (getattr(self.examples, "examples", None) or [None])[0]
        else:
            try:
                object.__setattr__(self, "examples", tuple(self.examples))
            except TypeError:
                raise ExperimentError(
                    f"A test set holds examples (grafting_lens.worlds.data.make_examples) or a tokenized "
                    f"batch with tokens, attention_mask, target_ids and spans (build one with "
                    f"grafting_lens.worlds.data.tokenize_examples); got {type(self.examples).__name__}."
                ) from None
            n = len(self.examples)
            first = self.examples[0] if n else None
        if n == 0:
            raise ExperimentError(
                f"The test set {self.dataset!r}/{self.prompt!r} has no examples: there is "
                "nothing to run."
            )
        if self.prompt is None:
            object.__setattr__(self, "prompt", getattr(first, "prompt_name", None) or "custom")
        if self.templates is not None and self.templates not in data.TEMPLATE_SETS:
            raise ExperimentError(
                f"templates must be None or one of {', '.join(map(repr, data.TEMPLATE_SETS))}, "
                f"got {self.templates!r}."
            )

    @property
    def label(self) -> str:
        """``dataset/prompt``, how messages name the test set."""
        return f"{self.dataset}/{self.prompt}"

    @property
    def is_tokenized(self) -> bool:
        """Whether the test set holds a batch rather than examples."""
        return isinstance(self.examples, TokenizedExamples) or hasattr(self.examples, "tokens")

    def batch(
        self, models: ModelSet, semantics: Semantics | str | None = None
    ) -> TokenizedExamples:
        """The test set as a checked batch for ``models`` (tokenized with its tokenizer).

        Examples are tokenized as ``semantics`` says (its ``bos``, ``target`` and
        ``spans``; see :func:`grafting_lens.worlds.data.tokenize_examples`; default
        :data:`~grafting_lens.study.DEFAULT_SEMANTICS`); an already
        tokenized batch is used as is. Examples that cannot be tokenized cleanly are
        dropped with one warning naming the test set.

        Raises:
            BatchError, TokenError, SelectionError: See
                :func:`grafting_lens.analysis.batch.as_batch`.
        """
        source = self.examples
        if not self.is_tokenized:
            rules = semantics_or_default(semantics).tokenization()
            with warnings.catch_warnings():
                # Drops are listed in TokenizedExamples.dropped; say it once, with the name.
                warnings.simplefilter("ignore")
                source = data.tokenize_examples(list(source), models.tokenizer, **rules)
            if source.dropped:
                warnings.warn(
                    f"Test set {self.label!r}: dropped {len(source.dropped)} of "
                    f"{len(source.dropped) + len(source)} examples that cannot be tokenized "
                    f"cleanly (first: {source.dropped[0][1]}).",
                    stacklevel=4,  # the caller of run_experiment
                )
        return as_batch(source, models)


def make_test_sets(
    relations: Sequence[data.Relation],
    prompts: Sequence[str] = ("headline", "qa"),
    direction: str = "A2B",
    dataset: str = "custom",
    seed: int | None = None,
    templates: str = DEFAULT_SEMANTICS.prompts,
) -> list[TestSet]:
    """One test set per prompt over ``relations``.

    Args:
        relations: The facts to ask about.
        prompts: Names in :data:`grafting_lens.worlds.data.TEST_TEMPLATES` or :data:`MOVIE_PROMPTS`.
        direction: ``"A2B"`` asks for the second actor, ``"B2A"`` for the first (reversal).
        dataset: Label of the relations (a column of the results).
        seed: Seed the relations were made with (recorded in the results).
        templates: Whose wording the prompts have, a semantics' ``prompts``: ``"code"``
            (the default, that of :data:`~grafting_lens.study.DEFAULT_SEMANTICS`),
            the paper's released code's (:data:`CODE_MOVIE_PROMPTS`,
            :data:`grafting_lens.worlds.data.CODE_TEST_TEMPLATES`), or ``"library"``
            (:data:`MOVIE_PROMPTS`, :data:`grafting_lens.worlds.data.TEST_TEMPLATES`), which a
            run under ``semantics="clean"`` asks for. A run refuses test sets of another
            wording than its semantics'.

    Raises:
        ExperimentError: No relations, an unknown prompt or ``templates``.
    """
    if not relations:
        raise ExperimentError("No relations to test: the example set is empty.")
    if templates not in data.TEMPLATE_SETS:
        raise ExperimentError(
            f"templates must be one of {', '.join(map(repr, data.TEMPLATE_SETS))}, got "
            f"{templates!r}."
        )
    movies = CODE_MOVIE_PROMPTS if templates == "code" else MOVIE_PROMPTS
    test_sets = []
    for prompt in prompts:
        if prompt in movies:
            template, words = movies[prompt]
            examples = data.make_examples(
                relations,
                prompt=prompt,
                direction=direction,
                template=template,
                relation_words=words,
            )
        elif prompt in data.TEST_TEMPLATES:
            examples = data.make_examples(
                relations, prompt=prompt, direction=direction, templates=templates
            )
        else:
            known = [*data.TEST_TEMPLATES, *MOVIE_PROMPTS]
            raise ExperimentError(
                f"Unknown prompt {prompt!r}.{did_you_mean(prompt, known)} Known: "
                f"{', '.join(known)}."
            )
        test_sets.append(
            TestSet(examples, dataset=dataset, prompt=prompt, seed=seed, templates=templates)
        )
    return test_sets
