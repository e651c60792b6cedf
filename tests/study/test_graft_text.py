"""gl.graft: a first graft from text, checked against the models' own forward passes."""

from __future__ import annotations

import unicodedata

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tokenizer
from test_experiments import _llama

import grafting_lens as gl
from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.core.errors import (
    ArgumentTypeError,
    ExperimentError,
    GraftingLensError,
    SelectionError,
)
from grafting_lens.study import make_test_sets, run_experiment
from grafting_lens.worlds import data

PROMPT = "Keanu Reeves starred in a movie alongside"
# The tiny tokenizer splits the space off most words (" Laurence" is " ", "L"...), and an
# answer scored by a bare space is refused: these answers' first tokens are words.
ANSWER = "movie"
OTHER = "starred"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    return gl.load_models(_llama(0), _llama(1), tokenizer=tokenizer, names=["pre", "sft"])


def _probability(logits: torch.Tensor, target: int) -> tuple[float, int]:
    """The answer's probability and rank (strictly greater probabilities) at the last token."""
    probabilities = torch.softmax(logits[0, -1].float(), dim=-1)
    p = probabilities[target]
    return float(p), int((probabilities > p).sum())


def test_a_graft_from_text_equals_the_models_and_the_graft_it_names(models, tokenizer):
    table = gl.graft(
        models,
        PROMPT,
        ANSWER,
        at=["Keanu Reeves", "last"],
        components="o+ffn",
        layers="last_half",
        # The library's reading, with the donor row the donor model itself (under clean
        # it is every component but the unembedding grafted).
        semantics="clean+sft=donor",
    )
    assert list(table["config"]) == ["pre", "sft", "Keanu Reeves+last"]
    # By hand, as the clean semantics reads a prompt: a BOS, the prompt, the answer's
    # first token in context; the entity's tokens are those overlapping its characters.
    encoded = tokenizer(PROMPT, add_special_tokens=False, return_offsets_mapping=True)
    tokens = torch.tensor([[tokenizer.bos_token_id, *encoded["input_ids"]]])
    joint = tokenizer(PROMPT + " " + ANSWER, add_special_tokens=False)["input_ids"]
    target = joint[len(encoded["input_ids"])]
    entity = [
        1 + i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < len("Keanu Reeves")
    ]
    where = torch.zeros_like(tokens, dtype=torch.bool)
    where[0, entity] = True
    where[0, -1] = True
    mask = gl.GraftMask.build(
        models, tokens, positions=where, components="o+ffn", layers="last_half"
    )
    expected = {
        # The base and the donor: each HF model's own forward pass (fresh copies).
        "pre": _llama(0)(tokens).logits,
        "sft": _llama(1)(tokens).logits,
        "Keanu Reeves+last": gl.graft_forward(models, tokens, mask),
    }
    for row in table.itertuples():
        probability, rank = _probability(expected[row.config].detach(), target)
        assert row.target_prob == pytest.approx(probability, rel=1e-4, abs=1e-7)
        assert row.target_rank == rank
        assert row.top5 == (rank < 5)
    # Each grafted token with its index, so a reader can tell equal tokens apart.
    shown = "|".join(
        f"{tokenizer.decode([tokens[0, i]])}@{i}" for i in [*entity, len(tokens[0]) - 1]
    )
    assert table["grafted"].tolist() == ["", "all", shown]


def test_graft_rows_are_the_runners_rows_under_every_default(models):
    """The first graft and a full experiment, both with their defaults, give one number."""
    relations = data.make_relations("fake_movies_real_actors", n=6, seed=0)
    examples = data.make_examples(relations)  # the default wording: the code's
    table = gl.graft(models, examples, at={"FE+LT": "FE+LT", "LT": "LT"})
    (test_set,) = make_test_sets(relations, prompts=("headline",))
    rows = run_experiment(models, test_set, ["PRE", "SFT", "FE+LT", "LT"])
    runs = {"pre": "PRE", "sft": "SFT", "FE+LT": "FE+LT", "LT": "LT"}
    mine = table.assign(config=table["config"].map(runs)).set_index(["config", "text"])
    theirs = rows.set_index(["config", "text"]).loc[mine.index]
    pd.testing.assert_series_equal(mine["target_rank"], theirs["target_rank"])
    pd.testing.assert_series_equal(mine["target_prob"], theirs["target_prob"])
    assert set(table["semantics"]) == {"reference"}


