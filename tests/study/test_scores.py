"""Scores beyond the answer's first token (score=), each against the models' own forward
passes: the whole answer's log-probability, the logit difference, KL to the donor, a
function of the logits; and every refusal at the door."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import make_tokenizer
from test_experiments import _llama

import grafting_lens as gl
from grafting_lens.analysis.scoring import Score
from grafting_lens.core.errors import ArgumentTypeError, ScoreError, SelectionError

PROMPTS = ["Keanu Reeves starred in a movie alongside", "Reeves starred in a"]
ANSWER = "movie alongside"  # several tokens, the first a word (the tiny tokenizer's)
COUNTER = "starred"
# The library's reading: a BOS, then the prompt; the donor's row is the donor model itself.
SEMANTICS = "clean+sft=donor"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    return gl.load_models(_llama(0), _llama(1), tokenizer=tokenizer, names=["pre", "sft"])


@pytest.fixture(scope="module")
def hf():
    """The checkpoints as Hugging Face models, fresh copies: their own forward passes."""
    return {"pre": _llama(0).eval(), "sft": _llama(1).eval()}


def _tokens(tokenizer, prompt: str, answer: str = ANSWER) -> tuple[torch.Tensor, list[int]]:
    """By hand, as the clean semantics reads a prompt: a BOS and the prompt; the answer's
    tokens as they follow it in context."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    joint = tokenizer(prompt + " " + answer, add_special_tokens=False)["input_ids"]
    assert joint[: len(ids)] == ids
    return torch.tensor([[tokenizer.bos_token_id, *ids]]), joint[len(ids) :]


def _graft_logits(models, tokens: torch.Tensor, answer: list[int], sources: str) -> torch.Tensor:
    """The graft of o+ffn, last half of the layers, at the prompt's last token, continued over
    the answer's positions as ``sources`` says: the token-by-token reference."""
    full = torch.cat([tokens, torch.tensor([answer])], dim=1)
    where = torch.zeros_like(full, dtype=torch.bool)
    where[0, tokens.shape[1] - 1] = True
    if sources == "last":
        where[0, tokens.shape[1] :] = True
    mask = gl.GraftMask.build(models, full, positions=where, components="o+ffn", layers="last_half")
    return gl.graft_forward_reference(models, full, mask)


def _expected_logits(models, hf, tokenizer, prompt: str, sources: str = "last"):
    tokens, answer = _tokens(tokenizer, prompt)
    full = torch.cat([tokens, torch.tensor([answer])], dim=1)
    with torch.no_grad():
        return (
            {
                "pre": hf["pre"](full).logits[0],
                "sft": hf["sft"](full).logits[0],
                "last": _graft_logits(models, tokens, answer, sources)[0],
            },
            tokens.shape[1] - 1,
            answer,
        )


def _table(models, score, **kwargs) -> pd.DataFrame:
    return gl.graft(
        models,
        PROMPTS,
        ANSWER,
        at="last",
        components="o+ffn",
        layers="last_half",
        semantics=SEMANTICS,
        score=score,
        **kwargs,
    )


@pytest.mark.parametrize("sources", ["last", "base"])
def test_the_whole_answers_log_probability_equals_the_models(models, hf, tokenizer, sources):
    table = _table(models, Score.of("answer_logprob", answer_sources=sources))
    assert list(table.columns[8:10]) == ["answer_logprob", "answer_logprob_mean"]
    for prompt in PROMPTS:
        logits, last, answer = _expected_logits(models, hf, tokenizer, prompt, sources)
        assert len(answer) > 1  # the whole answer, not its first token
        for run, values in logits.items():
            log_probs = torch.log_softmax(values.float(), dim=-1)
            each = [float(log_probs[last + j, token]) for j, token in enumerate(answer)]
            row = table[(table["text"] == prompt) & (table["config"] == run)].iloc[0]
            assert row["answer_logprob"] == pytest.approx(sum(each), rel=1e-4, abs=1e-5)
            assert row["answer_logprob_mean"] == pytest.approx(sum(each) / len(answer), rel=1e-4)
            # The paper's columns are today's: the first token's probability.
            assert row["target_prob"] == pytest.approx(
                float(log_probs[last, answer[0]].exp()), rel=1e-4, abs=1e-7
            )


