"""Test sets: the questions a run asks, one dataset under one prompt.

:func:`make_test_sets` makes a :class:`TestSet` per prompt over a list of relations, in the
paper's code's wording or the library's; :func:`read_prompts` reads a file of your own prompts.
"""

from __future__ import annotations

import csv
import io
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grafting_lens.analysis.batch import TokenizedExamples, as_batch, tokenize_examples
from grafting_lens.core.errors import ArgumentTypeError, ExperimentError, TokenError, check_known
from grafting_lens.models.model_set import ModelSet
from grafting_lens.study.semantics import CLEAN, DEFAULT_SEMANTICS, Semantics, semantics_or_default
from grafting_lens.worlds import data

__all__ = [
    "CODE_MOVIE_PROMPTS",
    "MOVIE_PROMPTS",
    "PROMPT_COLUMNS",
    "TestSet",
    "check_answers",
    "library_batches",
    "make_test_sets",
    "read_prompts",
]

MOVIE_PROMPTS: dict[str, tuple[str, str]] = {
    "headline_movie": ("{first_actor} starred in {movie_title} alongside", "starred in"),
    "qa_movie": ("Q: Who starred in {movie_title} with {first_actor}? A:", "starred in"),
}
"""Test prompts naming the movie: ``name -> (template, relation words)``."""

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
        templates: Whose wording the prompts have, ``"library"`` or ``"code"`` (set by
            :func:`make_test_sets`), or ``None`` for your own; a run refuses test sets
            worded otherwise than its semantics.
        source: The file the examples were read from (:func:`read_prompts`), for messages
            to name rows.

    Raises:
        ExperimentError: No examples, neither examples nor a batch, or unknown ``templates``.
    """

    __test__ = False  # not a pytest class

    examples: Any
    dataset: str = "custom"
    prompt: str | None = None
    seed: int | None = None
    templates: str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        if self.is_tokenized:
            n = int(torch.as_tensor(self.examples.tokens).shape[0])
            first = (getattr(self.examples, "examples", None) or [None])[0]
        else:
            try:
                object.__setattr__(self, "examples", tuple(self.examples))
            except TypeError:
                raise ArgumentTypeError(
                    f"A test set holds examples (grafting_lens.worlds.data.make_examples) or a tokenized "
                    f"batch with tokens, attention_mask, target_ids and spans (build one with "
                    f"grafting_lens.analysis.batch.tokenize_examples); got {type(self.examples).__name__}."
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
        if self.templates is not None:
            check_known(
                self.templates, data.TEMPLATE_SETS, "templates", ExperimentError, " or None"
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
        """The test set as a checked batch for ``models``: examples tokenized with its tokenizer
        as ``semantics`` says (default :data:`~grafting_lens.study.semantics.DEFAULT_SEMANTICS`;
        those that cannot be tokenized cleanly dropped, with one warning), a batch as it is.

        Raises:
            BatchError, TokenError, SelectionError: As :func:`~grafting_lens.analysis.batch.as_batch`.
        """
        source = self.examples
        if not self.is_tokenized:
            rules = semantics_or_default(semantics).tokenization()
            with warnings.catch_warnings():
                # Drops are listed in TokenizedExamples.dropped; say it once, with the name.
                warnings.simplefilter("ignore")
                source = tokenize_examples(list(source), models.tokenizer, **rules)
            if source.dropped:
                warnings.warn(
                    f"Test set {self.label!r}: dropped {len(source.dropped)} of "
                    f"{len(source.dropped) + len(source)} examples that cannot be tokenized "
                    f"cleanly (first: {source.dropped[0][1]}).",
                    stacklevel=4,  # the caller of run_experiment
                )
        batch = as_batch(source, models)
        self._check_context(batch, models)
        return batch

    def where(self, example: Any, index: int) -> str:
        """How a message names one example: its row in :attr:`source`, or its place here."""
        relation = getattr(example, "relation_id", None)
        if self.source is not None and relation is not None:
            return f"{self.source}, row {relation + 1}"
        return f"test set {self.label!r}, example {index}"

    def _check_context(self, batch: TokenizedExamples, models: ModelSet) -> None:
        """Refuse a prompt longer than the model's context (``n_ctx``), before memory runs out."""
        context = int(getattr(models.base.cfg, "n_ctx", 0) or 0)
        lengths = batch.attention_mask.sum(dim=1)  # as_batch gave the mask, padding or not
        if not context or int(lengths.max()) <= context:
            return
        index = int(lengths.argmax())
        example = batch.examples[index] if batch.examples else None
        text = getattr(example, "text", None)
        shown = "" if text is None else f" ({text[:60]!r}{'...' if len(text) > 60 else ''})"
        longer = int((lengths > context).sum())
        raise TokenError(
            f"The prompt of {self.where(example, index)}{shown} is {int(lengths[index])} tokens, "
            f"longer than the model's context (n_ctx) of {context}"
            + (f"; {longer - 1} more are too" if longer > 1 else "")
            + f". Shorten or split it to at most {context} tokens."
        )


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
        direction: ``"A2B"`` asks for the second actor, ``"B2A"`` for the first.
        dataset: Label of the relations (a column of the results).
        seed: Seed the relations were made with (recorded in the results).
        templates: Whose wording the prompts have, a semantics' ``prompts``: ``"code"``
            (the default's: :data:`CODE_MOVIE_PROMPTS`) or ``"library"`` (:data:`MOVIE_PROMPTS`,
            :data:`grafting_lens.worlds.data.TEST_TEMPLATES`).

    Raises:
        ExperimentError: No relations, an unknown prompt or ``templates``.
    """
    for prompt in prompts:
        check_known(prompt, [*data.TEST_TEMPLATES, *MOVIE_PROMPTS], "prompt", ExperimentError)
    movies = CODE_MOVIE_PROMPTS if templates == "code" else MOVIE_PROMPTS
    test_sets = []
    for prompt in prompts:
        if prompt in movies:
            template, words = movies[prompt]
            wording = {"template": template, "relation_words": words}
        else:
            wording = {"templates": templates}
        examples = data.make_examples(relations, prompt=prompt, direction=direction, **wording)
        test_sets.append(
            TestSet(examples, dataset=dataset, prompt=prompt, seed=seed, templates=templates)
        )
    return test_sets


def library_batches(
    relations: Sequence[data.Relation], tokenizer: Any, prompts: Sequence[str], count: int | None
) -> dict[str, TokenizedExamples]:
    """Each prompt's examples of the first ``count`` relations, worded and tokenized as CLEAN:
    the one reading of the library's own runners (the comparison, the attribution)."""
    return {
        prompt: tokenize_examples(
            data.make_examples(relations, prompt=prompt, templates=CLEAN.prompts)[:count],
            tokenizer,
            **CLEAN.tokenization(),
        )
        for prompt in prompts
    }