def test_chained_defaults_never_refuse_each_other(models):
    """Each pair of public calls a notebook chains, every argument left at its default."""
    relations = data.make_relations("fake_movies_real_actors", n=4, seed=1)
    examples = data.make_examples(relations)
    batch = tokenize_examples(examples, models.tokenizer)
    position = gl.run_position_grafting(models, batch, ["PRE", "FE+LT"])
    (test_set,) = make_test_sets(relations, prompts=("headline",))
    experiment = run_experiment(models, test_set, ["PRE", "FE+LT"])
    pd.testing.assert_series_equal(
        position["target_rank"].reset_index(drop=True),
        experiment["target_rank"].reset_index(drop=True),
    )
    # The scorer's defaults are the runner's: rank the runner's PRE rows by hand.
    logits = models.base(batch.tokens, attention_mask=batch.attention_mask)
    scored = gl.analysis.scoring.LastTokenScorer()(logits, batch.target_ids, batch.attention_mask)
    assert scored["target_rank"] == position.query("config == 'PRE'")["target_rank"].tolist()
    comparison = gl.compare_graft_and_patch(models, batch, positions=("LT",), layers=[0])
    assert len(comparison) > 0


TWICE = "Keanu met Keanu in a movie"
CAFE = "Keanu Reeves ate at a Café alongside"
EXAMPLE = data.make_examples(data.make_relations("fake_movies_real_actors", n=1, seed=0))[0]
NO_PLACE = "'last', 'all', a piece of the prompt's text, a token index"


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (dict(answer=None), SelectionError, "needs an answer"),
        (dict(answer=[ANSWER, ANSWER]), SelectionError, r"gives 2 answers for 1 prompts"),
        (dict(answer=[None]), ArgumentTypeError, r"answer\[0\] is None: each is a non-empty"),
        (
            dict(answer={"a": 1}),
            ArgumentTypeError,
            r"answer=\{'a': 1\} cannot be read; give an answer",
        ),
        (dict(prompts=12345), ArgumentTypeError, r"prompts=12345 cannot be read"),
        (dict(prompts=[{"prompt": PROMPT}]), SelectionError, r"a 'text' column .* \['prompt'\]"),
        # The bad item is None: it was taken for "no bad item" and scored as "None".
        (dict(prompts=[PROMPT, None]), ArgumentTypeError, r"prompts\[1\] is None"),
        (dict(prompts=[PROMPT, "  "]), SelectionError, r"prompts\[1\] is '  '"),
        (dict(prompts=[EXAMPLE, None], answer=None), SelectionError, r"\[1\] is None, among ex"),
        (dict(prompts=[]), SelectionError, r"prompts=\[\] holds nothing; give a prompt"),
        (
            dict(prompts={PROMPT: ANSWER}),
            ArgumentTypeError,
            r"prompts=\{'Keanu.*\} cannot be read; give a prompt, a list",
        ),
        (dict(prompts=b"Keanu"), ArgumentTypeError, r"prompts=b'Keanu' cannot be read"),
        (dict(prompts=3), ArgumentTypeError, r"prompts=3 cannot be read"),
        (
            dict(prompts=pd.DataFrame({"prompt": [PROMPT]})),
            SelectionError,
            r"a 'text' column .* this one has \['prompt'\] and answer='movie'",
        ),
        (
            dict(prompts=pd.DataFrame({"text": [PROMPT], "target": [ANSWER]})),
            SelectionError,
            r"\['text', 'target'\] and answer='movie': .*drop answer=",
        ),
        # Answers scored by a bare space, as `grafting-lens run --prompts` refuses them.
        (dict(prompts=[PROMPT] * 2, answer=["🎬", "東京"]), ExperimentError, "only whitespace"),
        (dict(answer="Laurence Fishburne"), ExperimentError, "' Laurence Fishburne'.*only white"),
        (dict(at="Tom Hanks"), SelectionError, "'Tom Hanks' is not in the prompt"),
        (
            dict(prompts=CAFE, at=unicodedata.normalize("NFD", "Café")),
            SelectionError,
            r"only in another Unicode normal form.*unicodedata.normalize\('NFC'",
        ),
        (dict(at="mov"), SelectionError, r"'mov' ends inside the token 'movie' .*at='movie'"),
        (dict(at="ovie"), SelectionError, r"'ovie' starts inside the token 'movie' .*at='movie'"),
        (
            dict(prompts=TWICE, at="Keanu"),
            SelectionError,
            r"'Keanu' occurs more than once in the prompt .* e\.g\. at='Keanu met'",
        ),
        (dict(at=[1.5]), ArgumentTypeError, rf"at=\[1\.5\]: 1\.5 is not a place; give {NO_PLACE}"),
        (dict(at=2.0), ArgumentTypeError, rf"at=2\.0 cannot be read; give {NO_PLACE}"),
        (dict(at=None), ArgumentTypeError, rf"at=None cannot be read; give {NO_PLACE}"),
        (dict(at=True), ArgumentTypeError, "at=True cannot be read; give 'last'"),
        (dict(at=[np.bool_(True)]), ArgumentTypeError, "is not a place"),
        (dict(at={}), SelectionError, "at={} names no graft"),
        (dict(at={0: "last"}), ArgumentTypeError, r"at=\{0: \.\.\.\}: a graft's label .* string"),
        (dict(at={"": "last"}), SelectionError, r"at=\{'': \.\.\.\}: a graft's label"),
        (dict(at=[]), SelectionError, r"at=\[\] holds nothing; give 'last'"),
        (dict(at=""), SelectionError, "at='': an empty string is not a place"),
        (dict(at=["last", " "]), SelectionError, "an empty string is not a place"),
        (dict(at={"pre": "last"}), SelectionError, "repeats a run's name"),
        (dict(at=40), SelectionError, "at=40: the token index is outside a prompt of 23 tokens"),
        (dict(donor=0), SelectionError, r"donor=0 is not a donor"),
        (dict(donor="PRE"), SelectionError, "donor='PRE' is not a donor"),
        (dict(donor=True), ArgumentTypeError, "donor=True is not a donor"),
        (
            dict(components=None),
            ArgumentTypeError,
            "components=None cannot be read; give a component name",
        ),
        (dict(components=[]), SelectionError, r"components=\[\] holds nothing"),
        (dict(components=["o", None]), ArgumentTypeError, r"components\[1\] is None"),
        (dict(components="router"), GraftingLensError, "router"),
        (dict(layers=[None]), ArgumentTypeError, "Layers must be ints, got None"),
        (dict(top_k=0), ExperimentError, "top_k must be an integer >= 1, got 0"),
        (dict(top_k=1000), ExperimentError, "top_k=1000 exceeds the vocabulary"),
    ],
)
def test_graft_refuses_what_it_cannot_read(models, arguments, error, message):
    with pytest.raises(error, match=message):
        gl.graft(models, **{"prompts": PROMPT, "answer": ANSWER, **arguments})


