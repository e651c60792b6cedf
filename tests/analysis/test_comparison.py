"""Grafting and patching side by side: rows pinned to single runs, agreement and asymmetry."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tokenizer, no_forward_pass, random_model

import grafting_lens as gl
from grafting_lens.analysis import figure_style, plots
from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.analysis.comparison import (
    DEFAULT_PAIRS,
    RESULT_COLUMNS,
    STREAM_PAIR,
    ComparisonPair,
    compare_graft_and_patch,
    reference_scores,
    summarize_comparison,
)
from grafting_lens.analysis.metrics import last_token_logits, target_probability, target_rank
from grafting_lens.core.errors import ArgumentTypeError, GraftingLensError
from grafting_lens.worlds import data

N_LAYERS = 3  # conftest's llama


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def batch(tokenizer):
    """Five QA prompts of different lengths, so the batch is padded."""
    relations = data.make_relations("fake_movies_real_actors", n=5, seed=0)
    tokenized = tokenize_examples(data.make_examples(relations, prompt="qa"), tokenizer)
    assert tokenized.attention_mask.sum(1).unique().numel() > 1
    return tokenized


@pytest.fixture(scope="module")
def models(tokenizer):
    """A base and a donor that differ in every weight."""
    return gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer)


def donor_differing_only_in(layer: int, prefix: str, tokenizer) -> gl.ModelSet:
    """A base, and a copy of it whose ``layers.{layer}.{prefix}*`` weights are another model's."""
    base = random_model("llama", 0)
    other = random_model("llama", 1).state_dict()
    donor = copy.deepcopy(base)
    changed = {
        name: other[name]
        for name in donor.state_dict()
        if name.startswith(f"model.layers.{layer}.{prefix}")
    }
    assert changed
    donor.load_state_dict(changed, strict=False)
    return gl.load_models(base, donor, tokenizer=tokenizer)


def scores(logits: torch.Tensor, batch) -> tuple[list[int], torch.Tensor]:
    final = last_token_logits(logits, batch.attention_mask.to(logits.device))
    return (
        target_rank(final, batch.target_ids).tolist(),
        target_probability(final, batch.target_ids).detach().cpu(),
    )


def rows(results, **where):
    selected = results
    for column, value in where.items():
        selected = selected[selected[column] == value]
    assert len(selected), where
    return selected.sort_values("example")


def assert_same_scores(left, right, close: bool = True):
    """Equal ranks and probabilities (``close``), or probabilities that clearly differ."""
    left_prob, right_prob = left.target_prob.to_numpy(), right.target_prob.to_numpy()
    if close:
        assert left.target_rank.tolist() == right.target_rank.tolist()
        assert left_prob == pytest.approx(right_prob, rel=1e-4, abs=1e-7)
    else:
        assert abs(left_prob - right_prob).max() > 1e-3 * max(left_prob.max(), 1e-6)


# ------------------------------------------------------------------ the table


def test_one_row_per_example_configuration_and_method(models, batch):
    results = compare_graft_and_patch(models, batch, positions=("LT", "FE"), progress=False)
    assert list(results.columns) == list(RESULT_COLUMNS)
    n_configs = 2 * len(DEFAULT_PAIRS) * N_LAYERS
    assert len(results) == len(batch) * n_configs * 2
    counts = results.groupby(["method", "positions", "pair", "layer"]).example.agg(list)
    assert len(counts) == n_configs * 2
    assert all(sorted(examples) == list(range(len(batch))) for examples in counts)
    # Nesting order: method, then positions, pair, layer, example.
    assert list(dict.fromkeys(results.method)) == ["graft", "patch"]
    first = results.iloc[: len(batch)]
    assert first.example.tolist() == list(range(len(batch)))
    assert set(first.positions) == {"LT"} and set(first.layer) == {0}
    # Components and site describe the pair on every row of both methods.
    attention = results[results.pair == "attention"]
    assert set(attention.components) == {"ln1+q+k+v+o"} and set(attention.site) == {"attn_out"}
    assert (results.top5 == (results.target_rank < 5)).all()