PROMPT_COLUMNS: dict[str, str] = {
    "prompt": "the text the model continues (no trailing space)",
    "target": "the answer's text, starting with one space (' Sandra Bullock')",
    "first_entity": "optional: the entity named in the prompt, for FE (its first occurrence)",
    "name": "optional: a label for the prompt (default 'custom'); one test set per name",
}
"""The columns of a prompts file (:func:`read_prompts`), and what each holds."""


def read_prompts(path: str | os.PathLike, dataset: str | None = None) -> list[TestSet]:
    """Test sets from a file of your own prompts: JSON or CSV with the columns of
    :data:`PROMPT_COLUMNS` (``prompt``, ``target``; optional ``first_entity``, ``name``).

    JSON is a list of objects; CSV has a header row (UTF-8, a byte-order mark allowed). Each
    row becomes an :class:`~grafting_lens.worlds.data.Example` (``relation_id``: its row
    number - 1), one test set per ``name``, with ``templates=None``, so it runs under any
    semantics. Check the answers against the models' tokenizer with :func:`check_answers`,
    as ``grafting-lens run ... --prompts FILE`` does.

    Args:
        path: A ``.json`` or ``.csv`` file.
        dataset: The ``dataset`` label of the rows (default: the file's name).

    Raises:
        ExperimentError: A file that cannot be read as prompts, or a row that is not one
            (missing, unknown or repeated columns, a value that is not text, a bad target
            or ``first_entity``, a repeated row); the message names the row and the fix.
    """
    path = Path(path).expanduser()
    columns = "prompt, target and optionally first_entity and name (PROMPT_COLUMNS)"
    rows = _prompt_rows(path, columns)
    if not rows:
        raise ExperimentError(f"{path} has no prompts: add one row per prompt ({columns}).")
    groups: dict[str, list[data.Example]] = {}
    seen: dict[tuple[str, str, str], int] = {}
    for number, row in enumerate(rows, start=1):
        problem = _row_problem(row, columns, number, seen, groups)
        if problem is None:
            prompt, target, name = row["prompt"], row["target"], row.get("name") or "custom"
            entity = row.get("first_entity") or ""
            start = prompt.find(entity)
            spans = {"first_entity": (start, start + len(entity))} if entity else {}
            try:
                example = data.Example(number - 1, name, prompt, target, spans)
                groups.setdefault(name, []).append(example)
            except ValueError as error:
                problem = f": {error}"
        if problem is not None:
            raise ExperimentError(f"{path}, row {number}{problem}")
    label = dataset or path.stem
    return [
        TestSet(examples, dataset=label, prompt=name, source=str(path))
        for name, examples in groups.items()
    ]


