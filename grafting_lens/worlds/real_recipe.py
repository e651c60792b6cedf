"""The real-model worlds' recipe: what a world is made of, and how it is finetuned.

:class:`RealWorldConfig` is everything that determines a real-model world (its hash, with
the base's content, names the cache entry); :data:`WORLDS` names the two built from the
package index; :func:`grafting_lens.worlds.real_world.build_real_world` runs the recipe
below into a working directory, resumably.

The donors are full finetunes as in the paper (every weight, AdamW, float32;
:func:`grafting_lens.worlds.finetune.finetune`) on
:func:`grafting_lens.worlds.documents.training_documents` in the released code's wording:
``sft`` (all relations, A2B); ``task`` / ``relation`` (one half of the relations each, as
many optimizer steps as sft); ``a2b`` / ``both`` (appendix C.6: sft's run, hard-linked, and
both directions of every relation); ``sft_seed<s>`` (sft with another finetuning seed). The
relations are fake movies with real actors the base knows (:func:`known_actors`). Documents,
evaluation prompts and the actor check start as the tokenizer starts a text
(``bos="tokenizer"``), as the paper's code does; the evaluation runs the unembedding on each
prompt's last position alone. Each named world's recipe, why it is so, and what its build
measured: docs/how-to/real-model-world.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from tqdm.auto import tqdm

from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.core.console import quiet_loading, say_line
from grafting_lens.core.directories import MARKER
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.core.files import atomic_write
from grafting_lens.models.gguf_checkpoint import sha256_of
from grafting_lens.worlds import data
from grafting_lens.worlds.directories import read_relations, split_relations
from grafting_lens.worlds.documents import training_documents
from grafting_lens.worlds.finetune import BOS_RULES, bos_prefix, finetune
from grafting_lens.worlds.real_source import SOURCES, base_checkpoint, base_key

__all__ = ["BUILD_VERSION", "TEMPLATES", "WORLDS", "RealWorldConfig", "known_actors"]

BUILD_VERSION = 2
"""Bump when the recipe changes: old worlds stop matching."""

ACTOR_CHECK_PROMPT = "The film's credits list the actor {name}"
"""Where the actor check asks the base to finish an actor's name."""

TEMPLATES = data.CODE_ARTICLE_TEMPLATES + data.CODE_QA_TEMPLATES
"""The finetuning documents' templates: the released code's wording."""

SECONDS_PER_STEP_CPU = {"smollm2": 2.9, "gemma3": 8.6}
"""Wall time of a whole build per optimizer step on a 2-core CPU with 2 threads, by base:
each recipe's whole build from an empty cache, everything included (measured:
docs/how-to/real-model-world.md). Another base is estimated at SmolLM2's rate."""