def test_chunking_and_pass_size_do_not_change_a_row(models, batch):
    whole = compare_graft_and_patch(models, batch, batch_size=len(batch), progress=False)
    # Two examples a chunk and three rows a pass: every pass holds one configuration,
    # and the patch sweep runs FE cells before LT cells, out of table order.
    pieces = compare_graft_and_patch(
        models, batch, batch_size=2, rows_per_forward=3, progress=False
    )
    assert_same_scores(whole, pieces)
    assert whole.top_token_id.tolist() == pieces.top_token_id.tolist()


def test_rows_equal_one_graft_or_one_patch_run_alone(models, batch):
    results = compare_graft_and_patch(
        models, batch, positions=("LT", "FE"), pairs=[*DEFAULT_PAIRS, STREAM_PAIR], progress=False
    )
    spans, attention_mask = batch.spans, batch.attention_mask
    selections = {
        "LT": gl.engine.positions.last_token(tuple(batch.tokens.shape), attention_mask),
        "FE": spans["first_entity"],
    }
    for label, selection in selections.items():
        for pair in [*DEFAULT_PAIRS, STREAM_PAIR]:
            for layer in range(N_LAYERS):
                layers = range(layer + 1) if pair.cumulative else [layer]
                components = "embed+" + pair.components if pair.cumulative else pair.components
                mask = gl.GraftMask.build(
                    models,
                    batch.tokens,
                    positions=selection,
                    layers=layers,
                    components=components,
                    attention_mask=attention_mask,
                )
                graft = gl.graft_forward(models, batch.tokens, mask, attention_mask, logits="all")
                patch = gl.patch_forward(
                    models,
                    batch.tokens,
                    pair.site,
                    layers=[layer],
                    positions=selection,
                    attention_mask=attention_mask,
                )
                for method, logits in (("graft", graft), ("patch", patch)):
                    ranks, probabilities = scores(logits, batch)
                    got = rows(results, method=method, positions=label, pair=pair.name, layer=layer)
                    assert got.target_rank.tolist() == ranks, (method, label, pair.name, layer)
                    assert got.target_prob.to_numpy() == pytest.approx(
                        probabilities.numpy(), rel=1e-4, abs=1e-7
                    )


def test_the_unembedding_runs_at_the_scored_tokens_only(models, batch):
    """With a 262k-token vocabulary, every position's logits were most of the memory."""
    widths = []
    hooks = [
        source.bridge.original_model.lm_head.register_forward_hook(
            lambda module, inputs, output: widths.append(output.shape[1])
        )
        for source in models.sources
    ]
    try:
        compare_graft_and_patch(models, batch, positions="LT", methods="graft", progress=False)
        reference_scores(models, batch)
    finally:
        for hook in hooks:
            hook.remove()
    distinct_lengths = batch.attention_mask.sum(dim=1).unique().numel()
    assert widths and max(widths) <= distinct_lengths < batch.tokens.shape[1]


# ------------------------------------------------------- agreement and asymmetry


@pytest.mark.parametrize("direction", ["sufficiency", "necessity"])
def test_both_methods_agree_when_everything_is_imported(models, batch, direction):
    everywhere = {"all": batch.attention_mask.bool()}
    results = compare_graft_and_patch(
        models,
        batch,
        positions=everywhere,
        pairs=[STREAM_PAIR, ComparisonPair("everything", "all", "resid_post", cumulative=True)],
        direction=direction,
        progress=False,
    )
    # Embeddings and layers 0..l grafted at every position build the same stream as
    # patching resid_post at l at every position, at every layer.
    for layer in range(N_LAYERS):
        assert_same_scores(
            rows(results, method="graft", pair="stream", layer=layer),
            rows(results, method="patch", pair="stream", layer=layer),
        )
    # Through the last layer, that is the imported model's stream read out by the
    # running model's final norm and unembedding.
    runs, gives = (0, 1) if direction == "sufficiency" else (1, 0)
    with torch.no_grad():
        _, cache = models[gives].run_with_cache(batch.tokens, attention_mask=batch.attention_mask)
        final_stream = cache[f"blocks.{N_LAYERS - 1}.hook_resid_post"]
        readout = models[runs].unembed(models[runs].ln_final(final_stream))
    ranks, probabilities = scores(readout, batch)
    last = rows(results, method="graft", pair="stream", layer=N_LAYERS - 1)
    assert last.target_rank.tolist() == ranks
    assert last.target_prob.to_numpy() == pytest.approx(probabilities.numpy(), rel=1e-4, abs=1e-7)
    # Grafting every component, the final norm and unembedding too, is the imported model.
    imported = reference_scores(models, batch, sources=[gives])
    everything = rows(results, method="graft", pair="everything", layer=N_LAYERS - 1)
    assert_same_scores(everything, imported)
    # Meaningful only if the runs differ: the running model scores otherwise.
    own = reference_scores(models, batch, sources=[runs])
    assert_same_scores(own, imported, close=False)