def _numbers(table: pd.DataFrame) -> pd.DataFrame:
    return table[["config", "text", "target", "grafted", "target_rank", "target_prob"]]


@pytest.mark.parametrize(
    "prompts, answer",
    [
        (pd.DataFrame({"text": [PROMPT, TWICE], "target": [ANSWER, OTHER]}), None),
        (pd.DataFrame({"text": [PROMPT, TWICE], "answer": [ANSWER, OTHER]}), None),
        (pd.DataFrame({"text": [PROMPT, TWICE], "n": [1, 2]}), [ANSWER, OTHER]),
        (pd.Series([PROMPT, TWICE]), pd.Series([ANSWER, OTHER])),
        (np.array([PROMPT, TWICE]), np.array([ANSWER, OTHER])),
        ((PROMPT, TWICE), (ANSWER, OTHER)),
        ((p for p in (PROMPT, TWICE)), (a for a in (ANSWER, OTHER))),
        ([{"text": PROMPT, "target": ANSWER}, {"text": TWICE, "target": OTHER}], None),
        ([{"text": PROMPT}, {"text": TWICE}], [ANSWER, OTHER]),
        ("dataset", None),
    ],
    ids=[
        *("frame-target", "frame-answer", "frame-text", "series", "ndarray", "tuple"),
        *("generator", "records", "records-text", "datasets.Dataset"),
    ],
)
def test_prompts_and_answers_come_in_any_container(models, prompts, answer):
    """A DataFrame's rows, not its column names; numpy's and pandas' strings as text; records
    (a JSON file's) and a Hugging Face dataset by their columns."""
    if isinstance(prompts, str):
        datasets = pytest.importorskip("datasets")
        prompts = datasets.Dataset.from_dict({"text": [PROMPT, TWICE], "target": [ANSWER, OTHER]})
    table = gl.graft(models, prompts, answer, at=["last", 1])
    expected = gl.graft(models, [PROMPT, TWICE], [ANSWER, OTHER], at=["last", 1])
    pd.testing.assert_frame_equal(_numbers(table), _numbers(expected))
    assert set(table["text"]) == {PROMPT, TWICE}
    assert all(type(text) is str for text in [*table["text"], *table["target"]])


