"""Position grafting: the paper's eight configurations, their masks and the runner."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokenizer, random_model

import grafting_lens as gl
from grafting_lens import data
from grafting_lens.errors import GraftingLensError
from grafting_lens.metrics import last_token_logits, target_probability, target_rank
from grafting_lens.position_grafting import (
    PAPER_CONFIGS,
    POSITION_CONFIGS,
    config_positions,
    position_grafting_components,
    position_grafting_masks,
    run_position_grafting,
)

PAPER_LABELS = ["PRE", "SFT", "FE", "LT", "FE+LT", "(FE+LT)^C", "FE^C", "LT^C"]


def _hand_spans():
    # Row 0: six real tokens, entity at 1-2. Row 1: four real tokens, two of padding, entity at 1.
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    first_entity = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    return {"first_entity": first_entity}, attention_mask


def test_position_configs_on_hand_made_spans():
    spans, attention_mask = _hand_spans()
    assert list(PAPER_CONFIGS) == PAPER_LABELS
    expected = {
        "PRE": [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
        "SFT": [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]],
        "FE": [[0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]],
        "LT": [[0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0]],
        "FE+LT": [[0, 1, 1, 0, 0, 1], [0, 1, 0, 1, 0, 0]],
        "(FE+LT)^C": [[1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 0]],
        "FE^C": [[1, 0, 0, 1, 1, 1], [1, 0, 1, 1, 0, 0]],
        "LT^C": [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]],
    }
    for name, rows in expected.items():
        assert config_positions(name, spans, attention_mask).tolist() == [
            [bool(v) for v in r] for r in rows
        ], name
    # A complement is taken over real tokens only: it and its set partition the real tokens.
    real = attention_mask.bool()
    for name in ("FE", "LT", "FE+LT"):
        chosen = config_positions(name, spans, attention_mask)
        other = config_positions(
            "(FE+LT)^C" if name == "FE+LT" else f"{name}^C", spans, attention_mask
        )
        assert torch.equal(chosen | other, real) and not (chosen & other).any()
    # A marked last_token span is used as given.
    marked = {
        **spans,
        "last_token": torch.tensor([[0, 0, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool),
    }
    assert config_positions("LT", marked, attention_mask)[0].nonzero().item() == 4


def test_position_config_errors_name_the_fix():
    spans, attention_mask = _hand_spans()
    with pytest.raises(GraftingLensError, match=r"Known: PRE, SFT, FE, LT, FE\+LT") as error:
        config_positions("FE+LTT", spans, attention_mask)
    assert "Did you mean 'FE+LT'" in str(error.value)
    with pytest.raises(GraftingLensError, match="first_entity"):
        config_positions("FE", {}, attention_mask)


def test_registered_configs_join_the_known_ones(monkeypatch):
    from grafting_lens import position_grafting

    spans, attention_mask = _hand_spans()
    monkeypatch.setattr(position_grafting, "POSITION_CONFIGS", dict(POSITION_CONFIGS))
    position_grafting.register_position_config("BOS", lambda spans, mask: mask.bool() & False)
    assert not config_positions("BOS", spans, attention_mask).any()
    with pytest.raises(GraftingLensError, match="overwrite=True"):
        position_grafting.register_position_config("FE", lambda spans, mask: mask.bool())
    # A configuration that selects padding is caught, not silently grafted.
    position_grafting.register_position_config(
        "ALL", lambda spans, mask: torch.ones_like(mask).bool()
    )
    with pytest.raises(GraftingLensError, match="padding"):
        config_positions("ALL", spans, attention_mask)


@pytest.fixture(scope="module")
def llama_set():
    tokenizer = make_tokenizer()
    models = gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer)
    relations = data.make_relations("fake_movies_real_actors", n=5, seed=0)
    # QA prompts of different lengths give a padded batch.
    tokenized = data.tokenize_examples(data.make_examples(relations, prompt="qa"), tokenizer)
    assert tokenized.attention_mask.sum(1).unique().numel() > 1
    return models, tokenized


def _expected_scores(logits, tokenized):
    final = last_token_logits(logits, tokenized.attention_mask)
    return target_rank(final, tokenized.target_ids), target_probability(final, tokenized.target_ids)


def test_default_components_leave_out_the_unembedding(llama_set):
    models, _ = llama_set
    assert "unembed" not in position_grafting_components(models)
    assert "embed" in position_grafting_components(models)
    assert "unembed" in position_grafting_components(models, include_unembed=True)
    assert "embed" not in position_grafting_components(models, include_embeddings=False)


def test_stacked_mask_equals_the_cat_of_one_mask_per_config(llama_set):
    models, tokenized = llama_set
    spans, attention_mask = tokenized.spans, tokenized.attention_mask
    stacked = position_grafting_masks(models, spans, attention_mask)
    one_by_one = gl.GraftMask.cat(
        [
            gl.GraftMask.build(
                models,
                tokenized.tokens,
                positions=config_positions(name, spans, attention_mask),
                components=position_grafting_components(models),
                attention_mask=attention_mask,
            )
            for name in PAPER_LABELS
        ]
    )
    assert stacked == one_by_one
    assert ("unembed", None) not in stacked and ("embed", None) in stacked


def test_pre_rows_are_the_base_and_sft_rows_the_donor(llama_set):
    models, tokenized = llama_set
    with torch.inference_mode():
        base = models.base(tokenized.tokens, attention_mask=tokenized.attention_mask)
        donor, cache = models[1].run_with_cache(
            tokenized.tokens, attention_mask=tokenized.attention_mask
        )
        # The clean default: donor computes everything, the base's unembedding predicts.
        donor_through_base_unembed = models.base.unembed(cache["ln_final.hook_out"])
    for semantics, sft_logits in (
        ("clean+unembed=donor", donor),
        ("clean", donor_through_base_unembed),
        ("clean+sft=donor", donor),
    ):
        results = run_position_grafting(
            models, tokenized, configs=["PRE", "SFT"], semantics=semantics, progress=False
        )
        for config, logits in (("PRE", base), ("SFT", sft_logits)):
            rows = results[results.config == config]
            ranks, probabilities = _expected_scores(logits, tokenized)
            assert rows.target_rank.tolist() == ranks.tolist(), (config, semantics)
            assert rows.target_prob.to_numpy() == pytest.approx(
                probabilities.numpy(), rel=1e-4, abs=1e-7
            )
            assert rows.top5.tolist() == (ranks < 5).tolist()
    # The test means something only if the base and donor disagree.
    assert not torch.equal(
        _expected_scores(base, tokenized)[0], _expected_scores(donor, tokenized)[0]
    )


def test_batching_configurations_matches_running_each_alone(llama_set):
    models, tokenized = llama_set
    # The batch is tokenized as tokenize_examples does by default: the clean reading's rules.
    batched = run_position_grafting(
        models, tokenized, batch_size=2, semantics="clean", progress=False
    )
    assert list(batched.columns[:6]) == [
        "example",
        "relation_id",
        "prompt",
        "direction",
        "text",
        "config",
    ]
    assert len(batched) == len(PAPER_LABELS) * len(tokenized)
    assert list(dict.fromkeys(batched.config)) == PAPER_LABELS
    assert batched.topk_tokens.map(len).eq(10).all()
    for name in PAPER_LABELS:
        alone = run_position_grafting(
            models,
            tokenized,
            configs=[name],
            batch_size=len(tokenized),
            semantics="clean",
            progress=False,
        )
        rows = batched[batched.config == name].reset_index(drop=True)
        assert rows.target_rank.tolist() == alone.target_rank.tolist(), name
        assert rows.target_prob.to_numpy() == pytest.approx(
            alone.target_prob.to_numpy(), rel=1e-4, abs=1e-7
        )
        assert rows.topk_ids.tolist() == alone.topk_ids.tolist(), name
    # Grafting changes the prediction: not every configuration scores like PRE.
    by_config = batched.groupby("config", sort=False).target_prob.apply(tuple)
    assert len(set(by_config)) > 2


def test_run_position_grafting_rejects_unknown_configs(llama_set):
    models, tokenized = llama_set
    with pytest.raises(
        GraftingLensError, match=r"Unknown position-grafting configuration 'XX'.*Known: PRE"
    ):
        run_position_grafting(models, tokenized, configs=["PRE", "XX"], progress=False)
    with pytest.raises(GraftingLensError, match="batch_size"):
        run_position_grafting(models, tokenized, batch_size=0, progress=False)
    with pytest.raises(GraftingLensError, match="tokenize_examples"):
        run_position_grafting(models, object(), progress=False)