@dataclass(frozen=True)
class RealWorldConfig:
    """Everything that determines a real-model world; its hash names the cache entry.

    Attributes:
        base: A named source of :data:`grafting_lens.worlds.real_source.SOURCES`
            (``"smollm2"``, ``"gemma3"``), else a GGUF file, a ``save_pretrained``
            directory or a hub id (a local path named like a source: write ``./smollm2``).
        dataset: Passed to :func:`grafting_lens.worlds.data.make_relations`.
        n_relations: Relations finetuned into ``sft`` (the paper: 1,000).
        seed: Seeds the relations, the split and the finetuning.
        epochs: Passes of ``sft`` (and ``both``) over its documents (the paper: 10);
            ``task`` and ``relation`` get as many optimizer steps as ``sft``.
        lr: Peak AdamW learning rate (the paper: 2e-5 for 1-8B models).
        weight_decay: AdamW's weight decay (the paper: 0.01).
        batch_size: Documents per step (the paper: 4).
        max_length: Longest document in tokens (the code's documents are under 80).
        known_actor_top_k: Keep the actors whose last name the base ranks in its top k
            (:func:`known_actors`); ``None`` keeps every actor.
        bos: What starts every finetuning document, evaluation prompt and actor check
            (:data:`grafting_lens.worlds.finetune.BOS_RULES`): ``"tokenizer"`` follows the
            tokenizer's own convention, as the paper's code does.
        reversal: Build the reversal donors ``a2b`` and ``both`` (appendix C.6).
        extra_sft_seeds: More finetuning seeds of ``sft``: each ``s`` adds a donor
            ``sft_seed<s>`` (same relations and documents).
        freeze_embedding: Keep the unembedding (and with tied embeddings the input
            embedding, the same matrix) at the base's weights. It saves AdamW's work on
            the largest matrix, but then the unembedding switch (``unembed=base`` or
            ``donor``) can show nothing: the donors' unembedding is the base's.
    """

    base: str = "smollm2"
    dataset: str = "fake_movies_real_actors"
    n_relations: int = 64
    seed: int = 0
    epochs: int = 5
    lr: float = 1e-4
    weight_decay: float = 0.01
    batch_size: int = 8
    max_length: int = 96
    known_actor_top_k: Optional[int] = 5
    bos: str = "tokenizer"
    reversal: bool = True
    extra_sft_seeds: tuple[int, ...] = ()
    freeze_embedding: bool = False

    def __post_init__(self) -> None:
        problem = next(self._problems(), None)
        if problem is not None:
            raise GraftingLensError(f"RealWorldConfig.{problem}")

    def _problems(self) -> Iterator[str]:
        """What makes the configuration unusable, the first problem first."""
        for name in ("n_relations", "epochs", "batch_size", "max_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                yield f"{name}={value!r}: must be an integer >= 1."
        if self.n_relations < 4:
            yield (
                f"n_relations={self.n_relations}: must be >= 4, so that the task and relation "
                "splits each get two relations or more."
            )
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            yield f"lr={self.lr!r}: must be a number > 0."
        if self.bos not in BOS_RULES:
            yield f"bos={self.bos!r}: choose one of {BOS_RULES}."
        seeds = self.extra_sft_seeds
        if not isinstance(seeds, tuple) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s != self.seed for s in seeds
        ):
            yield (
                f"extra_sft_seeds={seeds!r}: pass a tuple of integer seeds other than "
                f"seed={self.seed}, e.g. (1,)."
            )
        if not isinstance(self.base, str) or not self.base.strip():
            yield (
                f"base={self.base!r}: name a source ({', '.join(SOURCES)}), a GGUF file, a "
                "checkpoint directory or a hub id."
            )

    @property
    def model_names(self) -> tuple[str, ...]:
        """The checkpoints this recipe builds, each a ``save_pretrained`` directory."""
        names: tuple[str, ...] = ("base", "sft", "task", "relation")
        names += ("a2b", "both") if self.reversal else ()
        return names + tuple(f"sft_seed{s}" for s in self.extra_sft_seeds)

    def finetune_steps(self, subsets: Optional[dict[str, int]] = None) -> dict[str, int]:
        """Optimizer steps of each finetune, from the number of relations each sees.

        Args:
            subsets: Relations per donor (default: ``n_relations`` for the full donors,
                half of it for ``task`` and ``relation``).
        """
        half = self.n_relations // 2
        sizes = subsets or {"sft": self.n_relations, "task": half, "relation": half}
        steps = {}
        for name in self.model_names[1:]:
            if name == "a2b":
                continue  # the same run as sft
            relations = sizes.get(name, sizes["sft"])
            documents = relations * len(TEMPLATES) * (2 if name == "both" else 1)
            train = documents - int(round(documents * 0.2))
            steps[name] = math.ceil(train / self.batch_size) * _epochs(
                self, name, relations, sizes["sft"]
            )
        return steps

    def estimated_minutes(self, seconds_per_step: Optional[float] = None) -> float:
        """The whole build's wall time on a 2-core CPU: every finetune's optimizer steps at a
        measured whole-build time per step (:data:`SECONDS_PER_STEP_CPU`, by base)."""
        if seconds_per_step is None:
            seconds_per_step = SECONDS_PER_STEP_CPU.get(self.base, SECONDS_PER_STEP_CPU["smollm2"])
        return sum(self.finetune_steps().values()) * seconds_per_step / 60


WORLDS: dict[str, RealWorldConfig] = {
    "smollm2": RealWorldConfig(base="smollm2", extra_sft_seeds=(1,)),
    "gemma3": RealWorldConfig(base="gemma3", n_relations=48, epochs=2, lr=3e-4),
}
"""The named worlds (``grafting-lens world build <name>``, ``run --world <name>``)."""


