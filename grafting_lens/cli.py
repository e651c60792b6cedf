"""The ``grafting-lens`` command: position grafting end to end, from one line.

``grafting-lens demo --out results/`` reproduces the paper's first experiment
(figure 2) on the toy world (:mod:`grafting_lens.toy`): it builds or loads the
pretrained and finetuned toy checkpoints, asks both test prompts (headline and
QA) about every finetuned relation under the eight position-grafting
configurations (:mod:`grafting_lens.position_grafting`), prints top-1 and top-5
accuracy with bootstrap confidence intervals, and writes:

* ``results.csv``: one row per example and configuration (rank, probability and
  top-10 tokens of the answer);
* ``summary.csv``: one row per configuration and prompt;
* ``position_grafting.html`` (and ``.png`` when a Chrome is available, unless
  ``--no-png``): the bar chart.

Each file is written under a temporary name and renamed, so a file that exists is
complete even if the run was interrupted.

``--model`` runs the same pipeline on a real checkpoint (hub id or directory). With
``--donor`` the two are grafted as they are, and the donor is assumed to have been
finetuned on ``make_relations(--dataset, n=--n-relations, seed=--seed)`` (A2B
training documents); without it the model is first finetuned on those relations
with :func:`grafting_lens.finetune.finetune` (the paper's "aggressive" preset, two
epochs with ``--quick``), which wants a GPU for anything but small models.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any, NoReturn

import pandas as pd
import typer

from grafting_lens.errors import GraftingLensError
from grafting_lens.files import atomic_write

app = typer.Typer(
    name="grafting-lens",
    help="Dynamic weight grafting: localize finetuned knowledge by swapping weights per position.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

PROMPTS = ("headline", "qa")
"""The test prompts the demo asks, as in the paper's figures."""


def _quick_toy_config():
    """A toy world small enough to build in one to four minutes on two CPU cores.

    Good for checking that the pipeline runs; too small for the finetuned model to
    recall much, so its numbers are not the paper's picture.
    """
    from grafting_lens.toy import ToyWorldConfig

    return ToyWorldConfig(
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
        pretrain_epochs=1,
        finetune_epochs=10,
    )


@app.callback()
def main() -> None:
    """grafting-lens: dynamic weight grafting for TransformerLens models."""


