"""The paper's experiments: graft configurations as data, and one resumable runner for all of them.

Every experiment in the paper asks the same question of many prompts: *if these weights, at
these token positions, came from that checkpoint, would the model still name the right actor?*
Only the "these weights, these positions, that checkpoint" part changes between figures:

* **position grafting** (figures 2 and 3a) takes every weight of the finetuned model (SFT) at
  some positions (the first entity FE, the last token LT, both, their complements) and the
  pretrained model (PRE) elsewhere;
* **component grafting** (figure 4 and its baselines) takes only some matrices (ATTN, O, FFN,
  the FFN's up or down projection) at the last token, over a range of layers, from a model
  that knows the tested relations into one that knows only the task;
* the **reversal** variant grafts from a model finetuned on both directions of each relation
  into one finetuned on one direction, and asks the reversed question;
* the **hybrid** graft (figure 5) mixes three checkpoints: the task model's attention at FE
  and LT, the relation model's O and FFN at LT over the last half of the layers, plus several
  choices of task weights at FE (the authors' code grafts its *hybrid model*, the task model
  with the relation model's O, FFN-up and FFN-down from layer ``n // 2`` on: :data:`HYBRID`).

The package has one room per idea:

* :mod:`~grafting_lens.study.semantics`: :class:`Semantics`, what configurations mean
  (the authors' code, :data:`REFERENCE`, or the library's, :data:`CLEAN`);
* :mod:`~grafting_lens.study.configs`: :class:`Graft`, :class:`GraftConfig`, the
  paper's component names and the paper's configurations as data;
* :mod:`~grafting_lens.study.testsets`: :class:`TestSet`, one dataset under one prompt;
* :mod:`~grafting_lens.study.stacking`: configurations checked against a model set and
  stacked into one graft mask;
* :mod:`~grafting_lens.study.runner`: :func:`run_experiment` and its :class:`RunOptions`;
* :mod:`~grafting_lens.study.run_directory`: resumable run directories (manifest,
  fingerprint, chunks);
* :mod:`~grafting_lens.study.specs`: :class:`ExperimentSpec` and the one registry, of named
  experiments (:func:`register_experiment`), each holding the configurations its runs name
  (:func:`register_config`, :func:`get_configs`);
* :mod:`~grafting_lens.study.named`: setting up and running a named experiment;
* :mod:`~grafting_lens.study.report`: tables, markdown and the paper's figures;
* :mod:`~grafting_lens.study.paper`: the paper's experiments, one registered spec each;
* :mod:`~grafting_lens.study.patching_vs_grafting`: the comparison of both methods as
  a named experiment;
* :mod:`~grafting_lens.study.graft_attribution`: every cell's effect by attribution,
  verified, and the minimal graft, as a named experiment.

A configuration is data, a :class:`GraftConfig`: a name as in the paper's figures and a tuple
of :class:`Graft` s, each "take ``components`` over ``layers`` at ``positions`` from
``source``". Positions are *span expressions* over the spans every tokenized batch carries
(:func:`grafting_lens.engine.positions.select_positions`): ``FE``, ``LT``, ``M`` (movie title),
``REL`` (relation words), ``ALL``, joined with ``+`` and complemented with ``^C``, as in
``(FE+LT)^C``. Components use the paper's names (``ATTN``, ``O``, ``FFN``, ``FFN-up``,
``FFN-down``) or any component or group of :mod:`grafting_lens.models.components`.

:func:`run_experiment` runs a grid, model sets x test sets x configurations, and returns a tidy
DataFrame with one row per example and configuration; with ``out=`` it saves chunks as they
come and resumes a killed run.

What a configuration means is a :class:`Semantics`, because the paper's text, the authors'
released code and this library do not always agree. The paper says it uses "the finetuned
embeddings for all grafted token positions and ... the original model's unembeddings"; its code
copies weights by value, so on a model with tied embeddings (GPT-2, Llama 3.2 1B, Gemma) a
grafted embedding also decodes its position through the donor's unembedding, and it differs
on a dozen smaller points (final norm, fused QKV, layer quarters, BOS, the SFT baseline, the
hybrid model, target and rank). :data:`REFERENCE` does what the code does, :data:`CLEAN` what
this library does with components named as they are; every switch can be flipped alone
(``dataclasses.replace(REFERENCE, unembed="base")``). Everything here that takes a semantics
defaults to the one :data:`DEFAULT_SEMANTICS`, :data:`REFERENCE` (pass ``semantics="clean"``
for the library's reading); the lens, which takes none, grafts the library's way. Every row
records its semantics. A component named on its own is always grafted.

The named experiments (:data:`EXPERIMENTS`: ``position``, ``component``,
``component_baseline``, ``reversal``, ``hybrid``, ``patching_vs_grafting``,
``graft_attribution``, ``demo``) bundle
model roles, tested relations, prompts, configurations, summaries and figures; each runs from
Python and as ``grafting-lens run <name>``.

Examples:
    >>> from grafting_lens import study
    >>> models, relations, info = study.toy_setup("hybrid")  # builds the toy world once
    >>> results = study.run_named_experiment("hybrid", models, relations)
    >>> metrics.summarize(results, by=("config", "prompt"))

    A grid of your own:

    >>> config = GraftConfig("O+FFN@last_half", (Graft("LT", "O+FFN", "last_half"),))
    >>> test_sets = make_test_sets(relations, prompts=("headline", "qa"))
    >>> results = run_experiment(models, test_sets, ["PRE", "LT", config], out="runs/mine")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from grafting_lens.core.lazy import submodules

# Imported on first use, as the package's front door: `grafting-lens --help` and a notebook's
# `from grafting_lens import study` load no TransformerLens until a name is used.
_EXPORTS = {
    **dict.fromkeys(
        ("CLEAN", "DEFAULT_SEMANTICS", "REFERENCE", "Semantics", "as_semantics"), "semantics"
    ),
    **dict.fromkeys(
        (
            "COMPONENT_CONFIGS",
            "COMPONENT_LAYER_RANGES",
            "COMPONENT_SETS",
            "HYBRID",
            "HYBRID_CONFIGS",
            "PAPER_POSITION_CONFIGS",
            "POSITION_CONFIGS",
            "RELATION",
            "TASK",
            "Graft",
            "GraftConfig",
            "resolve_components",
        ),
        "configs",
    ),
    **dict.fromkeys(("MOVIE_PROMPTS", "TestSet", "make_test_sets", "read_prompts"), "testsets"),
    **dict.fromkeys(("config_masks",), "stacking"),
    **dict.fromkeys(("RunOptions", "run_experiment", "run_position_grafting"), "runner"),
    **dict.fromkeys(
        (
            "EXPERIMENTS",
            "ExperimentSpec",
            "Figure",
            "Part",
            "get_configs",
            "get_experiment",
            "register_config",
            "register_experiment",
        ),
        "specs",
    ),
    **dict.fromkeys(
        ("checkpoint_setup", "run_named_experiment", "run_spec", "setup_experiment", "toy_setup"),
        "named",
    ),
    **dict.fromkeys(("summary_table", "write_experiment_report"), "report"),
}

__all__ = [
    "as_semantics",
    "checkpoint_setup",
    "CLEAN",
    "COMPONENT_CONFIGS",
    "COMPONENT_LAYER_RANGES",
    "COMPONENT_SETS",
    "config_masks",
    "DEFAULT_SEMANTICS",
    "EXPERIMENTS",
    "ExperimentSpec",
    "Figure",
    "get_configs",
    "get_experiment",
    "Graft",
    "GraftConfig",
    "HYBRID",
    "HYBRID_CONFIGS",
    "make_test_sets",
    "MOVIE_PROMPTS",
    "PAPER_POSITION_CONFIGS",
    "Part",
    "POSITION_CONFIGS",
    "read_prompts",
    "REFERENCE",
    "register_config",
    "register_experiment",
    "RELATION",
    "resolve_components",
    "run_experiment",
    "run_named_experiment",
    "run_position_grafting",
    "run_spec",
    "RunOptions",
    "Semantics",
    "setup_experiment",
    "summary_table",
    "TASK",
    "TestSet",
    "toy_setup",
    "write_experiment_report",
]
"""The public names; tests/test_floors.py checks them against ``_EXPORTS``."""

_submodule = submodules(__name__)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        if name == "EXPERIMENTS":  # the paper's experiments register on import of paper
            importlib.import_module(f"{__name__}.paper")
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    return _submodule(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from grafting_lens.study.configs import (
        COMPONENT_CONFIGS,
        COMPONENT_LAYER_RANGES,
        COMPONENT_SETS,
        HYBRID,
        HYBRID_CONFIGS,
        PAPER_POSITION_CONFIGS,
        POSITION_CONFIGS,
        RELATION,
        TASK,
        Graft,
        GraftConfig,
        resolve_components,
    )
    from grafting_lens.study.named import (
        checkpoint_setup,
        run_named_experiment,
        run_spec,
        setup_experiment,
        toy_setup,
    )
    from grafting_lens.study.report import (
        summary_table,
        write_experiment_report,
    )
    from grafting_lens.study.runner import (
        RunOptions,
        run_experiment,
        run_position_grafting,
    )
    from grafting_lens.study.semantics import (
        CLEAN,
        DEFAULT_SEMANTICS,
        REFERENCE,
        Semantics,
        as_semantics,
    )
    from grafting_lens.study.specs import (
        EXPERIMENTS,
        ExperimentSpec,
        Figure,
        Part,
        get_configs,
        get_experiment,
        register_config,
        register_experiment,
    )
    from grafting_lens.study.stacking import (
        config_masks,
    )
    from grafting_lens.study.testsets import (
        MOVIE_PROMPTS,
        TestSet,
        make_test_sets,
        read_prompts,
    )