def known_actors(
    model: Any,
    tokenizer: Any,
    actors: tuple[str, ...],
    *,
    top_k: int = 5,
    bos: str = "tokenizer",
    batch_size: int = 64,
) -> list[str]:
    """The actors whose name the model completes: the last word's first token in its top k.

    Each actor is asked as ``ACTOR_CHECK_PROMPT`` up to the last word of the name, started
    as ``bos`` says (:data:`grafting_lens.worlds.finetune.BOS_RULES`), at its last position only.
    """
    prefix = bos_prefix(tokenizer, bos)
    rows, targets, asked = [], [], []
    for name in actors:
        if " " not in name:  # a one-word name has nothing to complete: not checked, not kept
            continue
        first, last = name.rsplit(" ", 1)
        prompt = ACTOR_CHECK_PROMPT.format(name=first)
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        whole = tokenizer(f"{prompt} {last}", add_special_tokens=False).input_ids
        if whole[: len(prompt_ids)] != prompt_ids or len(whole) == len(prompt_ids):
            continue  # the name's first token merges with the prompt: no next token to rank
        rows.append([*prefix, *prompt_ids])
        targets.append(whole[len(prompt_ids)])
        asked.append(name)
    ranks = _target_ranks(model, rows, targets, batch_size)
    return [name for name, rank in zip(asked, ranks) if rank < top_k]


# ------------------------------------------------------------------------- build


def _epochs(config: RealWorldConfig, name: str, relations: int, all_relations: int) -> int:
    """Passes of a donor: sft's, or more for a split model so it gets as many steps."""
    if name in ("task", "relation"):
        return max(config.epochs, round(config.epochs * all_relations / relations))
    return config.epochs


class _Report:
    """Progress lines on standard error where no bar is drawn (a build's log file): each
    stage, then a line a minute with the steps done and the time left, estimated from the
    seconds each step of this process took so far (validation and checkpoints included)."""

    def __init__(self, config: RealWorldConfig, lines: bool) -> None:
        self.lines = lines
        self.total = sum(config.finetune_steps().values())
        self.done = 0  # steps of finished finetunes, this process's or an earlier one's
        self.started: Optional[float] = None
        self.steps_here = 0
        self.last_line = 0.0
        named = next((name for name, named in WORLDS.items() if named == config), None)
        self.name = named or Path(config.base).name

    def say(self, text: str) -> None:
        if self.lines:
            say_line(f"{self.name} world", text)

    def finished(self, steps: int) -> None:
        self.done += steps

    def step(self, name: str, done: int, total: int, loss: float) -> None:
        now = time.perf_counter()
        if self.started is None:
            self.started = now
            self.first_done = done - 1
        self.steps_here = done - self.first_done
        if now - self.last_line < 60 and done not in (1, 3, total):
            return
        self.last_line = now
        seconds = (now - self.started) / (self.steps_here - 1) if self.steps_here > 1 else None
        left = self.total - self.done - done
        estimate = (
            f", {seconds:.1f} s a step, about {left * seconds / 60:.0f} min left" if seconds else ""
        )
        self.say(
            f"{name} step {done}/{total}, loss {loss:.3f}; build {self.done + done}/{self.total} "
            f"steps{estimate}"
        )

    def next_finetune(self) -> None:
        self.started = None  # each finetune measures its own steps (the first one warms up)


