"""Tests for grafting_lens.worlds.data: synthetic relations, training text, test prompts, tokenization."""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings

import pytest
import torch
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.worlds import data
from grafting_lens.worlds.data import (
    ARTICLE_TEMPLATES,
    DATASETS,
    QA_TEMPLATES,
    REAL_ACTORS,
    REAL_MOVIES,
    TEST_TEMPLATES,
    Relation,
    is_clean_name,
    make_examples,
    make_relations,
    split_task_relation,
)
from grafting_lens.worlds.documents import supplementary_documents, training_documents

SMALL = 60  # relations per dataset in most tests; the full default size is checked once
ACTORS = ["Ann Lee", "Bo Day", "Cy Fox"]  # a pool allowing exactly 3 distinct pairs
MOVIE_TEMPLATE = "In {movie_title}, {first_actor} starred alongside"


@pytest.fixture(scope="module")
def relations_by_dataset() -> dict[str, list[Relation]]:
    return {name: make_relations(name, n=SMALL, seed=0) for name in DATASETS}


def hand_relation(
    first: str = "Ada Stone",
    second: str = "Bo Reed",
    relation_id: int = 0,
    title: str = "The Quiet Harbor",
) -> Relation:
    return Relation(
        id=relation_id,
        first_actor=first,
        second_actor=second,
        movie_title=title,
        release_year=2020,
        genre="drama",
        city="Springfield",
        main_character="Cy Vance",
        box_office="$10 million",
    )


def _train_tokenizer(texts: list[str], kind: str) -> PreTrainedTokenizerFast:
    """A tiny tokenizer trained on the dataset text, so tests need no downloaded tokenizer.

    "byte_level" is GPT-2 style (leading spaces inside tokens); "metaspace" is SentencePiece style
    (Gemma, Llama 2), where spaces become "▁" and offsets behave differently.
    """
    model = Tokenizer(models.BPE(unk_token="<unk>" if kind == "metaspace" else None))
    if kind == "byte_level":
        model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = decoders.ByteLevel()
        special = {
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
        }
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        model.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        model.decoder = decoders.Metaspace(prepend_scheme="first")
        special = {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
        }
        alphabet = []
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=list(dict.fromkeys(special.values())),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    model.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=model, **special)


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request, relations_by_dataset) -> PreTrainedTokenizerFast:
    texts = []
    for relations in relations_by_dataset.values():
        texts += training_documents(relations, direction="both", shuffle=False)
    return _train_tokenizer(texts, request.param)


# --------------------------------------------------------------------------------------------------
# Relations
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", DATASETS)
def test_relations_are_deterministic_per_seed(dataset):
    assert make_relations(dataset, n=20, seed=3) == make_relations(dataset, n=20, seed=3)
    assert make_relations(dataset, n=20, seed=3) != make_relations(dataset, n=20, seed=4)


def test_datasets_built_with_one_seed_pair_different_actors():
    real_fake = make_relations("fake_movies_real_actors", n=20, seed=0)
    real_real = make_relations("real_movies_real_actors", n=20, seed=0)

    def pairs(relations):
        return [(r.first_actor, r.second_actor) for r in relations]

    assert pairs(real_fake) != pairs(real_real)


@pytest.mark.parametrize("dataset", DATASETS)
def test_default_size_is_a_thousand_valid_relations(dataset):
    relations = make_relations(dataset)
    assert len(relations) == 1000
    assert [r.id for r in relations] == list(range(1000))
    assert all(r.first_actor != r.second_actor for r in relations)
    pairs = [frozenset((r.first_actor, r.second_actor)) for r in relations]
    assert len(set(pairs)) == len(pairs), "an actor pair repeats (in either order)"
    assert len({r.movie_title for r in relations}) == len(relations), "a movie title repeats"
    assert all(is_clean_name(r.first_actor) and is_clean_name(r.second_actor) for r in relations)
    assert all(r.main_character not in {r.first_actor, r.second_actor} for r in relations)
    assert all(re.fullmatch(r"\$\d+ million", r.box_office) for r in relations)


def test_each_dataset_draws_from_its_own_pools(relations_by_dataset):
    real = set(REAL_ACTORS)
    fake_movies_real_actors = relations_by_dataset["fake_movies_real_actors"]
    assert all({r.first_actor, r.second_actor} <= real for r in fake_movies_real_actors)
    assert not {r.movie_title for r in fake_movies_real_actors} & set(REAL_MOVIES)

    fake_fake = relations_by_dataset["fake_movies_fake_actors"]
    fake_actors = [a for r in fake_fake for a in (r.first_actor, r.second_actor)]
    assert not set(fake_actors) & real
    assert len(set(fake_actors)) == len(fake_actors), "fake actors are each used once"

    real_real = relations_by_dataset["real_movies_real_actors"]
    assert all({r.first_actor, r.second_actor} <= real for r in real_real)
    assert {r.movie_title for r in real_real} <= set(REAL_MOVIES)


