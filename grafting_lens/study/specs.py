"""Named experiments: one registered :class:`ExperimentSpec` each, and the registry.

An :class:`ExperimentSpec` says everything an experiment is (roles, relations, parts, summaries,
figures, what the paper reports), and :func:`register_experiment` is the one door: a registered
spec runs from Python and as ``grafting-lens run <name>`` (how-to: "Adding an experiment"). The
paper's are registered by :mod:`grafting_lens.study.paper` on import; this registry never
imports it, since the paper's experiments stand on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grafting_lens.core.arguments import as_list
from grafting_lens.core.errors import ExperimentError, check_known, refuse_first
from grafting_lens.study.configs import HYBRID_CONFIGS, GraftConfig, code_hybrid_configs
from grafting_lens.study.semantics import (
    DEFAULT_SEMANTICS,
    Semantics,
    as_semantics,
    semantics_or_default,
)

if TYPE_CHECKING:
    from grafting_lens.models.model_set import ModelSet
    from grafting_lens.worlds import data

__all__ = [
    "EXPERIMENTS",
    "QUICK_RELATIONS",
    "ExperimentSetup",
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

QUICK_RELATIONS = 16
"""How many relations a ``quick`` run asks about."""


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
        semantics: The label of the :class:`~grafting_lens.study.semantics.Semantics` its
            runs default to (``"reference"``, the one default); an experiment whose runner
            works one way only (``"--semantics"`` in :attr:`inapplicable`) names that one.
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
        roles_after = ", ".join(self.roles[1:])
        # Every mistake at once: a spec is written by hand and read once, at registration.
        checks = (
            (
                not self.name or not isinstance(self.name, str),
                "an experiment needs a non-empty name",
            ),
            (
                len(self.roles) < 2,
                f"a graft needs at least two roles (a base and a donor), got {self.roles!r}",
            ),
            (
                set(self.donors) != set(self.roles[1:]),
                f"donors must give an option for every role after the base ({roles_after}), "
                f"got {sorted(self.donors)}",
            ),
            (
                self.relations not in RELATION_SETS,
                f"relations must be one of {RELATION_SETS}, got {self.relations!r}",
            ),
            (not self.parts and self.run is None, "it has neither parts to run nor a run function"),
            (
                self.names is not None and len(self.names) != len(self.roles),
                f"{len(self.names or ())} names for {len(self.roles)} roles",
            ),
        )
        problems = [problem for found, problem in checks if found]
        if problems:
            raise ExperimentError(f"Experiment {self.name!r}: {'; '.join(problems)}.")
        object.__setattr__(self, "donors", dict(self.donors))
        as_semantics(self.semantics)  # a label that does not read fails here

    @property
    def labels(self) -> tuple[str, ...]:
        """The sources' labels in tables: :attr:`names`, or the roles."""
        return self.names if self.names is not None else self.roles


@dataclass(frozen=True)
class ExperimentSetup:
    """What a named experiment runs on.

    Attributes:
        models: The model set, in the experiment's roles.
        relations: The relations to ask about.
        label: The models in a few words, for reports (``"toy world 3f2a..."``,
            ``"gpt2 <- gpt2-sft"``).
        dataset: The dataset the relations come from (the ``dataset`` column).
        data_seed: The seed they were made with (the ``data_seed`` column).
        seeds: Further seeds to record with every row (the toy world's).
        world: The toy world's ``root``, ``seed``, ``dataset`` and ``evaluation``, or
            ``None`` for your own checkpoints.
        resumable: Whether a run on these models can resume from a run directory (not
            when a donor was finetuned in this process: another process finetunes
            another donor).
    """

    models: ModelSet
    relations: list[data.Relation]
    label: str
    dataset: str
    data_seed: int | None = None
    seeds: dict[str, int] = field(default_factory=dict)
    world: dict[str, Any] | None = None
    resumable: bool = True


EXPERIMENTS: dict[str, ExperimentSpec] = {}
"""The named experiments, by name (the paper's once :mod:`grafting_lens.study.paper` is
imported: ``study.EXPERIMENTS`` and every name of ``grafting_lens.study`` import it)."""


def _register(
    table: MutableMapping[str, Any],
    item: Any,
    kind: type[ExperimentSpec] | type[GraftConfig],
    door: str,
    overwrite: bool,
) -> None:
    """Add ``item`` to ``table`` under its name, refusing another type or a taken name: the
    one door of both registries (``door`` names it in messages)."""
    taken = isinstance(item, kind) and item.name in table and not overwrite
    if taken or not isinstance(item, kind):
        raise ExperimentError(
            f"{door}: {item.name!r} is taken; pass overwrite=True to replace it."
            if taken
            else f"{door} takes {kind.__name__} objects, got {type(item).__name__}."
        )
    table[item.name] = item


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
    _register(EXPERIMENTS, spec, ExperimentSpec, "register_experiment", overwrite)
    return spec


def get_experiment(name: str | ExperimentSpec) -> ExperimentSpec:
    """The registered experiment ``name`` (a spec passes through).

    Raises:
        ExperimentError: An unknown name (the message lists the known ones).
    """
    if isinstance(name, ExperimentSpec):
        return name
    unregistered = " (the paper's register on import grafting_lens.study.paper)"
    check_known(
        name, EXPERIMENTS, "experiment", ExperimentError, "" if EXPERIMENTS else unregistered
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
    target = get_experiment(experiment).configurations
    if not isinstance(target, MutableMapping) or not target:
        raise ExperimentError(
            f"The {experiment} experiment runs no configurations of its own; register it with "
            "'position', 'component' or 'hybrid'."
        )
    _register(target, config, GraftConfig, f"register_config({experiment!r})", overwrite)


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
            :data:`~grafting_lens.study.semantics.DEFAULT_SEMANTICS`). Under
            ``hybrid="code"`` (the default's), :data:`HYBRID_CONFIGS`' names and objects
            are the code's hybrid configurations (:func:`code_hybrid_configs`); no other
            configuration depends on it.

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
    if not isinstance(configs, (list, tuple)):  # an empty list is refused below, with choices
        configs = as_list(configs, "configs", "a configuration's name or a list", ExperimentError)
    resolved = []
    for item in configs:
        if isinstance(item, GraftConfig) and code is not None:
            resolved.append(_as_code_hybrid(item, code))
        elif isinstance(item, GraftConfig):
            resolved.append(item)
        else:
            check_known(item, registry, f"{kind} configuration", ExperimentError)
            resolved.append(registry[item])
    names = [config.name for config in resolved]
    repeated = sorted({name for name in names if names.count(name) > 1})
    refuse_first(
        ExperimentError,
        (
            (
                not resolved,
                f"No configuration given (configs is empty); choose from {', '.join(registry)}.",
            ),
            (repeated, f"Configurations are listed twice: {repeated}."),
        ),
    )
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
