"""Cross-model activation patching: TransformerLens equality, batching, directions, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import no_forward_pass, random_model, random_tokens
from transformer_lens import patching as tl_patching
from transformer_lens.utilities import get_act_name

import grafting_lens as gl
from grafting_lens.core.errors import (
    AlignmentError,
    PatchingError,
    SelectionError,
    TokenError,
)
from grafting_lens.patching import passes as patch_passes
from grafting_lens.patching import patch as patching
from grafting_lens.patching.patch import head_patch_sweep, patch_forward, resid_patch_sweep

TOLERANCE = 1e-5
TWO_FAMILIES = pytest.mark.parametrize("family", ["gpt2", "llama"], indirect=True)


def per_prompt(logits: torch.Tensor) -> torch.Tensor:
    """A logit difference at the last position: one value per prompt (a sweep's default
    logits="last" gives that position alone)."""
    return logits[:, -1, 5] - logits[:, -1, 7]


def scalar(logits: torch.Tensor) -> torch.Tensor:
    """The same metric as TransformerLens wants it: one scalar for the batch."""
    return per_prompt(logits).mean()


# ---------------------------------------------------------------- TransformerLens


@TWO_FAMILIES
@pytest.mark.parametrize(
    "site, reference",
    [
        ("resid_pre", tl_patching.get_act_patch_resid_pre),
        ("attn_out", tl_patching.get_act_patch_attn_out),
        ("mlp_out", tl_patching.get_act_patch_mlp_out),
        # TransformerLens has no resid_post sweep; its generic function makes one.
        (
            "resid_post",
            lambda *args: tl_patching.generic_activation_patch(
                *args,
                patch_setter=tl_patching.layer_pos_patch_setter,
                activation_name="resid_post",
                index_axis_names=("layer", "pos"),
            ),
        ),
    ],
)
def test_layer_position_sweep_equals_transformer_lens(three_models, site, reference):
    tokens = random_tokens(2, 5, seed=20)
    _, donor_cache = three_models[1].run_with_cache(tokens)
    expected = reference(three_models.base, tokens, donor_cache, scalar)
    values, frame = resid_patch_sweep(three_models, tokens, per_prompt, site=site, progress=False)
    assert values.shape == expected.shape == (three_models.n_layers, 5)
    assert (values - expected.cpu()).abs().max() <= TOLERANCE
    # Only meaningful if the patches move the metric by much more than the tolerance.
    assert values.max() - values.min() > 0.1
    # A scalar metric, called per cell, gives the same values.
    again, _ = resid_patch_sweep(three_models, tokens, scalar, site=site, progress=False)
    assert (again - values).abs().max() <= TOLERANCE
    assert list(frame.columns) == ["site", "direction", "layer", "pos", "value"]


@TWO_FAMILIES
def test_head_sweeps_equal_transformer_lens(three_models):
    tokens = random_tokens(2, 4, seed=21)
    _, donor_cache = three_models[1].run_with_cache(tokens)
    all_positions = tl_patching.get_act_patch_attn_head_out_all_pos(
        three_models.base, tokens, donor_cache, scalar
    )
    values, _ = head_patch_sweep(three_models, tokens, per_prompt, progress=False)
    assert values.shape == all_positions.shape == (3, 4)
    assert (values - all_positions.cpu()).abs().max() <= TOLERANCE
    by_position = tl_patching.get_act_patch_attn_head_out_by_pos(
        three_models.base, tokens, donor_cache, scalar
    )
    values, _ = head_patch_sweep(three_models, tokens, per_prompt, positions="each", progress=False)
    assert values.shape == by_position.shape == (3, 4, 4)
    assert (values - by_position.cpu()).abs().max() <= TOLERANCE
    assert values.max() - values.min() > 0.1


def _resid_mid_loop(models, tokens, metric, hooks_for):
    """A (layer, position) resid_mid sweep, one forward per cell, with plain hooks."""
    _, donor_cache = models[1].run_with_cache(tokens)
    values = torch.zeros(models.n_layers, tokens.shape[1])
    for layer in range(models.n_layers):
        for pos in range(tokens.shape[1]):
            donor_mid = donor_cache[get_act_name("resid_mid", layer)]
            hooks = hooks_for(layer, pos, donor_mid)
            values[layer, pos] = metric(models.base.run_with_hooks(tokens, fwd_hooks=hooks))
    return values


def _true_resid_mid_hooks(layer, pos, donor_mid):
    """Write the mid residual itself: the MLP's input and the stream it is added to."""
    delta = {}

    def set_mlp_input(activation, hook):
        activation = activation.clone()
        delta["value"] = donor_mid[:, pos] - activation[:, pos]
        activation[:, pos] = donor_mid[:, pos]
        return activation

    def correct_stream(activation, hook):
        activation = activation.clone()
        activation[:, pos] += delta["value"]
        return activation

    return [
        (f"blocks.{layer}.hook_resid_mid", set_mlp_input),
        (f"blocks.{layer}.hook_resid_post", correct_stream),
    ]


