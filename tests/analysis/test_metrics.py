"""Tests for grafting_lens.analysis.metrics: ranks, probabilities, top-k and bootstrap intervals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from grafting_lens.analysis.metrics import (
    TIE_RULES,
    bootstrap_ci,
    last_token_logits,
    summarize,
    target_probability,
    target_rank,
    top_k_hit,
    top_k_tokens,
)
from grafting_lens.analysis.scoring import LastTokenScorer
from grafting_lens.core.errors import ArgumentTypeError, GraftingLensError, NonFiniteLogitsError

# Three rows over a vocabulary of five, no ties, so every rank is unambiguous.
LOGITS = torch.tensor(
    [
        [0.1, 2.0, -1.0, 0.5, 3.0],  # order: 4, 1, 3, 0, 2
        [5.0, 4.0, 3.0, 2.0, 1.0],  # order: 0, 1, 2, 3, 4
        [-2.0, -1.0, 0.0, 1.5, 1.0],  # order: 3, 4, 2, 1, 0
    ]
)
TARGETS = torch.tensor([1, 4, 3])


def test_target_rank_on_hand_made_logits():
    assert target_rank(LOGITS, TARGETS).tolist() == [1, 4, 0]


def test_target_rank_matches_argsort():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 40, generator=generator)
    targets = torch.randint(0, 40, (50,), generator=generator)
    order = logits.argsort(dim=1, descending=True)
    expected = (order == targets[:, None]).float().argmax(dim=1)
    assert torch.equal(target_rank(logits, targets), expected)


def test_target_probability_is_the_softmax_entry():
    expected = [float(torch.softmax(row, 0)[t]) for row, t in zip(LOGITS, TARGETS)]
    assert target_probability(LOGITS, TARGETS).tolist() == pytest.approx(expected, rel=1e-6)
    # Stable where a naive exp would overflow.
    huge = torch.tensor([[1000.0, 0.0]])
    assert target_probability(huge, torch.tensor([0])).item() == pytest.approx(1.0)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_hit_agrees_with_topk(k):
    generator = torch.Generator().manual_seed(k)
    logits = torch.randn(30, 12, generator=generator)
    targets = torch.randint(0, 12, (30,), generator=generator)
    expected = (logits.topk(k, dim=1).indices == targets[:, None]).any(dim=1)
    assert torch.equal(top_k_hit(logits, targets, k), expected)
    assert top_k_hit(LOGITS, TARGETS, 2).tolist() == [True, False, True]


def test_top_k_tokens_lists_ids_probabilities_and_strings():
    class Decoder:
        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    top = top_k_tokens(LOGITS, k=3, tokenizer=Decoder())
    assert top.ids.tolist() == [[4, 1, 3], [0, 1, 2], [3, 4, 2]]
    assert top.strings == [["<4>", "<1>", "<3>"], ["<0>", "<1>", "<2>"], ["<3>", "<4>", "<2>"]]
    assert torch.allclose(top.probabilities[:, 0], torch.softmax(LOGITS, -1).max(dim=1).values)
    assert (top.probabilities[:, :-1] >= top.probabilities[:, 1:]).all()
    assert top_k_tokens(LOGITS, k=2).strings is None


def test_last_token_logits_reads_each_rows_last_real_token():
    logits = torch.arange(2 * 4 * 3, dtype=torch.float).reshape(2, 4, 3)
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    final = last_token_logits(logits, attention_mask)
    assert torch.equal(final[0], logits[0, 3]) and torch.equal(final[1], logits[1, 1])
    assert torch.equal(last_token_logits(logits), logits[:, -1])


def test_bad_inputs_are_explained():
    with pytest.raises(GraftingLensError, match="last_token_logits"):
        target_rank(LOGITS[None], TARGETS)  # [batch, pos, vocab] instead of [batch, vocab]
    with pytest.raises(GraftingLensError, match=r"one id per row in 0\.\.4 .*shape \(2,\)"):
        target_rank(LOGITS, TARGETS[:2])
    with pytest.raises(GraftingLensError, match=r"one id per row in 0\.\.4"):
        target_probability(LOGITS, torch.tensor([0, 1, 5]))
    with pytest.raises(GraftingLensError, match=r"one id per row .*got torch.float32"):
        target_probability(LOGITS, TARGETS.float())
    with pytest.raises(GraftingLensError, match=r"with a row, got shape \(0, 5\)"):
        target_rank(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    with pytest.raises(GraftingLensError, match=r"k \(ks=, k=\) must be"):
        top_k_hit(LOGITS, TARGETS, 0)
    with pytest.raises(GraftingLensError, match="exceeds the vocabulary"):
        top_k_tokens(LOGITS, k=6)
    with pytest.raises(GraftingLensError, match="attention_mask"):
        last_token_logits(torch.zeros(2, 4, 3), torch.ones(2, 5))


def test_the_scorer_refuses_empty_runs_and_reads_narrow_target_ids():
    """Logits of empty tokens failed with IndexError; uint8 or int16 targets are their ids."""
    scorer = LastTokenScorer()
    with pytest.raises(GraftingLensError, match=r"position, got shape \(2, 0, 5\).*empty tok"):
        scorer(torch.zeros(2, 0, 5), TARGETS[:2])
    with pytest.raises(GraftingLensError, match="with a row"):
        scorer(torch.zeros(0, 3, 5), torch.zeros(0, dtype=torch.long))
    expected = scorer(LOGITS[:, None], TARGETS)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        assert scorer(LOGITS[:, None], TARGETS.to(dtype)) == expected


# ----------------------------------------------------------------- non-finite logits


@pytest.mark.parametrize(
    "score",
    [
        lambda logits, targets: target_rank(logits, targets),
        lambda logits, targets: target_rank(logits, targets, ties="optimistic"),
        lambda logits, targets: top_k_hit(logits, targets, 1),
        lambda logits, targets: top_k_hit(logits, targets, 5, ties="optimistic"),
        lambda logits, targets: target_probability(logits, targets),
        lambda logits, targets: top_k_tokens(logits, 2),
    ],
    ids=["rank", "rank-optimistic", "top1", "top5-optimistic", "probability", "top-tokens"],
)
@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"]
)
def test_rows_with_non_finite_logits_are_refused_never_scored(score, bad):
    # A NaN compares false with everything: counting "tokens above the target"
    # would give an all-NaN row rank 0, a perfect answer.
    all_bad = torch.full((1, 10), bad)
    with pytest.raises(NonFiniteLogitsError, match=r"1 of 1 rows of logits \(rows 0\)"):
        score(all_bad, torch.tensor([3]))
    one_bad = LOGITS.clone()
    one_bad[2, 0] = bad  # the target of row 2 is token 3, not the bad one
    with pytest.raises(NonFiniteLogitsError, match=r"1 of 3 rows of logits \(rows 2\).*float16"):
        score(one_bad, TARGETS)


def test_float16_overflow_is_refused_with_the_dtype_named():
    logits = (torch.tensor([[70000.0, 1.0, 2.0]])).half()  # overflows to inf in float16
    with pytest.raises(NonFiniteLogitsError, match="infinite.*torch.float16"):
        target_rank(logits, torch.tensor([1]))


# ------------------------------------------------------------------------ tie rule


def _rank_by_hand(row: list[float], target: int, ties: str) -> int:
    """The tie rule written out as a loop over the vocabulary."""
    above = sum(1 for j, value in enumerate(row) if j != target and value > row[target])
    tied = sum(1 for j, value in enumerate(row) if j != target and value == row[target])
    return above + (tied if ties == "pessimistic" else 0)


def test_ties_go_to_the_target_by_default_as_in_the_papers_code():
    tie = torch.zeros(1, 10)
    # The one default (the paper's code) counts only strictly greater values.
    assert target_rank(tie, torch.tensor([3])).tolist() == [0]
    assert top_k_hit(tie, torch.tensor([3]), 1).item()
    assert target_rank(tie, torch.tensor([3]), ties="pessimistic").tolist() == [9]
    assert not top_k_hit(tie, torch.tensor([3]), 1, ties="pessimistic").item()
    assert top_k_hit(tie, torch.tensor([3]), 10, ties="pessimistic").item()
    # Without ties both rules are the argsort rank.
    for ties in TIE_RULES:
        assert target_rank(LOGITS, TARGETS, ties=ties).tolist() == [1, 4, 0]


@pytest.mark.parametrize("ties", TIE_RULES)
def test_tie_rule_matches_a_loop_over_bfloat16_logits(ties):
    # bfloat16 keeps 8 bits of mantissa: a 300-token vocabulary has many exact ties.
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 300, generator=generator) * 3).bfloat16()
    targets = logits.float().argsort(dim=1, descending=True)[:, 2]
    expected = [
        _rank_by_hand(row, int(t), ties) for row, t in zip(logits.float().tolist(), targets)
    ]
    assert target_rank(logits, targets, ties=ties).tolist() == expected
    hits = top_k_hit(logits, targets, 3, ties=ties).tolist()
    assert hits == [rank < 3 for rank in expected]


def test_a_bfloat16_tie_with_the_top_token_is_not_a_top1_hit():
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(32, 300, generator=generator) * 3).bfloat16()
    targets = logits.argmax(dim=1)
    rows = torch.arange(32)
    logits[rows, (targets + 1) % 300] = logits[rows, targets]  # another token ties with the top one
    assert not top_k_hit(logits, targets, 1, ties="pessimistic").any()
    assert top_k_hit(logits, targets, 1, ties="optimistic").all()


def test_ranking_by_probability_ties_what_the_float32_softmax_cannot_tell_apart():
    # Logits 1000 apart: both losers' probabilities underflow to exactly 0.
    logits = torch.tensor([[0.0, -1000.0, -2000.0]])
    target = torch.tensor([2])
    assert target_rank(logits, target, by="logit", ties="pessimistic").tolist() == [2]
    assert target_rank(logits, target, by="probability", ties="pessimistic").tolist() == [2]
    # The paper's code: strictly greater probabilities, so the underflowed target ranks 1.
    assert target_rank(logits, target, by="probability", ties="optimistic").tolist() == [1]
    assert target_rank(logits, target, by="logit", ties="optimistic").tolist() == [2]
    assert target_rank(logits, target).tolist() == [1]  # the one default is the code's
    assert top_k_hit(logits, target, 2, by="probability", ties="optimistic").item()
    # Without such ties both are the argsort rank.
    for ties in TIE_RULES:
        assert target_rank(LOGITS, TARGETS, by="probability", ties=ties).tolist() == [1, 4, 0]


def test_rank_by_probability_matches_the_papers_formula():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 300, generator=generator) * 20  # many probabilities underflow
    targets = torch.randint(0, 300, (16,), generator=generator)
    probs = torch.softmax(logits, dim=-1)
    expected = [int((row > row[t]).sum()) for row, t in zip(probs, targets)]
    assert target_rank(logits, targets, by="probability", ties="optimistic").tolist() == expected


def test_the_scorer_ranks_as_it_is_told():
    logits = torch.tensor([[[0.0, -1000.0, -2000.0]]])
    target = torch.tensor([2])
    library = LastTokenScorer(rank_by="logit", ties="pessimistic")
    assert library(logits, target)["target_rank"] == [2]
    code = LastTokenScorer()  # the one default: the paper's code's ranking
    assert code(logits, target)["target_rank"] == [1]
    assert code(logits, target)["top1"] == [False] and code(logits, target)["top5"] == [True]
    with pytest.raises(GraftingLensError, match="Unknown rank_by 'odds'"):
        LastTokenScorer(rank_by="odds")
    with pytest.raises(GraftingLensError, match="Unknown ties 'fair'"):
        LastTokenScorer(ties="fair")


def test_an_unknown_rank_basis_is_refused():
    with pytest.raises(GraftingLensError, match="Unknown by 'prob'.*Known: logit, probability"):
        target_rank(LOGITS, TARGETS, by="prob")


def test_an_unknown_tie_rule_is_refused():
    with pytest.raises(GraftingLensError, match="Unknown ties 'mean'.*Known: pessimistic, optim"):
        target_rank(LOGITS, TARGETS, ties="mean")
    with pytest.raises(GraftingLensError, match="Unknown ties None"):
        top_k_hit(LOGITS, TARGETS, 1, ties=None)


def test_last_token_logits_refuses_attention_masks_that_are_not_zero_one():
    logits = torch.zeros(2, 4, 3)
    for values in (torch.full((2, 4), 0.5), torch.full((2, 4), 2)):
        with pytest.raises(GraftingLensError, match="only 0 \\(padding\\) and 1"):
            last_token_logits(logits, values)
    with pytest.raises(GraftingLensError, match="right padding"):
        last_token_logits(logits, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))


def test_bootstrap_ci_contains_the_mean_and_narrows_with_more_data():
    rng = np.random.default_rng(1)
    small = rng.binomial(1, 0.4, size=20)
    large = rng.binomial(1, 0.4, size=2000)
    low_s, high_s = bootstrap_ci(small)
    low_l, high_l = bootstrap_ci(large)
    assert low_s <= small.mean() <= high_s
    assert low_l <= large.mean() <= high_l
    assert 0.0 <= low_s < high_s <= 1.0
    assert (high_l - low_l) < (high_s - low_s) / 4  # width shrinks like 1/sqrt(n)
    assert bootstrap_ci(small, seed=3) == bootstrap_ci(small, seed=3)
    assert (
        bootstrap_ci(small, confidence=0.5)[1] - bootstrap_ci(small, confidence=0.5)[0]
        < high_s - low_s
    )


def test_bootstrap_ci_is_an_independent_percentile_bootstrap():
    """The interval is the 2.5th and 97.5th percentiles of resampled means, as a loop over
    the same generator's draws computes them."""
    values = np.random.default_rng(4).normal(size=37)
    draws = np.random.default_rng(7).integers(0, 37, size=(500, 37))
    means = values[draws].mean(axis=1)
    assert bootstrap_ci(values, n_resamples=500, seed=7) == pytest.approx(
        tuple(np.percentile(means, [2.5, 97.5])), rel=1e-12
    )