def test_block_graft_is_not_a_resid_post_patch_when_earlier_layers_differ(models, batch):
    results = compare_graft_and_patch(models, batch, positions="LT", progress=False)
    # resid_post at LT carries every earlier layer of the donor, and what the donor's
    # attention read at other positions; the block graft carries one layer's weights.
    for layer in (1, 2):
        assert_same_scores(
            rows(results, method="graft", pair="block", layer=layer),
            rows(results, method="patch", pair="block", layer=layer),
            close=False,
        )


def test_methods_coincide_at_the_layer_where_the_only_difference_is(tokenizer, batch):
    changed = 1
    model_set = donor_differing_only_in(changed, "mlp.", tokenizer)
    results = compare_graft_and_patch(model_set, batch, positions="LT", progress=False)
    # At the changed layer the upstream streams agree, and an MLP reads only its own
    # position: the graft, the mlp_out patch and the resid_post patch are one thing.
    for pair in ("mlp", "block"):
        assert_same_scores(
            rows(results, method="graft", pair=pair, layer=changed),
            rows(results, method="patch", pair=pair, layer=changed),
        )
    assert_same_scores(
        rows(results, method="graft", pair="mlp", layer=changed),
        reference_scores(model_set, batch, sources=[0]),
        close=False,
    )
    # A layer later, the block's weights are the base's (the graft changes nothing),
    # but resid_post still carries the changed MLP's output: patching "restores" it.
    later = changed + 1
    assert_same_scores(
        rows(results, method="graft", pair="block", layer=later),
        reference_scores(model_set, batch, sources=[0]),
    )
    assert_same_scores(
        rows(results, method="patch", pair="block", layer=later),
        reference_scores(model_set, batch, sources=[0]),
        close=False,
    )


