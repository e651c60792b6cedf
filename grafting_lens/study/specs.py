"""Named experiments: one registered :class:`ExperimentSpec` each, and the registry.

:func:`register_experiment` is the one door: a registered spec runs from Python and as
``grafting-lens run <name>`` (docs/developing/adding-an-experiment.md). The paper's are
registered by :mod:`grafting_lens.study.paper`, which stands on this registry.
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
"""Which relations an experiment asks about: all, or a half of ``split_task_relation``."""

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
        draw: ``(summary rows, caption) -> plotly figure`` (the caption:
            :func:`~grafting_lens.study.report.figure_caption`).
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
        fingerprinted: The value can change a result (``False`` for a batching size).
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
        roles: What each source of the model set is, base first (in the toy world, the
            checkpoint names).
        donors: For each role after the base, the command-line option that names its
            checkpoint and a line of help (the base is always ``--model``).
        relations: Which relations are asked about: ``"all"``, ``"task"`` or ``"relation"``
            (:data:`RELATION_SETS`).
        direction: ``"A2B"``, or ``"B2A"`` for the reversal.
        parts: The runs it is made of (see :class:`Part`).
        configurations: The configurations its parts name, by name (shared by experiments
            that run the same ones); :func:`register_config` adds to them.
        summary_by: The columns its summary groups by.
        figures: What to draw from the summary.
        paper: What the paper reports, listed next to the results.
        note: A line for the report saying what the configurations graft.
        names: Labels of the sources in tables (default: the roles).
        options: Command-line options of its own.
        inapplicable: Shared command-line options that do not apply to it.
        run: A runner other than the configuration grid:
            ``(spec, setup, **run arguments) -> {table name: DataFrame}``
            (:func:`~grafting_lens.study.named.run_spec`).
        run_resumes: That runner keeps its progress in the run directory it is given, and
            a run of the same command goes on from it.
        report: A report other than the standard one (``write_experiment_report``).
        quick_world: ``--quick`` builds a small toy world (and finetunes for two epochs)
            instead of asking about fewer relations.
        finetune_missing_donor: ``--model`` without a donor finetunes a copy of it first.
        default_relations: How many relations ``--model`` runs make by default.
        semantics: The label of the :class:`~grafting_lens.study.semantics.Semantics` its
            runs default to; a runner that works one way only (``"--semantics"`` in
            :attr:`inapplicable`) names that one.
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
        label: The models in a few words, for reports (``"gpt2 <- gpt2-sft"``).
        dataset: The dataset the relations come from (the ``dataset`` column).
        data_seed: The seed they were made with (the ``data_seed`` column).
        seeds: Further seeds to record with every row (the toy world's).
        world: The world's ``root``, ``seed``, ``dataset`` and ``evaluation``, or ``None``
            for your own checkpoints.
        resumable: Whether a run on these models can resume from a run directory (not
            when a donor was finetuned in this process).
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
imported, as every name of ``grafting_lens.study`` does)."""


def _register(
    table: MutableMapping[str, Any],
    item: Any,
    kind: type[ExperimentSpec] | type[GraftConfig],
    door: str,
    overwrite: bool,
) -> None:
    """Add ``item`` to ``table`` under its name, refusing another type or a taken name."""
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
        ExperimentError: An unknown name.
    """
    if isinstance(name, ExperimentSpec):
        return name
    hint = " (the paper's register on import grafting_lens.study.paper)"
    check_known(name, EXPERIMENTS, "experiment", ExperimentError, "" if EXPERIMENTS else hint)
    return EXPERIMENTS[name]


# ----------------------------------------------------------------------- configurations


def register_config(
    config: GraftConfig, experiment: str = "position", overwrite: bool = False
) -> None:
    """Add a configuration to an experiment's so that runs can name it.

    Args:
        config: The configuration.
        experiment: The registered experiment whose configurations it joins
            (``"position"``, ``"component"``, shared with ``component_baseline`` and
            ``reversal``, or ``"hybrid"``).
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
        kind: What to call the configurations in messages (default ``"<registry>-grafting"``).
        semantics: What the configurations will run under (default
            :data:`~grafting_lens.study.semantics.DEFAULT_SEMANTICS`): under
            ``hybrid="code"``, :data:`HYBRID_CONFIGS`' names and objects are the code's
            (:func:`code_hybrid_configs`).

    Raises:
        ExperimentError: No configuration, an unknown name, or a name given twice.
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
        if isinstance(item, GraftConfig):
            # HYBRID_CONFIGS' own objects run as the code's hybrid under it, as their names do.
            ours = HYBRID_CONFIGS.get(item.name) == item
            resolved.append((code or {}).get(item.name, item) if ours else item)
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