@app.command()
def demo(
    out: Path = typer.Option(
        ..., "--out", help="Directory for results.csv, summary.csv and the figure."
    ),
    model: str | None = typer.Option(
        None, "--model", help="A real checkpoint (hub id or directory) instead of the toy world."
    ),
    donor: str | None = typer.Option(
        None,
        "--donor",
        help="Finetuned checkpoint to graft into --model; without it --model is finetuned first.",
    ),
    n_examples: int | None = typer.Option(
        None,
        "--n-examples",
        min=1,
        help="Test only the first N finetuned relations (default: all of them).",
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="A small toy world (minutes to build, numbers only a smoke test) or a short finetune.",
    ),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Examples per forward pass."),
    device: str | None = typer.Option(
        None, "--device", help="torch device, e.g. cuda (default: cpu)."
    ),
    dataset: str = typer.Option(
        "fake_movies_real_actors",
        "--dataset",
        help="Relations for --model (see grafting_lens.data.DATASETS).",
    ),
    n_relations: int | None = typer.Option(
        None,
        "--n-relations",
        min=1,
        help="With --model: make_relations(--dataset, n=this, seed=--seed) are the relations the "
        "donor was (or is now) finetuned on (default: 100, 20 with --quick).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the relations and the bootstrap."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="Where toy worlds are cached."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars."),
    png: bool = typer.Option(
        True, "--png/--no-png", help="Also export the figure as PNG (needs Chrome for kaleido)."
    ),
    include_unembed: bool = typer.Option(
        False,
        "--include-unembed",
        help="Decode grafted positions through the donor's unembedding (default: the base's, "
        "as in the paper).",
    ),
) -> None:
    """Position grafting (PRE, SFT, FE, LT, FE+LT and complements) on the toy world or a model."""
    out = _check_out(out)
    if donor is not None and model is None:
        _fail("--donor needs --model: the base the donor is grafted into.")
    started = time.perf_counter()
    try:
        from grafting_lens.models import resolve_placement

        resolve_placement(device)  # a bad --device fails now, not after minutes of building
        if model is None:
            models, relations, label = _toy_models(quick, cache_dir, device, progress)
        else:
            models, relations, label = _checkpoint_models(
                model,
                donor,
                dataset,
                n_relations or (20 if quick else 100),
                seed,
                quick,
                device,
                progress,
            )
        if n_examples is not None:
            relations = relations[:n_examples]
        results = run_demo(
            models,
            relations,
            batch_size=batch_size,
            progress=progress,
            include_unembed=include_unembed,
        )
    except ValueError as error:  # GraftingLensError and every other error we raise on purpose
        _fail(str(error))

    from grafting_lens import metrics, plots

    summary = metrics.summarize(results, by=("config", "prompt"), ks=(1, 5), seed=seed)
    _print_summary(summary, label)
    typer.echo(
        "Grafted positions decode through the "
        + (
            "donor's unembedding (--include-unembed), so SFT is the finetuned model itself."
            if include_unembed
            else "base's unembedding, as in the paper; SFT is the finetuned model decoded that "
            "way. --include-unembed uses the donor's."
        )
    )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "results.csv", results.to_csv(index=False).encode())
    atomic_write(out / "summary.csv", summary.to_csv(index=False).encode())
    figure = plots.plot_accuracy(summary, k=5, title=f"Position grafting, top-5 accuracy ({label})")
    saved = plots.save_figure(figure, out / "position_grafting", png=png, warn=False)
    typer.echo(
        f"Wrote {out / 'results.csv'} ({len(results)} rows), {out / 'summary.csv'}, {saved['html']}"
    )
    if saved["png"] is not None:
        typer.echo(f"Wrote {saved['png']}")
    elif saved["png_error"]:
        typer.echo(f"No PNG: {saved['png_error']}.")
    typer.echo(f"Done in {time.perf_counter() - started:.0f}s.")


# ------------------------------------------------------------------- pipeline