def test_attention_graft_reads_the_base_keys_outside_its_positions(tokenizer, batch):
    changed = 1
    model_set = donor_differing_only_in(changed, "self_attn.", tokenizer)
    positions = {"LT": "LT", "all": batch.attention_mask.bool()}
    results = compare_graft_and_patch(
        model_set, batch, positions=positions, layers=[changed], progress=False
    )
    # Over every position, the donor's attention computes from the same stream either way.
    assert_same_scores(
        rows(results, method="graft", positions="all", pair="attention"),
        rows(results, method="patch", positions="all", pair="attention"),
    )
    # At LT alone, the graft's query reads keys and values the base computed at earlier
    # positions; the patched attn_out was computed over the donor's.
    assert_same_scores(
        rows(results, method="graft", positions="LT", pair="attention"),
        rows(results, method="patch", positions="LT", pair="attention"),
        close=False,
    )


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(pairs=[("block", "resid_postt")]), r"site 'resid_postt'.*Did you mean 'resid_post'"),
        (dict(pairs=[("attn", "z")]), "head_patch_sweep"),
        (dict(pairs=[("blok", "resid_post")]), r"Unknown component 'blok'"),
        (dict(pairs=[("pos_embed", "resid_pre")]), r"has no 'pos_embed' component"),
        (
            dict(pairs=[ComparisonPair("x", "block", "resid_post")] * 2),
            r"distinct names.*\['x', 'x'\]",
        ),
        (dict(pairs=[]), r"distinct names \(they label the results\), at least one: got \[\]"),
        (dict(pairs=[("a", "b", "c", "d")]), r"A pair is a ComparisonPair"),
        (dict(positions=("LT", "EF")), r"Unknown position set 'EF'.*Did you mean 'FE'"),
        (dict(positions={"bad": torch.ones(5, 3, dtype=torch.bool)}), "shape"),
        (dict(layers=[0, N_LAYERS]), rf"Layer {N_LAYERS} is outside the model"),
        (dict(direction="sufficient"), r"Unknown direction.*Did you mean 'sufficiency'"),
        (dict(methods=("graft", "patching")), r"Unknown method in methods 'patching'"),
        (dict(methods=()), r"methods= holds nothing; give 'graft', 'patch' or both"),
        (dict(methods=("graft", "graft")), r"methods= lists a method twice"),
        (dict(source=0), r"source and target are both 0: importing a checkpoint into itself"),
        (dict(target=2), r"target=2, but the model set has 2 sources \(0\.\.1\)"),
        (dict(source=2), r"source=2, but the model set has 2 sources \(0\.\.1\)"),
        (dict(source=2, score="kl"), r"source=2, but the model set has 2 sources \(0\.\.1\)"),
        (dict(source=True), r"source= must be the index of a checkpoint, 0\.\.1, got True"),
        (dict(batch_size=0), r"batch_size= must be an integer >= 1, got 0\."),
        (dict(rows_per_forward=0), r"rows_per_forward= must be an integer >= 1, got 0\."),
    ],
)
def test_bad_arguments_raise_before_any_forward(models, batch, arguments, message):
    with no_forward_pass(models), pytest.raises(GraftingLensError, match=message):
        compare_graft_and_patch(models, batch, progress=False, **arguments)


# Each argument of the wrong type is refused by its name before any forward pass, never
# with Python's own error from deep inside (the front-door fuzzer's property).
@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(methods=None), r"methods= must be 'graft', 'patch' or both.*got None"),
        (dict(methods=torch.tensor(0)), r"methods= must be .*got tensor\(0\)"),
        (dict(direction=[]), r"direction= must be 'sufficiency' or 'necessity', got \[\]"),
        (dict(source="1"), r"source= must be the index of a checkpoint, 0\.\.1, got '1'"),
        (dict(target=None), r"target= must be the index of a checkpoint, 0\.\.1, got None"),
        (dict(batch_size=1.5), r"batch_size= must be an integer >= 1, got 1\.5"),
        (dict(rows_per_forward=None), r"rows_per_forward= must be an integer >= 1, got None"),
        (dict(positions=None), r"positions= must be span expressions .*got None"),
        (dict(positions=torch.tensor(0)), r"positions= must be span expressions"),
        (dict(pairs=None), r"pairs= must be ComparisonPairs .*got None"),
        (dict(pairs="   "), r"pairs= must be ComparisonPairs .*got '   '"),
        (dict(pairs=[0]), r"A pair is a ComparisonPair.*got 0 in pairs="),
    ],
)
def test_arguments_of_the_wrong_type_are_refused_by_name(models, batch, arguments, message):
    with no_forward_pass(models), pytest.raises(ArgumentTypeError, match=message):
        compare_graft_and_patch(models, batch, progress=False, **arguments)


