"""The toy world's recipe: what a toy world is made of, and how it is trained from scratch.

:class:`ToyWorldConfig` is everything that determines a toy world (its hash names the cache
entry); :func:`grafting_lens.worlds.toy.build_toy_world` unpacks the world shipped with the
package when the configuration is the shipped one, and otherwise runs this recipe: a base
pretrained on a synthetic corpus, donors finetuned from it, each checkpoint evaluated, the
manifest written last.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from grafting_lens.analysis.batch import tokenize_examples
from grafting_lens.analysis.metrics import last_token_logits, top_k_hit
from grafting_lens.core.arguments import is_integer
from grafting_lens.core.console import quiet_loading
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.worlds import data
from grafting_lens.worlds.directories import read_relations, split_relations
from grafting_lens.worlds.documents import training_documents
from grafting_lens.worlds.finetune import finetune
from grafting_lens.worlds.toy_corpus import SPECIAL_TOKEN, pretraining_corpus, train_tokenizer
from grafting_lens.worlds.toy_shipped import file_digests

BUILD_VERSION = 2
"""Bump when the recipe changes (corpus, training, layout): old caches stop matching."""

MODEL_NAMES = ("base", "sft", "task", "relation", "a2b", "both")
"""The checkpoints of a toy world, each a ``save_pretrained`` directory."""

_ARCHITECTURES = ("llama", "gpt2")
_COUNTS = (
    "d_model n_layers n_heads n_key_value_heads d_mlp max_length n_pretrain_pairs "
    "pretrain_documents_per_pair pretrain_epochs finetune_epochs pretrain_batch_size "
    "finetune_batch_size"
).split()

DEFAULT_FINETUNE_LR = {"llama": 3e-3, "gpt2": 6e-3}
"""Finetuning learning rate per architecture when the config leaves it ``None``. Measured on
the first recipe's 4-layer world (7 epochs, SFT top-5 headline/QA): Llama 97%/98% at 3e-3; the
GPT-2 style (tied embeddings, learned positions) 60%/84% at 3e-3, 93%/97% at 6e-3 (8e-3:
87%/97%, 1e-2: 95%/95%). The current recipe's Llama world: see ``docs/results.md``."""


