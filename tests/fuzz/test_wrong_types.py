"""One exception for one mistake: an argument of the wrong type, at every door of ``gl``.

Each public callable is called with arguments it takes, but one of them replaced by a value
no argument of the library takes (a bare ``object()``, a complex number, ``Ellipsis``). The
call must raise :class:`~grafting_lens.errors.ArgumentTypeError` (a ``TypeError``) naming
that argument: never a raw ``TypeError`` or ``AttributeError`` from inside, never another kind
of :class:`~grafting_lens.GraftingLensError`, and never a result. The arguments of
``NOT_YET`` do not keep it yet, and are left out until their doors do.
"""

from __future__ import annotations

import contextlib
import inspect
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import grafting_lens as gl
from fuzz.conftest import PROMPT
from fuzz.strategies import _mentions, budget, threads_kept
from grafting_lens.core.errors import ArgumentTypeError
from grafting_lens.study import TestSet

WRONG = st.sampled_from([object(), 1j, Ellipsis])
"""Values of a type no argument of the library takes."""

EXCUSED = {
    "CLEAN": "a constant (a Semantics), not called",
    "REFERENCE": "a constant (a Semantics), not called",
    "errors": "a module of exception classes",
    "GraftingLensError": "an exception class",
    "build_real_world": "downloads a base model and finetunes it for hours; CI is offline",
}

_CACHE: dict[str, Any] = {}


def _once(name: str, make: Callable[[], Any]) -> Any:
    if name not in _CACHE:
        _CACHE[name] = make()
    return _CACHE[name]


def _mask(world) -> Any:
    return _once("mask", lambda: gl.GraftMask.build(world.models, tokens=(1, 4), positions="last"))


def _attribution(world) -> Any:
    return _once(
        "attribution",
        lambda: gl.attribute_grafts(
            world.models, world.batch, layers=[0], positions=("LT",), progress=False
        ),
    )


def _found(world) -> Any:
    return _once(
        "found",
        lambda: gl.find_minimal_graft(
            world.models,
            world.search_batch,
            components="o+ffn",
            layers=[1],
            positions=("LT",),
            steps=2,
            progress=False,
        ),
    )


def _table(world) -> Any:
    return _once("table", lambda: gl.graft(world.models, PROMPT, "movie"))


def _results(world) -> Any:
    return _once(
        "results",
        lambda: gl.run_position_grafting(world.models, world.batch, ["PRE"], progress=False),
    )


def _doors(world, scratch: Path) -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """Each public callable with arguments it takes (each cheap to run)."""
    models, tokens = world.models, torch.tensor([[1, 2, 3, 4]])
    mask = _mask(world)
    return {
        "graft": (gl.graft, dict(models=models, prompts=PROMPT, answer="movie", at="last")),
        "plot_graft": (gl.plot_graft, dict(table=_table(world), k=5, title="t")),
        "summarize": (gl.summarize, dict(results=_results(world), n_resamples=10)),
        "plot_accuracy": (
            gl.plot_accuracy,
            dict(summary=gl.summarize(_results(world), n_resamples=10), k=5, title="t"),
        ),
        "plot_attribution": (gl.plot_attribution, dict(frame=_attribution(world).frame)),
        "plot_recovery": (gl.plot_recovery, dict(curve=_found(world).curve, fraction=0.5)),
        "GraftMask": (
            gl.GraftMask.build,
            dict(models=models, tokens=(1, 4), positions="last", layers="all", source=1),
        ),
        "graft_forward": (
            gl.graft_forward,
            dict(models=models, tokens=tokens, mask=mask, attention_mask=None, logits="last"),
        ),
        "graft_forward_reference": (
            gl.graft_forward_reference,
            dict(models=models, tokens=tokens, mask=mask),
        ),
        "graft_generate": (
            gl.graft_generate,
            dict(models=models, tokens=tokens, mask=mask, max_new_tokens=1),
        ),
        "grafting": (lambda **kw: _enter(gl.grafting(**kw)), dict(models=models, mask=mask)),
        "patch_forward": (
            gl.patch_forward,
            dict(models=models, tokens=tokens, site="resid_pre", layers=[0], positions="last"),
        ),
        "resid_patch_sweep": (
            gl.resid_patch_sweep,
            dict(
                models=models,
                tokens=tokens,
                metric=lambda logits: logits[:, -1, 0].mean(),
                layers=[0],
                positions="last",
                progress=False,
            ),
        ),
        "head_patch_sweep": (
            gl.head_patch_sweep,
            dict(
                models=models,
                tokens=tokens,
                metric=lambda logits: logits[:, -1, 0].mean(),
                layers=[0],
                heads=0,
                positions="last",
                progress=False,
            ),
        ),
        "resolve_layers": (gl.resolve_layers, dict(spec="all", n_layers=4)),
        "select_positions": (
            gl.select_positions,
            dict(
                expression="LT",
                spans=world.batch.spans,
                attention_mask=world.batch.attention_mask,
            ),
        ),
        "run_position_grafting": (
            gl.run_position_grafting,
            dict(models=models, tokenized=world.batch, configs=("PRE",), progress=False),
        ),
        "run_experiment": (
            gl.run_experiment,
            dict(models=models, test_sets=TestSet(world.batch), configs=["PRE"], progress=False),
        ),
        "compare_graft_and_patch": (
            gl.compare_graft_and_patch,
            dict(
                models=models,
                tokenized=world.batch,
                positions=("LT",),
                layers=[0],
                methods=("graft",),
                progress=False,
            ),
        ),
        "attribute_grafts": (
            gl.attribute_grafts,
            dict(
                models=models, tokenized=world.batch, layers=[0], positions=("LT",), progress=False
            ),
        ),
        "find_minimal_graft": (
            gl.find_minimal_graft,
            dict(
                models=models,
                tokenized=world.search_batch,
                components="o+ffn",
                layers=[1],
                positions=("LT",),
                steps=2,
                progress=False,
            ),
        ),
        "load_models": (
            gl.load_models,
            dict(sources=(world.base, world.donor), tokenizer=world.tokenizer),
        ),
        "ModelSet": (gl.ModelSet, dict(sources=models.sources, names=["a", "b"])),
        "build_toy_world": (
            gl.build_toy_world,
            dict(cache_dir=scratch / "cache", progress=False, threads=1),
        ),
        "notebook": (gl.notebook, dict(threads=1, grad=False, renderer=None)),
    }