def test_a_column_named_twice_is_refused_by_name(models):
    """pd.concat(axis=1) of two tables: its ["text"] is a table, once read as the prompt "text"."""
    prompts = pd.concat([pd.DataFrame({"text": [PROMPT]}), pd.DataFrame({"text": [TWICE]})], axis=1)
    with pytest.raises(SelectionError, match=r"prompts= has two columns named 'text'"):
        gl.graft(models, prompts, ANSWER)
    table = gl.graft(models, PROMPT, ANSWER)
    with pytest.raises(SelectionError, match=r"table= has two columns named 'config'"):
        gl.plot_graft(pd.concat([table, table[["config"]]], axis=1))


def test_an_index_past_the_prompt_names_at_not_the_library(models):
    with pytest.raises(SelectionError, match=r"at=40: the token index is outside") as raised:
        gl.graft(models, PROMPT, ANSWER, at=40)
    assert "grafting_lens" not in str(raised.value) and "position function" not in str(raised.value)


@pytest.mark.parametrize(
    "index", [np.int64(2), np.int32(2), torch.tensor(2), [np.int64(2)], np.array([2])]
)
def test_numpy_and_torch_integers_are_token_indices(models, index):
    table = gl.graft(models, PROMPT, ANSWER, at=index)
    expected = gl.graft(models, PROMPT, ANSWER, at=2)
    pd.testing.assert_frame_equal(_numbers(table), _numbers(expected))
    assert table["config"].iloc[-1] == "2"


def test_grafted_shows_which_of_two_equal_tokens(models, tokenizer):
    """A piece that occurs twice is refused (see the table above); the one named by a
    longer piece is the one grafted, and ``grafted`` says which by its index."""
    first = gl.graft(models, TWICE, ANSWER, at="Keanu met")
    second = gl.graft(models, TWICE, ANSWER, at="Keanu in")
    ids = tokenizer(TWICE, add_special_tokens=False)["input_ids"]  # no BOS under reference
    words = [tokenizer.decode([i]) for i in ids]
    # Keanu's tokens are the same at both places, only their indices differ.
    start = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[i:]).startswith(" Keanu"))
    width = next(n for n in range(1, 9) if tokenizer.decode(ids[:n]) == "Keanu")
    assert words[:width] == words[start + 1 : start + 1 + width]  # " " is its own token
    assert first["grafted"].iloc[-1].startswith(f"{words[0]}@0|")
    assert second["grafted"].iloc[-1].startswith(f"{words[start + 1]}@{start + 1}|")
    assert first["target_prob"].iloc[-1] != second["target_prob"].iloc[-1]


def test_plot_graft_draws_one_prompt_and_many(models):
    one = gl.plot_graft(gl.graft(models, PROMPT, ANSWER))
    assert list(one.data[0].x) == ["pre", "sft", "last"]
    assert one.layout.yaxis.title.text == "P(movie)"
    relations = data.make_relations("fake_movies_real_actors", n=4, seed=0)
    many = gl.plot_graft(gl.graft(models, data.make_examples(relations), at={"LT": "LT"}))
    assert [trace.name for trace in many.data] == ["headline"]


def test_plot_graft_of_one_prompt_with_two_answers_draws_a_bar_group_per_answer(models):
    """Both answers' bars once drew on one axis labelled with the first answer."""
    table = gl.graft(models, [PROMPT, PROMPT], [ANSWER, OTHER])
    fig = gl.plot_graft(table)
    assert [trace.name for trace in fig.data] == [ANSWER, OTHER]
    assert fig.layout.barmode == "group" and fig.layout.yaxis.title.text == "P(answer)"
    for trace, answer in zip(fig.data, (ANSWER, OTHER)):
        rows = table[table["target"] == " " + answer]
        assert list(trace.x) == ["pre", "sft", "last"]
        assert list(trace.y) == rows["target_prob"].tolist()
        assert list(trace.text) == [f"rank {rank}" for rank in rows["target_rank"]]
    # The same prompt and answer asked twice is one group, drawn once.
    twice = gl.plot_graft(gl.graft(models, [PROMPT, PROMPT], ANSWER))
    assert len(twice.data) == 1 and list(twice.data[0].x) == ["pre", "sft", "last"]


