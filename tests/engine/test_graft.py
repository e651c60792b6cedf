"""The single pass against the token-by-token oracle, and the grafting context."""

from __future__ import annotations

import inspect
import re
import weakref
from importlib.metadata import version

import pytest
import torch
from conftest import no_forward_pass, random_mask, random_model, random_tokens, tiny_config
from transformers import AutoModelForCausalLM, OpenAIGPTConfig

import grafting_lens as gl

TOLERANCE = 1e-4


def test_single_pass_equals_token_by_token_oracle(three_models):
    tokens = random_tokens(3, 9, seed=1)
    mask = random_mask(three_models, tokens.shape, seed=2)
    fast = gl.graft_forward(three_models, tokens, mask, logits="all")
    slow = gl.graft_forward_reference(three_models, tokens, mask)
    assert (fast - slow).abs().max() <= TOLERANCE
    # The comparison means something only if grafting moved the logits a lot.
    assert (fast - three_models.base(tokens)).abs().max() > 1.0


@pytest.mark.parametrize("padded", [False, True])
def test_a_mask_of_spans_grafted_by_slices_equals_the_oracle(three_models, padded, monkeypatch):
    """The paper's spans (an entity, the last token) form runs, grafted by slices."""
    # Slices for these short runs too (by default, runs under MIN_RUN_ROWS rows go by index).
    monkeypatch.setattr(gl.engine.routing, "MIN_RUN_ROWS", 1)
    tokens = random_tokens(3, 8, seed=21)
    attention_mask = (torch.arange(8)[None, :] < torch.tensor([8, 6, 7])[:, None]).long()
    attention_mask = attention_mask if padded else None
    options = dict(layers=[0, 2], attention_mask=attention_mask)
    mask = gl.GraftMask.union(
        gl.GraftMask.build(three_models, tokens, positions=[2, 3], source=1, **options),
        gl.GraftMask.build(three_models, tokens, positions="last", source=2, **options),
    )
    state = gl.engine.routing.GraftState(mask)
    assert {state.plan(key).path for key in mask.keys()} == {"slices"}
    fast = gl.graft_forward(three_models, tokens, mask, attention_mask=attention_mask, logits="all")
    slow = gl.graft_forward_reference(three_models, tokens, mask, attention_mask=attention_mask)
    real = torch.ones(3, 8, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    assert (fast - slow)[real].abs().max() <= TOLERANCE
    assert (fast - three_models.base(tokens))[real].abs().max() > 1.0


def test_right_padded_batch_equals_oracle_and_unpadded_rows(three_models):
    tokens = random_tokens(3, 8, seed=3)
    lengths = [8, 5, 3]
    attention_mask = (torch.arange(8)[None, :] < torch.tensor(lengths)[:, None]).long()
    noisy = random_mask(three_models, tokens.shape, seed=4)
    # A mask never grafts padding (the run refuses one that does).
    mask = gl.GraftMask.from_dict(
        three_models,
        {key: noisy[key] * attention_mask for key in noisy.keys()},
        attention_mask=attention_mask,
    )
    fast = gl.graft_forward(three_models, tokens, mask, attention_mask=attention_mask, logits="all")
    slow = gl.graft_forward_reference(three_models, tokens, mask, attention_mask=attention_mask)
    for row, length in enumerate(lengths):
        assert (fast[row, :length] - slow[row, :length]).abs().max() <= TOLERANCE
        assert torch.isnan(slow[row, length:]).all()
        row_mask = gl.GraftMask.from_dict(
            three_models, {key: mask[key][row : row + 1, :length] for key in mask.keys()}
        )
        alone = gl.graft_forward(
            three_models, tokens[row : row + 1, :length], row_mask, logits="all"
        )
        assert (fast[row, :length] - alone[0]).abs().max() <= TOLERANCE


def test_logits_last_is_the_oracles_last_token_in_a_padded_batch(three_models):
    tokens = random_tokens(4, 8, seed=5)
    lengths = [8, 5, 3, 5]  # two rows share a last position
    attention_mask = (torch.arange(8)[None, :] < torch.tensor(lengths)[:, None]).long()
    noisy = random_mask(three_models, tokens.shape, seed=6)
    # With the unembedding grafted (every position's stream is needed) and without it
    # (the unembedding runs at the last positions only).
    for unembed in (1, 0):
        mask = gl.GraftMask.from_dict(
            three_models,
            {
                key: noisy[key] * attention_mask * (unembed if key[0] == "unembed" else 1)
                for key in noisy.keys()
            },
            attention_mask=attention_mask,
        )
        last = gl.graft_forward(three_models, tokens, mask, attention_mask=attention_mask)
        slow = gl.graft_forward_reference(three_models, tokens, mask, attention_mask=attention_mask)
        assert last.shape == (4, 1, slow.shape[-1])
        for row, length in enumerate(lengths):
            assert (last[row, 0] - slow[row, length - 1]).abs().max() <= TOLERANCE
    unpadded = gl.GraftMask.from_dict(three_models, {key: noisy[key] for key in noisy.keys()})
    full = gl.graft_forward(three_models, tokens, unpadded, logits="all")
    last = gl.graft_forward(three_models, tokens, unpadded, logits="last")
    assert (last[:, 0] - full[:, -1]).abs().max() <= 1e-5


def test_logits_at_named_positions_are_the_oracles_there(three_models):
    """logits=[batch, k] positions (what a score reads: the last token and an answer's): the
    unembedding runs there alone, grafted or not, and equals the oracle at each."""
    tokens = random_tokens(3, 7, seed=26)
    lengths = torch.tensor([7, 4, 6])
    attention_mask = (torch.arange(7)[None, :] < lengths[:, None]).long()
    noisy = random_mask(three_models, tokens.shape, seed=27)
    mask = gl.GraftMask.from_dict(
        three_models,
        {k: noisy[k] * attention_mask for k in noisy.keys()},
        attention_mask=attention_mask,
    )
    read = torch.tensor([[6, 2, 0], [3, 3, 1], [5, 4, 2]])
    some = gl.graft_forward(three_models, tokens, mask, attention_mask=attention_mask, logits=read)
    slow = gl.graft_forward_reference(three_models, tokens, mask, attention_mask=attention_mask)
    assert some.shape == (3, 3, slow.shape[-1])
    assert (some - slow[torch.arange(3)[:, None], read]).abs().max() <= TOLERANCE
    padding = read.clone()
    padding[1, 0] = 5  # row 1 holds 4 real tokens
    with pytest.raises(gl.errors.GraftingError, match="past a row's last real token"):
        gl.graft_forward(three_models, tokens, mask, attention_mask=attention_mask, logits=padding)


def test_a_grafted_unembedding_runs_on_the_scored_positions_alone(three_models):
    """logits="last" cuts the final stream to each row's last real token before the
    unembedding, also where the unembedding is grafted (its plan takes those positions)."""
    tokens = random_tokens(3, 7, seed=24)
    lengths = torch.tensor([7, 4, 2])
    attention_mask = (torch.arange(7)[None, :] < lengths[:, None]).long()
    noisy = random_mask(three_models, tokens.shape, seed=25)
    entries = {key: noisy[key] * attention_mask for key in noisy.keys()}
    unembed = torch.zeros(3, 7, dtype=torch.long)
    unembed[0, 6], unembed[1, 3], unembed[1, 0] = 1, 2, 1  # rows' last tokens: 1, 2 and 0
    entries[("unembed", None)] = unembed
    mask = gl.GraftMask.from_dict(three_models, entries, attention_mask=attention_mask)
    hook_in = three_models.slots("unembed", None)[0].holder(three_models.base).hook_in
    seen = []
    handle = hook_in.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    try:
        last = gl.graft_forward(three_models, tokens, mask, attention_mask=attention_mask)
    finally:
        handle.remove()
    assert seen == [(3, 1, three_models.base.cfg.d_model)]
    full = gl.graft_forward(three_models, tokens, mask, attention_mask=attention_mask, logits="all")
    assert (last[:, 0] - full[torch.arange(3), lengths - 1]).abs().max() <= 1e-5
    # The graft moved the scored logits: the rows' own sources computed them.
    base = three_models.base(tokens, attention_mask=attention_mask)[torch.arange(3), lengths - 1]
    assert (last[:2, 0] - base[:2]).abs().amax(dim=-1).min() > 1e-2


def test_empty_mask_is_the_base_and_full_mask_is_the_donor(three_models):
    tokens = random_tokens(2, 7, seed=5)
    empty = gl.GraftMask.from_dict(three_models, {}, shape=tokens.shape)
    grafted = gl.graft_forward(three_models, tokens, empty, logits="all")
    assert torch.equal(grafted, three_models.base(tokens))
    for source in (1, 2):
        full = gl.GraftMask.build(three_models, tokens, components="all", source=source)
        grafted = gl.graft_forward(three_models, tokens, full, logits="all")
        assert (grafted - three_models[source](tokens)).abs().max() <= 1e-5


def test_graft_at_position_t_leaves_earlier_positions_untouched(three_models):
    tokens = random_tokens(2, 8, seed=6)
    t = 4
    base = three_models.base(tokens)
    mask = gl.GraftMask.union(
        gl.GraftMask.build(three_models, tokens, positions=[t], components="attn+ln1", source=2),
        gl.GraftMask.build(three_models, tokens, positions=[t, 6], components="ffn+o", source=1),
    )
    grafted = gl.graft_forward(three_models, tokens, mask, logits="all")
    # Equal to float32 rounding: the split slots' base rows may run on another kernel
    # (grafting_lens.engine.products); the graft's own effect is a hundred times larger.
    assert (grafted[:, :t] - base[:, :t]).abs().max() <= 1e-4
    assert (grafted[:, t:] - base[:, t:]).abs().amax(dim=-1).min() > 1e-2


def test_run_with_cache_inside_grafting_sees_the_grafted_run(three_models):
    tokens = random_tokens(2, 6, seed=7)
    t = 2
    # Everything up to layer 0's Q at position t comes from the donor, so layer 0's
    # queries at t are the donor's own; every other position keeps the base's.
    mask = gl.GraftMask.build(three_models, tokens, positions=[t], components="all", source=1)
    # Without autograd, as graft_forward runs: both then take the same kernels.
    with gl.grafting(three_models, mask) as model, torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
    assert torch.equal(logits, gl.graft_forward(three_models, tokens, mask, logits="all"))
    _, base_cache = three_models.base.run_with_cache(tokens)
    _, donor_cache = three_models[1].run_with_cache(tokens)
    q, base_q, donor_q = (c["blocks.0.attn.hook_q"] for c in (cache, base_cache, donor_cache))
    assert torch.allclose(q[:, t], donor_q[:, t], atol=1e-5)
    assert torch.allclose(q[:, :t], base_q[:, :t], atol=1e-5)
    assert not torch.allclose(q[:, t], base_q[:, t], atol=1e-2)


def test_hooks_can_edit_a_grafted_run(three_models):
    tokens = random_tokens(1, 5, seed=8)
    mask = gl.GraftMask.build(three_models, tokens, positions="last", components="block", source=2)

    def zero_attention(activation, hook):
        return torch.zeros_like(activation)

    with gl.grafting(three_models, mask) as model:
        edited = model.run_with_hooks(
            tokens, fwd_hooks=[("blocks.1.hook_attn_out", zero_attention)]
        )
    plain = gl.graft_forward(three_models, tokens, mask, logits="all")
    assert (edited - plain).abs().max() > 1e-2


def test_base_is_restored_when_the_body_raises(three_models):
    tokens = random_tokens(2, 5, seed=9)
    before = three_models.base(tokens)
    originals = {
        pair: three_models.slots(*pair)[0].module(three_models.base)
        for pair in [("q", 0), ("mlp_out", 2), ("embed", None), ("unembed", None)]
    }
    mask = gl.GraftMask.build(three_models, tokens, components="all", source=1)
    with pytest.raises(RuntimeError, match="inside"):
        with gl.grafting(three_models, mask):
            raise RuntimeError("inside")
    for pair, module in originals.items():
        assert three_models.slots(*pair)[0].module(three_models.base) is module
    assert torch.equal(three_models.base(tokens), before)


def test_grafting_blocks_do_not_nest(three_models):
    tokens = random_tokens(1, 4)
    mask = gl.GraftMask.build(three_models, tokens, components="o", source=1)
    disjoint = gl.GraftMask.build(three_models, tokens, components="mlp_out", source=2)
    with gl.grafting(three_models, mask):
        for inner in (mask, disjoint):
            with pytest.raises(gl.errors.GraftingError, match="do not nest"):
                with gl.grafting(three_models, inner):
                    pass
        with pytest.raises(gl.errors.GraftingError, match="do not nest"):
            gl.graft_forward_reference(three_models, tokens, disjoint)
    # Refusing the inner block left the outer one's graft, and then the base, intact.
    with gl.grafting(three_models, disjoint):
        pass


@pytest.mark.parametrize("components", ["q", "block", "ln1"])
def test_running_other_tokens_inside_grafting_is_an_error(three_models, components):
    """Whichever grafted module the run would reach first (a norm applies its own scale)."""
    mask = gl.GraftMask.build(three_models, (2, 6), positions=[1], components=components, source=1)
    with gl.grafting(three_models, mask) as model:
        with pytest.raises(gl.errors.GraftingError, match=r"\[batch, pos\] = \[2, 6\]"):
            model(random_tokens(2, 7))
        with pytest.raises(gl.errors.GraftingError, match=r"\[batch, pos\] = \[2, 6\]"):
            model.run_with_cache(random_tokens(3, 6))


def test_embed_graft_does_not_touch_a_tied_unembedding(three_models):
    """Grafting the embedding equals patching in the donor's embedding output."""
    tokens = random_tokens(2, 6, seed=10)
    mask = gl.GraftMask.build(three_models, tokens, components="embed", source=1)
    grafted = gl.graft_forward(three_models, tokens, mask, logits="all")
    _, donor_cache = three_models[1].run_with_cache(tokens)
    patched = three_models.base.run_with_hooks(
        tokens, fwd_hooks=[("hook_embed", lambda act, hook: donor_cache["hook_embed"])]
    )
    assert (grafted - patched).abs().max() <= 1e-5


def test_unembed_graft_applies_the_donor_unembedding_to_the_base_stream(three_models):
    tokens = random_tokens(2, 6, seed=11)
    mask = gl.GraftMask.build(three_models, tokens, components="unembed", source=2)
    grafted = gl.graft_forward(three_models, tokens, mask, logits="all")
    _, base_cache = three_models.base.run_with_cache(tokens)
    expected = three_models[2].unembed(base_cache["ln_final.hook_out"])
    assert (grafted - expected).abs().max() <= 1e-5


def test_generation_continues_over_the_mixed_origin_cache(three_models):
    tokens = random_tokens(2, 5, seed=12)
    mask = random_mask(three_models, tokens.shape, seed=13)
    new = 4
    generated = gl.graft_generate(three_models, tokens, mask, max_new_tokens=new)
    assert generated.shape == (2, 5 + new)
    assert torch.equal(generated[:, :5], tokens)
    # Greedy decoding by re-running the whole sequence in one grafted pass each step.
    sequence = tokens
    for _ in range(new):
        extended = mask.extend(sequence.shape[1] - tokens.shape[1])
        logits = gl.graft_forward(three_models, sequence, extended)
        sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, sequence)


