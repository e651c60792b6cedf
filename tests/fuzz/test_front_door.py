"""Every public function of ``gl`` driven with generated inputs, good and hostile.

Each call either returns a result equal to an independent computation (the HF models' own
forwards: PRE and SFT rows, a graft of everything, patching, generation) or to an
arithmetic identity where there is no forward to compare with, or raises a
GraftingLensError naming the argument (:func:`fuzz.strategies.door`).
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import grafting_lens as gl
from fuzz.conftest import ANSWERS, PROMPT
from fuzz.oracles import (
    answer_probabilities,
    hf_greedy,
    hf_last_logits,
    hf_resid_pre_sweep,
    rank_fits,
)
from fuzz.strategies import (
    CHEAP,
    CONTAINERS,
    HOSTILE,
    arg,
    budget,
    container,
    door,
    integers,
    text,
    threads_kept,
)

FUZZED: set[str] = set()


def fuzzes(*names: str):
    """Record that the decorated test drives ``gl.<name>`` for each name."""
    FUZZED.update(names)
    return lambda test: test


NOT_FUZZED = {
    "CLEAN": "a constant (a Semantics), not called; fuzzed as semantics= of gl.graft",
    "REFERENCE": "a constant (a Semantics), not called; fuzzed as semantics= of gl.graft",
    "errors": "a module of exception classes",
    "GraftingLensError": "the exception class the property itself checks for",
    "notebook": "sets up the process (torch's threads, grad mode, plotly's renderer) for "
    "every test after it",
    "build_real_world": "downloads a base model and finetunes it for hours; CI is offline",
}


def test_every_public_name_is_fuzzed_or_excused():
    assert FUZZED | set(NOT_FUZZED) == set(gl.__all__)
    assert not FUZZED & set(NOT_FUZZED)


# -- gl.graft and gl.plot_graft -------------------------------------------------------------

PROMPTS = st.sampled_from(
    [PROMPT, PROMPT + "  ", "Keanu met Keanu in a movie", "A Café in 東京 starred Keanu 🎬"]
)
LONG_TEXT = st.integers(30, 120).map(lambda n: "Keanu starred " * n)
PROMPT_ITEMS = st.one_of(PROMPTS, PROMPTS, text(30), HOSTILE, LONG_TEXT)
PLACES = st.one_of(
    st.sampled_from(
        ["last", "all", "Keanu", "Keanu Reeves", "Keanu Reeve", "movie", "FE+LT", "user"]
    ),
    text(8),
    integers(-45, 45),
    st.sampled_from([2.0, -0.0, np.float32(1)]),
    HOSTILE,
)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


AT = st.one_of(
    PLACES,
    st.lists(PLACES, max_size=3),
    st.dictionaries(
        st.one_of(st.sampled_from(["a", "pre", "sft"]), text(4), HOSTILE.filter(_hashable)),
        PLACES,
        max_size=2,
    ),
)


# A template of plain words: the tiny tokenizer writes it without special tokens.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.one_of(st.sampled_from(["user", "system", "assistant", "robot"]), HOSTILE),
            "content": PROMPT_ITEMS,
        }
    ),
    max_size=3,
)


def _build(kind: str, items: list[Any]) -> Any:
    return CONTAINERS[kind](items)


def _parts(place: Any) -> list[Any]:
    if isinstance(place, (list, tuple)):
        return list(place)
    return [place]


@fuzzes("graft", "plot_graft")
@budget(60)
@given(data=st.data())
def test_graft(world, data):
    shape = data.draw(st.sampled_from(["one", "container", "frame", "chat"]), "prompts as")
    if shape == "chat":  # one conversation, or several (each a list of messages)
        items = data.draw(st.lists(MESSAGES, min_size=1, max_size=2), "conversations")
        prompts = items[0] if data.draw(st.booleans(), "one conversation") else items
    elif shape == "one":
        items = [data.draw(PROMPT_ITEMS, "prompt")]
        prompts: Any = items[0]
    else:
        kind, items = data.draw(container(st.lists(PROMPT_ITEMS, max_size=3)), "prompts")
        prompts = _build(kind, items) if shape == "container" else pd.DataFrame({"text": items})
    answer_items = data.draw(
        st.lists(st.one_of(st.sampled_from(ANSWERS), text(6), HOSTILE), min_size=1, max_size=3),
        "answers",
    )
    answer_kind = data.draw(
        st.sampled_from(["one", "list", "none", *sorted(CONTAINERS)]), "answer as"
    )
    answer: Any = {"one": answer_items[0], "none": None}.get(answer_kind)
    if answer_kind not in ("one", "none"):
        answer = _build(answer_kind, answer_items)
    kwargs = dict(
        at=data.draw(AT, "at"),
        components=data.draw(
            arg(
                "all",
                "o+ffn",
                "attn",
                ["o", "ffn"],
                extra=st.sampled_from(["router", "all+unembed", ["o", None]]),
            ),
            "components",
        ),
        layers=data.draw(arg("all", "last_half", [0, 2], extra=integers(-5, 5)), "layers"),
        donor=data.draw(
            arg(1, "sft", extra=st.one_of(integers(-2, 3), st.sampled_from(["pre", "SFT"]))),
            "donor",
        ),
        semantics=data.draw(
            arg(
                None,
                "reference",
                "clean",
                extra=st.sampled_from(
                    [
                        "clean+sft=donor",
                        "reference+bos=always",
                        "reference+unembed=nope",
                        "REFERENCE",
                        gl.CLEAN,
                    ]
                ),
            ),
            "semantics",
        ),
        top_k=data.draw(arg(5, 1, extra=integers(-1, 400)), "top_k"),
        score=data.draw(
            arg(
                "first_token",
                "answer_logprob",
                "kl",
                extra=st.sampled_from(
                    ["logit_diff", "kl_div", "", lambda logits: logits[:, -1, 0]]
                ),
            ),
            "score",
        ),
        counter=data.draw(arg(None, extra=st.one_of(st.sampled_from(ANSWERS), HOSTILE)), "counter"),
    )
    if isinstance(kwargs["semantics"], gl.study.Semantics):
        kwargs["semantics"] = kwargs["semantics"].label
    template = data.draw(st.sampled_from([TEMPLATE, None]), "chat template")
    world.models.tokenizer.chat_template = template
    try:
        table = door(gl.graft, world.models, prompts=prompts, answer=answer, **kwargs)
    finally:
        world.models.tokenizer.chat_template = None
    if table is None:
        return
    # A score's columns: one finite number per row (a log-probability at most 0, a KL at least 0).
    for column in ("answer_logprob", "logit_diff", "kl", "score"):
        if column in table:
            assert np.isfinite(table[column].to_numpy(dtype=float)).all(), column
    assert "answer_logprob" not in table or (table["answer_logprob"] <= 1e-6).all()
    assert "kl" not in table or (table["kl"] >= -1e-5).all()
    if "target_rank" not in table:  # kl or a function without an answer: none is scored
        assert answer is None and table["target"].isna().all()
        assert kwargs["score"] == "kl" or callable(kwargs["score"])
        return
    if shape == "chat":  # the template's text: its tokens are checked in test_chat
        assert ((table["target_prob"] >= 0) & (table["target_prob"] <= 1)).all()
        _plot_graft(table, data)
        return
    # What was asked: each prompt a non-empty string, each answer too (one, or one each).
    texts = list(items)
    answers = [answer] * len(texts) if isinstance(answer, str) else list(answer_items)
    assert all(isinstance(t, str) and t.strip() for t in texts), f"scored prompts {texts!r}"
    assert all(isinstance(a, str) and a.strip() for a in answers), f"scored answers {answers!r}"
    if shape == "container" and kind == "set":
        texts = sorted(texts)  # a set's order is its own: compare as a set below
    assert len(answers) == len(texts), f"{len(answers)} answers scored for {len(texts)} prompts"
    asked = {(t.rstrip(), a if a[:1].isspace() else " " + a) for t, a in zip(texts, answers)}
    assert set(zip(table["text"], table["target"])) <= asked
    at = kwargs["at"]
    places = at if isinstance(at, dict) else {"+".join(map(str, _parts(at))): _parts(at)}
    everything = {
        label
        for label, place in places.items()
        if "all" in _parts(place) and kwargs["components"] == "all" and kwargs["layers"] == "all"
    }
    for row in table.itertuples():
        model = {"pre": world.base, "sft": world.donor}.get(row.config)
        if row.config in everything:
            model = world.donor  # every component of every layer at every position
        assert 0.0 <= row.target_prob <= 1.0 and row.target_rank >= 0
        if model is None:
            continue
        p, probabilities = answer_probabilities(
            model, world, row.text, row.target, kwargs["semantics"]
        )
        assert row.target_prob == pytest.approx(p, rel=1e-4, abs=1e-6), row.config
        assert rank_fits(row.target_rank, row.target_prob, probabilities), row.config
    _plot_graft(table, data)


def _plot_graft(table: pd.DataFrame, data) -> None:
    which = data.draw(
        st.sampled_from(["whole", "empty", "no target_prob", "nan", "one row"]), "table"
    )
    if which == "empty":
        table = table.iloc[:0]
    elif which == "no target_prob":
        table = table.drop(columns="target_prob")
    elif which == "nan":
        table = table.assign(target_prob=np.nan)
    elif which == "one row":
        table = table.iloc[:1]
    k = data.draw(arg(5, 1, extra=integers(-1, 10)), "k")
    title = data.draw(arg(None, "A title", extra=text(10)), "title")
    figure = door(gl.plot_graft, table=table, k=k, title=title)
    if figure is None:
        return
    assert isinstance(figure, go.Figure)
    if table["text"].nunique() == 1:  # one prompt: a bar per run for each answer
        targets = table.drop_duplicates(["config", "target"])["target"].unique()
        assert len(figure.data) == len(targets), "answers drawn on one another's bars"
        for trace, target in zip(figure.data, targets):
            rows = table.drop_duplicates(["config", "target"]).query("target == @target")
            np.testing.assert_allclose(trace.y, rows["target_prob"])


# -- tokens, masks and the engine -------------------------------------------------------------

VALID_TOKENS = st.tuples(st.integers(1, 2), st.integers(1, 8), st.integers(0, 10**6)).map(
    lambda t: torch.randint(0, 300, t[:2], generator=torch.Generator().manual_seed(t[2]))
)
TOKENS = st.one_of(
    VALID_TOKENS,
    VALID_TOKENS,
    VALID_TOKENS.map(lambda t: t.float()),
    VALID_TOKENS.map(lambda t: t.numpy()),
    VALID_TOKENS.map(lambda t: t.tolist()),
    VALID_TOKENS.map(lambda t: t[0]),
    VALID_TOKENS.map(lambda t: t + 300),
    VALID_TOKENS.map(lambda t: -t - 1),
    st.just(torch.zeros(1, 0, dtype=torch.long)),
    st.just(torch.zeros(1, 70, dtype=torch.long)),
    HOSTILE,
)


def _attention_mask(data, tokens: Any) -> Any:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        return data.draw(arg(None), "attention_mask")
    batch, pos = tokens.shape
    lengths = data.draw(st.lists(st.integers(0, pos), min_size=batch, max_size=batch), "lengths")
    right = (torch.arange(pos)[None] < torch.tensor(lengths)[:, None]).long()
    return data.draw(
        st.sampled_from(
            [
                None,
                torch.ones_like(tokens),
                right,
                right.flip(1),
                right.bool(),
                right.float(),
                right[:, :-1],
            ]
        ),
        "attention_mask",
    )


POSITIONS = st.one_of(
    st.sampled_from(["all", "last", "first"]),
    integers(-9, 9),
    st.lists(integers(-9, 9), max_size=3),
    HOSTILE,
)
COMPONENTS = arg(
    "all",
    "o+ffn",
    "attn",
    "ffn",
    ["q", "k"],
    extra=st.sampled_from(["router", "unembed", "embed+ln_final", "O"]),
)
LAYERS = arg(
    "all",
    "last_half",
    [0, 2],
    extra=st.one_of(integers(-6, 6), st.lists(integers(-5, 5), max_size=3)),
)


def _mask(world, data, tokens: Any) -> tuple[Any, dict[str, Any]]:
    shape = tokens.shape if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 else (1, 4)
    kwargs = dict(
        positions=data.draw(POSITIONS, "positions"),
        layers=data.draw(LAYERS, "layers"),
        components=data.draw(COMPONENTS, "components"),
        source=data.draw(arg(1, 0, extra=integers(-1, 3)), "source"),
    )
    mask = door(gl.GraftMask.build, world.models, tokens=tuple(shape), **kwargs)
    return mask, kwargs


def _uniform(kwargs: dict[str, Any]) -> int | None:
    """The source a mask takes everywhere from, if it does."""
    if kwargs["positions"] == "all" and kwargs["components"] == "all" and kwargs["layers"] == "all":
        return int(kwargs["source"])
    return None


@fuzzes("GraftMask", "graft_forward", "graft_forward_reference", "grafting")
@budget(50)
@given(data=st.data())
def test_graft_forward(world, data):
    tokens = data.draw(TOKENS, "tokens")
    attention_mask = _attention_mask(data, tokens)
    mask, built = _mask(world, data, tokens)
    if mask is None:
        mask = data.draw(arg(None, extra=st.just("mask")), "mask")
    logits = data.draw(arg("last", "all", extra=st.sampled_from(["first", "LAST"])), "logits")
    grad = data.draw(arg(False, True), "grad")
    fast = door(
        gl.graft_forward,
        world.models,
        tokens=tokens,
        mask=mask,
        attention_mask=attention_mask,
        logits=logits,
        grad=grad,
    )
    slow = door(
        gl.graft_forward_reference,
        world.models,
        tokens=tokens,
        mask=mask,
        attention_mask=attention_mask,
    )
    if slow is not None:  # the positions that are real tokens
        real = attention_mask if attention_mask is not None else torch.ones_like(tokens)
    if fast is not None:
        assert isinstance(tokens, torch.Tensor) and isinstance(mask, gl.GraftMask)
        assert slow is not None, "graft_forward ran what graft_forward_reference refuses"
        last = real.long().sum(1) - 1  # a float mask (HF takes one) counts the same
        if logits == "last":
            expected = slow[torch.arange(len(slow)), last][:, None]
        else:
            expected = slow * real[..., None]
            fast = fast * real[..., None]
        torch.testing.assert_close(fast.detach(), expected, rtol=1e-4, atol=1e-4)
        source = _uniform(built)
        if source in (0, 1):
            model = (world.base, world.donor)[source]
            torch.testing.assert_close(
                slow[torch.arange(len(slow)), last][:, None],
                hf_last_logits(model, tokens, attention_mask),
                rtol=1e-4,
                atol=1e-4,
            )
    if isinstance(mask, gl.GraftMask) and isinstance(tokens, torch.Tensor) and slow is not None:
        with gl.grafting(world.models, mask=mask) as bridge:
            inside = bridge(tokens, attention_mask=attention_mask)
        torch.testing.assert_close(
            inside * real[..., None], slow * real[..., None], rtol=1e-4, atol=1e-4
        )
    elif not isinstance(mask, gl.GraftMask):
        with pytest.raises(gl.GraftingLensError):
            with gl.grafting(world.models, mask=mask):
                pass


@fuzzes("graft_generate")
@budget(25)
@given(data=st.data())
def test_graft_generate(world, data):
    tokens = data.draw(TOKENS, "tokens")
    mask, built = _mask(world, data, tokens)
    new = data.draw(arg(1, 3, extra=integers(-1, 80)), "max_new_tokens")
    sources = data.draw(
        arg("last", 0, 1, extra=st.one_of(integers(-1, 3), st.sampled_from(["base", "first"]))),
        "new_token_sources",
    )
    out = door(
        gl.graft_generate,
        world.models,
        tokens=tokens,
        mask=mask,
        max_new_tokens=new,
        new_token_sources=sources,
    )
    if out is None:
        return
    assert out.shape == (tokens.shape[0], tokens.shape[1] + int(new))
    source = _uniform(built)
    if source in (0, 1) and (
        sources == "last" or (not isinstance(sources, str) and int(sources) == source)
    ):
        expected = hf_greedy((world.base, world.donor)[source], tokens, int(new))
        assert torch.equal(out, expected)


@fuzzes("select_positions")
@budget(40)
@given(
    expression=arg(
        "FE", "LT", "FE+LT", "(FE+LT)^C", "ALL", "M", extra=st.text("FELTMRAC+^() ", max_size=10)
    ),
    cut=st.integers(0, 3),
)
def test_select_positions(world, expression, cut):
    batch = world.batch
    spans = dict(batch.spans)
    if cut == 1:
        spans.pop("first_entity", None)
    attention_mask = batch.attention_mask if cut != 2 else batch.attention_mask[:, :-1]
    selected = door(
        gl.select_positions, expression=expression, spans=spans, attention_mask=attention_mask
    )
    if selected is None:
        return
    assert selected.dtype == torch.bool and selected.shape == attention_mask.shape
    assert not (selected & ~attention_mask.bool()).any(), "padding selected"
    complement = gl.select_positions(f"({expression})^C", spans, attention_mask)
    assert torch.equal(complement, attention_mask.bool() & ~selected)


@fuzzes("resolve_layers")
@budget(60)
@given(
    spec=arg(
        "all",
        None,
        "last_half",
        (0.25, 0.75),
        extra=st.one_of(
            integers(-8, 8),
            st.lists(integers(-8, 8), max_size=4),
            st.tuples(st.floats(-1, 2), st.floats(-1, 2)),
            st.builds(range, st.integers(-2, 6), st.integers(-2, 8)),
            st.builds(slice, st.integers(-6, 6), st.integers(-6, 6)),
            st.sampled_from(["first_quarter", "middle", "bogus", "ALL"]),
        ),
    ),
    n_layers=arg(4, 1, 18, extra=integers(-2, 30), hostile=CHEAP),
    arithmetic=arg("fractions", "quarters", extra=st.just("thirds")),
)
def test_resolve_layers(spec, n_layers, arithmetic):
    layers = door(gl.resolve_layers, spec=spec, n_layers=n_layers, arithmetic=arithmetic)
    if layers is None:
        return
    n = int(n_layers)
    assert n >= 1 and layers and list(layers) == sorted(set(layers))
    assert all(type(layer) is int and 0 <= layer < n for layer in layers)
    if spec in (None, "all"):
        assert layers == tuple(range(n))
    elif isinstance(spec, (int, np.integer)) or (torch.is_tensor(spec) and spec.dim() == 0):
        assert layers == (int(spec) % n,) and -n <= int(spec) < n
    elif isinstance(spec, list) or torch.is_tensor(spec):  # a 1-d tensor: a list of layers
        assert layers == tuple(sorted({int(i) % n for i in spec}))
    elif isinstance(spec, (slice, range)):
        chosen = list(range(n))[spec] if isinstance(spec, slice) else list(spec)
        assert set(layers) == {i % n for i in chosen}  # negative layers count from the end


# -- patching -----------------------------------------------------------------------------------

SITES = arg(
    "resid_pre",
    "resid_post",
    "attn_out",
    "mlp_out",
    extra=st.sampled_from(["resid_mid", "z", "pattern", "RESID_PRE"]),
)


def _metric(data):
    target = data.draw(st.integers(0, 299), "metric target")
    kind = data.draw(
        st.sampled_from(["last", "tl-second-last", "per-row", "float", "vector", "hostile"]),
        "metric",
    )
    return kind, {
        "last": lambda logits: logits[:, -1, target].mean(),
        # What people write for transformer_lens.patching: a position other than the last.
        "tl-second-last": lambda logits: logits[:, -2, target].mean(),
        "per-row": lambda logits: logits[:, -1, target],
        "float": lambda logits: float(logits[:, -1, target].mean()),
        "vector": lambda logits: logits[:, -1, :3],
        "hostile": "logprob",
    }[kind]


@fuzzes("patch_forward")
@budget(30)
@given(data=st.data())
def test_patch_forward(world, data):
    tokens = data.draw(TOKENS, "tokens")
    kwargs = dict(
        site=data.draw(SITES, "site"),
        layers=data.draw(LAYERS, "layers"),
        positions=data.draw(POSITIONS, "positions"),
        source=data.draw(arg(1, 0, extra=integers(-1, 3)), "source"),
        target=data.draw(arg(0, 1, extra=integers(-1, 3)), "target"),
        heads=data.draw(arg(None, 0, [0, 1], extra=integers(-3, 5)), "heads"),
        direction=data.draw(arg("sufficiency", "necessity", extra=st.just("both")), "direction"),
    )
    logits = door(gl.patch_forward, world.models, tokens=tokens, **kwargs)
    if logits is None:
        return
    run = kwargs["target"] if kwargs["direction"] == "sufficiency" else kwargs["source"]
    donor = kwargs["source"] if kwargs["direction"] == "sufficiency" else kwargs["target"]
    hf = (world.base, world.donor)
    with torch.no_grad():
        if int(run) == int(donor):  # patched with itself: the model's own forward
            torch.testing.assert_close(logits, hf[int(run)](tokens).logits, rtol=1e-4, atol=1e-4)
        elif (kwargs["site"], kwargs["layers"], kwargs["positions"], kwargs["heads"]) == (
            "resid_post",
            [0, 2],
            "all",
            None,
        ):
            pass
        elif (kwargs["site"], kwargs["positions"], kwargs["heads"]) == (
            "resid_post",
            "all",
            None,
        ) and kwargs["layers"] in ("all", -1, "last_half"):
            # The last block's output is the donor's everywhere; the final norm and unembedding
            # are shared: the donor's forward.
            torch.testing.assert_close(logits, hf[int(donor)](tokens).logits, rtol=1e-4, atol=1e-4)


@fuzzes("resid_patch_sweep", "head_patch_sweep")
@budget(30)
@given(data=st.data())
def test_patch_sweeps(world, data):
    tokens = data.draw(st.one_of(VALID_TOKENS, TOKENS), "tokens")
    kind, metric = _metric(data)
    if kind == "tl-second-last" and not (
        isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[1] >= 2
    ):
        kind, metric = "last", lambda logits: logits[:, -1, 0].mean()  # TL fails there too
    common = dict(
        layers=data.draw(LAYERS, "layers"),
        source=data.draw(arg(1, 0, extra=integers(-1, 3)), "source"),
        target=data.draw(arg(0, 1, extra=integers(-1, 3)), "target"),
        reduce=data.draw(arg("mean", "none", extra=st.just("sum")), "reduce"),
        chunk_size=data.draw(arg(64, 1, extra=integers(-1, 3)), "chunk_size"),
        logits=data.draw(arg("last", "all", extra=st.just("first")), "logits"),
    )
    if data.draw(st.booleans(), "heads"):
        heads = data.draw(arg(None, 0, [0, 1], extra=integers(-3, 5)), "heads")
        sweep = door(
            gl.head_patch_sweep,
            world.models,
            tokens=tokens,
            metric=metric,
            heads=heads,
            positions=data.draw(arg("all", "each", "last", extra=POSITIONS), "positions"),
            **common,
        )
        site, positions = "z", None
    else:
        site = data.draw(SITES, "site")
        positions = data.draw(arg("each", "all", "last", extra=POSITIONS), "positions")
        sweep = door(
            gl.resid_patch_sweep,
            world.models,
            tokens=tokens,
            metric=metric,
            site=site,
            positions=positions,
            **common,
        )
    if sweep is None:
        return
    values = torch.as_tensor(sweep.values)
    assert torch.isfinite(values).all()
    hf = (world.base, world.donor)
    if int(common["source"]) == int(common["target"]) and common["reduce"] == "mean":
        with torch.no_grad():  # patched with itself: every cell is the unpatched metric
            full = hf[int(common["target"])](tokens).logits
            expected = float(torch.as_tensor(metric(full)).float().mean())
        torch.testing.assert_close(values, torch.full_like(values, expected), rtol=1e-4, atol=1e-4)
    elif (site, positions, common["layers"], common["reduce"], kind) == (
        "resid_pre",
        "each",
        "all",
        "mean",
        "tl-second-last",
    ) and (int(common["source"]), int(common["target"])) == (1, 0):
        # What transformer_lens.patching.get_act_patch_resid_pre gives this metric.
        expected = hf_resid_pre_sweep(world.base, world.donor, tokens, metric)
        torch.testing.assert_close(values, expected, rtol=1e-4, atol=1e-4)


# -- analyses on a tokenized batch ------------------------------------------------------------

BATCH_SIZES = arg(8, 2, extra=integers(-1, 3))
POSITION_GROUPS = arg(
    ("FE", "LT"),
    ("LT",),
    "LT",
    extra=st.sampled_from([("FE", "FE"), ("XX",), "FE+LT", ["LT", None]]),
)


def _tokenized(world, data) -> Any:
    return data.draw(
        st.sampled_from(
            [world.batch, world.batch, world.examples, [PROMPT], None, world.batch.tokens]
        ),
        "tokenized",
    )


@fuzzes("run_position_grafting")
@budget(20)
@given(data=st.data())
def test_run_position_grafting(world, data):
    tokenized = _tokenized(world, data)
    kwargs = dict(
        configs=data.draw(
            arg(
                ("PRE", "SFT"),
                ("PRE", "SFT", "FE+LT"),
                ["SFT", "PRE", "SFT"],
                extra=st.sampled_from([("XYZ",), "PRE", ("PRE", None)]),
            ),
            "configs",
        ),
        batch_size=data.draw(BATCH_SIZES, "batch_size"),
        components=data.draw(arg(None, "o+ffn", extra=st.just("router")), "components"),
        source=data.draw(arg(1, extra=integers(-1, 3)), "source"),
        top_k=data.draw(arg(10, 1, extra=integers(-1, 400)), "top_k"),
        score=data.draw(
            arg("first_token", "kl", "answer_logprob", extra=st.just("kl_div")), "score"
        ),
    )
    rows = door(
        gl.run_position_grafting, world.models, tokenized=tokenized, progress=False, **kwargs
    )
    if rows is None:
        return
    if kwargs["components"] is None:  # SFT grafts every component, so it is the donor
        _check_pre_sft(world, rows, int(kwargs["source"]))
    if kwargs["score"] == "kl":  # the donor's own rows are at KL 0
        assert (rows[rows["config"] == "PRE"]["kl_recovered"].fillna(0) == 0).all()


def _check_pre_sft(world, rows: pd.DataFrame, source: int = 1, semantics: Any = None) -> None:
    """PRE rows are the base's own forward, SFT rows the donor's (source 1)."""
    for row in rows.itertuples():
        model = {"PRE": world.base, "SFT": world.donor if source == 1 else None}.get(row.config)
        if model is None:
            continue
        p, probabilities = answer_probabilities(model, world, row.text, row.target, semantics)
        assert row.target_prob == pytest.approx(p, rel=1e-4, abs=1e-6), row.config
        assert rank_fits(row.target_rank, row.target_prob, probabilities), row.config


@fuzzes("run_experiment")
@budget(15)
@given(data=st.data())
def test_run_experiment(world, data):
    from grafting_lens.study import make_test_sets

    relations = gl.worlds.data.make_relations("fake_movies_real_actors", n=3, seed=0)
    test_sets = data.draw(
        st.sampled_from(["headline", "both", "none", "list", "empty"]).map(
            lambda kind: {
                "headline": lambda: make_test_sets(relations, prompts=("headline",))[0],
                "both": lambda: make_test_sets(relations),
                "none": lambda: None,
                "list": lambda: [PROMPT],
                "empty": lambda: [],
            }[kind]()
        ),
        "test_sets",
    )
    with tempfile.TemporaryDirectory() as scratch:
        file = Path(scratch, "file.txt")
        file.write_text("not a directory")
        out = data.draw(
            st.sampled_from(
                [None, Path(scratch, "out"), str(Path(scratch, "a", "b")), file, "", 3]
            ),
            "out",
        )
        settings = data.draw(
            st.sampled_from(
                [
                    {},
                    {"top_k": 3},
                    {"top_k": 0},
                    {"bogus": 1},
                    {"semantics": "clean"},
                    {"batch_size": np.int64(2)},
                ]
            ),
            "settings",
        )
        configs = data.draw(
            arg(
                ["PRE", "SFT"],
                "PRE",
                ["PRE", "FE+LT"],
                extra=st.sampled_from([["PRE", "PRE"], ["nope"], [None]]),
            ),
            "configs",
        )
        rows = door(
            gl.run_experiment,
            world.models,
            test_sets=test_sets,
            configs=configs,
            out=out,
            **settings,
            progress=False,
        )
    if rows is None:
        return
    _check_pre_sft(world, rows, semantics=settings.get("semantics"))


@fuzzes("compare_graft_and_patch")
@budget(10)
@given(data=st.data())
def test_compare_graft_and_patch(world, data):
    tokenized = _tokenized(world, data)
    kwargs = dict(
        positions=data.draw(
            arg(("LT",), ("LT", "FE"), extra=st.sampled_from([(), ("ZZ",), "LT", ("LT", "LT")])),
            "positions",
        ),
        layers=data.draw(arg([0], [2], extra=integers(-5, 5)), "layers"),
        direction=data.draw(arg("sufficiency", "necessity", extra=st.just("both")), "direction"),
        methods=data.draw(
            arg(
                ("graft", "patch"),
                ("graft",),
                extra=st.sampled_from([(), ("patch", "patch"), "graft", ("grfat",)]),
            ),
            "methods",
        ),
        source=data.draw(arg(1, extra=integers(-1, 3)), "source"),
        target=data.draw(arg(0, extra=integers(-1, 3)), "target"),
        batch_size=data.draw(BATCH_SIZES, "batch_size"),
        rows_per_forward=data.draw(arg(256, extra=integers(-1, 2)), "rows_per_forward"),
        score=data.draw(
            arg("first_token", "kl", "answer_logprob", extra=st.sampled_from(["logit_diff", 2])),
            "score",
        ),
        counter=data.draw(arg(None, extra=st.one_of(st.sampled_from(ANSWERS), HOSTILE)), "counter"),
    )
    table = door(
        gl.compare_graft_and_patch, world.models, tokenized=tokenized, progress=False, **kwargs
    )
    if table is None:
        return
    assert isinstance(table, pd.DataFrame) and len(table) > 0
    for column in ("answer_logprob", "logit_diff", "kl"):
        if column in table:
            assert np.isfinite(table[column].to_numpy(dtype=float)).all(), column


@fuzzes("attribute_grafts", "plot_attribution")
@budget(10)
@given(data=st.data())
def test_attribute_grafts(world, data):
    tokenized = _tokenized(world, data)
    kwargs = dict(
        metric=data.draw(
            arg("logprob", "prob", extra=st.sampled_from(["logit", "bogus", len])), "metric"
        ),
        components=data.draw(COMPONENTS, "components"),
        layers=data.draw(LAYERS, "layers"),
        positions=data.draw(POSITION_GROUPS, "positions"),
        direction=data.draw(arg("sufficiency", "necessity", extra=st.just("both")), "direction"),
        source=data.draw(arg(1, extra=integers(-1, 3)), "source"),
        method=data.draw(arg("gradient", "exact", extra=st.just("ig")), "method"),
        steps=data.draw(arg(2, extra=integers(-1, 3), hostile=CHEAP), "steps"),
        verify=data.draw(arg(None, 2, "all", extra=integers(-1, 3)), "verify"),
        batch_size=data.draw(BATCH_SIZES, "batch_size"),
        logits=data.draw(arg("last", "all", extra=st.just("first")), "logits"),
    )
    attribution = door(
        gl.attribute_grafts, world.models, tokenized=tokenized, progress=False, **kwargs
    )
    frame = attribution.frame if attribution is not None else pd.DataFrame()
    frame = data.draw(
        st.sampled_from([frame, frame.iloc[:0], frame.drop(columns=frame.columns[:1]), "frame"]),
        "frame",
    )
    figure = door(
        gl.plot_attribution,
        frame=frame,
        value=data.draw(arg("estimate", "exact", extra=st.just("both")), "value"),
        title=data.draw(arg(None, "t", extra=text(5)), "title"),
        columns=data.draw(arg(3, 1, extra=integers(-1, 5)), "columns"),
    )
    assert figure is None or isinstance(figure, go.Figure)


@fuzzes("find_minimal_graft", "plot_recovery")
@budget(8)
@given(data=st.data())
def test_find_minimal_graft(world, data):
    tokenized = _tokenized(world, data)
    kwargs = dict(
        fraction=data.draw(
            arg(0.5, 0.9, extra=st.sampled_from([0.0, 1.0, 1.5, -0.1, np.float32(0.5)])), "fraction"
        ),
        components=data.draw(arg("o+ffn", "all", extra=st.just("router")), "components"),
        layers=data.draw(arg([1, 2], "last_half", extra=integers(-5, 5)), "layers"),
        positions=data.draw(POSITION_GROUPS, "positions"),
        source=data.draw(arg(1, extra=integers(-1, 3)), "source"),
        reference=data.draw(arg("donor", extra=st.just("base")), "reference"),
        search=data.draw(arg("doubling", "greedy", extra=st.just("beam")), "search"),
        steps=data.draw(arg(2, extra=integers(-1, 3), hostile=CHEAP), "steps"),
        max_cells=data.draw(arg(None, 4, extra=integers(-1, 3)), "max_cells"),
        curve_points=data.draw(arg(25, None, extra=integers(-1, 3)), "curve_points"),
        batch_size=data.draw(BATCH_SIZES, "batch_size"),
    )
    found = door(gl.find_minimal_graft, world.models, tokenized=tokenized, progress=False, **kwargs)
    curve = found.curve if found is not None else pd.DataFrame()
    curve = data.draw(st.sampled_from([curve, curve.iloc[:0], "curve"]), "curve")
    figure = door(
        gl.plot_recovery,
        curve=curve,
        fraction=data.draw(arg(None, 0.9, extra=st.sampled_from([2.0, -1.0])), "fraction"),
        title=data.draw(arg(None, "t", extra=text(5)), "title"),
    )
    assert figure is None or isinstance(figure, go.Figure)


_RESULTS: dict[str, pd.DataFrame] = {}


def _results(world) -> pd.DataFrame:
    """A results table of the runner (once per session)."""
    if "rows" not in _RESULTS:
        _RESULTS["rows"] = gl.run_position_grafting(
            world.models, world.batch, ["PRE", "SFT", "FE+LT"], progress=False
        )
    return _RESULTS["rows"]


@fuzzes("summarize", "plot_accuracy")
@budget(30)
@given(data=st.data())
def test_summarize(world, data):
    rows = _results(world)
    results = data.draw(
        st.sampled_from(["whole", "empty", "no rank", "nan rank", "negative rank", "list"]).map(
            lambda kind: {
                "whole": rows,
                "empty": rows.iloc[:0],
                "no rank": rows.drop(columns="target_rank"),
                "nan rank": rows.assign(
                    target_rank=np.where(np.arange(len(rows)) == 0, np.nan, rows["target_rank"])
                ),
                "negative rank": rows.assign(target_rank=-1),
                "list": rows.to_dict("records"),
            }[kind]
        ),
        "results",
    )
    kwargs = dict(
        by=data.draw(
            arg(
                ("config", "prompt"),
                ("config",),
                "config",
                extra=st.sampled_from([(), ("config", "config"), ("nope",)]),
            ),
            "by",
        ),
        ks=data.draw(arg((1, 5), (1,), 3, extra=st.lists(integers(-1, 6), max_size=3)), "ks"),
        n_resamples=data.draw(arg(50, 1, extra=integers(-1, 3), hostile=CHEAP), "n_resamples"),
        confidence=data.draw(
            arg(0.95, 0.5, extra=st.sampled_from([0.0, 1.0, 95, np.float32(0.9)])), "confidence"
        ),
        seed=data.draw(arg(0, extra=integers(-1, 2**33)), "seed"),
    )
    summary = door(gl.summarize, results=results, **kwargs)
    if summary is None:
        return
    by = [kwargs["by"]] if isinstance(kwargs["by"], str) else list(kwargs["by"])
    ks = [kwargs["ks"]] if not isinstance(kwargs["ks"], (list, tuple)) else list(kwargs["ks"])
    groups = results.groupby(by, sort=False)
    for k in ks:
        expected = groups["target_rank"].apply(lambda r, k=int(k): float((r < k).mean()))
        got = summary.set_index(by)[f"top{int(k)}"]
        np.testing.assert_allclose(got.loc[expected.index], expected)
        low, high = summary[f"top{int(k)}_low"], summary[f"top{int(k)}_high"]
        assert (
            (low <= summary[f"top{int(k)}"] + 1e-9) & (summary[f"top{int(k)}"] <= high + 1e-9)
        ).all()
    assert summary.set_index(by)["n"].loc[groups.size().index].tolist() == groups.size().tolist()
    figure = door(
        gl.plot_accuracy,
        summary=summary,
        k=data.draw(st.one_of(st.sampled_from(ks), integers(-1, 7), HOSTILE), "k"),
        x=data.draw(arg(by[0], extra=st.just("nope")), "x"),
        color=data.draw(arg(by[-1], "config", extra=st.just("nope")), "color"),
        title=data.draw(arg(None, "t", extra=text(5)), "title"),
        caption=data.draw(arg(None, "c", extra=text(5)), "caption"),
    )
    assert figure is None or isinstance(figure, go.Figure)


# -- models and worlds --------------------------------------------------------------------------


@fuzzes("load_models", "ModelSet")
@budget(10)
@given(data=st.data())
def test_load_models(world, data):
    with tempfile.TemporaryDirectory() as scratch:
        file = Path(scratch, "model.gguf")
        file.write_bytes(b"GGUF not really")
        empty = Path(scratch, "empty")
        empty.mkdir()
        sources = data.draw(
            st.lists(
                st.sampled_from(["base", "donor", "file", "empty", "missing", "", None, 3]),
                min_size=0,
                max_size=3,
            ),
            "sources",
        )
        given_sources = [
            {
                "base": copy.deepcopy(world.base),
                "donor": copy.deepcopy(world.donor),
                "file": str(file),
                "empty": empty,
                "missing": str(Path(scratch, "missing")),
            }.get(kind, kind)
            for kind in sources
        ]
        before = [s.state_dict() if isinstance(s, torch.nn.Module) else None for s in given_sources]
        before = [None if b is None else {k: v.clone() for k, v in b.items()} for b in before]
        kwargs = dict(
            tokenizer=data.draw(
                st.sampled_from([world.tokenizer, world.tokenizer, None, "gpt2-nonexistent", 3]),
                "tokenizer",
            ),
            names=data.draw(
                arg(
                    None,
                    extra=st.lists(
                        st.one_of(st.sampled_from(["pre", "sft", "pre"]), text(5)), max_size=3
                    ),
                ),
                "names",
            ),
            device=data.draw(
                arg(None, "cpu", extra=st.sampled_from([torch.device("cpu"), "cuda:7", "gpu"])),
                "device",
            ),
            dtype=data.draw(
                arg(
                    None,
                    "float32",
                    extra=st.sampled_from([torch.float32, "float64", "int8", torch.int64]),
                ),
                "dtype",
            ),
            components=data.draw(arg(None, "o+ffn", extra=st.just("router")), "components"),
            layers=data.draw(arg(None, [0], extra=integers(-5, 5)), "layers"),
        )
        models = door(gl.load_models, *given_sources, **kwargs)
        for source, state in zip(given_sources, before):
            if state is not None:  # a model passed in is left as it was
                for key, value in source.state_dict().items():
                    assert torch.equal(value, state[key]), f"load_models changed the caller's {key}"
    if models is None:
        return
    assert len(models) == len(sources) >= 2
    tokens = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for kind, name, bridge_logits in zip(sources, models.names, (models.base(tokens), None)):
            if bridge_logits is not None and kind in ("base", "donor"):
                expected = {"base": world.base, "donor": world.donor}[kind](tokens).logits
                torch.testing.assert_close(bridge_logits.float(), expected, rtol=1e-4, atol=1e-4)
    names = data.draw(
        arg(
            ["a", "b"], extra=st.lists(st.one_of(st.sampled_from(["a", "a"]), text(3)), max_size=3)
        ),
        "ModelSet names",
    )
    again = door(gl.ModelSet, sources=models.sources, names=names)
    if again is not None:
        assert list(again.names) == [str(n) for n in names] and len(set(again.names)) == len(
            again.names
        )


@fuzzes("build_toy_world")
@budget(6)
@given(data=st.data())
def test_build_toy_world(data):
    from grafting_lens.worlds.toy import ToyWorldConfig

    with tempfile.TemporaryDirectory() as scratch:
        file = Path(scratch, "file")
        file.write_text("x")
        kwargs = dict(
            # Other configurations train a world (minutes): only the shipped one, or the wrong type.
            config=data.draw(
                st.sampled_from([None, ToyWorldConfig(), "toy", {"n_relations": 4}, 3]), "config"
            ),
            cache_dir=data.draw(
                st.sampled_from([Path(scratch, "cache"), str(Path(scratch, "c")), file, ""]),
                "cache_dir",
            ),
            force=False,
            progress=data.draw(arg(False, extra=st.just("no")), "progress"),
            threads=data.draw(arg(1, None, extra=integers(-1, 4096)), "threads"),
        )
        here = Path(scratch, "cwd")
        here.mkdir()
        with threads_kept(), contextlib.chdir(here):
            toy = door(gl.build_toy_world, **kwargs)
        assert toy is None or isinstance(toy, gl.worlds.toy.ToyWorld)
        # cache_dir="" once unpacked the world into the working directory.
        assert not list(here.iterdir()), "build_toy_world wrote into the working directory"