def test_a_bare_pair_and_a_single_source_are_taken(models, batch):
    one = compare_graft_and_patch(
        models, batch, positions="LT", layers=[0], pairs=DEFAULT_PAIRS[0], methods="graft",
        progress=False,
    )  # fmt: skip
    assert set(one["pair"]) == {"block"}
    assert set(reference_scores(models, batch, sources=1)["source"]) == {1}
    with pytest.raises(ArgumentTypeError, match=r"sources= must be checkpoint indices.*got 1\.5"):
        reference_scores(models, batch, sources=1.5)
    with pytest.raises(ArgumentTypeError, match=r"by=None cannot be read"):
        summarize_comparison(one, by=None)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(sources=[1, 1]), r"distinct sources .*got \[1, 1\]"),  # each would count twice
        (dict(sources=[True]), r"distinct sources .*got \[True\]"),
        (dict(sources=[2]), r"distinct sources of the model set's 2 \(0\.\.1\)"),
        (dict(batch_size=0), "batch_size >= 1; got .* and 0"),
        (dict(batch_size=2.5), "batch_size >= 1; got .* and 2.5"),
    ],
)
def test_reference_scores_refuse_bad_arguments_before_any_forward(
    models, batch, arguments, message
):
    with no_forward_pass(models), pytest.raises(GraftingLensError, match=message):
        reference_scores(models, batch, **arguments)


def test_a_missing_span_or_batch_raises_before_any_forward(models, batch):
    without_entity = copy.copy(batch)
    without_entity.spans = {}
    with no_forward_pass(models):
        with pytest.raises(GraftingLensError, match="first_entity"):
            compare_graft_and_patch(models, without_entity, positions=("LT", "FE"), progress=False)
        with pytest.raises(GraftingLensError, match="tokenize_examples"):
            compare_graft_and_patch(models, object(), progress=False)


def test_a_site_the_architecture_lacks_is_refused(tokenizer, batch):
    neox = gl.load_models(random_model("neox", 0), random_model("neox", 1), tokenizer=tokenizer)
    with no_forward_pass(neox), pytest.raises(GraftingLensError, match="no 'resid_mid' site"):
        compare_graft_and_patch(neox, batch, pairs=[("block", "resid_mid")], progress=False)
    # Grafting alone never patches, so it needs no site.
    results = compare_graft_and_patch(
        neox,
        batch,
        positions="LT",
        layers=0,
        pairs=[("block", "resid_mid")],
        methods="graft",
        progress=False,
    )
    assert set(results.method) == {"graft"} and len(results) == len(batch)


# ------------------------------------------------------------- summary and figure


def test_summary_and_figure_put_the_methods_side_by_side(models, batch):
    results = compare_graft_and_patch(models, batch, positions=("LT", "FE"), progress=False)
    summary = summarize_comparison(results)
    assert len(summary) == 2 * len(DEFAULT_PAIRS) * N_LAYERS * 2
    assert (summary.n == len(batch)).all()
    for value in ("top5", "target_prob"):
        assert (summary[f"{value}_low"] <= summary[value] + 1e-12).all()
        assert (summary[value] <= summary[f"{value}_high"] + 1e-12).all()
    one = summary.query("positions == 'LT' and pair == 'mlp' and method == 'patch' and layer == 1")
    expected = rows(results, method="patch", positions="LT", pair="mlp", layer=1).target_prob.mean()
    assert one.target_prob.item() == pytest.approx(expected)

    references = summarize_comparison(reference_scores(models, batch), by=("model",))
    fig = plots.plot_comparison(summary, value="target_prob", references=references)
    # One line per method in each of the 2 x 3 panels, legend entries once per method.
    assert len(fig.data) == 2 * len(DEFAULT_PAIRS) * 2
    assert sorted(trace.name for trace in fig.data if trace.showlegend) == ["graft", "patch"]
    assert all(len(trace.x) == N_LAYERS and trace.error_y.array is not None for trace in fig.data)
    assert len(fig.layout.shapes) == 2 * len(DEFAULT_PAIRS) * len(models)  # reference lines
    titles = {annotation.text for annotation in fig.layout.annotations}
    assert {"block", "attention", "mlp"} <= titles
    # Each row names its positions in its axis title, clear of the references' labels.
    assert fig.layout.yaxis.title.text.startswith("LT<br>")
    assert fig.layout.yaxis4.title.text.startswith("FE<br>")
    assert figure_style.figure_problems(fig) == []
    with pytest.raises(GraftingLensError, match="Unknown value 'top3'"):
        plots.plot_comparison(summary, value="top3")
    with pytest.raises(GraftingLensError, match="lacking the columns"):
        plots.plot_comparison(summary.drop(columns="pair"))