def test_generation_with_new_tokens_from_one_source(three_models):
    tokens = random_tokens(1, 4, seed=14)
    mask = gl.GraftMask.build(three_models, tokens, positions="last", components="block", source=1)
    new = 3
    generated = gl.graft_generate(
        three_models, tokens, mask, max_new_tokens=new, new_token_sources=2
    )
    # Every component of every generated position comes from source 2.
    full = {
        pair: torch.cat([mask[pair], torch.full((1, new), 2)], dim=1) for pair in three_models.pairs
    }
    sequence = tokens
    for _ in range(new):
        length = sequence.shape[1]
        step_mask = gl.GraftMask.from_dict(
            three_models, {pair: value[:, :length] for pair, value in full.items()}
        )
        logits = gl.graft_forward(three_models, sequence, step_mask)
        sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, sequence)


def test_gradients_flow_through_a_grafted_run(three_models):
    tokens = random_tokens(2, 5, seed=16)
    mask = random_mask(three_models, tokens.shape, seed=17)
    stream = {}

    def keep(activation, hook):
        activation.retain_grad()
        stream["resid"] = activation
        return activation

    with gl.grafting(three_models, mask) as model:
        logits = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", keep)])
    logits[0, -1, 3].backward()
    gradient = stream["resid"].grad
    assert gradient is not None and gradient[0].abs().sum() > 0
    assert gradient[1].abs().sum() == 0  # rows do not interact


