"""Named experiments: one registered :class:`ExperimentSpec` each, and the registry.

An experiment of the paper is more than a list of configurations: it needs
checkpoints in *roles* (pretrained and finetuned; task and relation model...), asks
about some relations in one direction, runs in *parts* (the movie-title
configurations need prompts that name the movie), is summarized by some columns,
drawn in some figures and read next to what the paper reports. An
:class:`ExperimentSpec` says all of that in one place, and
:func:`register_experiment` is the one door: a registered spec is runnable from
Python (:func:`~grafting_lens.study.named.run_named_experiment`) and from the
command line (``grafting-lens run <name>``), with its own options.

The paper's experiments are registered in :mod:`grafting_lens.study.paper`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from grafting_lens.core.errors import ExperimentError, did_you_mean
from grafting_lens.study.configs import HYBRID_CONFIGS, GraftConfig, code_hybrid_configs
from grafting_lens.study.semantics import (
    DEFAULT_SEMANTICS,
    Semantics,
    as_semantics,
    semantics_or_default,
)

__all__ = [
    "EXPERIMENTS",
    "get_configs",
    "register_config",
    "ExperimentSpec",
    "Figure",
    "Option",
    "Part",
    "get_experiment",
    "register_experiment",
]

RELATION_SETS = ("all", "task", "relation")
"""Which relations an experiment asks about: all of them, or one half of
:func:`grafting_lens.worlds.data.split_task_relation`."""


@dataclass(frozen=True)
class Part:
    """One run of an experiment: the prompts it asks and the configurations it grafts.

    Attributes:
        name: The ``part`` column, and the run's sub-directory.
        prompts: Test prompts (:data:`grafting_lens.worlds.data.TEST_TEMPLATES` or
            :data:`~grafting_lens.study.testsets.MOVIE_PROMPTS`).
        configs: Configuration names in the experiment's registry, in table order.
        quick: The configurations of a ``quick`` run (``None``: all of them).
    """

    name: str
    prompts: tuple[str, ...]
    configs: tuple[str, ...]
    quick: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Figure:
    """A figure of an experiment's summary, saved as ``<name>.html`` (and ``.png``).

    Attributes:
        name: The file's stem.
        draw: ``(summary rows, caption) -> plotly figure``; the caption says the
            setting (see :func:`~grafting_lens.study.report.figure_caption`).
        part: Draw only this part's rows (``None``: every row); no rows, no figure.
    """

    name: str
    draw: Callable[[Any, str], Any]
    part: str | None = None


@dataclass(frozen=True)
class Option:
    """A command-line option one experiment adds to the options every run shares.

    Attributes:
        flag: ``"--rows-per-forward"``; its value reaches the experiment's ``run`` as
            ``extras["rows_per_forward"]``.
        help: One line for ``--help``.
        type: The value's type.
        default: Its default.
        choices: The values allowed (``None``: any).
        many: Take one or more values.
        fingerprinted: The value can change a result, so a run with another value is
            another run (``False`` for a batching size and the like).
    """

    flag: str
    help: str
    type: type = str
    default: Any = None
    choices: tuple[Any, ...] | None = None
    many: bool = False
    fingerprinted: bool = True

    @property
    def dest(self) -> str:
        """The option's name as a Python identifier."""
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class ExperimentSpec:
    """One named experiment: which checkpoints, which questions, which grafts, which report.

    Attributes:
        name: Key in :data:`EXPERIMENTS` and on the command line.
        title: For figures and reports.
        roles: What each source of the model set is, base first; in the toy world, the
            checkpoint names (:data:`grafting_lens.worlds.toy.MODEL_NAMES`).
        donors: For each role after the base, the command-line option that names a real
            checkpoint for it and a line of help (the base is always ``--model``).
        relations: Which relations are asked about: ``"all"``, ``"task"`` or
            ``"relation"`` (the halves of :func:`grafting_lens.worlds.data.split_task_relation`).
        direction: ``"A2B"``, or ``"B2A"`` for the reversal.
        parts: The runs it is made of (see :class:`Part`).
        configurations: The configurations its parts name, by name (shared by the
            experiments that run the same ones: ``component``, ``component_baseline`` and
            ``reversal``); :func:`register_config` adds to them.
        summary_by: The columns its summary groups by.
        figures: What to draw from the summary.
        paper: What the paper reports, listed next to the results.
        note: A line for the report saying what the configurations graft.
        names: Labels of the sources in tables (default: the roles).
        options: Command-line options of its own.
        inapplicable: Shared command-line options that do not apply to it.
        run: A runner other than the configuration grid:
            ``(spec, setup, **run arguments) -> {table name: DataFrame}`` (see
            :func:`~grafting_lens.study.named.run_spec`).
        run_resumes: That runner keeps its progress in the run directory it is given
            (``out/runs`` on the command line), and a run of the same command goes on from it.
        report: A report other than the standard one (see
            :func:`~grafting_lens.study.report.write_experiment_report`).
        quick_world: ``--quick`` builds a small toy world (and finetunes a checkpoint
            for two epochs) instead of asking about fewer relations.
        finetune_missing_donor: ``--model`` without a donor finetunes a copy of the
            model on the relations first.
        default_relations: How many relations ``--model`` runs make by default.
        semantics: The semantics its runs default to, a label of
            :class:`~grafting_lens.study.semantics.Semantics`: by default that of
            :data:`~grafting_lens.study.semantics.DEFAULT_SEMANTICS` (``"reference"``, the
            one default); an experiment whose runner works one way only (with
            ``"--semantics"`` in :attr:`inapplicable`) names the one it runs.
    """

    name: str
    title: str
    roles: tuple[str, ...]
    donors: Mapping[str, tuple[str, str]]
    relations: str = "all"
    direction: str = "A2B"
    parts: tuple[Part, ...] = ()
    configurations: Mapping[str, GraftConfig] = field(default_factory=dict)
    summary_by: tuple[str, ...] = ("config", "prompt")
    figures: tuple[Figure, ...] = ()
    paper: tuple[str, ...] = ()
    note: str = ""
    names: tuple[str, ...] | None = None
    options: tuple[Option, ...] = ()
    inapplicable: tuple[str, ...] = ()
    run: Callable[..., Mapping[str, Any]] | None = None
    run_resumes: bool = False
    report: Callable[..., Any] | None = None
    quick_world: bool = False
    finetune_missing_donor: bool = False
    default_relations: int = 1000
    semantics: str = DEFAULT_SEMANTICS.label

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ExperimentError(f"An experiment needs a non-empty name, got {self.name!r}.")
        if len(self.roles) < 2:
            raise ExperimentError(
                f"Experiment {self.name!r}: a graft needs at least two roles (a base and a "
                f"donor), got {self.roles!r}."
            )
        if set(self.donors) != set(self.roles[1:]):
            raise ExperimentError(
                f"Experiment {self.name!r}: donors must give an option for every role after the "
                f"base ({', '.join(self.roles[1:])}), got {sorted(self.donors)}."
            )
        if self.relations not in RELATION_SETS:
            raise ExperimentError(
                f"Experiment {self.name!r}: relations must be one of {RELATION_SETS}, got "
                f"{self.relations!r}."
            )
        if not self.parts and self.run is None:
            raise ExperimentError(
                f"Experiment {self.name!r} has neither parts to run nor a run function."
            )
        if self.names is not None and len(self.names) != len(self.roles):
            raise ExperimentError(
                f"Experiment {self.name!r}: {len(self.names)} names for {len(self.roles)} roles."
            )
        object.__setattr__(self, "donors", dict(self.donors))
        as_semantics(self.semantics)  # a label that does not read fails here

    @property
    def labels(self) -> tuple[str, ...]:
        """The sources' labels in tables: :attr:`names`, or the roles."""
        return self.names if self.names is not None else self.roles