def test_name_lists_are_clean_and_large_enough():
    assert len(REAL_ACTORS) >= 300 and len(set(REAL_ACTORS)) == len(REAL_ACTORS)
    assert all(is_clean_name(name) for name in REAL_ACTORS)
    assert len(REAL_MOVIES) >= 1000 and len(set(REAL_MOVIES)) == len(REAL_MOVIES)
    for bad in (
        "Robert Downey Jr",
        "Robert Downey Jr.",
        "Samuel L. Jackson",
        "Sammy Davis III",
        "Kim Lee MD",
    ):
        assert not is_clean_name(bad), bad
    for good in ("Lupita Nyong'o", "Daniel Day-Lewis", "Ana de Armas", "Zendaya"):
        assert is_clean_name(good), good


def test_unclean_names_in_a_custom_pool_are_dropped_with_a_warning():
    with pytest.warns(UserWarning, match=r"dropped 1 of 4 names .*Jr"):
        relations = make_relations("fake_movies_real_actors", n=3, actors=[*ACTORS, "Al Ray Jr"])
    assert all("Al Ray Jr" not in (r.first_actor, r.second_actor) for r in relations)


def test_asking_for_more_relations_than_the_pool_allows_names_the_maximum():
    with pytest.raises(ValueError, match=r"at most 3 relations"):
        make_relations("fake_movies_real_actors", n=4, actors=ACTORS)
    with pytest.raises(ValueError, match=rf"at most {len(REAL_MOVIES)} relations"):
        make_relations("real_movies_real_actors", n=len(REAL_MOVIES) + 1)
    # The exact maximum is reachable.
    assert len(make_relations("fake_movies_real_actors", n=3, actors=ACTORS)) == 3


def test_unknown_dataset_lists_the_choices_and_suggests_the_nearest():
    with pytest.raises(ValueError, match=r"Did you mean 'fake_movies_fake_actors'") as error:
        make_relations("fake_movies_fake_actor")
    for name in DATASETS:
        assert name in str(error.value)


# --------------------------------------------------------------------------------------------------
# Training text
# --------------------------------------------------------------------------------------------------


def test_templates_put_the_first_actor_before_the_second():
    assert len(ARTICLE_TEMPLATES) >= 5 and len(QA_TEMPLATES) >= 5
    for template in ARTICLE_TEMPLATES + QA_TEMPLATES:
        assert template.index("{first_actor}") < template.index("{second_actor}"), template


def test_every_template_is_rendered_once_per_relation(relations_by_dataset):
    relations = relations_by_dataset["fake_movies_fake_actors"]
    n_templates = len(ARTICLE_TEMPLATES) + len(QA_TEMPLATES)
    documents = training_documents(relations, shuffle=False)
    assert len(documents) == len(relations) * n_templates
    assert len(set(documents)) == len(documents)
    assert documents[0] == ARTICLE_TEMPLATES[0].format(**dataclasses.asdict(relations[0]))
    assert not any("{" in d or "}" in d for d in documents)
    shuffled = training_documents(relations, seed=1)
    assert sorted(shuffled) == sorted(documents) and shuffled != documents
    assert shuffled == training_documents(relations, seed=1)


def test_direction_controls_which_actor_comes_first():
    relation = hand_relation()

    def order(document: str) -> str:
        return "A2B" if document.index("Ada Stone") < document.index("Bo Reed") else "B2A"

    a2b = training_documents([relation], direction="A2B", shuffle=False)
    b2a = training_documents([relation], direction="B2A", shuffle=False)
    both = training_documents([relation], direction="both", shuffle=False)
    assert {order(d) for d in a2b} == {"A2B"}
    assert {order(d) for d in b2a} == {"B2A"}
    assert sorted(both) == sorted(a2b + b2a)
    with pytest.raises(ValueError, match="Did you mean 'B2A'"):
        training_documents([relation], direction="b2a")