def test_two_backward_passes_in_one_grafting_block(three_models):
    tokens = random_tokens(1, 5, seed=18)
    mask = random_mask(three_models, tokens.shape, seed=19)
    with gl.grafting(three_models, mask) as model:
        first = model(tokens)[0, -1, 2]
        first.backward()
        second = model(tokens)[0, -1, 2]
        second.backward()
    assert torch.equal(first.detach(), second.detach())


# ------------------------------------------ a run and its mask agree on the real tokens


def _padded_batch():
    tokens = random_tokens(4, 6, seed=20)
    attention_mask = torch.ones_like(tokens)
    attention_mask[1:, 4:] = 0
    return tokens.masked_fill(attention_mask == 0, 0), attention_mask  # 0: the pad id


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_mask_built_with_the_runs_attention_mask_grafts_each_rows_last_token(three_models):
    tokens, attention_mask = _padded_batch()
    built = gl.GraftMask.build(
        three_models, tokens, positions="last", components="all", attention_mask=attention_mask
    )
    logits = gl.graft_forward(three_models, tokens, built, attention_mask=attention_mask)
    base = three_models.base(tokens, attention_mask=attention_mask)
    # Each row's real last token was grafted (a padding column would leave it the base's).
    moved = (logits[:, 0] - gl.analysis.metrics.last_token_logits(base, attention_mask)).abs()
    assert (moved.amax(dim=1) > 1.0).all()