@TWO_FAMILIES
def test_resid_mid_patches_the_residual_stream(three_models):
    tokens = random_tokens(2, 4, seed=22)
    expected = _resid_mid_loop(three_models, tokens, scalar, _true_resid_mid_hooks)
    values, _ = resid_patch_sweep(
        three_models, tokens, per_prompt, site="resid_mid", progress=False
    )
    assert (values - expected).abs().max() <= TOLERANCE
    assert values.max() - values.min() > 0.1


@TWO_FAMILIES
def test_transformer_lens_resid_mid_on_the_bridge_patches_only_the_mlp_input(three_models):
    """Pins a TransformerLens 4.3 incompatibility: ``hook_resid_mid`` is ``ln2``'s input.

    If this starts failing, TransformerLens patches the real residual now and
    ``get_act_patch_resid_mid`` can join the equality test above.
    """
    tokens = random_tokens(2, 4, seed=22)
    _, donor_cache = three_models[1].run_with_cache(tokens)
    theirs = tl_patching.get_act_patch_resid_mid(three_models.base, tokens, donor_cache, scalar)

    def mlp_input_only(layer, pos, donor_mid):
        def hook(activation, hook):
            activation = activation.clone()
            activation[:, pos] = donor_mid[:, pos]
            return activation

        return [(f"blocks.{layer}.hook_resid_mid", hook)]

    mlp_input_patched = _resid_mid_loop(three_models, tokens, scalar, mlp_input_only)
    assert (theirs.cpu() - mlp_input_patched).abs().max() <= TOLERANCE
    ours, _ = resid_patch_sweep(three_models, tokens, per_prompt, site="resid_mid", progress=False)
    assert (ours - theirs.cpu()).abs().max() > 0.1


# ----------------------------------------------------------- batching and chunks


