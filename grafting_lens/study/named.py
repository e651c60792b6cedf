"""Running a named experiment: its checkpoints in their roles, its relations, its parts.

:func:`setup_experiment` loads what an experiment runs on (:func:`toy_setup`,
:func:`real_world_setup`, :func:`checkpoint_setup` or :func:`finetuned_setup`), and
:func:`run_spec` runs the experiment on it: every part of its configuration grid, or its
own runner.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grafting_lens.core.arguments import is_integer
from grafting_lens.core.console import show_progress
from grafting_lens.core.errors import ExperimentError, check_known, refuse_first
from grafting_lens.models.loading import load_models
from grafting_lens.models.model_set import ModelSet
from grafting_lens.study import paper  # noqa: F401  (the paper's experiments, registered on import)
from grafting_lens.study.runner import ChunkInfo, RunOptions, run_experiment
from grafting_lens.study.semantics import Semantics, as_semantics
from grafting_lens.study.specs import (
    EXPERIMENTS,
    QUICK_RELATIONS,
    RELATION_SETS,
    ExperimentSetup,
    ExperimentSpec,
    get_configs,
    get_experiment,
)
from grafting_lens.study.testsets import TestSet, make_test_sets
from grafting_lens.worlds import data, toy
from grafting_lens.worlds.documents import training_documents
from grafting_lens.worlds.finetune import finetune
from grafting_lens.worlds.real_recipe import WORLDS
from grafting_lens.worlds.real_world import open_world

__all__ = [
    "checkpoint_setup",
    "finetuned_setup",
    "run_named_experiment",
    "run_spec",
    "setup_experiment",
    "toy_setup",
]


def toy_setup(
    experiment: str | ExperimentSpec,
    config: Any = None,
    cache_dir: str | os.PathLike | None = None,
    device: str | None = None,
    progress: bool | None = None,
    *,
    dtype: torch.dtype | None = None,
    lazy: bool = False,
) -> tuple[ModelSet, list[data.Relation], dict[str, Any]]:
    """The toy world's checkpoints and relations for one experiment (the world is built on
    first use, minutes, then cached: :func:`grafting_lens.worlds.toy.build_toy_world`).

    Returns:
        ``(models, relations, info)``: the model set in the experiment's roles, the relations
        to ask about, and the world's ``root``, ``seed``, ``dataset`` and ``evaluation``.

    Raises:
        ExperimentError: An unknown experiment.
    """
    spec = get_experiment(experiment)
    world = toy.build_toy_world(
        config=config, cache_dir=cache_dir, progress=show_progress(progress)
    )
    return _world_setup(spec, world, spec.roles, device, dtype, lazy, world.load_tokenizer())


def _world_setup(
    spec: ExperimentSpec,
    world: Any,
    checkpoints: Sequence[str],
    device: str | None,
    dtype: torch.dtype | None,
    lazy: bool,
    tokenizer: Any = None,
) -> tuple[ModelSet, list[data.Relation], dict[str, Any]]:
    """A built world's ``checkpoints`` in the experiment's roles, its relations, and its info."""
    models = load_models(
        *(world.model_dir(name) for name in checkpoints),
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        names=list(spec.labels),
        lazy=lazy,
    )
    relations = "relations" if spec.relations == "all" else f"{spec.relations}_relations"
    info = {
        "root": str(world.root),
        "seed": world.config.seed,
        "dataset": world.config.dataset,
        "evaluation": world.manifest.get("evaluation", {}),
    }
    return models, list(getattr(world, relations)), info


def real_world_setup(
    experiment: str | ExperimentSpec,
    world: Any = "smollm2",
    cache_dir: str | os.PathLike | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    *,
    lazy: bool = False,
    sft_seed: int | None = None,
) -> tuple[ModelSet, list[data.Relation], dict[str, Any]]:
    """A built real-model world's checkpoints and relations for one experiment.

    Opens the world (a name of :data:`grafting_lens.worlds.real_world.WORLDS` or a
    :class:`~grafting_lens.worlds.real_world.RealWorldConfig`), never builds one
    (``grafting-lens world build <name>``). With ``sft_seed``, the ``sft`` role is the
    world's ``sft`` finetuned with that seed (``sft_seed<S>``, built with
    ``RealWorldConfig.extra_sft_seeds``).

    Returns:
        ``(models, relations, info)`` as :func:`toy_setup`'s.

    Raises:
        ExperimentError: An unknown experiment.
        WorldCacheError: The world is not built (the message names the command).
        GraftingLensError: An experiment whose roles the world lacks, or a seed it was not
            built with.
    """
    spec = get_experiment(experiment)
    built = open_world(world, cache_dir=cache_dir)
    checkpoints = list(spec.roles)
    if sft_seed is not None and sft_seed != built.config.seed:
        checkpoints = [f"sft_seed{sft_seed}" if role == "sft" else role for role in checkpoints]
    return _world_setup(spec, built, checkpoints, device, dtype, lazy)


def checkpoint_setup(
    experiment: str | ExperimentSpec,
    checkpoints: Sequence[str | os.PathLike],
    dataset: str = "fake_movies_real_actors",
    n_relations: int = 1000,
    seed: int = 0,
    relations: str | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    *,
    lazy: bool = False,
) -> tuple[ModelSet, list[data.Relation]]:
    """Real checkpoints in an experiment's roles, and the relations they were finetuned on.

    Args:
        experiment: A key of :data:`~grafting_lens.study.specs.EXPERIMENTS`.
        checkpoints: Hub ids or directories, one per role (base first).
        dataset: The dataset the donors were finetuned on, as in ``make_relations``.
        n_relations: How many relations, as in ``make_relations``.
        seed: The seed of ``make_relations``.
        relations: Which of them to ask about (``"all"``, ``"task"``, ``"relation"``;
            default: the experiment's).
        device: Passed to :func:`grafting_lens.load_models`.
        dtype: Passed to :func:`grafting_lens.load_models`.
        lazy: Passed to :func:`grafting_lens.load_models`.

    Raises:
        ExperimentError: A wrong number of checkpoints or an unknown choice.
    """
    spec = get_experiment(experiment)
    if len(checkpoints) != len(spec.roles):
        raise ExperimentError(
            f"The {spec.name} experiment needs {len(spec.roles)} checkpoints "
            f"({', '.join(spec.roles)}), got {len(checkpoints)}."
        )
    made = _relations(spec, dataset, n_relations, seed, relations)
    names = list(spec.labels)
    return load_models(*checkpoints, device=device, dtype=dtype, names=names, lazy=lazy), made


def finetuned_setup(
    experiment: str | ExperimentSpec,
    checkpoint: str,
    *,
    dataset: str = "fake_movies_real_actors",
    n_relations: int = 100,
    seed: int = 0,
    epochs: int | None = None,
    device: str | None = None,
    progress: bool | None = None,
    on_status: Callable[[str], None] | None = None,
) -> tuple[ModelSet, list[data.Relation]]:
    """A pretrained checkpoint and a copy of it finetuned here on the experiment's relations
    (the paper's "aggressive" preset of :func:`grafting_lens.worlds.finetune.finetune`, on
    the A2B documents of ``make_relations(dataset, n_relations, seed)``).

    Args:
        experiment: An experiment with two roles (base and donor).
        checkpoint: Hub id or directory of the pretrained model.
        dataset: The relations' dataset.
        n_relations: How many relations to teach.
        seed: Their seed, and the finetuning's.
        epochs: Override the preset's epochs (e.g. 2 for a smoke run).
        device: Where to finetune and run.
        progress: Show the finetuning's progress bar (default: when someone watches).
        on_status: Called with one line before finetuning starts.

    Raises:
        ExperimentError: An experiment with more than two roles.
    """
    spec = get_experiment(experiment)
    if len(spec.roles) != 2:
        raise ExperimentError(
            f"The {spec.name} experiment needs {len(spec.roles)} checkpoints; only a base and "
            "one donor can be made by finetuning here."
        )
    relations = _relations(spec, dataset, n_relations, seed, None)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    base = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    finetuned = copy.deepcopy(base)
    documents = training_documents(relations, direction="A2B", seed=seed)
    if on_status is not None:
        on_status(
            f"Finetuning {_short(checkpoint)} on {len(relations)} relations "
            f"({len(documents)} documents)..."
        )
    finetune(
        finetuned,
        tokenizer,
        documents,
        preset="aggressive",
        epochs=epochs,
        device=device,
        seed=seed,
        progress=progress,
    )
    if device is not None:
        base.to(device)
    names = list(spec.labels)
    return load_models(base, finetuned, tokenizer=tokenizer, device=device, names=names), relations


def setup_experiment(
    experiment: str | ExperimentSpec,
    checkpoints: Sequence[str] | None = None,
    *,
    toy_config: Any = None,
    cache_dir: str | os.PathLike | None = None,
    dataset: str = "fake_movies_real_actors",
    n_relations: int | None = None,
    seed: int = 0,
    relations: str | None = None,
    quick: bool = False,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
    on_status: Callable[[str], None] | None = None,
    world: str = "toy",
    lazy: bool = False,
    sft_seed: int | None = None,
) -> ExperimentSetup:
    """Load what an experiment runs on: a world, your checkpoints, or a finetuned copy.

    Args:
        experiment: A registered experiment.
        checkpoints: ``None`` for a world; one checkpoint per role; or the base alone, for
            an experiment that finetunes a missing donor.
        toy_config: A :class:`grafting_lens.worlds.toy.ToyWorldConfig` (default: the standard
            world; a small one for ``quick`` runs of a ``quick_world`` experiment).
        cache_dir: Where toy worlds are cached.
        dataset: With checkpoints: the dataset they were (or are now) finetuned on.
        n_relations: With checkpoints: how many relations (default: the experiment's).
        seed: With checkpoints: the relations' seed.
        relations: With checkpoints: which relations to ask about (default: the experiment's).
        quick: A smoke run (see :attr:`ExperimentSpec.quick_world`).
        device: Where the models go.
        dtype: Cast the models.
        progress: Show progress bars (default: when someone watches).
        on_status: Called with a line before long steps (building, finetuning).
        world: Without checkpoints: ``"toy"`` or a built real-model world, ``"smollm2"``
            or ``"gemma3"`` (:mod:`grafting_lens.worlds.real_world`).
        lazy: Open the donors lazily (``load_models(lazy=True)``).
        sft_seed: With a real world: the ``sft`` finetuned with this seed in the ``sft``
            role (see :func:`real_world_setup`).

    Raises:
        ExperimentError: A wrong number of checkpoints, or an unknown world.
    """
    spec = get_experiment(experiment)
    check_known(world, ("toy", *WORLDS), "world", ExperimentError)
    finetunes = checkpoints is not None and len(checkpoints) == 1 and spec.finetune_missing_donor
    refuse_first(
        ExperimentError,
        (
            (
                sft_seed is not None and (checkpoints is not None or world == "toy"),
                "sft_seed (--sft-seed) chooses among a real world's sft checkpoints: name the "
                "world (--world smollm2) instead of checkpoints or the toy world.",
            ),
            (
                sft_seed is not None and "sft" not in spec.roles,
                f"sft_seed (--sft-seed) does not apply to the {spec.name} experiment: it grafts "
                f"{', '.join(spec.roles[1:])} into {spec.roles[0]}, not sft.",
            ),
            (
                lazy and finetunes,
                "lazy=True (--lazy) reads donors from checkpoint directories, but the donor "
                "of this run is finetuned here, in memory. Save it (save_pretrained) and pass "
                "both checkpoints, or run without lazy.",
            ),
        ),
    )
    if checkpoints is None:
        say = on_status or (lambda line: None)
        if world != "toy":
            say(f"Opening the {world} world...")
            models, made, info = real_world_setup(
                spec, world, cache_dir, device, dtype, lazy=lazy, sft_seed=sft_seed
            )
            seeded = "" if sft_seed is None else f", sft seed {sft_seed}"
        else:
            small = toy_config is None and quick and spec.quick_world
            say(f"Building or loading the toy world{' (quick)' if small else ''}...")
            # Cast as loaded: casting afterwards would go through every source's model
            # (reading a lazily loaded donor whole).
            config = quick_toy_config() if small else toy_config
            models, made, info = toy_setup(
                spec, config, cache_dir, device, progress, dtype=dtype, lazy=lazy
            )
            seeded = ""
        return ExperimentSetup(
            models=models,
            relations=made,
            label=f"{world} world {Path(info['root']).name}{seeded}",
            dataset=info["dataset"],
            data_seed=info["seed"],
            seeds={"world": info["seed"]},
            world=info,
        )
    checkpoints = [str(checkpoint) for checkpoint in checkpoints]
    if finetunes:
        count = n_relations or (20 if quick else spec.default_relations)
        models, made = finetuned_setup(
            spec,
            checkpoints[0],
            dataset=dataset,
            n_relations=count,
            seed=seed,
            epochs=2 if quick else None,
            device=device,
            progress=progress,
            on_status=on_status,
        )
        if dtype is not None:
            for bridge in models:
                # Quietly: TransformerLens would print "Changing model dtype to ..." per model.
                bridge.to(dtype=dtype, print_details=False)
        label = f"{_short(checkpoints[0])}, finetuned here"
    else:
        models, made = checkpoint_setup(
            spec,
            checkpoints,
            dataset=dataset,
            n_relations=n_relations or spec.default_relations,
            seed=seed,
            relations=relations,
            device=device,
            dtype=dtype,
            lazy=lazy,
        )
        label = " <- ".join(_short(checkpoint) for checkpoint in checkpoints)
    return ExperimentSetup(
        models=models,
        relations=made,
        label=label,
        dataset=dataset,
        data_seed=seed,
        resumable=not finetunes,
    )


def run_named_experiment(
    experiment: str | ExperimentSpec,
    models: ModelSet,
    relations: Sequence[data.Relation],
    *,
    out: str | os.PathLike | None = None,
    quick: bool = False,
    n_examples: int | None = None,
    dataset: str = "fake_movies_real_actors",
    seed: int | None = None,
    options: RunOptions | None = None,
    on_chunk: Callable[[ChunkInfo], None] | None = None,
    **settings: Any,
) -> pd.DataFrame:
    """Run one of :data:`~grafting_lens.study.specs.EXPERIMENTS` over ``relations``: every part,
    every prompt (:func:`run_spec` on the models and relations given; the other arguments are its).

    Args:
        models: The model set in the experiment's roles (see :func:`toy_setup`).
        relations: What to ask about.
        dataset: Label of the relations (the ``dataset`` column).
        seed: Seed the relations were made with (the ``data_seed`` column).

    Returns:
        The parts' tables, concatenated, with a ``part`` column after ``models`` (for an
        experiment with its own runner, its ``results`` table).

    Raises:
        GraftingLensError: As :func:`run_spec`.
    """
    spec = get_experiment(experiment)
    setup = ExperimentSetup(
        models=models,
        relations=list(relations),
        label=",".join(models.names),
        dataset=dataset,
        data_seed=seed,
    )
    tables = run_spec(
        spec,
        setup,
        out=out,
        quick=quick,
        n_examples=n_examples,
        options=options,
        on_chunk=on_chunk,
        **settings,
    )
    return tables["results"]


def run_spec(
    experiment: str | ExperimentSpec,
    setup: ExperimentSetup,
    *,
    out: str | os.PathLike | None = None,
    quick: bool = False,
    n_examples: int | None = None,
    options: RunOptions | None = None,
    extras: Mapping[str, Any] | None = None,
    on_chunk: Callable[[ChunkInfo], None] | None = None,
    prompts: Sequence[TestSet] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Run a named experiment on what :func:`setup_experiment` loaded.

    The semantics is ``options.semantics`` or, if none is given, the experiment's
    (:attr:`ExperimentSpec.semantics`); the test sets are worded as it says.

    Args:
        experiment: A registered experiment.
        setup: Its models and relations.
        out: A directory for its resumable runs (``out/<part>``).
        quick: A short run: 16 relations and the parts' ``quick`` configurations.
        n_examples: Ask about the first ``n_examples`` relations only.
        options: How to run (:class:`~grafting_lens.study.runner.RunOptions`).
        extras: Values of the experiment's own options (see :class:`Option`).
        on_chunk: Called after each chunk (see :func:`~grafting_lens.study.runner.run_experiment`).
        prompts: Test sets of your own prompts (:func:`~grafting_lens.study.testsets.read_prompts`)
            asked instead of the relations, under the first part's configurations (a grid
            experiment only); ``n_examples`` keeps the first rows of each.
        **settings: Fields of :class:`~grafting_lens.study.runner.RunOptions` by name.

    Returns:
        ``{"results": table, ...}``: the grid's table, or what its own runner returns.

    Raises:
        ExperimentError: ``n_examples`` is not an integer >= 1, or no relation is left.
        GraftingLensError: What :func:`~grafting_lens.study.runner.run_experiment` refuses,
            for any part, before the first runs.
    """
    spec = get_experiment(experiment)
    if n_examples is not None and (not is_integer(n_examples) or n_examples < 1):
        # For every runner, before anything runs (a slice would take -1 too).
        raise ExperimentError(
            f"n_examples is how many relations to ask about: an integer >= 1, got {n_examples!r}."
        )
    options = dataclasses.replace(options or RunOptions(), **settings)
    if (
        "--semantics" in spec.inapplicable
        and options.semantics is not None
        and as_semantics(options.semantics) != as_semantics(spec.semantics)
    ):
        # Its runner works the library's way only: a semantics would be ignored.
        raise ExperimentError(
            f"The {spec.name} experiment runs with the {spec.semantics!r} semantics only, "
            f"got semantics={as_semantics(options.semantics).label!r}: leave it out."
        )
    options = options.with_semantics(as_semantics(spec.semantics))
    semantics = options.semantics
    assert isinstance(semantics, Semantics)  # with_semantics gives one
    if setup.seeds:  # the toy world's seed goes with every row; explicit seeds come after
        options = dataclasses.replace(options, seeds={**setup.seeds, **options.seeds})
    if prompts is not None:
        check_prompts_apply(spec)
    if spec.run is not None:
        return dict(
            spec.run(
                spec,
                setup,
                out=out,
                quick=quick,
                n_examples=n_examples,
                options=options,
                extras=dict(extras or {}),
                on_chunk=on_chunk,
            )
        )
    # An experiment whose quick run is a small toy world asks every question of it.
    quick = quick and not spec.quick_world
    relations = list(setup.relations)[:n_examples][: QUICK_RELATIONS if quick else None]
    own = None
    if prompts is not None:
        own = [
            t if t.is_tokenized else replace(t, examples=t.examples[:n_examples]) for t in prompts
        ]
    # Check every part before running any of them.
    parts = []
    for part in spec.parts if own is None else spec.parts[:1]:
        names = part.quick if quick and part.quick is not None else part.configs
        configs = get_configs(list(names), spec.configurations, semantics=semantics)
        test_sets = own
        if test_sets is None:
            test_sets = make_test_sets(
                relations,
                part.prompts,
                spec.direction,
                dataset=setup.dataset,
                seed=setup.data_seed,
                templates=semantics.prompts,
            )
        parts.append((part.name, test_sets, configs))
    tables = []
    for name, test_sets, configs in parts:
        table = run_experiment(
            setup.models,
            test_sets,
            configs,
            registry=spec.configurations,
            out=None if out is None else Path(out) / name,
            options=options,
            on_chunk=on_chunk,
        )
        table.insert(1, "part", name)
        tables.append(table)
    return {"results": pd.concat(tables, ignore_index=True)}


def check_prompts_apply(experiment: str | ExperimentSpec) -> None:
    """Refuse own prompts for an experiment that asks its own questions (one with a ``run``).

    Raises:
        ExperimentError: Naming the experiments that take them.
    """
    spec = get_experiment(experiment)
    if spec.run is not None:
        grids = [name for name, other in EXPERIMENTS.items() if other.run is None]
        raise ExperimentError(
            f"The {spec.name} experiment asks its own questions; own prompts go with an "
            f"experiment of configurations: {', '.join(grids)}."
        )


def quick_toy_config() -> Any:
    """A toy world that builds in one to four minutes on two CPU cores: it checks that the
    pipeline runs, but its finetuned model recalls too little for the paper's picture."""
    return toy.ToyWorldConfig(
        d_model=48,
        n_layers=2,
        n_heads=4,
        n_key_value_heads=2,
        d_mlp=128,
        vocab_size=768,
        max_length=64,
        n_relations=16,
        n_pretrain_documents=3000,
        n_pretrain_pairs=100,
        pretrain_documents_per_pair=5,
        pretrain_epochs=1,
        finetune_epochs=10,
    )


def _relations(
    spec: ExperimentSpec, dataset: str, n_relations: int, seed: int, which: str | None
) -> list[data.Relation]:
    which = which or spec.relations
    if which not in RELATION_SETS:
        raise ExperimentError(f"relations must be 'all', 'task' or 'relation', got {which!r}.")
    made = data.make_relations(dataset, n=n_relations, seed=seed)
    if which != "all":
        task, relation = data.split_task_relation(made, seed=seed)
        made = task if which == "task" else relation
    return made


def _short(name: str) -> str:
    """A checkpoint's label for tables: a directory's name, or the hub id."""
    path = Path(name).expanduser()
    return path.name if path.is_dir() else name