def _other_rows(models):
    """A mask for the padded batch built from its shape alone: "last" is column 5."""
    tokens, attention_mask = _padded_batch()
    mask = gl.GraftMask.build(models, tuple(tokens.shape), positions="last")
    return dict(tokens=tokens, mask=mask, attention_mask=attention_mask)


def _grafting_padding(models):
    tokens, attention_mask = _padded_batch()
    column = torch.zeros(4, 6, dtype=torch.long)
    column[:, -1] = 1
    mask = gl.GraftMask.from_dict(models, {("o", 0): column})  # lengths unknown
    return dict(tokens=tokens, mask=mask, attention_mask=attention_mask)


def _run(tokens=None, mask=None, **options):
    """Arguments of a grafted run on (2, 5) tokens, with ``options`` in place of the defaults."""

    def arguments(models):
        given = random_tokens(2, 5, seed=21) if tokens is None else tokens
        built = gl.GraftMask.build(models, (2, 5), positions="last") if mask is None else mask
        return dict(tokens=given, mask=built(models) if callable(built) else built, **options)

    return arguments


ERRORS = gl.errors
RUN_REFUSALS = [  # (arguments, error, message) for graft_forward, its oracle and generation
    (_run(mask={("q", 0): torch.ones(2, 5)}), ERRORS.ArgumentTypeError, "mask must be a GraftMask"),
    (
        _run(tokens=random_tokens(2, 4)),
        ERRORS.GraftMaskError,
        r"\[2, 5\], the tokens have \[2, 4\]",
    ),
    (
        _run(mask=gl.GraftMask({("q", 0): torch.ones(2, 5, dtype=torch.long)}, (2, 5), 2)),
        ERRORS.GraftMaskError,
        "for the model set.s 3 sources, got one built for 2",
    ),
    (_run(tokens=random_tokens(2, 5) + 10_000), ERRORS.TokenError, "vocabulary"),
    (
        _run(tokens=random_tokens(2, 5).bool()),
        ERRORS.TokenError,
        "integer token ids, got torch.bool",
    ),
    (
        _run(attention_mask=torch.tensor([[0, 1, 1, 1, 1]] * 2)),
        ERRORS.SelectionError,
        "right padding",
    ),
    (
        _run(attention_mask=torch.full((2, 5), 2)),
        ERRORS.SelectionError,
        r"only 0 \(padding\) and 1",
    ),
    (_run(attention_mask=[[1] * 5] * 2), ERRORS.SelectionError, "attention_mask must be a"),
    (_run(attention_mask=torch.ones(2, 5, device="meta")), ERRORS.SelectionError, "on meta"),
    (
        lambda m: {**_other_rows(m), "attention_mask": None},
        ERRORS.SelectionError,
        "end in the pad token",
    ),
    (_other_rows, ERRORS.GraftMaskError, "row 1: 6 real tokens in the mask, 4 in the run"),
    (_grafting_padding, ERRORS.GraftMaskError, r"grafts \('o', 0\) at row 1, position 5"),
]
FORWARD_REFUSALS = [
    (
        _run(logits="first"),
        ERRORS.GraftingError,
        "logits must be 'last', 'all' or a \\[batch, k\\] tensor of positions",
    ),
    (_run(grad="yes"), ERRORS.ArgumentTypeError, "grad True or False"),
]