EXPERIMENTS: dict[str, ExperimentSpec] = {}
"""The named experiments, by name (the paper's register on import of
:mod:`grafting_lens.study.paper`, which every lookup here and ``study.EXPERIMENTS`` do
first)."""


def _with_the_papers() -> dict[str, ExperimentSpec]:
    """The registry with the paper's experiments in it: :mod:`grafting_lens.study` imports its
    rooms on first use, so the module that registers them may not have run yet."""
    importlib.import_module("grafting_lens.study.paper")
    return EXPERIMENTS


def register_experiment(spec: ExperimentSpec, overwrite: bool = False) -> ExperimentSpec:
    """Add a named experiment, so that it runs by name and from the command line.

    Args:
        spec: The experiment.
        overwrite: Allow replacing an experiment of the same name.

    Returns:
        ``spec``.

    Raises:
        ExperimentError: Not an :class:`ExperimentSpec`, or a name that is taken.
    """
    if not isinstance(spec, ExperimentSpec):
        raise ExperimentError(
            f"register_experiment needs an ExperimentSpec, got {type(spec).__name__}."
        )
    if spec.name in _with_the_papers() and not overwrite:
        raise ExperimentError(
            f"An experiment named {spec.name!r} exists; pass overwrite=True to replace it."
        )
    EXPERIMENTS[spec.name] = spec
    return spec