def _row_problem(
    row: dict[str, Any],
    columns: str,
    number: int,
    seen: dict[tuple[str, str, str], int],
    groups: dict[str, list[data.Example]],
) -> str | None:
    """What is wrong with one row of a prompts file, alone or beside the rows before it, or
    ``None`` (``seen``: each question's first row; ``groups``: the test sets)."""
    unknown = [key for key in row if key not in PROMPT_COLUMNS]
    if unknown:
        return (
            f" has the unknown columns {unknown}; a prompts file's columns are {columns}. "
            "Rename or drop them."
        )
    kinds = {dict: "object", list: "array", bool: "boolean", int: "number", float: "number"}
    for key, value in row.items():
        if value is not None and not isinstance(value, str):
            kind = kinds.get(type(value), type(value).__name__)
            return (
                f": {key} is a JSON {kind} ({json.dumps(value)[:60]}), not text: "
                "write it as a string."
            )
    missing = [key for key in ("prompt", "target") if not (row.get(key) or "").strip()]
    if missing:
        return f" has no {' and no '.join(missing)}: every row needs a prompt and its target."
    entity = row.get("first_entity") or ""
    if entity not in row["prompt"]:
        return (
            f": first_entity {entity!r} is not in the prompt {row['prompt']!r}; copy it from "
            "the prompt as written (case and spacing included)."
        )
    name = row.get("name") or "custom"
    first = seen.setdefault((name, row["prompt"], row["target"]), number)
    if first != number:
        return (
            f" repeats row {first} (the same prompt, target and name): it would be counted "
            "twice in every summary. Delete one of them."
        )
    group = groups.get(name)
    if group and bool(group[0].spans) != bool(entity):
        return (
            f" {'gives' if entity else 'has no'} first_entity, but row "
            f"{group[0].relation_id + 1} (test set {name!r}) "
            f"{'has none' if entity else 'gives one'}: give it in every row of a test set, "
            "or in none."
        )
    return None


def _prompt_rows(path: Path, columns: str) -> list[dict[str, Any]]:
    """The rows of a prompts file, each a mapping of column to value, as the file holds them."""
    suffix = path.suffix.lower()
    refusals = {  # the first that holds is the one said
        f"{path} is a directory": path.is_dir(),
        f"No prompts file at {path}": not path.is_file(),
        f"{path} is neither .json nor .csv": suffix not in (".json", ".csv"),
    }
    refused = next((message for message, found in refusals.items() if found), None)
    if refused:
        raise ExperimentError(f"{refused}: pass a .json or .csv file with the columns {columns}.")
    try:
        # utf-8-sig: a byte-order mark (Excel writes one) is not part of the first column's name.
        text = path.read_text(encoding="utf-8-sig")
        rows = (
            json.loads(text, object_pairs_hook=unique_keys)
            if suffix == ".json"
            else _csv_rows(path, text)
        )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RepeatedKey) as error:
        raise ExperimentError(_unreadable(path, error)) from None
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ExperimentError(
            f"{path} holds a {type(rows).__name__}; a prompts file in JSON is a list of "
            f"objects with the keys {columns}."
        )
    return rows