@pytest.mark.parametrize("family", ["llama"])
@pytest.mark.parametrize(
    ("run", "arguments", "error", "message"),
    [(gl.graft_forward, *case) for case in RUN_REFUSALS + FORWARD_REFUSALS]
    + [
        (run, *case)
        for run in (gl.graft_forward_reference, gl.graft_generate)
        for case in RUN_REFUSALS
    ],
)
def test_grafted_runs_refuse_at_the_door(three_models, run, arguments, error, message):
    given = arguments(three_models)
    with no_forward_pass(three_models), pytest.raises(error, match=message):
        run(three_models, **given)


@pytest.mark.parametrize("family", ["gpt2"])
def test_tokens_past_the_learned_positions_are_refused(three_models):
    tokens = random_tokens(1, 70)  # the GPT-2 test models embed 64 positions
    with no_forward_pass(three_models):
        with pytest.raises(
            gl.GraftingLensError, match="70 positions.*learned position embeddings for 64"
        ):
            gl.graft_forward(three_models, tokens, gl.GraftMask.build(three_models, tokens))


def _long_prompt(models):
    tokens = random_tokens(1, 78)  # rotary: 78 positions embed, but exceed n_ctx=64
    return dict(tokens=tokens, mask=gl.GraftMask.build(models, tokens), max_new_tokens=1)


@pytest.mark.parametrize("family", ["llama"])
@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (_run(max_new_tokens=bad), error, "max_new_tokens must be an int >= 1")
        for bad, error in [
            (2.5, ERRORS.GraftingError),
            (True, ERRORS.ArgumentTypeError),  # a bool counts nothing
            (0, ERRORS.GraftingError),
            ("3", ERRORS.ArgumentTypeError),
        ]
    ]
    + [
        # 10**9 new tokens would allocate until the process is killed.
        (
            _run(max_new_tokens=10**9),
            ERRORS.GraftingError,
            "context of 64 with the prompt's 5, got 1000000000: ask for 1..59 new tokens",
        ),
        (
            _long_prompt,
            ERRORS.GraftingError,
            r"prompt's 78, got 1: shorten the prompt to 63 tokens\.$",
        ),
        (
            _run(new_token_sources=True),
            ERRORS.ArgumentTypeError,
            "new_token_sources must be 'last'",
        ),
        (_run(new_token_sources=3), ERRORS.GraftingError, "a source index 0..2"),
        (
            _run(mask={("q", 0): torch.ones(2, 5)}),
            ERRORS.ArgumentTypeError,
            "mask must be a GraftMask",
        ),
    ],
)
def test_generation_refuses_at_the_door(three_models, arguments, error, message):
    given = arguments(three_models)
    with no_forward_pass(three_models), pytest.raises(error, match=message):
        gl.graft_generate(three_models, **given)