def test_batched_sweeps_equal_a_per_cell_loop(three_models):
    """Every site, labelled per-row selections, padding and odd chunk sizes."""
    tokens = random_tokens(3, 6, seed=23)
    lengths = torch.tensor([6, 5, 4])
    attention_mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    first_entity = gl.engine.positions.span_positions(
        tokens.shape, [1, 2, 1], [3, 4, 2], attention_mask
    )
    last = gl.engine.positions.last_token(tokens.shape, attention_mask)
    rest = gl.engine.positions.complement(first_entity | last, attention_mask)
    selections = {"FE": first_entity, "LT": last, "rest": rest}

    def metric(logits):  # reads each row's own last real token
        return logits[torch.arange(3), lengths - 1, 3]

    layers = [0, 2]
    for site in patching.available_sites(three_models):
        direction = "necessity" if site in ("resid_post", "z") else "sufficiency"
        heads = [0, 3] if site == "z" else None
        sweeps = []
        # One cell per pass; two cells per pass, the last one short; every position recomputed.
        for chunk_size, reuse_prefix in ((3, True), (7, True), (7, False)):
            kwargs = dict(
                layers=layers,
                positions=selections,
                direction=direction,
                source=2,
                attention_mask=attention_mask,
                reduce="none",
                chunk_size=chunk_size,
                reuse_prefix=reuse_prefix,
                progress=False,
                logits="all",
            )
            if site == "z":
                sweeps.append(head_patch_sweep(three_models, tokens, metric, heads=heads, **kwargs))
            else:
                sweeps.append(resid_patch_sweep(three_models, tokens, metric, site=site, **kwargs))
        (values, frame), *others = sweeps
        assert values.shape == ((2, 3, 2, 3) if site == "z" else (2, 3, 3))
        for other, _ in others:
            assert (values - other).abs().max() <= TOLERANCE
        columns = ["layer", "pos", "head"] if site == "z" else ["layer", "pos"]
        for (layer, label, *head), _ in frame.groupby(columns, sort=False):
            logits = patch_forward(
                three_models,
                tokens,
                site,
                layers=layer,
                positions=selections[label],
                source=2,
                heads=head or None,
                attention_mask=attention_mask,
                direction=direction,
            )
            cell = values[layers.index(layer), list(selections).index(label)]
            if head:
                cell = cell[heads.index(head[0])]
            assert (cell - metric(logits)).abs().max() <= TOLERANCE, (site, layer, label)
        assert (values.amax(dim=0) - values.amin(dim=0)).max() > 1e-2


def test_last_token_logits_give_the_same_sweeps(three_models):
    """logits="last" hands the metric each row's last real token, padding included."""
    tokens = random_tokens(3, 6, seed=37)
    lengths = torch.tensor([6, 4, 5])
    attention_mask = (torch.arange(6)[None, :] < lengths[:, None]).long()

    def every_position(logits):
        return logits[torch.arange(3), lengths - 1, 3] - logits[torch.arange(3), lengths - 1, 8]

    def last_position(logits):
        assert logits.shape[1] == 1
        return logits[:, -1, 3] - logits[:, -1, 8]

    for site in patching.available_sites(three_models):
        sweep = head_patch_sweep if site == "z" else resid_patch_sweep
        extra = {"heads": [0, 2]} if site == "z" else {"site": site}
        for chunk_size, reuse_prefix in ((3, True), (8, True), (8, False)):
            kwargs = dict(
                positions="each",
                attention_mask=attention_mask,
                reduce="none",
                chunk_size=chunk_size,
                reuse_prefix=reuse_prefix,
                progress=False,
                **extra,
            )
            expected, _ = sweep(three_models, tokens, every_position, logits="all", **kwargs)
            values, _ = sweep(three_models, tokens, last_position, **kwargs)
            assert (values - expected).abs().max() <= TOLERANCE, (site, chunk_size, reuse_prefix)


def test_sweeps_resume_from_later_blocks_on_every_family(three_models):
    """The fast path (blocks before a cell's layer skipped) is taken, and is exact."""
    tokens = random_tokens(2, 5, seed=29)
    setup = patch_passes.PatchRun(
        three_models,
        site="resid_pre",
        running=0,
        giving=1,
        tokens=tokens,
        patch_tokens=None,
        attention_mask=None,
    )
    with torch.no_grad():
        assert setup.can_skip_layers(setup.unpatched_prefix())
    kwargs = dict(positions="each", reduce="none", chunk_size=2, progress=False)
    fast, _ = resid_patch_sweep(three_models, tokens, per_prompt, **kwargs)
    slow, _ = resid_patch_sweep(three_models, tokens, per_prompt, reuse_prefix=False, **kwargs)
    assert (fast - slow).abs().max() <= TOLERANCE
    assert (fast.amax(dim=0) - fast.amin(dim=0)).max() > 1e-2  # layers differ: not all skipped


