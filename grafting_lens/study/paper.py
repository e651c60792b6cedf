"""The paper's experiments, one registered :class:`~grafting_lens.study.specs.ExperimentSpec` each.

* ``position``: figures 2 and 3a, every SFT weight at some positions, into PRE;
* ``component``: figure 4, matrices at the last token, relation model into task model;
* ``component_baseline``: appendix C.5, the same, SFT into PRE;
* ``reversal``: appendix C.6, both-directions model into one-direction model, asked B2A;
* ``hybrid``: figure 5, task attention and relation O+FFN on the pretrained model;
* ``patching_vs_grafting``: activation patching beside grafting, layer by layer;
* ``graft_attribution`` (not in the paper): every cell attributed, verified, the minimal graft;
* ``demo``: position grafting end to end, the quickest look.

Each runs from Python (:func:`~grafting_lens.study.named.run_named_experiment`) and as
``grafting-lens run <name> --out <dir>``. The grafting experiments run the ``reference``
semantics (they reproduce figures made by the authors' code); the comparison and the
attribution are this library's own and run ``clean`` only.
"""

from __future__ import annotations

from grafting_lens.study import graft_attribution, patching_vs_grafting
from grafting_lens.study.configs import (
    COMPONENT_CONFIGS,
    COMPONENT_LAYER_RANGES,
    COMPONENT_SETS,
    HYBRID_CONFIGS,
    MOVIE_CONFIGS,
    PAPER_POSITION_CONFIGS,
    POSITION_CONFIGS,
    GraftConfig,
)
from grafting_lens.study.report import accuracy_bars, component_figures, mean_rank_bars
from grafting_lens.study.specs import (
    EXPERIMENTS,
    ExperimentSpec,
    Figure,
    Option,
    Part,
    register_experiment,
)
from grafting_lens.study.testsets import MOVIE_PROMPTS

__all__ = ["PAPER_NUMBERS"]

PROMPTS = ("headline", "qa")

POSITION_PAPER = (
    "FE+LT recovers full or nearly full SFT top-5 accuracy in all four models (figure 2).",
    "(FE+LT)^C stays near PRE (near-zero top-5) in all four models.",
    "LT alone: 53% top-5 for Gemma-1.1 (SFT 100%); FE alone: 28% for GPT2-XL.",
    "FE^C beats LT for every model except Gemma; LT^C is near zero except for GPT2-XL.",
)
COMPONENT_PAPER = (
    "O+FFN at the last token nearly matches ATTN+O+FFN (Gemma, Llama3); the last quarter "
    "of the layers carries most of it.",
    "Dropping O (FFN alone) costs 29% top-5 in Gemma and 41% in Llama3.",
    "O+FFN-up and O+FFN-down each recover some, both are needed.",
)
HYBRID_PAPER = (
    "Task ATTN at FE and LT plus relation O+FFN at LT: 63% top-5 (Gemma), 34% (Llama3).",
    "Task FFN at FE is about the same as grafting at LT only; task O with ATTN at FE helps.",
)


def _component_names(layer_ranges: tuple[str, ...]) -> tuple[str, ...]:
    return ("BASE", "DONOR", *(f"{s}@{r}" for r in layer_ranges for s in COMPONENT_SETS))


COMPONENT_PART = Part(
    "component",
    PROMPTS,
    _component_names(COMPONENT_LAYER_RANGES),
    quick=_component_names(("all", "last_half")),
)
COMPONENT_NOTE = (
    "Grafts at the last token only; ATTN = Q, K, V; FFN = every MLP matrix (gate included); "
    "FFN-up = up projection (+ gate); FFN-down = down projection. Layer ranges are counted "
    "as the semantics says (reference: the code's n // 4 quarters, 'last_half' = third and "
    "fourth quarters)."
)
COMPONENT_SUMMARY = ("config", "component_set", "layer_range", "layers", "prompt")
"""``layers``: the numbers each range grafted on the model (the legend shows them)."""


def _component_spec(
    name: str, title: str, roles: tuple[str, str], donor: str, **kwargs
) -> ExperimentSpec:
    heatmap, bars = component_figures(title)
    return ExperimentSpec(
        name,
        title,
        roles,
        donors={roles[1]: ("--donor", donor)},
        parts=(COMPONENT_PART,),
        configurations=COMPONENT_CONFIGS,
        summary_by=COMPONENT_SUMMARY,
        figures=(Figure("component_heatmap", heatmap), Figure("component_bars", bars)),
        paper=COMPONENT_PAPER,
        note=COMPONENT_NOTE,
        semantics="reference",
        **kwargs,
    )


POSITION_RUNS: dict[str, GraftConfig] = {**POSITION_CONFIGS, **MOVIE_CONFIGS}
"""The configurations ``position`` and ``demo`` name (``register_config`` adds yours here)."""


LIBRARY_READING_ONLY = ("--semantics", "--unembed", "--lm-head")
"""The options of an experiment whose runner works the library's way only (patching,
attribution: the code has nothing there to follow), refused rather than ignored."""