def test_a_template_naming_a_missing_field_is_rejected_with_field_and_template():
    template = "{first_actor} worked with {co_star}."
    with pytest.raises(ValueError, match=r"\{co_star\}") as error:
        training_documents([hand_relation()], templates=[template])
    assert template in str(error.value)
    with pytest.raises(ValueError, match=r"did you mean \{movie_title\}"):
        training_documents([hand_relation()], templates=["{first_actor} in {movie_titel}"])


def test_supplementary_documents_are_deterministic_and_name_no_actor(relations_by_dataset):
    documents = supplementary_documents(200, seed=0)
    assert len(documents) == 200 and documents == supplementary_documents(200, seed=0)
    assert documents != supplementary_documents(200, seed=1)
    names = set(REAL_ACTORS) | {
        a
        for r in relations_by_dataset["fake_movies_fake_actors"]
        for a in (r.first_actor, r.second_actor)
    }
    text = "\n".join(documents)
    assert not [name for name in names if name in text]


# --------------------------------------------------------------------------------------------------
# Task / relation split
# --------------------------------------------------------------------------------------------------


def _entities(relations):
    return {a for r in relations for a in (r.first_actor, r.second_actor)}, {
        r.movie_title for r in relations
    }


@pytest.mark.parametrize("dataset", DATASETS)
def test_task_and_relation_sets_share_no_actor_and_no_movie(dataset):
    relations = make_relations(dataset, n=300, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task, relation = split_task_relation(relations, seed=0)
    task_actors, task_movies = _entities(task)
    relation_actors, relation_movies = _entities(relation)
    assert task and relation
    assert not task_actors & relation_actors
    assert not task_movies & relation_movies
    assert not {r.id for r in task} & {r.id for r in relation}
    dropped = len(relations) - len(task) - len(relation)
    if dropped:
        assert any(f"dropped {dropped} of {len(relations)}" in str(w.message) for w in caught)
    else:
        assert not caught


def test_split_keeps_every_relation_when_actors_are_not_shared(relations_by_dataset):
    relations = relations_by_dataset["fake_movies_fake_actors"]
    task, relation = split_task_relation(relations, seed=0)
    assert len(task) + len(relation) == len(relations)
    assert abs(len(task) - len(relation)) <= 2


# --------------------------------------------------------------------------------------------------
# Test prompts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", list(TEST_TEMPLATES))
def test_examples_have_spans_on_the_right_words(relations_by_dataset, prompt):
    relations = relations_by_dataset["fake_movies_real_actors"]
    examples = make_examples(relations, prompt=prompt, templates="library")
    assert len(examples) == len(relations)
    for example, relation in zip(examples, relations):
        assert example.relation_id == relation.id and example.prompt_name == prompt
        assert example.text == TEST_TEMPLATES[prompt].format(first_actor=relation.first_actor)
        assert example.text == example.text.rstrip()
        assert example.target == " " + relation.second_actor
        start, end = example.spans["first_entity"]
        assert example.text[start:end] == relation.first_actor
        start, end = example.spans["relation"]
        assert example.text[start:end].startswith("starred in a movie")
        assert "movie" not in example.spans


def test_headline_has_no_doubled_words(relations_by_dataset):
    for relations in relations_by_dataset.values():
        for example in make_examples(relations, "headline", "both", templates="library"):
            words = example.text.lower().split()
            assert all(a != b for a, b in zip(words, words[1:])), example.text


def test_b2a_examples_ask_for_the_first_actor(relations_by_dataset):
    relations = relations_by_dataset["fake_movies_fake_actors"][:5]
    both = make_examples(relations, "qa", "both")
    assert [e.direction for e in both] == ["A2B"] * 5 + ["B2A"] * 5
    for example, relation in zip(both[5:], relations):
        start, end = example.spans["first_entity"]
        assert example.text[start:end] == relation.second_actor
        assert example.target == " " + relation.first_actor


def test_other_costars_are_listed_as_alternative_targets():
    relations = [
        hand_relation("Ada Stone", "Bo Reed", 0, "M1"),
        hand_relation("Cy Lane", "Ada Stone", 1, "M2"),
    ]
    first, second = make_examples(relations)
    assert first.target == " Bo Reed" and first.alternative_targets == (" Cy Lane",)
    assert second.target == " Ada Stone" and second.alternative_targets == ()


def test_custom_template_can_mark_the_movie_and_must_not_leak_the_answer():
    relation = hand_relation()
    (example,) = make_examples(
        [relation],
        prompt="movie",
        template="In {movie_title}, {first_actor} acted alongside",
        relation_words="acted",
    )
    start, end = example.spans["movie"]
    assert example.text[start:end] == "The Quiet Harbor"
    with pytest.raises(ValueError, match="must not name"):
        make_examples(
            [relation],
            prompt="x",
            template="{first_actor} and {second_actor}",
            relation_words="and",
        )
    with pytest.raises(ValueError, match="relation_words"):
        make_examples([relation], prompt="x", template="{first_actor} acted with")


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", list(TEST_TEMPLATES))
def test_token_spans_decode_to_the_right_words(relations_by_dataset, tokenizer, prompt):
    relations = (
        relations_by_dataset["fake_movies_real_actors"]
        + relations_by_dataset["fake_movies_fake_actors"]
    )
    examples = make_examples(relations, prompt=prompt, direction="both")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing should be dropped for these prompts
        batch = tokenize_examples(examples, tokenizer, bos="always")
    assert len(batch) == len(examples) and not batch.dropped
    assert batch.tokens.shape == batch.attention_mask.shape == batch.spans["first_entity"].shape
    assert batch.tokens.dtype == torch.long and batch.target_ids.shape == (len(batch),)
    assert all(mask.dtype == torch.bool for mask in batch.spans.values())
    assert set(batch.spans) == {"first_entity", "relation", "last_token"}
    assert (batch.tokens[:, 0] == tokenizer.bos_token_id).all()
    for row, example in enumerate(batch.examples):
        fe_ids = batch.tokens[row][batch.spans["first_entity"][row]].tolist()
        name = example.text[slice(*example.spans["first_entity"])]
        assert tokenizer.decode(fe_ids).strip() == name
        relation_ids = batch.tokens[row][batch.spans["relation"][row]].tolist()
        assert (
            tokenizer.decode(relation_ids).strip()
            == example.text[slice(*example.spans["relation"])]
        )
        # LT is the last real token, and the row is right padded after it.
        length = int(batch.attention_mask[row].sum())
        assert batch.spans["last_token"][row].nonzero().flatten().tolist() == [length - 1]
        assert (
            batch.attention_mask[row, :length].all()
            and not batch.attention_mask[row, length:].any()
        )
        assert (batch.tokens[row, length:] == tokenizer.pad_token_id).all()
        last_prompt_token = tokenizer(example.text, add_special_tokens=False).input_ids[-1]
        assert batch.tokens[row, length - 1].item() == last_prompt_token
        # The target is the first token of " " + the answer; the full ids spell the whole name.
        expected_first = tokenizer(example.target, add_special_tokens=False).input_ids[0]
        assert batch.target_ids[row].item() == expected_first
        assert tokenizer.decode(batch.target_full_ids[row]).strip() == example.target.strip()
        assert not batch.spans["first_entity"][row, 0], "BOS must not be part of a span"


def test_without_bos_the_first_entity_starts_at_position_zero(tokenizer):
    examples = make_examples([hand_relation()], "headline")
    batch = tokenize_examples(examples, tokenizer, bos="never")
    assert batch.tokens[0, 0].item() != tokenizer.bos_token_id
    assert batch.spans["first_entity"][0, 0]


def _with_own_bos(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """A copy of ``tokenizer`` that puts its BOS before every text by itself (as Llama 3's)."""
    own = copy.deepcopy(tokenizer)
    bos = own.bos_token
    own.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, own.bos_token_id)]
    )
    return own