def test_sweeps_fall_back_to_every_block_when_resuming_is_not_exact(three_models, monkeypatch):
    tokens = random_tokens(2, 5, seed=31)
    kwargs = dict(positions="each", layers=[1, 2], reduce="none", progress=False)
    expected, _ = resid_patch_sweep(three_models, tokens, per_prompt, reuse_prefix=False, **kwargs)
    first_layers = []
    run = patch_passes.PatchRun.run

    def spy(self, *args, **kwargs):
        first_layers.append(kwargs.get("first_layer", args[5] if len(args) > 5 else 0))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(patch_passes.PatchRun, "can_skip_layers", lambda self, prefix: False)
    monkeypatch.setattr(patch_passes.PatchRun, "run", spy)
    values, _ = resid_patch_sweep(three_models, tokens, per_prompt, **kwargs)
    assert set(first_layers) == {0}
    assert (values - expected).abs().max() <= TOLERANCE


def test_passes_partition_the_cells_and_respect_the_chunk_size():
    generator = torch.Generator().manual_seed(0)
    starts = [tuple(pair) for pair in torch.randint(0, 9, (200, 2), generator=generator).tolist()]
    for per_pass, overhead in ((1, 0.0), (7, 32.0), (64, 1024.0)):
        passes = patch_passes.plan_passes(starts, per_pass, 2, 10, (9, 5.0, overhead))
        assert sorted(cell for cells in passes for cell in cells) == list(range(200))
        assert max(map(len, passes)) <= per_pass
    # Without a fixed cost per pass, each distinct start gets a pass of its own.
    grid = [(position, layer) for layer in range(4) for position in range(5)]
    passes = patch_passes.plan_passes(grid, 100, 1, 5, (4, 2.0, 0.0))
    assert all(len({grid[cell] for cell in cells}) == 1 for cells in passes)
    # With a large one, everything shares as few passes as the chunk size allows.
    assert len(patch_passes.plan_passes(grid, 100, 1, 5, (4, 2.0, 1e9))) == 1


def test_each_position_leaves_rows_too_short_for_it_unpatched(three_models):
    tokens = random_tokens(2, 5, seed=24)
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    values, _ = resid_patch_sweep(
        three_models,
        tokens,
        lambda logits: logits[:, 2, 4],
        logits="all",
        layers=[1],
        attention_mask=attention_mask,
        reduce="none",
        progress=False,
    )
    unpatched = three_models.base(tokens, attention_mask=attention_mask)[:, 2, 4]
    assert values.shape == (1, 5, 2)
    # Positions 3 and 4 do not exist in row 1, and lie after position 2 in row 0.
    assert torch.allclose(values[0, 3:], unpatched.expand(2, 2), atol=TOLERANCE)
    assert (values[0, :3, 1] - unpatched[1]).abs().max() > 1e-2


def test_head_sweep_shape_and_index_frame(three_models):
    tokens = random_tokens(2, 5, seed=25)
    values, frame = head_patch_sweep(
        three_models,
        tokens,
        per_prompt,
        layers=[0, 2],
        heads=[1, 3],
        positions="each",
        progress=False,
    )
    assert values.shape == (2, 5, 2)
    assert list(frame.columns) == ["site", "direction", "layer", "pos", "head", "value"]
    assert len(frame) == values.numel()
    assert frame.iloc[0][["layer", "pos", "head"]].tolist() == [0, 0, 1]
    assert frame.iloc[-1][["layer", "pos", "head"]].tolist() == [2, 4, 3]
    assert torch.equal(torch.tensor(frame["value"].to_numpy()), values.flatten())
    pivot = frame[frame["head"] == 3].pivot(index="layer", columns="pos", values="value")
    assert torch.allclose(torch.tensor(pivot.to_numpy()), values[..., 1])
    per_example, long = head_patch_sweep(
        three_models, tokens, per_prompt, layers=1, positions="last", reduce="none", progress=False
    )
    assert per_example.shape == (1, 4, 2)
    assert list(long.columns) == ["site", "direction", "layer", "head", "example", "value"]
    assert torch.allclose(
        per_example.mean(-1),
        head_patch_sweep(
            three_models, tokens, per_prompt, layers=1, positions="last", progress=False
        ).values,
    )


