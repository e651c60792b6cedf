"""gl.graft: a first graft from text, checked against the models' own forward passes."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import make_tokenizer
from test_experiments import _llama

import grafting_lens as gl
from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.core.errors import GraftingLensError, SelectionError
from grafting_lens.study import make_test_sets, run_experiment
from grafting_lens.worlds import data

PROMPT = "Keanu Reeves starred in a movie alongside"
ANSWER = "Laurence Fishburne"


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
    shown = "|".join(tokenizer.decode([t]) for t in tokens[0][where[0]].tolist())
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


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(prompts=PROMPT, answer=None), "needs an answer"),
        (dict(prompts=PROMPT, answer=[ANSWER, ANSWER]), "needs an answer"),
        (dict(prompts=[{"text": PROMPT}], answer=ANSWER), "non-empty strings"),
        (dict(prompts=[], answer=ANSWER), "No prompts"),
        (dict(prompts=PROMPT, answer=ANSWER, at="Tom Hanks"), "not in the prompt"),
        (dict(prompts=PROMPT, answer=ANSWER, at=[1.5]), "Cannot read the place"),
        (dict(prompts=PROMPT, answer=ANSWER, at={}), "names no graft"),
        (dict(prompts=PROMPT, answer=ANSWER, at={"pre": "last"}), "repeats a run's name"),
        (dict(prompts=PROMPT, answer=ANSWER, at=40), "outside a prompt"),
        (dict(prompts=PROMPT, answer=ANSWER, donor=0), "not a donor"),
        (dict(prompts=PROMPT, answer=ANSWER, donor="PRE"), "not a donor"),
    ],
)
def test_graft_refuses_what_it_cannot_read(models, arguments, message):
    with pytest.raises(SelectionError, match=message):
        gl.graft(models, **arguments)


def test_graft_refuses_components_the_model_lacks(models):
    with pytest.raises(GraftingLensError, match="router"):
        gl.graft(models, PROMPT, ANSWER, components="router")


def test_plot_graft_draws_one_prompt_and_many(models):
    one = gl.plot_graft(gl.graft(models, PROMPT, ANSWER))
    assert list(one.data[0].x) == ["pre", "sft", "last"]
    relations = data.make_relations("fake_movies_real_actors", n=4, seed=0)
    many = gl.plot_graft(gl.graft(models, data.make_examples(relations), at={"LT": "LT"}))
    assert [trace.name for trace in many.data] == ["headline"]
    with pytest.raises(SelectionError, match="lacks"):
        gl.plot_graft(pd.DataFrame({"config": ["a"]}))