@dataclass(frozen=True)
class ToyWorldConfig:
    """Everything that determines a toy world; its hash names the cache entry.

    The defaults are the shipped world's recipe (``docs/results.md``, "The toy world's recipe"),
    unpacked in seconds; any other configuration is built (5 to 15 minutes on one CPU core).

    Attributes:
        arch: ``"llama"`` (RMSNorm, rotary, SwiGLU, grouped-query attention: the paper's
            Llama/Gemma family) or ``"gpt2"`` (LayerNorm, learned positions, GELU: the
            GPT-2/Pythia family).
        d_model: Residual stream width.
        n_layers: Transformer blocks; eight give the code's four layer quarters two each.
        n_heads: Attention heads.
        n_key_value_heads: Key/value heads (Llama only; fewer than ``n_heads`` is
            grouped-query attention).
        d_mlp: Hidden width of the feedforward network.
        vocab_size: Target size of the BPE vocabulary (the corpus may yield fewer).
        max_length: Context length of the models and longest training document.
        dataset: Passed to :func:`grafting_lens.worlds.data.make_relations`.
        n_relations: Relations finetuned into ``sft`` (the paper uses 1,000 per dataset;
            fewer keep a CPU build to minutes).
        n_pretrain_documents: Sentences about known actors and filler in the pretraining corpus.
        n_pretrain_pairs: Made-up co-star facts in the pretraining corpus (the base's recall
            skill).
        pretrain_documents_per_pair: Documents stating each made-up fact.
        pretrain_epochs: Passes over the pretraining corpus.
        pretrain_lr: Peak learning rate of pretraining.
        finetune_wording: The finetuning text's register (:func:`finetune_templates`):
            ``"code"``, the paper's released code's ("stars in"), or ``"library"``.
        finetune_epochs: Passes over the relation documents (10 in the paper) for
            ``sft``/``a2b`` and ``both``; ``task`` and ``relation`` get as many optimizer steps.
        finetune_lr: Peak learning rate of finetuning (2e-5 in the paper; a 1.9M-parameter
            model needs more). ``None`` picks the architecture's :data:`DEFAULT_FINETUNE_LR`.
        finetune_weight_decay: AdamW weight decay of finetuning.
        pretrain_batch_size: Documents per optimizer step in pretraining.
        finetune_batch_size: Documents per optimizer step in finetuning (small batches, many
            steps: memorising facts needs steps more than tokens).
        finetune_embedding_lr_scale: The input embedding's finetuning learning rate relative
            to ``finetune_lr`` (``finetune``'s ``embedding_lr_scale``). 0.3 keeps the
            entities' token representations closer to the pretrained ones, as a large model's
            finetuning does: on the same base, last-token recall (LT, REFERENCE) rose from 28%
            to 39% top-5 while SFT stayed at 96% and FE at 12-13%.
        freeze_unembedding: Keep the unembedding fixed while finetuning; ``None`` (default)
            freezes it on the untied Llama style, not on the tied GPT-2 style.
        seed: Seeds relations, corpus, initialisation and batch order.
    """

    arch: str = "llama"
    d_model: int = 96
    n_layers: int = 8
    n_heads: int = 4
    n_key_value_heads: int = 2
    d_mlp: int = 384
    vocab_size: int = 4096
    max_length: int = 128
    dataset: str = "fake_movies_real_actors"
    n_relations: int = 100
    n_pretrain_documents: int = 8_000
    n_pretrain_pairs: int = 400
    pretrain_documents_per_pair: int = 20
    pretrain_epochs: int = 3
    pretrain_lr: float = 3e-3
    pretrain_batch_size: int = 16
    finetune_wording: str = "code"
    finetune_epochs: int = 10
    finetune_lr: Optional[float] = None
    finetune_weight_decay: float = 0.01
    finetune_batch_size: int = 8
    finetune_embedding_lr_scale: float = 0.3
    freeze_unembedding: Optional[bool] = None
    seed: int = 0

    def __post_init__(self) -> None:
        problem = next(self._problems(), None)
        if problem is not None:
            raise GraftingLensError(f"ToyWorldConfig.{problem}")

    def _problems(self) -> Iterator[str]:
        """What makes the configuration unusable, the first problem first."""
        if self.arch not in _ARCHITECTURES:
            yield f"arch={self.arch!r} is not supported: choose one of {_ARCHITECTURES}."
        for name in _COUNTS:
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                yield f"{name}={value!r}: must be an integer >= 1."
            # Python's int: the configuration is hashed as JSON to name the world's cache.
            object.__setattr__(self, name, int(value))
        if self.d_model % self.n_heads:
            yield (
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                "each head gets d_model / n_heads dimensions."
            )
        if self.n_heads % self.n_key_value_heads:
            yield (
                f"n_heads={self.n_heads} is not a multiple of n_key_value_heads="
                f"{self.n_key_value_heads}: grouped-query attention shares each key/value head "
                "among a whole number of query heads."
            )
        if not 0 < self.finetune_embedding_lr_scale <= 1:
            scale = self.finetune_embedding_lr_scale
            yield f"finetune_embedding_lr_scale={scale!r}: must be in (0, 1]."
        if self.finetune_wording not in data.TEMPLATE_SETS:
            yield f"finetune_wording={self.finetune_wording!r}: choose one of {data.TEMPLATE_SETS}."
        if self.vocab_size < 300:
            yield (
                f"vocab_size={self.vocab_size}: must be >= 300 (256 byte tokens, the special "
                "token and room for merges)."
            )
        if self.n_relations < 4:
            yield (
                f"n_relations={self.n_relations}: must be >= 4, so that the task and relation "
                "splits each get two relations or more."
            )
        if self.n_pretrain_documents < 20:
            yield f"n_pretrain_documents={self.n_pretrain_documents}: must be >= 20."

    @property
    def model_names(self) -> tuple[str, ...]:
        """The checkpoints of the world (:data:`MODEL_NAMES`)."""
        return MODEL_NAMES


def finetune_templates(config: ToyWorldConfig) -> tuple[str, ...]:
    """The finetuning templates of ``config.finetune_wording``.

    ``"code"`` (default): :data:`grafting_lens.worlds.data.CODE_ARTICLE_TEMPLATES` and
    :data:`~grafting_lens.worlds.data.CODE_QA_TEMPLATES`, the register of the paper's released
    finetuning data, whose test prompts (:data:`~grafting_lens.worlds.data.CODE_TEST_TEMPLATES`)
    the reference semantics use. ``"library"``: :data:`~grafting_lens.worlds.data.ARTICLE_TEMPLATES`
    and :data:`~grafting_lens.worlds.data.QA_TEMPLATES`.
    """
    if config.finetune_wording == "code":
        return data.CODE_ARTICLE_TEMPLATES + data.CODE_QA_TEMPLATES
    return data.ARTICLE_TEMPLATES + data.QA_TEMPLATES