# ------------------------------------------------------------------- directions


def _embedding_donor_set(family: str, tokenizer) -> gl.ModelSet:
    """A base and a donor that differ only in their (untied) input embeddings."""
    base = random_model(family, 0)
    donor = copy.deepcopy(base)
    # GPT-2 ties its token embedding to the unembedding: change its positions instead.
    name = {"gpt2": "transformer.wpe.weight", "llama": "model.embed_tokens.weight"}[family]
    with torch.no_grad():
        donor.get_parameter(name).add_(0.5 * torch.randn_like(donor.get_parameter(name)))
    return gl.load_models(base, donor, tokenizer=tokenizer)


@pytest.mark.parametrize("family_name", ["gpt2", "llama"])
def test_full_resid_pre_patch_at_layer_0_reproduces_the_donor(family_name, tokenizer):
    models = _embedding_donor_set(family_name, tokenizer)
    tokens = random_tokens(2, 6, seed=26)
    base, donor = models.base(tokens), models[1](tokens)
    assert (base - donor).abs().max() > 1.0
    sufficiency = patch_forward(models, tokens, "resid_pre", layers=0, positions="all")
    assert (sufficiency - donor).abs().max() <= TOLERANCE
    necessity = patch_forward(
        models, tokens, "resid_pre", layers=0, positions="all", direction="necessity"
    )
    assert (necessity - base).abs().max() <= TOLERANCE
    values, _ = resid_patch_sweep(
        models, tokens, per_prompt, layers=0, positions={"all": "all"}, progress=False
    )
    assert (values[0, 0] - per_prompt(donor).mean()).abs() <= TOLERANCE


@TWO_FAMILIES
def test_sufficiency_runs_the_target_and_necessity_the_source(three_models):
    tokens = random_tokens(2, 6, seed=27)
    base, donor = three_models.base(tokens), three_models[1](tokens)
    nowhere = torch.zeros(tokens.shape, dtype=torch.bool)
    for direction, runs in (("sufficiency", base), ("necessity", donor)):
        unpatched = patch_forward(three_models, tokens, "mlp_out", 1, nowhere, direction=direction)
        assert torch.allclose(unpatched, runs, atol=TOLERANCE)
        # Patching position t changes the run from t on and leaves earlier positions alone.
        patched = patch_forward(three_models, tokens, "attn_out", "all", [3], direction=direction)
        assert torch.allclose(patched[:, :3], runs[:, :3], atol=TOLERANCE)
        assert (patched[:, 3:] - runs[:, 3:]).abs().amax(dim=-1).min() > 1e-2
    # Necessity from the donor's side is sufficiency with the roles swapped, and differs
    # from sufficiency.
    head_patch = (three_models, tokens, "z", [0, 2], "last")
    necessity = patch_forward(*head_patch, heads=[1], direction="noising")
    swapped = patch_forward(*head_patch, source=0, target=1, heads=[1])
    sufficiency = patch_forward(*head_patch, heads=[1])
    assert torch.allclose(necessity, swapped, atol=TOLERANCE)
    assert (necessity - sufficiency).abs().max() > 1.0
    # TransformerLens's own word for sufficiency is denoising.
    denoising = patch_forward(*head_patch, heads=[1], direction="denoising")
    assert torch.equal(denoising, sufficiency)


