"""The exceptions grafting-lens raises on purpose, all in this one room, each naming the fix.

A usable type with an unusable value raises a subclass of :class:`GraftingLensError` (also a
:class:`ValueError`); a wrong type altogether :class:`ArgumentTypeError` (also a
:class:`TypeError`). The hierarchy, and a page per error: ``docs/errors/index.md``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "AdapterError",
    "AlignmentError",
    "ArgumentTypeError",
    "AttributionError",
    "BatchError",
    "ComponentError",
    "DependencyError",
    "ExperimentError",
    "GraftMaskError",
    "GraftingError",
    "GraftingLensError",
    "LazyLoadWarning",
    "NonFiniteLogitsError",
    "PatchingError",
    "RunError",
    "ScoreError",
    "SelectionError",
    "TokenError",
    "ToyWorldError",
    "WorldCacheError",
    "WorldSourceError",
    "check_known",
    "did_you_mean",
    "kind",
    "refuse_first",
    "unsafe_pickle",
]


class GraftingLensError(ValueError):
    """Base class of every error raised on purpose by grafting-lens."""


class ArgumentTypeError(GraftingLensError, TypeError):
    """An argument of the wrong type altogether: a :class:`TypeError`, as Python's own raise,
    and a :class:`GraftingLensError`, so one ``except`` catches every refusal."""


class AlignmentError(GraftingLensError):
    """The checkpoints of a :class:`~grafting_lens.ModelSet` cannot be grafted together: not one
    network with other weights, or placed apart (another dtype or device)."""


class AdapterError(AlignmentError):
    """A LoRA/PEFT adapter cannot be grafted: made for another base, or of a kind not computed
    (the fix for those: merge it into a full checkpoint and load that)."""


class ComponentError(GraftingLensError):
    """A component name is unknown, the architecture does not have that component, or a
    graft would take every component around weights that no component covers."""


class UnsupportedArchitectureError(GraftingLensError):
    """A model whose architecture TransformerLens cannot bridge, so it cannot be grafted."""


class UnverifiedArchitectureWarning(UserWarning):
    """A model TransformerLens bridges, of an architecture grafting-lens has not verified."""


class LazyLoadWarning(UserWarning):
    """A lazily loaded donor is being loaded whole, to run alone (patching, scoring)."""


class GraftMaskError(GraftingLensError):
    """A graft mask does not fit the model set or the tokens it is used with."""


class SelectionError(GraftMaskError):
    """Positions, spans or layers cannot be selected (:mod:`grafting_lens.engine.positions`,
    :mod:`grafting_lens.models.layers`); patching reports the same as :class:`PatchingError`."""


class TokenError(GraftMaskError):
    """Token ids that the model set cannot run: not a ``[batch, pos]`` tensor of ids
    within the vocabulary (see :meth:`grafting_lens.models.model_set.ModelSet.check_tokens`)."""


class ScoreError(GraftingLensError):
    """A score cannot be computed as asked: an unknown name, a missing (counter-)answer, a
    function that returns no number per prompt (:class:`~grafting_lens.analysis.scoring.Score`)."""


class BatchError(GraftingLensError):
    """A tokenized batch is malformed: a missing part, or parts whose shapes disagree
    (see :func:`grafting_lens.analysis.batch.as_batch`)."""


class DependencyError(GraftingLensError):
    """An installed release of transformers, TransformerLens or torch no longer computes what
    this library relies on (a pass continued over a key/value cache, checked once per model)."""


class GraftingError(GraftingLensError):
    """A grafted run was asked for something the single pass cannot do."""


class NonFiniteLogitsError(GraftingLensError):
    """Logits to be scored hold NaN or infinite values (a NaN would rank 0, a perfect answer)."""


class PatchingError(GraftingLensError):
    """A patch or sweep was asked for something the model set or the tokens cannot give."""


class AttributionError(GraftingLensError):
    """A graft attribution or minimal-graft search cannot give what was asked: a metric that is
    not one differentiable value per prompt, a fraction outside (0, 1], unmixable outputs."""


class ExperimentError(GraftingLensError):
    """An experiment, configuration, registry or test set is unknown, taken or malformed."""


class RunError(GraftingLensError):
    """A run or output directory cannot be used: it holds another run (or its report), another
    process writes into it, its chunks cannot be trusted, or it cannot be written."""


class ToyWorldError(GraftingLensError):
    """The toy world shipped with the package, or one in the cache, is damaged or does not
    match the recipe; the message says how to repair it (reinstall, or rebuild)."""


class WorldSourceError(GraftingLensError):
    """The weights a real-model world is made from cannot be used: not fetched, damaged (not a
    GGUF, a wrong checksum) or of another architecture; the message names the file and fix."""


class WorldCacheError(GraftingLensError):
    """Where a world or converted checkpoint goes cannot be used: the target is, holds or lies
    inside the source, holds files grafting-lens did not write, or cannot be written; or the
    world asked for is not built yet."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A " Did you mean 'x'?" suffix naming the closest choice, or an empty string."""
    by_lowercase = {str(choice).lower(): choice for choice in choices}  # 'b2a' is 'B2A'
    close = difflib.get_close_matches(str(name).lower(), list(by_lowercase), n=1, cutoff=0.5)
    return f" Did you mean {by_lowercase[close[0]]!r}?" if close else ""


def check_known(
    name: object,
    choices: Iterable[str],
    what: str,
    error: type[GraftingLensError] = GraftingLensError,
    known: str = "",
) -> str:
    """``name`` if it is one of ``choices``; else refused in the one wording of unknown names:
    ``Unknown <what> 'x'. Did you mean 'y'? Known: a, b<known>.``

    Raises:
        ArgumentTypeError: ``name`` is not a string.
        GraftingLensError: ``error``, naming the choices.
    """
    choices = list(choices)
    if not isinstance(name, str) or name not in choices:
        raise (error if isinstance(name, str) else ArgumentTypeError)(
            f"Unknown {what} {name!r}.{did_you_mean(str(name), choices)} Known: "
            f"{', '.join(choices) or 'none'}{known}."
        )
    return name


def kind(
    value: object, accepted: type | tuple[type, ...], error: type[GraftingLensError]
) -> type[GraftingLensError]:
    """``error`` for a value of an ``accepted`` type, else :class:`ArgumentTypeError`: one
    refusal type for a wrong type at every door, whatever the door's own error is."""
    return error if isinstance(value, accepted) else ArgumentTypeError


def refuse_first(error: type[GraftingLensError], checks: Iterable[tuple[object, str]]) -> None:
    """Refuse with the message of the first ``(found, message)`` whose ``found`` holds (a door's
    refusals as one table).

    Raises:
        GraftingLensError: ``error``, with that message.
    """
    message = next((message for found, message in checks if found), None)
    if message is not None:
        raise error(message)


def unsafe_pickle(what: str) -> str:
    """The message for a pickled file that torch's safe loader refused (whose own advice,
    ``weights_only=False``, would run whatever code the file holds)."""
    return (
        f"{what} is a pickle holding more than tensors, refused as unsafe (unpickling could run "
        "any code). If you trust it, convert it to safetensors where it was made "
        "(save_pretrained(..., safe_serialization=True)) and load that."
    )