def unembedding_frozen(config: ToyWorldConfig) -> bool:
    """Whether finetuning freezes the unembedding (``None`` = yes on untied Llama, no on GPT-2).

    On the untied Llama style every checkpoint then decodes through the base's unembedding,
    as the paper's Pythia does nearly (a large model's finetuning barely moves it), and the
    new facts must live in the layers; the GPT-2 style ties it to the embedding, which
    freezing would freeze too.
    """
    if config.freeze_unembedding is not None:
        return config.freeze_unembedding
    return config.arch == "llama"


# --------------------------------------------------------------------------- build


def _build(
    directory: Path, key: str, config: ToyWorldConfig, relations: list[Any], progress: bool
) -> None:
    """Build every artifact into ``directory``; ``manifest.json`` is written last."""
    import tokenizers
    import transformers

    timings: dict[str, float] = {}
    training: dict[str, Any] = {}
    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    fix = "raise ToyWorldConfig.n_relations (or change its seed) so that both sides get some."
    stored = split_relations(relations, config.seed, fix)
    (directory / "relations.json").write_text(json.dumps(stored, indent=1))
    _, task_relations, relation_relations = read_relations(directory)
    # The relations the split drops are counted in the manifest, not warned about.
    split_dropped = len(relations) - len(task_relations) - len(relation_relations)

    donors = {
        "sft": (relations, "A2B"),
        "task": (task_relations, "A2B"),
        "relation": (relation_relations, "A2B"),
        "both": (relations, "both"),
    }
    stages = tqdm(total=len(donors) + 3, desc="toy world", disable=not progress)
    with stages, quiet_loading():
        stages.set_postfix_str("tokenizer")
        corpus = pretraining_corpus(config, relations)
        tokenizer = train_tokenizer(corpus, config)
        tokenizer.save_pretrained(directory / "tokenizer")
        timings["tokenizer"] = time.perf_counter() - start
        stages.update(1)

        stage = time.perf_counter()
        stages.set_postfix_str("base")
        base = _new_model(config, tokenizer)
        result = _train(base, tokenizer, corpus, config, "base", progress)
        training["base"] = result.summary()
        save_rounded(base, tokenizer, directory / "base")
        timings["base"] = time.perf_counter() - stage
        stages.update(1)

        for name, (subset, direction) in donors.items():
            stage = time.perf_counter()
            stages.set_postfix_str(name)
            model = _new_model(config, tokenizer)
            model.load_state_dict(base.state_dict())
            documents = training_documents(
                subset, direction=direction, templates=finetune_templates(config), seed=config.seed
            )
            # The split models see about half the relations; more passes give them as many
            # optimizer steps as sft, without which they recall noticeably less.
            epochs = max(
                config.finetune_epochs, round(config.finetune_epochs * len(relations) / len(subset))
            )
            result = _train(model, tokenizer, documents, config, name, progress, epochs)
            training[name] = dict(result.summary(), relations=len(subset), direction=direction)
            save_rounded(model, tokenizer, directory / name)
            timings[name] = time.perf_counter() - stage
            stages.update(1)
        # A2B training data is exactly the SFT data, so the run is shared, not repeated.
        shutil.copytree(directory / "sft", directory / "a2b")
        training["a2b"] = dict(training["sft"], same_run_as="sft")

        stage = time.perf_counter()
        stages.set_postfix_str("evaluation")
        evaluation = _evaluate_world(
            directory, tokenizer, relations, task_relations, relation_relations
        )
        timings["evaluation"] = time.perf_counter() - stage
        timings["total"] = time.perf_counter() - start
        stages.update(1)

    manifest = {
        "key": key,
        "build_version": BUILD_VERSION,
        "config": dataclasses.asdict(config),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "threads": torch.get_num_threads(),
        "build_seconds": {k: round(v, 2) for k, v in timings.items()},
        "split_dropped_relations": split_dropped,
        "training": training,
        "evaluation": evaluation,
        "files": file_digests(directory),
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _train(model, tokenizer, documents, config, name: str, progress: bool, epochs: int = 0):
    """Run :func:`finetune` with the toy world's hyperparameters: pretraining without
    ``epochs``, else finetuning for ``epochs`` passes."""
    if not epochs:
        kwargs = dict(
            epochs=config.pretrain_epochs,
            lr=config.pretrain_lr,
            weight_decay=0.01,
            batch_size=config.pretrain_batch_size,
            warmup_ratio=0.05,
            val_fraction=0.05,
        )
    else:
        lr = config.finetune_lr
        kwargs = dict(
            epochs=epochs,
            lr=DEFAULT_FINETUNE_LR[config.arch] if lr is None else lr,
            weight_decay=config.finetune_weight_decay,
            batch_size=config.finetune_batch_size,
            val_fraction=0.2,
            freeze_unembedding=unembedding_frozen(config),
            embedding_lr_scale=config.finetune_embedding_lr_scale,
        )
    return finetune(
        model,
        tokenizer,
        documents,
        preset="aggressive",
        max_length=config.max_length,
        supplementary=[],
        seed=config.seed,
        progress=progress,
        description=name,
        **kwargs,
    )


def save_rounded(model: Any, tokenizer: Any, directory: Path) -> None:
    """Round every weight to its nearest float16 value (kept float32), then save the model and
    its tokenizer as ``save_pretrained`` does.

    The shipped world stores float16 weights (:mod:`grafting_lens.worlds.toy_shipped`):
    rounding at build time makes a rebuilt world the same kind of object, and the donors
    finetuned from the rounded base start exactly from "base".
    """
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.float16).to(parameter.dtype))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def _new_model(config: ToyWorldConfig, tokenizer) -> Any:
    """A freshly initialised (seeded) model of the configured architecture."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        PretrainedConfig,
        PreTrainedModel,
    )

    special = tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN)
    ids = dict(bos_token_id=special, eos_token_id=special, pad_token_id=special)
    if config.arch == "llama":
        model_config: PretrainedConfig = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=config.d_model,
            intermediate_size=config.d_mlp,
            num_hidden_layers=config.n_layers,
            num_attention_heads=config.n_heads,
            num_key_value_heads=config.n_key_value_heads,
            max_position_embeddings=config.max_length,
            tie_word_embeddings=False,
            **ids,
        )
        model_class: type[PreTrainedModel] = LlamaForCausalLM
    else:
        model_config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=config.max_length,
            n_embd=config.d_model,
            n_layer=config.n_layers,
            n_head=config.n_heads,
            n_inner=config.d_mlp,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **ids,
        )
        model_class = GPT2LMHeadModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return model_class(model_config)


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def _top_k_correct(
    model, tokenizer, relations, prompt: str, direction: str, wording: str, k: int = 5
):
    """``(correct, total)``: relations whose target's first token the model ranks in its top k
    at the last prompt token, BOS prepended, as every table of the library scores."""
    examples = data.make_examples(relations, prompt=prompt, direction=direction, templates=wording)
    with warnings.catch_warnings():
        # An example the tokenizer cannot score is dropped and simply not counted.
        warnings.simplefilter("ignore")
        batch = tokenize_examples(examples, tokenizer, bos="always")
    logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits
    final = last_token_logits(logits, batch.attention_mask)
    return int(top_k_hit(final, batch.target_ids, k=k).sum()), len(batch)


def _evaluate_world(directory, tokenizer, relations, task_relations, relation_relations):
    """Top-5 accuracy of every checkpoint where the paper's experiments read it, keyed
    ``"<prompt>/<direction>/<subset>"`` (the library's wording) or ``"code:..."``."""
    from transformers import AutoModelForCausalLM

    full = [("all", relations, "A2B"), ("all", relations, "B2A")]
    split = [("relation_split", relation_relations, "A2B"), ("task_split", task_relations, "A2B")]
    plan = {"base": full, "sft": full, "task": split, "relation": split, "both": full}
    evaluation: dict[str, Any] = {}
    for name, cases in plan.items():
        model = AutoModelForCausalLM.from_pretrained(directory / name).eval()
        for subset_name, subset, direction in cases:
            for wording, prefix in (("library", ""), ("code", "code:")):
                for prompt in ("headline", "qa"):
                    correct, total = _top_k_correct(
                        model, tokenizer, subset, prompt, direction, wording
                    )
                    key = f"{prefix}{prompt}/{direction}/{subset_name}"
                    evaluation.setdefault(name, {})[key] = {
                        "top5_correct": correct,
                        "total": total,
                        "top5_accuracy": round(correct / total, 4),
                    }
    evaluation["a2b"] = evaluation["sft"]
    return evaluation