@TWO_FAMILIES
def test_patch_tokens_give_classic_clean_to_corrupted_patching(three_models):
    clean, corrupted = random_tokens(2, 6, seed=28), random_tokens(2, 6, seed=29)
    restored = patch_forward(
        three_models, corrupted, "resid_pre", 0, "all", source=0, target=0, patch_tokens=clean
    )
    assert (restored - three_models.base(clean)).abs().max() <= TOLERANCE


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize("family", ["neox"], indirect=True)
def test_parallel_blocks_have_no_resid_mid(three_models):
    assert patching.available_sites(three_models) == (
        "resid_pre",
        "resid_post",
        "attn_out",
        "mlp_out",
        "z",
    )
    tokens = random_tokens(1, 4)
    with no_forward_pass(three_models):
        with pytest.raises(
            PatchingError,
            match=r"GPTNeoXForCausalLM has no 'resid_mid' site \(.*parallel\)\. Its sites are: "
            r"resid_pre, resid_post, attn_out, mlp_out, z",
        ):
            resid_patch_sweep(three_models, tokens, per_prompt, site="resid_mid")
        with pytest.raises(PatchingError, match="no 'resid_mid' site"):
            patch_forward(three_models, tokens, "resid_mid", 0, "all")


TOKENS = random_tokens(2, 5, seed=30)
PADDED = TOKENS.masked_fill(torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1]]) == 1, 0)


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (
            dict(site="resid_mdi"),
            PatchingError,
            r"Unknown site 'resid_mdi'\. Did you mean 'resid_mid'",
        ),
        (dict(site="z", heads=[4]), PatchingError, r"distinct head indices in 0\.\.3 .* 4 heads"),
        (dict(site="z", heads=-1), PatchingError, r"distinct head indices in 0\.\.3"),
        (dict(site="z", heads=[1, 1]), PatchingError, r"distinct head indices"),
        (dict(site="z", heads=[]), PatchingError, r"distinct head indices"),
        (dict(site="attn_out", heads=[0]), PatchingError, r"heads applies to the per-head site"),
        (dict(layers=3), SelectionError, r"Layer 3 is outside the model, which has 3 layers"),
        (dict(layers="last_thrid"), SelectionError, r"Unknown layer range 'last_thrid'"),
        (dict(positions=[5]), SelectionError, r"Position 5 is beyond row 0, which has 5 real"),
        (dict(positions=[]), SelectionError, r"positions=\[\] selects no position"),
        (dict(positions=True), SelectionError, r"Cannot read positions from True"),
        (
            dict(patch_tokens=random_tokens(2, 6)),
            PatchingError,
            r"patch_tokens have shape \[2, 6\]",
        ),
        (dict(source=3), PatchingError, r"source=3 and target=0 must be checkpoints .* \(0\.\.2\)"),
        (dict(source=True), PatchingError, r"source=True and target=0 must be checkpoints"),
        (dict(source=0), PatchingError, r"two different ones unless patch_tokens"),
        (dict(direction="sufficient"), PatchingError, r"Unknown direction 'sufficient'\. Did you"),
        (dict(tokens=TOKENS[0]), TokenError, r"tokens must be a \[batch, pos\] tensor"),
        (dict(tokens=TOKENS + 1000), TokenError, r"Token ids in tokens must lie in 0\.\.299"),
        (dict(tokens=TOKENS.bool()), TokenError, r"tokens must hold integer token ids"),
        (dict(tokens=random_tokens(1, 70)), TokenError, r"70 positions.*embeddings for 64"),
        (dict(tokens=TOKENS[:, :0]), TokenError, r"tokens is empty"),
        (dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1]] * 2)), SelectionError, "right padding"),
        (dict(attention_mask=torch.full((2, 5), 2)), SelectionError, r"only 0 \(padding\) and 1"),
        (dict(tokens=PADDED, positions="last"), SelectionError, r"rows 1\) end in the pad token 0"),
    ],
)
def test_patch_forward_refuses_before_any_forward_pass(three_models, overrides, error, message):
    arguments = {
        **dict(tokens=TOKENS, site="resid_pre", layers="all", positions="all"),
        **overrides,
    }
    with no_forward_pass(three_models), pytest.raises(error, match=message):
        patch_forward(three_models, **arguments)


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
@pytest.mark.parametrize(
    "sweep, overrides, error, message",
    [
        ("resid", dict(site="z"), PatchingError, r"Unknown site 'z'\. Heads have their own sweep"),
        ("resid", dict(reduce="sum"), PatchingError, r"reduce='mean' or 'none'.*'sum'"),
        ("resid", dict(chunk_size=0), PatchingError, r"chunk_size >= 1.*, 0\.$"),
        ("resid", dict(logits="first"), PatchingError, r"logits='last' or 'all'.*'first'"),
        ("resid", dict(metric=3), gl.errors.ArgumentTypeError, r"metric must be a function"),
        ("resid", dict(positions={}), PatchingError, r"mapping of position selections is empty"),
        (
            "resid",
            dict(models="base"),
            TypeError,
            r"models must be a ModelSet, got TransformerBridge",
        ),
        ("head", dict(heads=[0, 9]), PatchingError, r"distinct head indices in 0\.\.3"),
        ("head", dict(layers=-4), SelectionError, r"Layer -4 is outside the model"),
        (
            "head",
            dict(models="base"),
            TypeError,
            r"models must be a ModelSet, got TransformerBridge",
        ),
    ],
)
def test_sweeps_refuse_before_any_forward_pass(three_models, sweep, overrides, error, message):
    arguments = {**dict(models=three_models, tokens=TOKENS, metric=per_prompt), **overrides}
    if arguments["models"] == "base":
        arguments["models"] = three_models.base
    run = resid_patch_sweep if sweep == "resid" else head_patch_sweep
    with no_forward_pass(three_models), pytest.raises(error, match=message):
        run(**arguments)


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
@pytest.mark.parametrize(
    "metric, options, message",
    [
        (
            lambda logits: logits[:, -1, :4],
            {},
            r"returned shape \[2, 4\] .*one per prompt \(\[2\]\)",
        ),
        (scalar, dict(reduce="none"), r"returned shape \[\] .*since reduce='none' keeps them"),
        (lambda logits: "good", {}, r"returned str .*it must return numbers"),
        (lambda logits: None, {}, r"returned NoneType"),
        (lambda logits: {"value": 1.0}, {}, r"returned dict"),
    ],
)
def test_metrics_that_give_no_value_per_prompt_are_named(three_models, metric, options, message):
    tokens = random_tokens(2, 4, seed=31)
    with pytest.raises(PatchingError, match=message):
        resid_patch_sweep(three_models, tokens, metric, layers=0, positions=[0], **options)


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
def test_numbers_in_a_list_are_a_metrics_values(three_models):
    tokens = random_tokens(2, 4, seed=32)
    sweep = resid_patch_sweep(
        three_models, tokens, lambda logits: [1.0, 2.0], layers=0, positions=[0], progress=False
    )
    assert sweep.values.tolist() == [[1.5]]
    assert issubclass(PatchingError, gl.GraftingLensError)