def test_kl_to_the_donor_and_how_much_of_it_a_graft_recovers(models, hf, tokenizer):
    table = _table(models, "kl")
    for prompt in PROMPTS:
        logits, last, answer = _expected_logits(models, hf, tokenizer, prompt)
        # The prompt's last token and each of the answer's: len(answer) + 1 positions.
        read = slice(last, last + len(answer) + 1)
        donor = torch.log_softmax(logits["sft"][read].float(), dim=-1)

        def kl(run, read=read, donor=donor):
            run = torch.log_softmax(run[read].float(), dim=-1)
            return float((donor.exp() * (donor - run)).sum())

        rows = table[table["text"] == prompt].set_index("config")
        for run in ("pre", "sft", "last"):
            assert rows.loc[run, "kl"] == pytest.approx(kl(logits[run]), rel=1e-4, abs=1e-5)
        expected = 1 - kl(logits["last"]) / kl(logits["pre"])
        assert rows.loc["last", "kl_recovered"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
        assert rows.loc["pre", "kl_recovered"] == 0 and rows.loc["sft", "kl_recovered"] == 1


def test_the_logit_difference_against_a_counter_answer(models, hf, tokenizer):
    table = _table(models, "logit_diff", counter=[COUNTER, " " + COUNTER])  # one per prompt
    for prompt in PROMPTS:
        logits, last, answer = _expected_logits(models, hf, tokenizer, prompt)
        _, counter = _tokens(tokenizer, prompt, COUNTER)
        rows = table[table["text"] == prompt].set_index("config")
        for run, values in logits.items():
            expected = float(values[last, answer[0]] - values[last, counter[0]])
            assert rows.loc[run, "logit_diff"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_a_function_of_the_logits_sees_each_prompt_without_padding(models, hf, tokenizer):
    seen = []

    def answer_logit(logits):  # TransformerLens's convention: [batch, pos, d_vocab] -> [batch]
        seen.append(tuple(logits.shape[:2]))
        return logits[:, -1].log_softmax(dim=-1).max(dim=-1).values

    table = _table(models, answer_logit)
    lengths = {len(_tokens(tokenizer, prompt)[0][0]) for prompt in PROMPTS}
    assert {length for _, length in seen} == lengths  # each prompt cut to its own length
    for prompt in PROMPTS:
        tokens, _ = _tokens(tokenizer, prompt)
        rows = table[table["text"] == prompt].set_index("config")
        for run in ("pre", "sft"):
            with torch.no_grad():
                expected = answer_logit(hf[run](tokens).logits)
            assert rows.loc[run, "score"] == pytest.approx(float(expected), rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("chat", [False, True])
def test_kl_and_a_function_need_no_answer(models, hf, tokenizer, chat):
    """A behaviour has no answer: kl compares at the prompt's last token, a function sees the
    prompt; the answer's columns are left out rather than scoring a placeholder."""
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS] if chat else PROMPTS
    kw = dict(at="last", components="o+ffn", layers="last_half", semantics=SEMANTICS)
    if chat:
        models.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        table = gl.graft(models, prompts, score="kl", **kw)
        last = gl.graft(models, prompts, score=lambda logits: logits[:, -1, 0], **kw)
    finally:
        models.tokenizer.chat_template = None
    assert not {"target_rank", "target_prob", "top1", "top5"} & set(table.columns)
    assert table["target"].isna().all()
    for prompt in PROMPTS:
        tokens, _ = _tokens(tokenizer, prompt)
        where = torch.zeros_like(tokens, dtype=torch.bool)
        where[0, -1] = True
        mask = gl.GraftMask.build(
            models, tokens, positions=where, components="o+ffn", layers="last_half"
        )
        with torch.no_grad():
            logits = {
                "pre": hf["pre"](tokens).logits[0, -1],
                "sft": hf["sft"](tokens).logits[0, -1],
                "last": gl.graft_forward_reference(models, tokens, mask)[0, -1],
            }
        donor = logits["sft"].float().log_softmax(-1)
        rows = table[table["text"] == prompt].set_index("config")
        scores = last[last["text"] == prompt].set_index("config")
        for run, values in logits.items():
            run_log = values.float().log_softmax(-1)
            expected = float((donor.exp() * (donor - run_log)).sum())
            assert rows.loc[run, "kl"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
            assert scores.loc[run, "score"] == pytest.approx(float(values[0]), rel=1e-4)
    if chat:  # the template adds nothing here, so the chat rows equal the plain ones
        plain = gl.graft(models, PROMPTS, score="kl", **kw)
        assert table["kl"].tolist() == pytest.approx(plain["kl"].tolist(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("score", ["answer_logprob", "kl"])
def test_an_answer_past_the_models_positions_is_refused_naming_it(tokenizer, score):
    """GPT-2 embeds 64 positions here: a prompt that fits with an answer that does not."""
    from conftest import random_model

    models = gl.load_models(random_model("gpt2", 0), random_model("gpt2", 1), tokenizer=tokenizer)
    limit = models.max_positions
    with pytest.raises(ScoreError, match=rf"are \d+ tokens, past the {limit} positions.*answer"):
        gl.graft(models, PROMPTS[1], " movie" * limit, score=score)


def test_a_score_of_the_answer_without_one_names_the_scores_that_need_none(models):
    with pytest.raises(SelectionError, match=r"score='kl' or a function scores without one"):
        gl.graft(models, PROMPTS, score="answer_logprob")


def test_the_first_token_score_is_todays_table(models):
    assert _table(models, "first_token").equals(
        gl.graft(
            models,
            PROMPTS,
            ANSWER,
            at="last",
            components="o+ffn",
            layers="last_half",
            semantics=SEMANTICS,
        )
    )


REFUSALS = {
    "an unknown score": (
        {"score": "answer_log_prob"},
        ScoreError,
        r"Unknown score 'answer_log_prob'\. Did you mean 'answer_logprob'\? Known: first_token, "
        r"answer_logprob, logit_diff, kl or a function",
    ),
    "not a score": ({"score": 3}, ArgumentTypeError, r"Unknown score 3"),
    "logit_diff without a counter": (
        {"score": "logit_diff"},
        ScoreError,
        r"score='logit_diff' needs counter=",
    ),
    "a counter for another score": (
        {"score": "kl", "counter": "x"},
        ScoreError,
        r"counter= is score='logit_diff''s",
    ),
    "a counter equal to the answer": (
        {"score": "logit_diff", "counter": "movie"},
        ScoreError,
        r"counter= ' movie' starts with the answer's own first token",
    ),
    "counters not one per prompt": (
        {"score": "logit_diff", "counter": ["a", "b", "c"]},
        ScoreError,
        r"counter= gives 3 counter-answers for 2 prompts",
    ),
    "a function returning one number": (
        {"score": lambda logits: logits.sum()},
        ScoreError,
        r"returned tensor\(.*\) for \d prompts of logits \[\d, \d+, \d+\]: return a finite tensor",
    ),
    "a function returning NaN": (
        {"score": lambda logits: logits[:, 0, 0] * torch.nan},
        ScoreError,
        r"return a finite tensor of one number per prompt",
    ),
    "a function returning a list": (
        {"score": lambda logits: logits[:, 0, 0].tolist()},
        ScoreError,
        r"returned \[.*\]",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_every_refusal_names_the_argument_and_the_fix(models, case):
    arguments, error, message = REFUSALS[case]
    with pytest.raises(error, match=message):
        _table(models, **arguments)


def test_position_grafting_takes_a_score(models, hf, tokenizer):
    """run_position_grafting(score=): the whole answer's log-probability of each example, the
    base's and the donor's rows against the HF models' own teacher-forced forwards."""
    from grafting_lens.analysis.batch import tokenize_examples
    from grafting_lens.study.semantics import semantics_or_default
    from grafting_lens.worlds import data

    examples = data.make_examples(data.make_relations("fake_movies_real_actors", n=3, seed=0))
    rules = semantics_or_default(SEMANTICS).tokenization()
    batch = tokenize_examples(examples, tokenizer, **rules)
    table = gl.run_position_grafting(
        models, batch, ("PRE", "SFT", "LT"), semantics=SEMANTICS, score="answer_logprob"
    )
    assert list(table.columns[-2:]) == ["answer_logprob", "answer_logprob_mean"]
    for config, model in (("PRE", hf["pre"]), ("SFT", hf["sft"])):
        rows = table[table["config"] == config].set_index("example")
        for i, answer in enumerate(batch.target_full_ids):
            length = int(batch.attention_mask[i].sum())
            tokens = torch.tensor([[*batch.tokens[i, :length].tolist(), *answer]])
            with torch.no_grad():
                log_probs = model(tokens).logits[0].float().log_softmax(-1)
            expected = sum(float(log_probs[length - 1 + j, t]) for j, t in enumerate(answer))
            assert rows.loc[i, "answer_logprob"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