@pytest.mark.parametrize(
    "table, options, message",
    [
        ("columns", {}, "lacks"),
        ("rows", {}, "table= takes the table gl.graft returns; got str"),
        ("empty", {}, "non-empty"),
        ("nan", {}, r"1 rows of the table have no score .* table\.dropna"),
        ("ok", dict(k=0), r"k=0: give the top-k as an integer >= 1"),
        ("ok", dict(k=True), r"k=True: give the top-k"),
        ("ok", dict(k=2.5), r"k=2\.5: give the top-k"),
        ("ok", dict(k="5"), r"k='5': give the top-k"),
        ("ok", dict(title=3), r"title= must be a string or None, got 3"),
    ],
)
def test_plot_graft_refuses_what_it_cannot_draw(models, table, options, message):
    graft = gl.graft(models, [PROMPT, TWICE], ANSWER)
    table = {
        "columns": pd.DataFrame({"config": ["a"]}),
        "empty": graft.iloc[:0],
        "nan": graft.assign(target_prob=[np.nan, *graft["target_prob"][1:]]),
        "ok": graft,
    }.get(table, table)  # "rows": a str, not a table
    # A wrong type is an ArgumentTypeError at every door, as at plot_accuracy.
    wrong_type = isinstance(table, str) or options not in ({}, {"k": 0})
    with pytest.raises(ArgumentTypeError if wrong_type else SelectionError, match=message):
        gl.plot_graft(table, **options)


def test_plot_graft_takes_numpy_k(models):
    table = gl.graft(models, [PROMPT, TWICE], ANSWER)
    fig = gl.plot_graft(table, k=np.int64(1))
    assert fig.to_dict() == gl.plot_graft(table, k=1).to_dict()


def test_answers_sharing_their_first_token_are_warned_of(models):
    """As `grafting-lens run --prompts` lists them: a hit on one is a hit on each."""
    with pytest.warns(UserWarning, match="' movie', ' movie star' share their first token"):
        gl.graft(models, [PROMPT, PROMPT], [ANSWER, "movie star"])


CHATML = (  # SmolLM2-Instruct's template, without its default system prompt
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_conversation_is_grafted_at_its_roles_through_the_template():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHATML
    models = gl.load_models(_llama(0), _llama(1), tokenizer=tokenizer, names=["pre", "sft"])
    content = "Reeves starred in a"  # the template takes most of the tiny context
    conversation = [{"role": "user", "content": content}]
    at = {"user": "user", "template": "template", "assistant_start": "assistant_start"}
    table = gl.graft(
        models, conversation, ANSWER, at=at, components="o+ffn", semantics="clean+sft=donor"
    )
    assert list(table["config"]) == ["pre", "sft", *at]
    # By hand: the template's own text, a BOS before it (clean), each place's tokens from
    # the tokenizer's offsets.
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    tokens = torch.tensor([[tokenizer.bos_token_id, *encoded["input_ids"]]])
    joint = tokenizer(text + ANSWER, add_special_tokens=False)["input_ids"]
    target = joint[len(encoded["input_ids"])]
    start, opening = text.index(content), text.rindex("<|im_start|>assistant")
    offsets = encoded["offset_mapping"]
    user = [1 + j for j, (a, b) in enumerate(offsets) if a < start + len(content) and b > start]
    where = {
        "user": user,
        "template": [0, *(1 + j for j in range(len(offsets)) if 1 + j not in user)],
        "assistant_start": [1 + j for j, (a, b) in enumerate(offsets) if b > opening],
    }
    for label, positions in where.items():
        chosen = torch.zeros_like(tokens, dtype=torch.bool)
        chosen[0, positions] = True
        mask = gl.GraftMask.build(models, tokens, positions=chosen, components="o+ffn")
        probability, rank = _probability(gl.graft_forward(models, tokens, mask), target)
        row = table[table["config"] == label].iloc[0]
        assert row.target_prob == pytest.approx(probability, rel=1e-4, abs=1e-7)
        assert row.target_rank == rank