def test_a_source_cast_or_moved_after_loading_is_refused(tokenizer):
    models = gl.load_models(random_model("gpt2", 0), random_model("gpt2", 1), tokenizer=tokenizer)
    tokens = random_tokens(2, 5)
    models[1].half()
    with no_forward_pass(models):
        with pytest.raises(
            AlignmentError,
            match=r"This patch: source 1 \(source1\)'s .* is torch.float16 on cpu, the base's torch",
        ):
            patch_forward(models, tokens, "resid_pre", layers=1)
        with pytest.raises(
            AlignmentError, match=r"is torch.float16 on cpu, the base's torch.float32 on cpu"
        ):
            resid_patch_sweep(models, tokens, lambda logits: logits[:, -1, 0])
    models[1].float().to("meta")  # patching silently returned logits on the meta device
    with pytest.raises(
        AlignmentError, match=r"is torch.float32 on meta, the base's torch.float32 on cpu"
    ):
        patch_forward(models, tokens, "resid_pre", layers=1, direction="necessity")


# ------------------------------------------------- TransformerLens metrics under logits="last"


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
@pytest.mark.parametrize("sweep", [resid_patch_sweep, head_patch_sweep])
def test_a_transformer_lens_metric_is_refused_under_last_token_logits(three_models, sweep):
    """A metric reading another position than the last ends in a PatchingError naming
    logits='all', whether it would fail ([:, -2]) or silently read the last token ([:, 0])."""
    tokens = random_tokens(2, 5, seed=41)
    for metric, message in (
        (lambda logits: logits[:, -2, 5], r"IndexError: .*needs logits='all'"),
        (lambda logits: logits[:, 0, 5], r"reads positions other than the last.*logits='all'"),
        (lambda logits: logits.mean(1)[:, 5], r"reads positions other than the last"),
    ):
        with pytest.raises(PatchingError, match=message):
            sweep(three_models, tokens, metric, layers=[1], progress=False)
        for reuse_prefix in (True, False):  # from the prefix's logits, or one unpatched pass
            with pytest.raises(PatchingError, match=message):
                sweep(
                    three_models,
                    tokens,
                    metric,
                    layers=[0],
                    positions=[0],
                    reuse_prefix=reuse_prefix,
                    progress=False,
                )


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
def test_transformer_lens_metrics_get_every_position_with_all_logits(three_models):
    """Refused by default, a TransformerLens metric gets with logits='all' the values of
    patch_forward's logits (every position), cell by cell."""
    tokens = random_tokens(2, 5, seed=42)
    for metric in (
        lambda logits: logits[:, -2, 5],
        lambda logits: logits[:, 0, 5] - logits[:, -1, 7],
    ):
        with pytest.raises(PatchingError, match="logits='all'"):
            resid_patch_sweep(three_models, tokens, metric, layers=[0], progress=False)
        values, _ = resid_patch_sweep(
            three_models,
            tokens,
            metric,
            layers=[0, 2],
            positions=[0, 3],
            logits="all",
            reduce="none",
            progress=False,
        )
        for i, layer in enumerate((0, 2)):
            for j, position in enumerate((0, 3)):
                patched = patch_forward(three_models, tokens, "resid_pre", [layer], [position])
                assert (values[i, j] - metric(patched)).abs().max() <= TOLERANCE
        assert values.max() - values.min() > 0.01


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
def test_a_last_position_metric_gives_the_same_values_either_way(three_models):
    """A metric reading [:, -1] passes the probe (its value on the unpatched run's last
    token and on every position, once each, before the sweep) and is not changed by it."""
    tokens = random_tokens(2, 5, seed=43)
    shapes = []

    def last_position(logits):
        shapes.append(tuple(logits.shape[:2]))
        return per_prompt(logits)

    last, _ = resid_patch_sweep(three_models, tokens, last_position, progress=False)
    assert shapes[:2] == [(2, 1), (2, 5)] and set(shapes[2:]) == {(2, 1)}
    every, _ = resid_patch_sweep(three_models, tokens, per_prompt, logits="all", progress=False)
    assert (last - every).abs().max() <= TOLERANCE
    assert last.max() - last.min() > 0.1


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
def test_a_metric_raising_during_the_sweep_names_the_cell(three_models):
    tokens = random_tokens(2, 4, seed=44)
    calls = []

    def fails_later(logits):
        calls.append(1)
        if len(calls) > 3:
            raise ValueError("no answer token\nsecond line")
        return logits[:, -1, 5]

    message = r"^The metric raised ValueError: no answer token on the cell layer=\d, pos=\d"
    with pytest.raises(PatchingError, match=message):
        resid_patch_sweep(three_models, tokens, fails_later, progress=False)
    calls.clear()
    with pytest.raises(PatchingError, match=r"on the cell layer=\d, head=\d"):
        head_patch_sweep(three_models, tokens, fails_later, progress=False)