def _replaced(kwargs: dict[str, Any], parameter: str, wrong: Any) -> Any:
    """``wrong`` in place of ``parameter``, or of the first of the sources."""
    return (wrong, *kwargs["sources"][1:]) if parameter == "sources" else wrong


def _enter(context: Any) -> None:
    with context:
        pass


def _call(call: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    if "sources" in kwargs and call is gl.load_models:  # positional, *sources
        kwargs = dict(kwargs)
        return call(*kwargs.pop("sources"), **kwargs)
    return call(**kwargs)


def _parameters(name: str) -> list[str]:
    """The arguments a door takes by name (``*sources`` counted as one)."""
    call = gl.GraftMask.build if name == "GraftMask" else getattr(gl, name)
    return [p.name for p in inspect.signature(call).parameters.values() if p.kind != p.VAR_KEYWORD]


def test_every_public_callable_is_tried_or_excused(world):
    with tempfile.TemporaryDirectory() as scratch:
        doors = set(_doors(world, Path(scratch)))
    assert doors | set(EXCUSED) == set(gl.__all__)
    assert not doors & set(EXCUSED)


# Doors that still raise another kind (or nothing) for a wrong type, as the first run of this
# property found them: each to be made an ArgumentTypeError at its own door, then removed here.
# build_toy_world: config=object() trains a world (minutes) instead of refusing it.
NOT_YET: dict[str, str] = {
    # Refused whatever their type, by design, before their type matters: heads= applies to the
    # per-head site only (the door's site is resid_pre), beam= to search='greedy' only.
    "patch_forward": "heads",
    "find_minimal_graft": "beam",
}


SLOTS = [
    (name, parameter)
    for name in (
        "graft plot_graft summarize plot_accuracy plot_attribution plot_recovery GraftMask "
        "graft_forward graft_forward_reference graft_generate grafting patch_forward "
        "resid_patch_sweep head_patch_sweep resolve_layers select_positions "
        "run_position_grafting run_experiment compare_graft_and_patch attribute_grafts "
        "find_minimal_graft load_models ModelSet build_toy_world notebook"
    ).split()
    for parameter in _parameters(name)
    if parameter not in NOT_YET.get(name, "").split()
]


@budget(60)
@given(slot=st.sampled_from(SLOTS), wrong=WRONG)
def test_a_wrong_type_is_an_argument_type_error(world, slot, wrong):
    name, parameter = slot
    with tempfile.TemporaryDirectory() as scratch, threads_kept():
        call, kwargs = _doors(world, Path(scratch))[name]
        kwargs = {**kwargs, parameter: _replaced(kwargs, parameter, wrong)}
        with contextlib.chdir(scratch), pytest.raises(ArgumentTypeError) as raised:
            _call(call, kwargs)
    assert _mentions(str(raised.value), parameter, wrong), (
        f"{name}({parameter}={wrong!r}) refused without naming it: {raised.value}"
    )