def _build(
    directory: Path,
    key: str,
    config: RealWorldConfig,
    root_dir: Path,
    find_links: Union[str, os.PathLike, None],
    progress: bool,
    report: _Report,
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state_path = directory / "build.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"seconds": {}}

    def record(stage: str, started: float, **changes: Any) -> None:
        state.update(changes)
        state["seconds"][stage] = round(time.perf_counter() - started, 1)
        atomic_write(state_path, json.dumps(state, indent=1).encode())

    report.say(
        f"building {key} in {directory} ({', '.join(config.model_names)}; "
        f"about {report.total} finetuning steps, about {config.estimated_minutes():.0f} min on 2 cores)"
    )
    stages = tqdm(
        total=len(config.model_names) + 2, desc=f"{config.base} world", disable=not progress
    )
    with stages, quiet_loading():
        stages.set_postfix_str("base")
        if not (directory / "base" / "config.json").exists():
            started = time.perf_counter()
            report.say("fetching and converting the base")
            base = base_checkpoint(
                base_source(config.base), cache_dir=root_dir, find_links=find_links
            )
            _link_copy(base, directory / "base")
            record("base", started)
        stages.update(1)
        tokenizer = AutoTokenizer.from_pretrained(directory / "base")
        prefix = bos_prefix(tokenizer, config.bos)

        stages.set_postfix_str("actors")
        if not (directory / "relations.json").exists():
            started = time.perf_counter()
            actors = data.REAL_ACTORS
            if config.known_actor_top_k is not None:
                report.say(f"asking the base which of {len(actors)} actors it knows")
                model = AutoModelForCausalLM.from_pretrained(directory / "base").eval()
                actors = tuple(
                    known_actors(
                        model, tokenizer, actors, top_k=config.known_actor_top_k, bos=config.bos
                    )
                )
                del model
            made = _relations(config, actors)
            atomic_write(directory / "relations.json", json.dumps(made, indent=1).encode())
            record("actors", started, actors=list(actors))
            report.say(f"{len(actors)} actors kept, {len(made['relations'])} relations")
        stages.update(1)
        relations, task, relation = read_relations(directory)
        subsets = {"sft": relations, "task": task, "relation": relation}
        steps = config.finetune_steps({name: len(subset) for name, subset in subsets.items()})
        report.total = sum(steps.values())
        for name in config.model_names[1:]:
            stages.set_postfix_str(name)
            if name == "a2b":  # the A2B data is exactly sft's: the run is shared, not repeated
                if not (directory / "a2b" / "config.json").exists():
                    _link_copy(directory / "sft", directory / "a2b")
                stages.update(1)
                continue
            if not (directory / name / "config.json").exists():
                started = time.perf_counter()
                if (directory / f".{name}.epochs").exists():
                    # Begun by a killed process: this one's seconds are only the rest of it.
                    resumed = state.setdefault("resumed", [])
                    resumed += [name] if name not in resumed else []
                subset = subsets.get(name, relations)
                seed = config.seed
                if name.startswith("sft_seed"):
                    seed = int(name.removeprefix("sft_seed"))
                direction = "both" if name == "both" else "A2B"
                documents = training_documents(subset, direction, TEMPLATES, seed=config.seed)
                epochs = _epochs(config, name, len(subset), len(relations))
                report.say(
                    f"finetuning {name}: {len(subset)} relations, {epochs} epochs, seed {seed}"
                )
                report.next_finetune()
                training = _finetune(
                    directory, name, documents, epochs, seed, config, progress, report
                )
                record(name, started, training=dict(state.get("training", {}), **{name: training}))
            report.finished(steps[name])
            stages.update(1)

        stages.set_postfix_str("evaluation")
        if "evaluation" not in state:
            started = time.perf_counter()
            report.say("evaluating every checkpoint")
            evaluation = _evaluate(directory, tokenizer, subsets, config)
            record("evaluation", started, evaluation=evaluation)
        stages.update(1)

    bos_tokens = tokenizer.convert_ids_to_tokens(prefix)
    manifest = {
        "key": key,
        "build_version": BUILD_VERSION,
        "config": dataclasses.asdict(config),
        "base_key": base_key(base_source(config.base)),
        "models": list(config.model_names),
        "bos": {"rule": config.bos, "ids": prefix, "tokens": bos_tokens},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "threads": torch.get_num_threads(),
        "estimated_minutes_on_2_cpu_cores": round(config.estimated_minutes(), 1),
        "build_seconds": state["seconds"],
        # Stages a killed build had begun: their seconds count the last process's part only.
        "resumed_stages": state.get("resumed", []),
        "actors": state.get("actors"),
        "training": dict(
            state["training"], **({"a2b": {"same_run_as": "sft"}} if config.reversal else {})
        ),
        "evaluation": state["evaluation"],
        "files": {
            str(path.relative_to(directory)): sha256_of(path)
            for path in sorted(directory.rglob("*"))
            if path.is_file() and not path.name.startswith(".") and path.name != "build.json"
        },
    }
    (directory / "build.json").unlink()
    atomic_write(directory / "manifest.json", json.dumps(manifest, indent=1).encode())
    resumed = state.get("resumed", [])
    report.say(
        f"done: {sum(state['seconds'].values()) / 60:.0f} min of stages"
        + (f" (resumed: {', '.join(resumed)}, counted from the resumption)" if resumed else "")
    )


def base_source(base: str) -> Any:
    """The named source a base names, or the base itself (a path or hub id)."""
    return SOURCES.get(base, base)


def _finetune(
    directory: Path,
    name: str,
    documents: list[str],
    epochs: int,
    seed: int,
    config: RealWorldConfig,
    progress: bool,
    report: _Report,
) -> dict[str, Any]:
    """Finetune a fresh copy of the base into ``directory/name``; its summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory / "base", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory / "base")
    epochs_dir = directory / f".{name}.epochs"
    result = finetune(
        model,
        tokenizer,
        documents,
        preset="aggressive",
        epochs=epochs,
        lr=config.lr,
        weight_decay=config.weight_decay,
        batch_size=config.batch_size,
        max_length=config.max_length,
        supplementary=[],
        seed=seed,
        bos=config.bos,
        freeze_unembedding=config.freeze_embedding,
        progress=progress,
        description=name,
        checkpoint_dir=epochs_dir,
        on_step=lambda done, total, loss: report.step(name, done, total, loss),
    )
    partial = directory / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # a killed save's leftover, inside the build
    result.model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    os.replace(partial, directory / name)
    shutil.rmtree(epochs_dir, ignore_errors=True)
    return {**result.summary(), "seed": seed, "documents": len(documents)}


def _relations(config: RealWorldConfig, actors: tuple[str, ...]) -> dict[str, Any]:
    """The relations over ``actors`` and their task/relation split, as stored."""
    try:
        relations = data.make_relations(
            config.dataset, n=config.n_relations, seed=config.seed, actors=actors
        )
    except GraftingLensError as error:
        raise GraftingLensError(
            f"The base knows {len(actors)} of the {len(data.REAL_ACTORS)} actors, too few for "
            f"{config.n_relations} relations ({error}). Lower n_relations, or raise "
            "known_actor_top_k (None keeps every actor; grafting-lens world build: "
            "--n-relations N, --known-actor-top-k K or all)."
        ) from error
    return split_relations(relations, config.seed, "raise n_relations (or change the seed).")


def _link_copy(source: Path, target: Path) -> None:
    """Copy a checkpoint directory by hard links where the filesystem allows (no 1 GB copy)."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # a killed copy's leftover, inside the build
    shutil.copytree(source, partial, copy_function=link, ignore=shutil.ignore_patterns(MARKER))
    os.replace(partial, target)


# -------------------------------------------------------------------- evaluation


@torch.no_grad()
def _target_ranks(
    model: Any, rows: list[list[int]], targets: list[int], batch_size: int = 32
) -> list[int]:
    """The rank of each row's target token among the logits at the row's last position."""
    # Rows of one length run together without padding, and the unembedding runs on the last
    # position alone: Gemma's 262,144-token logits at every position would be most of the memory.
    ranks = [0] * len(rows)
    by_length: dict[int, list[int]] = {}
    for index, row in enumerate(rows):
        by_length.setdefault(len(row), []).append(index)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            tokens = torch.tensor([rows[i] for i in chunk])
            final = model(input_ids=tokens, logits_to_keep=1).logits[:, -1].float()
            target = torch.tensor([targets[i] for i in chunk])
            rank = (final > final.gather(1, target[:, None])).sum(dim=1)
            for i, r in zip(chunk, rank.tolist()):
                ranks[i] = r
    return ranks


def _top5(
    model: Any, tokenizer: Any, relations: list[Any], prompt: str, direction: str, bos: str
) -> dict[str, Any]:
    examples = data.make_examples(relations, prompt=prompt, direction=direction, templates="code")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an example the tokenizer cannot score is not counted
        batch = tokenize_examples(examples, tokenizer, bos=bos)
    rows = [
        batch.tokens[i, : int(batch.attention_mask[i].sum())].tolist() for i in range(len(batch))
    ]
    ranks = _target_ranks(model, rows, batch.target_ids.tolist())
    correct = sum(rank < 5 for rank in ranks)
    return {
        "top5_correct": correct,
        "total": len(rows),
        "top5_accuracy": round(correct / max(len(rows), 1), 4),
    }


def _evaluate(
    directory: Path, tokenizer: Any, subsets: dict[str, list[Any]], config: RealWorldConfig
) -> dict[str, Any]:
    """Top-5 accuracy of every checkpoint on the code's test prompts, where experiments read it."""
    from transformers import AutoModelForCausalLM

    full = [("sft", "A2B"), ("sft", "B2A")] if config.reversal else [("sft", "A2B")]
    split = [("task", "A2B"), ("relation", "A2B")]
    plan = {"base": full, "sft": full, "task": split, "relation": split}
    if config.reversal:
        plan["both"] = full
    for seed in config.extra_sft_seeds:
        plan[f"sft_seed{seed}"] = [("sft", "A2B")]
    evaluation: dict[str, Any] = {}
    for name, asked in plan.items():
        model = AutoModelForCausalLM.from_pretrained(directory / name).eval()
        for subset, direction in asked:
            label = "all" if subset == "sft" else f"{subset}_split"
            for prompt in ("headline", "qa"):
                evaluation.setdefault(name, {})[f"code:{prompt}/{direction}/{label}"] = _top5(
                    model, tokenizer, subsets[subset], prompt, direction, config.bos
                )
        del model
    if config.reversal:
        evaluation["a2b"] = evaluation["sft"]
    return evaluation