register_experiment(
    ExperimentSpec(
        "position",
        "Position grafting (SFT into PRE)",
        ("base", "sft"),
        donors={"sft": ("--donor", "the finetuned checkpoint (SFT) grafted into --model")},
        parts=(
            Part("paper", PROMPTS, PAPER_POSITION_CONFIGS),
            Part(
                "movie",
                tuple(MOVIE_PROMPTS),
                ("PRE", "SFT", "FE", "LT", "FE+LT", *MOVIE_CONFIGS),
                quick=("PRE", "SFT", "M", "FE+M+LT"),
            ),
        ),
        configurations=POSITION_RUNS,
        summary_by=("part", "config", "prompt"),
        figures=(
            Figure("position_grafting", accuracy_bars("Position grafting"), part="paper"),
            Figure("position_grafting_movie", accuracy_bars("Position grafting"), part="movie"),
            Figure("position_mean_rank", mean_rank_bars("Position grafting"), part="paper"),
        ),
        paper=POSITION_PAPER,
        semantics="reference",
    )
)

register_experiment(
    _component_spec(
        "component",
        "Component grafting at the last token (relation model into task model)",
        ("task", "relation"),
        "the relation model grafted into --model (the task model)",
        relations="relation",
    )
)

register_experiment(
    _component_spec(
        "component_baseline",
        "Component grafting at the last token (SFT into PRE, baseline)",
        ("base", "sft"),
        "the finetuned checkpoint grafted into --model",
    )
)

register_experiment(
    _component_spec(
        "reversal",
        "Reversal: both-direction model into one-direction model, reversed prompts",
        ("a2b", "both"),
        "the model finetuned on both directions, grafted into --model",
        direction="B2A",
    )
)

register_experiment(
    ExperimentSpec(
        "hybrid",
        "Hybrid graft (pretrained + task ATTN + relation O+FFN)",
        ("base", "task", "relation"),
        donors={
            "task": ("--task-model", "the model finetuned on the task split"),
            "relation": ("--relation-model", "the model finetuned on the relation split"),
        },
        relations="relation",
        parts=(Part("hybrid", PROMPTS, tuple(HYBRID_CONFIGS)),),
        configurations=HYBRID_CONFIGS,
        summary_by=("config", "first_entity", "prompt"),
        figures=(Figure("hybrid_grafting", accuracy_bars("Hybrid grafting")),),
        paper=HYBRID_PAPER,
        semantics="reference",
        note=(
            "Reference semantics: LT = every ATTN, O and FFN weight of the code's hybrid model "
            "(the task model with the relation model's O, FFN-up and FFN-down from layer n // 2 "
            "on) at the last token, over the third and fourth quarters. Clean: task ATTN at the "
            "last token (all layers) + relation O+FFN there (last half). LT+FE:<set> adds the "
            "task model's <set> at the first entity (all layers)."
        ),
    )
)

register_experiment(
    ExperimentSpec(
        "patching_vs_grafting",
        "Activation patching beside grafting, layer by layer (SFT into PRE)",
        ("base", "sft"),
        donors={
            "sft": ("--donor", "the finetuned checkpoint (SFT) patched and grafted into --model")
        },
        names=("PRE", "SFT"),
        options=(
            Option(
                "--directions",
                "Which directions to run (default both; --quick runs sufficiency only).",
                choices=("sufficiency", "necessity"),
                many=True,
            ),
            Option(
                "--rows-per-forward",
                "Rows of one forward pass (default 512).",
                type=int,
                fingerprinted=False,
            ),
        ),
        inapplicable=LIBRARY_READING_ONLY,
        semantics="clean",  # its runner works the library's way only
        run=patching_vs_grafting.run,
        report=patching_vs_grafting.report,
    )
)

register_experiment(
    ExperimentSpec(
        "graft_attribution",
        "Graft attribution: every cell's effect, verified, and the minimal graft (SFT into PRE)",
        ("base", "sft"),
        donors={"sft": ("--donor", "the finetuned checkpoint (SFT) whose cells are attributed")},
        names=("PRE", "SFT"),
        options=(
            Option(
                "--method",
                "The estimate: first-order gradient (default) or integrated gradients.",
                choices=("gradient", "integrated"),
            ),
            Option("--steps", "Points of the integrated path (default 8).", type=int),
            Option(
                "--fraction",
                "The share of SFT's log P(answer) the minimal graft must recover (default 0.8).",
                type=float,
            ),
            Option("--verify", "Cells to graft exactly: 'all' (default) or a number."),
        ),
        inapplicable=LIBRARY_READING_ONLY,
        semantics="clean",  # its runner works the library's way only
        run=graft_attribution.run,
        run_resumes=True,  # its attribution and search steps are kept in out/runs
        report=graft_attribution.report,
    )
)

register_experiment(
    ExperimentSpec(
        "demo",
        "Position grafting",
        ("base", "sft"),
        donors={
            "sft": (
                "--donor",
                "the finetuned checkpoint grafted into --model; without it --model is "
                "finetuned here first",
            )
        },
        names=("PRE", "SFT"),
        parts=(Part("paper", PROMPTS, PAPER_POSITION_CONFIGS),),
        configurations=POSITION_RUNS,
        figures=(
            Figure("position_grafting", accuracy_bars("Position grafting")),
            Figure("position_mean_rank", mean_rank_bars("Position grafting")),
        ),
        paper=POSITION_PAPER,
        quick_world=True,
        finetune_missing_donor=True,
        default_relations=100,
        semantics="reference",
    )
)

PAPER_NUMBERS: dict[str, list[str]] = {
    name: list(spec.paper) for name, spec in EXPERIMENTS.items() if spec.paper and name != "demo"
}
"""What the paper reports, per experiment, for the reports next to toy-world numbers."""