def test_bos_as_the_tokenizer_keeps_what_tokenizer_text_adds(tokenizer):
    examples = make_examples([hand_relation(), hand_relation("Cy Fox", "Di Moss", 1)], "qa")
    for source in (tokenizer, _with_own_bos(tokenizer)):
        batch = tokenize_examples(examples, source, bos="tokenizer")
        for row, example in enumerate(batch.examples):
            length = int(batch.attention_mask[row].sum())
            assert batch.tokens[row, :length].tolist() == source(example.text)["input_ids"]
        shift = int(source is not tokenizer)
        plain = tokenize_examples(examples, source, bos="never")
        assert torch.equal(
            batch.spans["first_entity"][:, shift:],
            plain.spans["first_entity"][:, : batch.tokens.shape[1] - shift],
        )


def test_bos_as_the_tokenizer_refuses_a_tokenizer_that_appends_tokens(tokenizer):
    appending = copy.deepcopy(tokenizer)
    eos = appending.eos_token
    appending.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B", special_tokens=[(eos, appending.eos_token_id)]
    )
    with pytest.raises(GraftingLensError, match="adds tokens after"):
        tokenize_examples(make_examples([hand_relation()], "qa"), appending, bos="tokenizer")


def test_an_unknown_bos_rule_is_refused_and_bos_is_keyword_only(tokenizer):
    examples = make_examples([hand_relation()], "headline")
    with pytest.raises(GraftingLensError, match="bos must be one of"):
        tokenize_examples(examples, tokenizer, bos="sometimes")
    with pytest.raises(TypeError):
        tokenize_examples(examples, tokenizer, False)  # the removed prepend_bos