def test_bootstrap_ci_edge_cases():
    assert bootstrap_ci([0.7]) == (0.7, 0.7)
    assert bootstrap_ci(torch.tensor([True, True])) == (1.0, 1.0)
    for arguments, message in [
        (([],), r"at least one value \(values=\), got none"),
        (([1.0, float("nan")],), r"got 1 NaN or infinite values of 2 \(values=\)"),
        (([1.0, 2.0], 1000, 95), r"confidence= must lie in \(0, 1\), e.g. 0.95; got 95\."),
        (([1.0, 2.0], 0), r"n_resamples= must be in 1\.\.1,000,000 \(1000 is usual\), got 0\."),
    ]:
        with pytest.raises(GraftingLensError, match=message):
            bootstrap_ci(*arguments)


def _results() -> pd.DataFrame:
    rows = []
    ranks = {
        ("PRE", "headline"): [0, 7, 9, 12],
        ("SFT", "headline"): [0, 0, 3, 1],
        ("PRE", "qa"): [4, 5, 6, 30],
    }
    for (config, prompt), values in ranks.items():
        rows += [{"config": config, "prompt": prompt, "target_rank": r} for r in values]
    return pd.DataFrame(rows)


def test_summarize_columns_and_values():
    summary = summarize(_results(), n_resamples=200)
    assert list(summary.columns) == [
        "config", "prompt", "n",
        "top1", "top1_low", "top1_high",
        "top5", "top5_low", "top5_high",
        "mean_rank", "mean_rank_low", "mean_rank_high",
    ]  # fmt: skip
    # Groups keep the order in which they appear, not alphabetical order.
    assert list(zip(summary.config, summary.prompt)) == [
        ("PRE", "headline"), ("SFT", "headline"), ("PRE", "qa")
    ]  # fmt: skip
    pre, sft, qa = (summary.iloc[i] for i in range(3))
    assert pre.n == 4 and pre.top1 == 0.25 and pre.top5 == 0.25 and pre.mean_rank == 7.0
    assert sft.top1 == 0.5 and sft.top5 == 1.0 and sft.mean_rank == 1.0
    assert qa.top1 == 0.0 and qa.top5 == 0.25
    assert sft.top5_low == sft.top5_high == 1.0  # every resample hits
    for _, row in summary.iterrows():
        for column in ("top1", "top5", "mean_rank"):
            assert row[f"{column}_low"] <= row[column] <= row[f"{column}_high"]