def test_generation_refuses_nan_logits_instead_of_choosing_token_0(tokenizer):
    """The argmax of NaN logits is token 0: a NaN donor generated token 0 three times."""
    donor = random_model("llama", 1)
    with torch.no_grad():
        donor.lm_head.weight.fill_(float("nan"))
    models = gl.load_models(random_model("llama", 0), donor, tokenizer=tokenizer)
    tokens = random_tokens(2, 5, seed=23)
    mask = gl.GraftMask.build(models, tokens, components="unembed")
    with pytest.raises(gl.errors.NonFiniteLogitsError, match=r"new token 0 .* rows \[0, 1\]"):
        gl.graft_generate(models, tokens, mask, max_new_tokens=3)
    base_only = gl.GraftMask.build(models, tokens, components="unembed", source=0)
    assert gl.graft_generate(models, tokens, base_only, max_new_tokens=3).shape == (2, 8)


def test_a_nan_weight_in_the_donor_is_never_scored_as_a_hit(tokenizer):
    from conftest import random_model

    donor = random_model("llama", 1)
    with torch.no_grad():
        donor.lm_head.weight[3, 0] = float("nan")
    models = gl.load_models(random_model("llama", 0), donor, tokenizer=tokenizer)
    tokens = random_tokens(2, 5, seed=23)
    logits = gl.graft_forward(models, tokens, gl.GraftMask.build(models, tokens, components="all"))
    final = gl.analysis.metrics.last_token_logits(logits)
    with pytest.raises(gl.errors.NonFiniteLogitsError, match="2 of 2 rows"):
        gl.analysis.metrics.top_k_hit(final, torch.tensor([5, 5]), 1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_runs_inside_grafting_are_checked_against_the_masks_rows(three_models):
    tokens, attention_mask = _padded_batch()
    unpadded = gl.GraftMask.build(three_models, tuple(tokens.shape), positions="last")
    with gl.grafting(three_models, unpadded) as model:
        for run in (model, model.run_with_cache, lambda *a, **k: model.run_with_hooks(*a, **k)):
            with pytest.raises(
                gl.errors.GraftMaskError, match="row 1: 6 real tokens in the mask, 4 in"
            ):
                run(tokens, attention_mask=attention_mask)
            with pytest.raises(gl.errors.GraftMaskError, match="end in the pad token"):
                run(tokens)
    built = gl.GraftMask.build(
        three_models, tokens, positions="last", attention_mask=attention_mask
    )
    with gl.grafting(three_models, built) as model:
        inside, _ = model.run_with_cache(tokens, attention_mask=attention_mask)
    expected = gl.graft_forward(
        three_models, tokens, built, attention_mask=attention_mask, logits="all"
    )
    assert torch.equal(inside, expected)
    # The check is gone after the block.
    three_models.base(tokens, attention_mask=attention_mask)


def test_flattened_module_inputs_are_routed_like_batched_ones(three_models):
    """A module may receive [batch * pos, ...] (OPT's decoder layer, MoE blocks do)."""
    tokens = random_tokens(2, 6, seed=15)
    mask = random_mask(three_models, tokens.shape, seed=16)
    expected = gl.graft_forward(three_models, tokens, mask, logits="all")
    hooks = []
    for layer in range(three_models.n_layers):
        hooks.append((f"blocks.{layer}.mlp.out.hook_in", lambda x, hook: x.flatten(0, 1)))
        hooks.append((f"blocks.{layer}.mlp.out.hook_out", lambda x, hook: x.reshape(2, 6, -1)))
    with gl.grafting(three_models, mask) as model:
        flattened = model.run_with_hooks(tokens, fwd_hooks=hooks)
    assert (flattened - expected).abs().max() <= TOLERANCE


def test_a_module_input_without_the_windows_positions_is_refused_naming_the_module(three_models):
    tokens = random_tokens(2, 6, seed=17)
    mask = gl.GraftMask.build(
        three_models, tokens, positions="last", components="mlp_out", source=1
    )

    def drop_a_row(activation, hook):
        return activation.flatten(0, 1)[:-1]

    with gl.grafting(three_models, mask) as model:
        with pytest.raises(
            gl.errors.GraftingError, match=r"blocks\.0\.mlp\.out .*shape \[11, "
        ) as caught:
            model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.out.hook_in", drop_a_row)])
    assert "tokens" not in str(caught.value)


def test_the_oracle_refuses_a_model_without_a_key_value_cache(tokenizer):
    """OpenAI GPT ignores past_key_values: token by token, each token would see only itself."""
    config = OpenAIGPTConfig(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    with pytest.warns(gl.errors.UnverifiedArchitectureWarning):
        models = gl.load_models(
            *(AutoModelForCausalLM.from_config(config) for _ in range(2)), tokenizer=tokenizer
        )
    tokens = random_tokens(1, 3)
    mask = gl.GraftMask.build(models, tokens, positions="last", components="mlp_out")
    with pytest.raises(gl.errors.GraftingError, match="no key/value cache"):
        gl.graft_forward_reference(models, tokens, mask)


@pytest.mark.parametrize(
    ("model_type", "settings", "message"),
    [
        (
            "rwkv",
            dict(attention_hidden_size=32, context_length=64),
            r"RwkvForCausalLM keeps no key/value cache a pass can be continued over: it carries "
            r"a state of its own between calls instead \(its forward takes 'state'",
        ),
        (
            "recurrent_gemma",
            dict(block_types=["recurrent", "attention"], lru_width=32),
            r"RecurrentGemmaForCausalLM keeps a sliding-window cache of 2048 tokens "
            r"\(config.sliding_window=2048\) and layers that keep a recurrent state of their own "
            r"\(linear_attention\), which a pass continued over a key/value cache given from "
            r"outside does not reproduce \(the continued pass failed: RuntimeError",
        ),
    ],
)
def test_a_model_keeping_its_own_state_or_window_is_named_not_called_cacheless(
    tokenizer, model_type, settings, message
):
    """RWKV was said to keep "no key/value cache"; RecurrentGemma's windowed cache and
    recurrent layers failed inside torch ("The size of tensor a (6) must match...")."""
    config = tiny_config(model_type, **settings)
    with pytest.warns(gl.errors.UnverifiedArchitectureWarning):
        models = gl.load_models(
            *(AutoModelForCausalLM.from_config(config) for _ in range(2)),
            tokenizer=tokenizer,
            allow_uncovered=True,
        )
    tokens = random_tokens(1, 4)
    mask = gl.GraftMask.build(models, tokens, positions="last", components="ln_final")
    assert gl.graft_forward(models, tokens, mask, logits="all").shape == (1, 4, 300)
    for run in (gl.graft_forward_reference, gl.graft_generate):
        with pytest.raises(gl.errors.GraftingError, match=message):
            run(models, tokens, mask)


@pytest.mark.parametrize("source", [0, 1])
def test_generation_equals_the_checkpoints_own_greedy_generation(family, three_models, source):
    """Every position and new token computed by one checkpoint: its own HF generate()."""
    tokens = random_tokens(2, 5, seed=18)
    mask = gl.GraftMask.build(three_models, tokens, components="all", source=source)
    generated = gl.graft_generate(
        three_models, tokens, mask, max_new_tokens=6, new_token_sources=source
    )
    # A fresh copy of the checkpoint (same seed), run by transformers alone.
    model = random_model(family, source)
    expected = model.generate(
        tokens,
        attention_mask=torch.ones_like(tokens),
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(generated, expected)


def _prompts_of_three_lengths():
    """Right-padded prompts of lengths 7, 4, 7 and 2 (two rows share one)."""
    lengths = [7, 4, 7, 2]
    attention_mask = (torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]).long()
    return random_tokens(4, 7, seed=24) * attention_mask, attention_mask, lengths  # 0: pad


def _hf_greedy(model, prompt, new):
    """transformers' own greedy generation, exactly ``new`` tokens."""
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )


@pytest.mark.parametrize("source", [0, 1])
def test_prompts_of_different_lengths_generate_as_the_checkpoints_own_generate(
    family, three_models, source
):
    """All base is the base's HF generate(), all donor the donor's, row by row."""
    tokens, attention_mask, lengths = _prompts_of_three_lengths()
    mask = gl.GraftMask.build(
        three_models, tokens, components="all", source=source, attention_mask=attention_mask
    )
    new = 4
    out = gl.graft_generate(
        three_models, tokens, mask, new, new_token_sources=source, attention_mask=attention_mask
    )
    assert out.shape == (4, 7 + new)
    model = random_model(family, source)  # a fresh copy, run by transformers alone
    for row, length in enumerate(lengths):
        alone = _hf_greedy(model, tokens[row : row + 1, :length], new)
        assert torch.equal(out[row, : length + new], alone[0])
        assert torch.equal(out[row, length + new :], tokens[row, length:])  # the padding


def test_prompts_of_different_lengths_generate_as_each_alone_and_as_the_oracle(three_models):
    """A position graft: each row as generated alone, and as greedy decoding over the paper's
    token-by-token procedure (the whole sequence re-run each step)."""
    tokens, attention_mask, lengths = _prompts_of_three_lengths()
    noisy = random_mask(three_models, tokens.shape, seed=25)
    mask = gl.GraftMask.from_dict(
        three_models,
        {key: noisy[key] * attention_mask for key in noisy.keys()},
        attention_mask=attention_mask,
    )
    new = 3
    out = gl.graft_generate(three_models, tokens, mask, new, attention_mask=attention_mask)
    for row, length in enumerate(lengths):
        row_mask = gl.GraftMask.from_dict(
            three_models, {key: mask[key][row : row + 1, :length] for key in mask.keys()}
        )
        alone = gl.graft_generate(three_models, tokens[row : row + 1, :length], row_mask, new)
        assert torch.equal(out[row, : length + new], alone[0])
        sequence = tokens[row : row + 1, :length]
        for step in range(new):
            logits = gl.graft_forward_reference(three_models, sequence, row_mask.extend(step))
            sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(alone, sequence)


def test_a_cache_the_installed_releases_do_not_keep_is_an_error_not_a_number(
    three_models, monkeypatch
):
    """The canary: a model whose forward drops the cache makes every cached path refuse."""
    from grafting_lens.core import compat

    tokens = random_tokens(1, 4, seed=19)
    mask = gl.GraftMask.build(three_models, tokens, positions="last", components="mlp_out")
    model = three_models.base.original_model
    forward = type(model).forward

    def dropping_the_cache(self, *args, cache=None, past_key_values=None, **kwargs):
        kwargs.pop("use_cache", None)
        return forward(self, *args, use_cache=False, **kwargs)

    dropping_the_cache.__signature__ = inspect.signature(forward)  # still declares a cache
    monkeypatch.setattr(type(model), "forward", dropping_the_cache)
    monkeypatch.setattr(compat, "_CONTINUATION_CHECKED", weakref.WeakKeyDictionary())
    versions = rf"transformers {re.escape(version('transformers'))}, transformer-lens"
    with pytest.raises(gl.errors.DependencyError, match=rf"graft_generate .*{versions}"):
        gl.graft_generate(three_models, tokens, mask, max_new_tokens=2)
    with pytest.raises(gl.errors.DependencyError, match="token-by-token reference"):
        gl.graft_forward_reference(three_models, tokens, mask)
    with pytest.raises(gl.errors.DependencyError, match="reuse_prefix=False"):
        gl.resid_patch_sweep(three_models, tokens, lambda logits: logits[:, -1, 3], progress=False)
    # What needs no cache still runs, and patching without the resumed prefix too.
    gl.graft_forward(three_models, tokens, mask)
    gl.resid_patch_sweep(
        three_models, tokens, lambda logits: logits[:, -1, 3], reuse_prefix=False, progress=False
    )


def test_a_source_cast_or_moved_after_loading_is_refused_naming_it(tokenizer):
    """load_models places every source alike; one cast or moved afterwards failed inside
    torch ("mat1 and mat2 must have the same dtype"), naming neither the source nor the fix."""
    models = gl.load_models(random_model("llama", 0), random_model("llama", 1), tokenizer=tokenizer)
    tokens = random_tokens(2, 5, seed=31)
    mask = gl.GraftMask.build(models, tokens, positions="last", components="o")
    expected = gl.graft_forward(models, tokens, mask, logits="all")
    models.base.half()
    cast = r"source 1 \(source1\)'s o at layer 0's weight is torch.float32 on cpu, the base's "
    with no_forward_pass(models):
        for run in (gl.graft_forward, gl.graft_forward_reference, gl.graft_generate):
            with pytest.raises(
                gl.errors.AlignmentError, match=cast + r"torch.float16.*load_models\("
            ):
                run(models, tokens, mask)
    models.base.float()
    models[1].to("meta")  # another device, on a machine without a second one
    with no_forward_pass(models):
        with pytest.raises(
            gl.errors.AlignmentError, match=r"o at layer 0's weight is torch.float32 on meta"
        ):
            gl.graft_forward(models, tokens, mask)
    # A graft that takes nothing from the moved source runs, and the base is intact.
    nothing = gl.GraftMask.build(models, tokens, positions="last", components="o", source=0)
    assert torch.equal(gl.graft_forward(models, tokens, nothing, logits="all"), models.base(tokens))
    assert not torch.equal(expected, models.base(tokens))


def test_graft_forward_keeps_no_autograd_graph_unless_asked(three_models):
    tokens = random_tokens(2, 5, seed=21)
    mask = random_mask(three_models, tokens.shape, seed=22)
    embedding = three_models.base.original_model.get_input_embeddings().weight
    assert embedding.requires_grad and torch.is_grad_enabled()
    logits = gl.graft_forward(three_models, tokens, mask)
    assert not logits.requires_grad and logits.grad_fn is None
    kept = gl.graft_forward(three_models, tokens, mask, grad=True)
    torch.testing.assert_close(kept.detach(), logits)
    kept[0, -1, 3].backward()
    assert embedding.grad is not None and embedding.grad.abs().sum() > 0
    embedding.grad = None