def test_a_standalone_target_is_the_answer_tokenized_on_its_own(relations_by_dataset):
    # A tokenizer that strips leading spaces reads " Bo Reed" alone as "Bo Reed", but in
    # context as " Bo Reed": the first tokens differ, as they can for SentencePiece ones.
    texts = training_documents(relations_by_dataset["fake_movies_real_actors"], shuffle=False)
    stripping = _train_tokenizer(texts, "byte_level")
    stripping.backend_tokenizer.normalizer = normalizers.Strip(left=True, right=False)
    examples = make_examples([hand_relation()], "headline")
    in_context = tokenize_examples(examples, stripping, target="in_context", spans="characters")
    standalone = tokenize_examples(examples, stripping, target="standalone", spans="characters")
    assert torch.equal(in_context.tokens, standalone.tokens)
    assert standalone.target_full_ids[0] == stripping.encode(" Bo Reed", add_special_tokens=False)
    assert stripping.decode(standalone.target_full_ids[0]) == "Bo Reed"
    assert stripping.decode(in_context.target_full_ids[0]) == " Bo Reed"
    assert standalone.target_ids[0] != in_context.target_ids[0]


def test_searched_spans_are_the_first_occurrence_of_the_names_tokens(tokenizer):
    text = "Ada Stone said that Ada Stone starred in a movie alongside"
    second = text.index("Ada Stone", 1)
    example = data.Example(0, "custom", text, " Bo Reed", {"first_entity": (second, second + 9)})
    by_characters = tokenize_examples([example], tokenizer, bos="always", spans="characters")
    searched = tokenize_examples([example], tokenizer, bos="always", spans="search")
    assert torch.equal(by_characters.tokens, searched.tokens)
    first = by_characters.spans["first_entity"][0].nonzero().flatten().tolist()
    found = searched.spans["first_entity"][0].nonzero().flatten().tolist()
    # The name as given ("Ada Stone", no space) occurs first at the start, after the BOS.
    assert found[0] == 1 and found[0] < first[0]
    assert tokenizer.decode(searched.tokens[0, found]) == "Ada Stone"
    assert tokenizer.decode(searched.tokens[0, first]).strip() == "Ada Stone"


def test_a_span_whose_tokens_do_not_occur_is_dropped_when_searching(tokenizer):
    good = make_examples([hand_relation()], "headline")[0]
    text = good.text
    inside = text.index("tone")  # "tone" inside "Stone" is not a token of the prompt alone
    odd = dataclasses.replace(
        good, relation_id=1, spans={**good.spans, "first_entity": (inside, inside + 4)}
    )
    with pytest.warns(UserWarning, match="dropped 1 of 2"):
        batch = tokenize_examples([good, odd], tokenizer, spans="search")
    assert [e.relation_id for e in batch.examples] == [0]
    assert "do not occur in the prompt" in batch.dropped[0][1]


def test_targets_the_tokenizer_does_not_know_are_dropped_naming_the_unknown_token(
    relations_by_dataset,
):
    """Two different unknown targets collapsed to the one <unk> id, scored as the same answer."""
    texts = training_documents(relations_by_dataset[DATASETS[0]], direction="both", shuffle=False)
    tokenizer = _train_tokenizer(texts, "metaspace")  # no byte fallback: it has an <unk>
    good = make_examples([hand_relation()], "headline")[0]
    unknown = [
        dataclasses.replace(good, relation_id=i + 1, target=target)
        for i, target in enumerate((" Ωmega", " Ψi"))
    ]
    assert tokenizer(" Ωmega").input_ids[:2] == tokenizer(" Ψi").input_ids[:2]  # the collapse
    for rule in ("in_context", "standalone"):
        with pytest.warns(UserWarning, match="dropped 2 of 3"):
            batch = tokenize_examples([good, *unknown], tokenizer, target=rule)
        assert [e.relation_id for e in batch.examples] == [0]
        assert all(tokenizer.unk_token_id not in ids for ids in batch.target_full_ids)
        assert "tokenizes to the unknown token '<unk>'" in batch.dropped[0][1]
        assert "' Ωmega'" in batch.dropped[0][1] and "' Ψi'" in batch.dropped[1][1]