def run_demo(
    models: Any,
    relations: list[Any],
    batch_size: int = 8,
    progress: bool = True,
    include_unembed: bool = False,
) -> pd.DataFrame:
    """Every position-grafting configuration on both test prompts of ``relations``.

    ``include_unembed`` decodes grafted positions through the donor's unembedding.

    Returns:
        The concatenated :func:`~grafting_lens.position_grafting.run_position_grafting`
        tables of the headline and QA prompts.
    """
    import warnings

    from grafting_lens import data
    from grafting_lens.position_grafting import run_position_grafting

    if not relations:
        raise GraftingLensError("No relations to test: pass --n-examples 1 or more.")
    tables = []
    for prompt in PROMPTS:
        examples = data.make_examples(relations, prompt=prompt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokenized = data.tokenize_examples(examples, models.tokenizer)
        for warning in caught:
            typer.echo(f"[{prompt}] {warning.message}", err=True)
        tables.append(
            run_position_grafting(
                models,
                tokenized,
                batch_size=batch_size,
                progress=progress,
                include_unembed=include_unembed,
            )
        )
    return pd.concat(tables, ignore_index=True)


def _toy_models(quick: bool, cache_dir: Path | None, device: str | None, progress: bool):
    import grafting_lens as gl
    from grafting_lens import toy

    config = _quick_toy_config() if quick else None
    typer.echo(
        "Building or loading the toy world" + (" (quick)" if quick else "") + "...", err=True
    )
    world = toy.build_toy_world(config=config, cache_dir=cache_dir, progress=progress)
    models = gl.load_models(
        world.base_dir,
        world.sft_dir,
        tokenizer=world.load_tokenizer(),
        device=device,
        names=["PRE", "SFT"],
    )
    return models, list(world.relations), f"toy world {world.root.name}"


def _checkpoint_models(
    name: str,
    donor: str | None,
    dataset: str,
    n_relations: int,
    seed: int,
    quick: bool,
    device: str | None,
    progress: bool,
):
    import grafting_lens as gl
    from grafting_lens import data

    _check_checkpoint(name, "--model")
    relations = data.make_relations(dataset, n=n_relations, seed=seed)
    if donor is not None:
        _check_checkpoint(donor, "--donor")
        models = gl.load_models(name, donor, device=device, names=["PRE", "SFT"])
        return models, relations, f"{_short(name)} <- {_short(donor)}"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grafting_lens.finetune import finetune

    tokenizer = AutoTokenizer.from_pretrained(name)
    base = AutoModelForCausalLM.from_pretrained(name).eval()
    finetuned = copy.deepcopy(base)
    documents = data.training_documents(relations, direction="A2B", seed=seed)
    typer.echo(
        f"Finetuning {_short(name)} on {len(relations)} relations ({len(documents)} documents)...",
        err=True,
    )
    finetune(finetuned, tokenizer, documents, preset="aggressive", epochs=2 if quick else None,
             device=device, seed=seed, progress=progress)  # fmt: skip
    if device is not None:
        base.to(device)
    models = gl.load_models(
        base, finetuned, tokenizer=tokenizer, device=device, names=["PRE", "SFT"]
    )
    return models, relations, f"{_short(name)}, finetuned here"


def _short(name: str) -> str:
    """A checkpoint's label for tables: a directory's name, or the hub id."""
    path = Path(name).expanduser()
    return path.name if path.is_dir() else name


# --------------------------------------------------------------------- checks


def _check_out(out: Path) -> Path:
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise typer.BadParameter(
            f"{out} is an existing file; --out must be a directory (new or existing).",
            param_hint="--out",
        )
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise typer.BadParameter(
                    f"{parent} is a file, so {out} cannot be created.", param_hint="--out"
                )
            if not os.access(parent, os.W_OK):
                raise typer.BadParameter(f"{parent} is not writable.", param_hint="--out")
            break
    return out


def _check_checkpoint(name: str, option: str) -> None:
    """Fail early, with a clear message, on a checkpoint that cannot be found."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path.is_dir() and (path / "config.json").is_file()):
            _fail(
                f"{option} {name!r} is not a checkpoint: expected a directory with config.json "
                "(written by save_pretrained) or a Hugging Face hub id."
            )
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        where = (
            "in the local Hugging Face cache (HF_HUB_OFFLINE is set)"
            if offline
            else "on the Hugging Face hub"
        )
        _fail(
            f"Unknown model {name!r} for {option}: it is not a local directory and was not found "
            f"{where}. Pass a hub id such as 'gpt2' or a directory written by save_pretrained. "
            f"({type(error).__name__}: {' '.join(str(error).split())[:200]})"
        )


def _fail(message: str) -> NoReturn:
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code=1)


# --------------------------------------------------------------------- output


def _print_summary(summary: pd.DataFrame, label: str) -> None:
    def interval(row, column: str) -> str:
        return f"{row[column]:.0%} [{row[column + '_low']:.0%}, {row[column + '_high']:.0%}]"

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich comes with typer, but a plain table does as well
        typer.echo(summary.to_string(index=False))
        return
    table = Table(title=f"Position grafting: {label} (95% bootstrap CI)")
    for column in ("config", "prompt", "n", "top-1", "top-5", "mean rank"):
        table.add_column(column, justify="left" if column in ("config", "prompt") else "right")
    for _, row in summary.iterrows():
        table.add_row(
            str(row["config"]),
            str(row["prompt"]),
            str(row["n"]),
            interval(row, "top1"),
            interval(row, "top5"),
            f"{row['mean_rank']:.1f}",
        )
    Console(width=max(100, Console().width)).print(table)




if __name__ == "__main__":
    app()