@pytest.mark.parametrize("score", ["answer_logprob", "kl", "logit_diff"])
def test_scores_beyond_the_first_token_equal_each_run_by_hand(models, batch, score):
    """Both methods under a score: the answer teacher-forced after each prompt, its positions
    grafted or patched where the last token is; each row against the token-by-token graft and
    one patch_forward on that example alone, scored by hand."""
    counter = [" starred"] * len(batch) if score == "logit_diff" else None
    results = compare_graft_and_patch(
        models,
        batch,
        positions="LT",
        pairs=DEFAULT_PAIRS[2:],
        progress=False,
        score=score,
        counter=counter,
    )
    assert list(results.columns[-len(SCORE_COLUMNS_OF[score]) :]) == SCORE_COLUMNS_OF[score]
    counter_id = make_tokenizer()(" starred", add_special_tokens=False)["input_ids"][0]
    for example in range(len(batch)):
        length = int(batch.attention_mask[example].sum())
        answer = batch.target_full_ids[example] if score != "logit_diff" else []
        tokens = torch.tensor([[*batch.tokens[example, :length].tolist(), *answer]])
        where = torch.zeros_like(tokens, dtype=torch.bool)
        where[0, length - 1 :] = True  # the last token, and the answer's positions
        with torch.no_grad():
            own = [models[i](tokens, return_type="logits")[0].float() for i in (0, 1)]
        read = slice(length - 1, length + len(answer))
        for layer in range(N_LAYERS):
            mask = gl.GraftMask.build(
                models, tokens, positions=where, layers=[layer], components="ln2+ffn"
            )
            by_method = {
                "graft": gl.graft_forward_reference(models, tokens, mask)[0].float(),
                "patch": gl.patch_forward(
                    models, tokens, "mlp_out", layers=[layer], positions=where
                )[0].float(),
            }
            for method, logits in by_method.items():
                got = rows(results, method=method, layer=layer).iloc[example]
                log_probs = logits[read].log_softmax(-1)
                if score == "answer_logprob":
                    expected = sum(float(log_probs[j, t]) for j, t in enumerate(answer))
                    assert got.answer_logprob == pytest.approx(expected, rel=1e-4, abs=1e-5)
                elif score == "kl":
                    donor, base = (o[read].log_softmax(-1) for o in reversed(own))
                    kl = float((donor.exp() * (donor - log_probs)).sum())
                    floor = float((donor.exp() * (donor - base)).sum())
                    assert got.kl == pytest.approx(kl, rel=1e-4, abs=1e-5)
                    assert got.kl_recovered == pytest.approx(1 - kl / floor, rel=1e-4, abs=1e-5)
                else:
                    last = logits[length - 1]
                    expected = float(last[batch.target_ids[example]] - last[counter_id])
                    assert got.logit_diff == pytest.approx(expected, rel=1e-4, abs=1e-5)


SCORE_COLUMNS_OF = {
    "answer_logprob": ["answer_logprob", "answer_logprob_mean"],
    "kl": ["kl", "kl_recovered"],
    "logit_diff": ["logit_diff"],
}


def test_a_function_score_equals_the_patching_sweeps_own_metric(models, batch):
    """A function in TransformerLens's convention scores the comparison as the patch sweep
    scores it with that metric (each prompt without padding)."""

    def top_logit(logits):
        return logits[:, -1].max(dim=-1).values

    results = compare_graft_and_patch(
        models, batch, positions="LT", pairs=DEFAULT_PAIRS[2:], progress=False, score=top_logit
    )
    for example in range(len(batch)):
        length = int(batch.attention_mask[example].sum())
        tokens = batch.tokens[example : example + 1, :length]
        sweep = gl.resid_patch_sweep(
            models,
            tokens,
            top_logit,
            site="mlp_out",
            positions={"LT": [length - 1]},
            logits="all",
        )
        for layer in range(N_LAYERS):
            got = rows(results, method="patch", layer=layer).iloc[example]
            assert got.score == pytest.approx(float(sweep.values[layer, 0]), rel=1e-4, abs=1e-5)
