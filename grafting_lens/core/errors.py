"""The exceptions grafting-lens raises on purpose, all in this one room.

Every error a user can meet names the problem and the fix. An argument of a
usable type but an unusable value raises a subclass of :class:`GraftingLensError`,
which is also a :class:`ValueError`, so ``except ValueError`` keeps working for code
that does not care which. An argument of the wrong type altogether (a number where
a checkpoint is expected, a slow tokenizer where offsets are needed) raises
:class:`TypeError`, as Python's own functions do.

The hierarchy, one class per thing that can go wrong:

    GraftingLensError
    ├── AlignmentError      the checkpoints cannot be grafted together
    │   └── AdapterError    an adapter grafting-lens cannot compute, or made for another base
    ├── ComponentError      an unknown component, or one the architecture lacks
    ├── GraftMaskError      a graft mask does not fit the model set or the tokens
    │   ├── SelectionError  positions, spans or layers cannot be selected
    │   └── TokenError      token ids the model set cannot run
    ├── BatchError          a tokenized batch is malformed
    ├── GraftingError       a grafted run asked for something the single pass cannot do
    ├── KernelError         an unknown kernel policy, or an unusable kernel decision file
    ├── NonFiniteLogitsError  logits to be scored hold NaN or infinite values
    ├── PatchingError       a patch or sweep the model set or tokens cannot give
    ├── AttributionError    a graft attribution or graft search that cannot be run
    ├── ExperimentError     an unknown or malformed experiment, configuration or test set
    ├── RunError            a run or output directory cannot be used
    ├── ToyWorldError       the shipped toy world is damaged
    ├── WorldSourceError    a real model's weights cannot be fetched, are damaged or are foreign
    ├── WorldCacheError     where a world or a converted checkpoint goes cannot be used
    └── DependencyError     an installed release computes something this library does not expect

:class:`SelectionError` and :class:`TokenError` derive from :class:`GraftMaskError`
because selections and tokens were reported as mask errors before they had names
of their own: ``except GraftMaskError`` keeps catching them.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "AdapterError",
    "AlignmentError",
    "AttributionError",
    "BatchError",
    "ComponentError",
    "DependencyError",
    "ExperimentError",
    "GraftMaskError",
    "GraftingError",
    "GraftingLensError",
    "KernelError",
    "LazyLoadWarning",
    "NonFiniteLogitsError",
    "PatchingError",
    "RunError",
    "SelectionError",
    "TokenError",
    "ToyWorldError",
    "WorldCacheError",
    "WorldSourceError",
    "did_you_mean",
    "unsafe_pickle",
]


class GraftingLensError(ValueError):
    """Base class of every error raised on purpose by grafting-lens."""


class AlignmentError(GraftingLensError):
    """The checkpoints of a :class:`~grafting_lens.ModelSet` cannot be grafted together.

    Grafting swaps one checkpoint's weights for another's at the same place in the
    network, so every source must share the architecture, the shape of every
    parameter and the vocabulary of the base. The message names the first difference.
    """


class AdapterError(AlignmentError):
    """A LoRA/PEFT adapter cannot be grafted: made for another base, or of a kind not computed.

    An adapter whose modules or shapes do not match the base was made for another
    model. grafting-lens computes plain LoRA (``W x + B A x * scale``, with rsLoRA's
    scale and per-module ranks and alphas) on linear layers and embeddings, and
    ``modules_to_save``; other PEFT methods and LoRA variants (DoRA, LoRA biases,
    adapters of raw parameters) are refused with the variant named. The fix for
    those: merge the adapter into a full checkpoint (PEFT's ``merge_and_unload``)
    and load that.
    """


class ComponentError(GraftingLensError):
    """A component name is unknown, the architecture does not have that component, or a
    graft would take every component around weights that no component covers."""


class UnsupportedArchitectureError(GraftingLensError):
    """A model whose architecture TransformerLens cannot bridge, so it cannot be grafted.

    The message names the model's class and ``model_type``, the nearest supported
    architectures, and what to do.
    """


class UnverifiedArchitectureWarning(UserWarning):
    """A model TransformerLens bridges, of an architecture grafting-lens has not verified."""


class LazyLoadWarning(UserWarning):
    """A lazily loaded donor is being loaded whole, to run alone (patching, scoring)."""


class GraftMaskError(GraftingLensError):
    """A graft mask does not fit the model set or the tokens it is used with."""


class SelectionError(GraftMaskError):
    """Positions, spans or layers cannot be selected.

    Raised by the selectors in :mod:`grafting_lens.engine.positions` and
    :mod:`grafting_lens.models.layers`: an unknown selector, a span expression that does not
    parse, an index outside a row's real tokens, an attention mask that is not right
    padding, a layer outside the model. Patching reports the same messages as
    :class:`PatchingError`.
    """


class TokenError(GraftMaskError):
    """Token ids that the model set cannot run: not a ``[batch, pos]`` tensor of ids
    within the vocabulary (see :meth:`grafting_lens.models.model_set.ModelSet.check_tokens`)."""


class BatchError(GraftingLensError):
    """A tokenized batch is malformed: a missing part, or parts whose shapes disagree
    (see :func:`grafting_lens.analysis.batch.as_batch`)."""


class DependencyError(GraftingLensError):
    """An installed release of transformers, TransformerLens or torch no longer computes what
    this library relies on.

    Paths that rely on more than a plain forward pass (continuing a pass over a
    key/value cache: the token-by-token reference, generation, patching that resumes
    the unpatched run) check that behaviour once per model against a plain pass and
    raise this, with the installed versions, instead of returning a number that a new
    release made wrong. The fix: install the versions of the project's lock, or report
    the versions named to grafting-lens.
    """


class GraftingError(GraftingLensError):
    """A grafted run was asked for something the single pass cannot do."""


class KernelError(GraftingLensError):
    """The kernel for grafted linear layers cannot be chosen as asked.

    An unknown policy in :func:`grafting_lens.engine.kernels.use` or ``GRAFTING_LENS_KERNEL``,
    ``"onednn"`` pinned in a PyTorch without a working oneDNN operator, or a kernel
    decision file in the cache that cannot be read (see :mod:`grafting_lens.engine.kernels`).
    """


class NonFiniteLogitsError(GraftingLensError):
    """Logits to be scored hold NaN or infinite values.

    A NaN compares false with everything, so a rank counted as "tokens scoring
    higher than the target" would be 0, a perfect answer. Scoring refuses such
    rows instead; the message names them and the usual causes (a NaN or infinite
    weight in a checkpoint, float16 overflow).
    """


class PatchingError(GraftingLensError):
    """A patch or sweep was asked for something the model set or the tokens cannot give."""


class AttributionError(GraftingLensError):
    """A graft attribution or a search for a minimal graft was asked for something it cannot
    give: a metric that is not one differentiable value per prompt, a fraction outside
    (0, 1], a relaxation of a module whose outputs cannot be mixed."""


class ExperimentError(GraftingLensError):
    """An experiment, configuration, registry or test set is unknown, taken or malformed."""


class RunError(GraftingLensError):
    """A run or output directory cannot be used: it holds another run (or another run's
    report), another process is writing into it, its chunks cannot be trusted, it is not
    a run directory, or it cannot be written."""


class ToyWorldError(GraftingLensError):
    """The toy world shipped with the package, or one in the cache, is damaged or does not
    match the recipe; the message says how to repair it (reinstall, or rebuild)."""


class WorldSourceError(GraftingLensError):
    """The weights a real-model world is made from cannot be used: the package holding them
    cannot be fetched, the file is damaged (not a GGUF, a wrong checksum) or holds another
    architecture. The message names the file and the fix (fetch again, or pass a checkpoint)."""


class WorldCacheError(GraftingLensError):
    """Where a world or a converted checkpoint is written or looked up cannot be used: the
    target is, holds or lies inside the source; it holds files grafting-lens did not write;
    the cache is a file or cannot be written; or the world asked for is not built yet."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A " Did you mean 'x'?" suffix naming the closest choice, or an empty string."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def unsafe_pickle(what: str) -> str:
    """The message for a pickled file that torch's safe loader refused.

    torch's own message advises retrying with ``weights_only=False``, which would run
    whatever code the file holds; grafting-lens never does, and says so instead.
    """
    return (
        f"{what} is a pickle holding more than tensors, refused as unsafe: unpickling it "
        "could run arbitrary code, so grafting-lens reads pickled weights only with torch's "
        "weights-only loader and never retries without it. If you trust the file, convert it "
        "to safetensors where it was made (save_pretrained(..., safe_serialization=True)) and "
        "load that."
    )