def _csv_rows(path: Path, text: str) -> list[dict[str, Any]]:
    """A CSV prompts file's rows (a header row, then one row per prompt; empty lines skipped)."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, [])
    unique_keys([(column, None) for column in header])
    rows: list[dict[str, Any]] = []
    for cells in (cells for cells in reader if cells):
        if len(cells) > len(header):
            raise ExperimentError(
                f"{path}, row {len(rows) + 1} has {len(cells)} cells but the header "
                f"{len(header)}: quote a cell that holds a comma."
            )
        rows.append(dict(zip(header, cells)))
    return rows


def _unreadable(path: Path, error: Exception) -> str:
    """Why a prompts file cannot be read, and the fix."""
    if isinstance(error, RepeatedKey):
        return f"{path} sets {error.args[0]!r} twice (JSON and CSV keep the last); keep one."
    if isinstance(error, UnicodeDecodeError):
        return (
            f"{path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
            f"{error.start}); save it as UTF-8."
        )
    if isinstance(error, json.JSONDecodeError):
        return (
            f"{path} is not valid JSON ({error}); write a list of objects such as "
            '[{"prompt": "Keanu Reeves starred in a movie alongside", "target": " Sandra '
            'Bullock", "first_entity": "Keanu Reeves"}].'
        )
    return f"Cannot read the prompts file {path}: {error}."


class RepeatedKey(Exception):
    """A JSON object set one key twice (its first argument)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` refusing a key set twice (``json`` keeps the last).

    Raises:
        RepeatedKey: Naming the key.
    """
    keys = [key for key, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise RepeatedKey(key)
    return dict(pairs)


def check_answers(
    test_sets: Sequence[TestSet], models: ModelSet, semantics: Semantics | str | None = None
) -> list[str]:
    """Check that ``models``' tokenizer can score each answer of your own prompts.

    The score is the answer's first token (as ``semantics`` tokenizes it). An answer whose
    first token is bare whitespace (``" 1999"`` or ``" 東京"`` on some tokenizers) would
    score only whether a space comes next: refused. Answers that share their first token
    (``" Sandra Bullock"``, ``" Sandra Oh"``) score alike: returned as lines for the report.

    Raises:
        ExperimentError: An answer scored by a bare-whitespace token, naming its rows.
    """
    lines = []
    for test_set in test_sets:
        if test_set.is_tokenized:
            continue
        batch = test_set.batch(models, semantics)
        tokenizer = models.tokenizer
        shared: dict[int, dict[str, list[str]]] = {}
        blank = []
        scored = zip(batch.examples or [], batch.target_ids.tolist())
        for index, (example, token) in enumerate(scored):
            where = test_set.where(example, index)
            if not tokenizer.decode([token]).strip():
                blank.append((f"{example.target!r} ({where})", token))
            shared.setdefault(token, {}).setdefault(example.target, []).append(where)
        if blank:
            token = tokenizer.convert_ids_to_tokens(blank[0][1])
            raise ExperimentError(
                f"The answer {blank[0][0]}"
                + (f" and {len(blank) - 1} more" if len(blank) > 1 else "")
                + " is scored by a first token that is only whitespace (this tokenizer splits "
                f"the space off; token {token!r}), so every such answer would score alike. "
                "Reword the answer so that its first token holds a word."
            )
        for token, answers in shared.items():
            if len(answers) > 1:
                named = ", ".join(f"{answer!r}" for answer in list(answers)[:4])
                more = f" and {len(answers) - 4} more" if len(answers) > 4 else ""
                lines.append(
                    f"Test set {test_set.label!r}: the answers {named}{more} share their "
                    f"first token {tokenizer.decode([token])!r}, the token scored: a hit on "
                    "one is a hit on each."
                )
    return lines