def get_experiment(name: str | ExperimentSpec) -> ExperimentSpec:
    """The registered experiment ``name`` (a spec passes through).

    Raises:
        ExperimentError: An unknown name (the message lists the known ones).
    """
    if isinstance(name, ExperimentSpec):
        return name
    if name not in _with_the_papers():
        raise ExperimentError(
            f"Unknown experiment {name!r}.{did_you_mean(str(name), EXPERIMENTS)} Known: "
            f"{', '.join(EXPERIMENTS)}."
        )
    return EXPERIMENTS[name]


# ----------------------------------------------------------------------- configurations


def register_config(
    config: GraftConfig, experiment: str = "position", overwrite: bool = False
) -> None:
    """Add a configuration to an experiment's so that runs can name it.

    Args:
        config: The configuration.
        experiment: The registered experiment whose configurations it joins (``"position"``:
            next to the paper's eight; ``"component"``: also ``component_baseline``'s and
            ``reversal``'s, which share them; ``"hybrid"``).
        overwrite: Allow replacing a configuration of the same name.

    Raises:
        ExperimentError: Not a configuration, an unknown experiment, one whose
            configurations cannot grow, or a name that is taken.
    """
    if not isinstance(config, GraftConfig):
        raise ExperimentError(f"register_config needs a GraftConfig, got {type(config).__name__}.")
    target = get_experiment(experiment).configurations
    if not isinstance(target, MutableMapping) or not target:
        raise ExperimentError(
            f"The {experiment} experiment runs no configurations of its own; register it with "
            "'position', 'component' or 'hybrid'."
        )
    if config.name in target and not overwrite:
        raise ExperimentError(
            f"A {experiment} configuration named {config.name!r} exists; pass overwrite=True to "
            "replace it."
        )
    target[config.name] = config


def get_configs(
    configs: str | GraftConfig | Iterable[str | GraftConfig],
    registry: str | Mapping[str, GraftConfig] = "position",
    kind: str | None = None,
    *,
    semantics: Semantics | str | None = None,
) -> list[GraftConfig]:
    """Look configuration names up in a registry; GraftConfig objects pass through.

    Args:
        configs: Names, :class:`GraftConfig` s, or a mix.
        registry: A registered experiment, whose configurations the names are looked up
            in, or a mapping of configurations.
        kind: What to call the configurations in messages (default: the registry's
            name, e.g. ``"component-grafting"``).
        semantics: What the configurations will run under (default
            :data:`~grafting_lens.study.semantics.DEFAULT_SEMANTICS`, whose hybrid is the code's).
            Under ``hybrid="code"``, the names of :data:`HYBRID_CONFIGS` are the code's
            hybrid configurations (:func:`code_hybrid_configs`), and so are
            :data:`HYBRID_CONFIGS`' objects wherever they are passed; pass
            ``semantics="clean"`` for the library's hybrid. Other configurations do not
            depend on it.

    Raises:
        ExperimentError: No configuration, an unknown name (the message lists the
            known ones), or a name given twice.
    """
    chosen = semantics_or_default(semantics)
    code = None
    if chosen.hybrid == "code":
        code = code_hybrid_configs(chosen.hybrid_last_token_layers)
    if isinstance(registry, str):
        kind = kind or f"{registry}-grafting"
        registry = get_experiment(registry).configurations
    if registry is HYBRID_CONFIGS and code is not None:
        registry = {**registry, **code}  # the code's hybrid model under the same names
    kind = kind or "grafting"
    if isinstance(configs, (str, GraftConfig)):
        configs = [configs]
    resolved = []
    for item in configs:
        if isinstance(item, GraftConfig) and code is not None:
            resolved.append(_as_code_hybrid(item, code))
        elif isinstance(item, GraftConfig):
            resolved.append(item)
        elif isinstance(item, str) and item in registry:
            resolved.append(registry[item])
        else:
            raise ExperimentError(
                f"Unknown {kind} configuration {item!r}.{did_you_mean(str(item), registry)} "
                f"Known: {', '.join(registry)}."
            )
    if not resolved:
        raise ExperimentError(f"No configuration given; choose from {', '.join(registry)}.")
    names = [config.name for config in resolved]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ExperimentError(f"Configurations are listed twice: {repeated}.")
    return resolved


def _as_code_hybrid(config: GraftConfig, code: Mapping[str, GraftConfig]) -> GraftConfig:
    """A configuration given as an object, under a semantics whose hybrid is the code's.

    The library's own hybrid configurations (:data:`HYBRID_CONFIGS`' objects, in any
    registry or none) run as the code runs them, as their names do, so that a row's
    semantics says what was grafted; any other configuration is the caller's own graft
    and is taken as it is.
    """
    if HYBRID_CONFIGS.get(config.name) == config and config.name in code:
        return code[config.name]
    return config