def test_summarize_other_ks_and_groups():
    summary = summarize(_results(), by="config", ks=(10,), n_resamples=50)
    assert list(summary.columns[:5]) == ["config", "n", "top10", "top10_low", "top10_high"]
    assert summary.set_index("config").loc["PRE", "n"] == 8
    assert summary.set_index("config").loc["PRE", "top10"] == pytest.approx(
        6 / 8
    )  # 0, 7, 9, 4, 5, 6


def test_summarize_rejects_bad_tables():
    for results, options, message in [
        (_results().iloc[:0], {}, "non-empty DataFrame"),
        (_results().drop(columns="target_rank"), {}, r"lacking \['target_rank'\]"),
        (_results(), dict(by=("model",)), r"lacking \['model'\]"),
        (_results().to_dict(), {}, "got dict"),
        (_results(), dict(ks=(0,)), r"k \(ks=, k=\) must be"),
        (_results(), dict(ks=(5, 5)), r"ks= has repeated values: \[5, 5\]"),
        (_results().assign(target_rank=-1), {}, "numbers >= 0"),
    ]:
        with pytest.raises(GraftingLensError, match=message):
            summarize(results, **options)


# Each argument of the wrong type or value is refused by its name, never with numpy's,
# pandas' or scipy's own error from deep inside (the front-door fuzzer's property).
@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(n_resamples=None), ArgumentTypeError, r"n_resamples= must be an integer, got None"),
        (dict(n_resamples=-1), GraftingLensError, r"n_resamples= must be in 1\.\..*got -1\."),
        (dict(n_resamples=2**31), GraftingLensError, r"n_resamples= .*got 2147483648\."),
        (dict(seed=""), ArgumentTypeError, r"seed= must be an integer >= 0, got ''"),
        (dict(seed=1.5), ArgumentTypeError, r"seed= must be an integer >= 0, got 1\.5"),
        (dict(seed=-1), GraftingLensError, r"seed= must be an integer >= 0, got -1"),
        (dict(confidence=None), ArgumentTypeError, r"confidence= must be a number in \(0, 1\)"),
        (dict(confidence="0.9"), ArgumentTypeError, r"confidence= .*got '0\.9'"),
        (dict(confidence=float("nan")), GraftingLensError, r"confidence= must lie in \(0, 1\)"),
        (dict(by=()), GraftingLensError, r"by=\(\) holds nothing"),
        (dict(by=None), ArgumentTypeError, r"by=None cannot be read"),
        (dict(by=torch.tensor(0)), ArgumentTypeError, r"by=tensor\(0\) cannot be read"),
        (dict(by=("config", "config")), GraftingLensError, r"by= names 'config' twice"),
        (dict(ks=torch.tensor(1.0)), ArgumentTypeError, r"ks= must be an integer or a list"),
        (dict(ks=None), ArgumentTypeError, r"ks= must be an integer or a list .*got None"),
        (dict(ks=""), ArgumentTypeError, r"ks= must be an integer or a list .*got ''"),
        (dict(ks=()), GraftingLensError, r"ks= holds nothing"),
        (dict(ks=(1.5,)), ArgumentTypeError, r"k \(ks=, k=\) must be an integer >= 1, got 1\.5"),
    ],
)
def test_summarize_refuses_each_bad_argument_by_name(options, error, message):
    with pytest.raises(error, match=message):
        summarize(_results(), **options)


@pytest.mark.parametrize(
    "values, options, message",
    [
        ("", {}, r"needs numbers \(values=\), got ''"),
        (["x", 1], {}, r"needs numbers \(values=\), got \['x', 1\]"),
        ({"a": 1.0}, {}, r"needs numbers \(values=\)"),
        ([1.0, 0.0], dict(seed=[None]), r"seed= must be an integer >= 0, got \[None\]"),
        ([1.0, 0.0], dict(confidence=torch.tensor([1, 2])), r"confidence= must be a number"),
    ],
)
def test_bootstrap_ci_refuses_each_bad_argument_by_name(values, options, message):
    with pytest.raises(ArgumentTypeError, match=message):
        bootstrap_ci(values, **options)


def test_summarize_takes_numpy_and_torch_numbers_as_python_ones():
    plain = summarize(_results(), ks=(1, 5), n_resamples=50, confidence=0.5, seed=3)
    numbers = summarize(
        _results(),
        by=pd.Series(["config", "prompt"]),
        ks=torch.tensor([1, 5]),
        n_resamples=np.int64(50),
        confidence=np.float32(0.5),
        seed=torch.tensor(3),
    )
    pd.testing.assert_frame_equal(plain, numbers)