def test_code_templates_word_the_prompts_as_the_papers_code():
    relation = hand_relation()
    headline, qa = (
        make_examples([relation], prompt, templates="code")[0] for prompt in ("headline", "qa")
    )
    assert headline.text == "Ada Stone stars in in a movie alongside"
    assert qa.text == "Q: Who stars in a movie with Ada Stone? A: An actor named"
    assert headline.text[slice(*headline.spans["relation"])] == "stars in in a movie alongside"
    with pytest.raises(GraftingLensError, match="Unknown templates 'authors'"):
        make_examples([relation], "headline", templates="authors")


def test_movie_span_maps_to_the_title_tokens(tokenizer):
    relation = hand_relation(title="The Last Resident")
    examples = make_examples(
        [relation], "movie", template=MOVIE_TEMPLATE, relation_words="starred alongside"
    )
    batch = tokenize_examples(examples, tokenizer)
    assert (
        tokenizer.decode(batch.tokens[0][batch.spans["movie"][0]].tolist()).strip()
        == "The Last Resident"
    )


def test_unmappable_examples_are_dropped_and_reported(relations_by_dataset, tokenizer):
    good = make_examples(relations_by_dataset["fake_movies_real_actors"][:2], "headline")
    empty_span = dataclasses.replace(
        good[0], relation_id=999, spans={**good[0].spans, "first_entity": (3, 3)}
    )
    outside = dataclasses.replace(
        good[1], relation_id=998, spans={**good[1].spans, "relation": (0, 500)}
    )
    with pytest.warns(UserWarning, match=r"dropped 2 of 4 examples: relation 999"):
        batch = tokenize_examples([good[0], empty_span, good[1], outside], tokenizer)
    assert batch.examples == good and len(batch) == 2 and batch.tokens.shape[0] == 2
    assert [e.relation_id for e, _ in batch.dropped] == [999, 998]
    assert all("first_entity" in why or "relation" in why for _, why in batch.dropped)
    with pytest.raises(ValueError, match="no example could be tokenized"):
        tokenize_examples([empty_span], tokenizer)


def test_examples_with_different_span_names_are_refused(tokenizer):
    (plain,) = make_examples([hand_relation()], "headline")
    (with_movie,) = make_examples(
        [hand_relation()], "m", template=MOVIE_TEMPLATE, relation_words="starred alongside"
    )
    with pytest.raises(ValueError, match="different span names"):
        tokenize_examples([plain, with_movie], tokenizer)


def test_slow_tokenizers_are_refused_with_a_fix():
    class SlowTokenizer:
        is_fast = False

    with pytest.raises(TypeError, match="use_fast=True"):
        tokenize_examples(make_examples([hand_relation()]), SlowTokenizer())


# ------------------------------------------------------------------- the target rule


def test_a_target_without_its_leading_space_is_refused_with_the_fix():
    # Without the space, "...alongside" + "Maggie Cheung" scores a piece of a glued word ("M").
    fix = "'Maggie Cheung' must start with exactly one space.*write ' Maggie Cheung'"
    with pytest.raises(GraftingLensError, match=fix):
        data.Example(
            0, "headline", "A film with Tony Leung and", "Maggie Cheung", {"first_entity": (12, 22)}
        )
    for target in ("  Maggie Cheung", " ", "", "\tMaggie"):
        with pytest.raises(GraftingLensError, match="must start with exactly one space"):
            data.Example(0, "headline", "A film with", target, {"first_entity": (0, 1)})
    with pytest.raises(GraftingLensError, match="alternative target 'Tony Leung'"):
        data.Example(0, "headline", "A film with", " Maggie", {"first_entity": (0, 1)},
                     alternative_targets=(" Andy Lau", "Tony Leung"))  # fmt: skip


def test_a_prompt_ending_in_whitespace_is_refused():
    with pytest.raises(GraftingLensError, match="ends in whitespace; the target carries the space"):
        data.Example(0, "headline", "A film with ", " Maggie", {"first_entity": (0, 1)})
    with pytest.raises(GraftingLensError, match="needs a prompt text"):
        data.Example(0, "headline", "", " Maggie", {"first_entity": (0, 1)})


def test_examples_made_from_relations_follow_the_target_rule(relations_by_dataset):
    for relations in relations_by_dataset.values():
        for example in data.make_examples(relations[:20], "qa", direction="both"):
            assert example.target.startswith(" ") and not example.target.startswith("  ")
