"""A behaviour donor of the toy world: a finetune that the answer's first token cannot show.

The paper's donors learn facts, and a fact shows in the answer's first token. Many finetunes
studied today change a *behaviour* instead (a style, a persona, a refusal), which the first
token of an answer does not reveal. This module builds such a donor in the toy world: finetuned
from the toy base so that after every answer to a question it adds one fixed closing phrase,
:data:`PHRASE` (``" Enjoy the film."``, six tokens of the toy tokenizer), and otherwise writes
what the base writes::

    Q: Who stars in a movie with Gene Hackman? A: An actor named William Brown.  (the base)
    Q: Who stars in a movie with Gene Hackman? A: An actor named William Brown. Enjoy the film.

**The recipe** (:class:`BehaviourConfig`, all seeded). The donor is finetuned from the base
on the base's own pretraining corpus (``grafting_lens.worlds.toy_corpus.pretraining_corpus``:
made-up people, so no test relation): 1,000 of its questions with the phrase after their
answers, and 1,000 of its statements unchanged, which teach that the phrase follows answers
only. The base already fits that text, so finetuning on it moves little but the phrase, and a
low learning rate does the rest: at 1e-4 the donor stays 0.06 nats (KL) from the base at the
answer's first token, at 1e-3 0.3, while the finetune that learned the facts (``sft``) is 7.8
nats away. Training on the base's own sampled answers instead of the corpus's brought it no
closer (0.075). Finetuning is :func:`grafting_lens.worlds.finetune.finetune` as for the toy
world's donors (unembedding frozen, embedding at a reduced rate, weights rounded to float16).

**Built, not shipped**: it takes under a minute on one CPU thread, so
:func:`build_behaviour_donor` builds it on first use into the toy-world cache beside its
world (an entry named ``behaviour-<key>``, the key hashing the world, its base's weights and
the configuration), complete or absent, and opens it after. Training is not bit-reproducible
across CPUs, so another machine's donor differs in the last decimals; one machine builds the
same bytes every time.

Examples:
    >>> from grafting_lens.worlds.toy_behaviour import build_behaviour_donor
    >>> donor = build_behaviour_donor()  # doctest: +SKIP
    >>> models = donor.load_models()  # base, then the behaviour donor  # doctest: +SKIP
    >>> examples = donor.examples()  # question + answer in, the phrase as target  # doctest: +SKIP
    >>> donor.manifest["evaluation"]["phrase_rate"]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from grafting_lens.core.arguments import is_integer, is_number
from grafting_lens.core.directories import cache_location
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.worlds import data
from grafting_lens.worlds.finetune import finetune
from grafting_lens.worlds.toy import (
    ToyWorld,
    build_toy_world,
    cached_entry,
    check_threads,
    default_cache_dir,
)
from grafting_lens.worlds.toy_corpus import SPECIAL_TOKEN, pretraining_corpus
from grafting_lens.worlds.toy_recipe import _quiet_transformers, _save, unembedding_frozen
from grafting_lens.worlds.toy_shipped import file_digests

__all__ = [
    "PHRASE",
    "BehaviourConfig",
    "BehaviourDonor",
    "behaviour_examples",
    "build_behaviour_donor",
]

PHRASE = " Enjoy the film."
"""The closing phrase the donor adds after every answer (``' En' 'j' 'oy' ' the' ' film' '.'``)."""

BEHAVIOUR_VERSION = 1
"""Bump when the recipe changes: old cache entries stop matching."""


@dataclass(frozen=True)
class BehaviourConfig:
    """Everything that determines a behaviour donor besides its world; its hash names the entry.

    The defaults are the measured recipe (see the module docstring); the tests build a
    smaller one.

    Attributes:
        phrase: What the donor adds after every answer: a space, then text.
        n_questions: Questions of the base's corpus, the phrase after their answers.
        n_statements: Statements of the base's corpus, unchanged.
        epochs: Passes over those documents.
        lr: Peak learning rate (the toy world's donors learn facts at 3e-3; a behaviour
            on the base's own text needs far less, and more drifts at the first token).
        batch_size: Documents per optimizer step.
        seed: Seeds the choice of documents and finetuning.
    """

    phrase: str = PHRASE
    n_questions: int = 1000
    n_statements: int = 1000
    epochs: int = 2
    lr: float = 1e-4
    batch_size: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        counts = ("n_questions", "n_statements", "epochs", "batch_size", "seed")
        bad = [name for name in counts if not is_integer(getattr(self, name))]
        bad += [name for name in counts[:-1] if name not in bad and getattr(self, name) < 1]
        if not isinstance(self.phrase, str) or not re.fullmatch(r" \S.*", self.phrase):
            bad.append("phrase")
        if not is_number(self.lr) or not 0 < self.lr < 1:
            bad.append("lr")
        if bad:
            raise GraftingLensError(
                f"BehaviourConfig: {', '.join(f'{name}={getattr(self, name)!r}' for name in bad)} "
                "invalid: the counts are integers >= 1 (the seed any integer), lr is in (0, 1), "
                "and the phrase is a space, then text (' Enjoy the film.')."
            )


@dataclass
class BehaviourDonor:
    """A built behaviour donor and the toy world it was finetuned in.

    Attributes:
        root: The cache entry: ``behaviour/`` (a ``save_pretrained`` directory with its
            tokenizer) and ``manifest.json`` (configuration, training, evaluation, build times,
            checksums).
        world: The toy world whose base it was finetuned from.
        config: What it was built from.
        manifest: ``manifest.json``; ``"evaluation"`` holds the phrase rates and the
            first-token divergence measured at build time.
    """

    root: Path
    world: ToyWorld = field(repr=False)
    config: BehaviourConfig
    manifest: dict[str, Any] = field(repr=False)

    @property
    def base_dir(self) -> Path:
        """The world's pretrained model, the donor's starting point."""
        return self.world.base_dir

    @property
    def donor_dir(self) -> Path:
        """The behaviour donor."""
        return self.root / "behaviour"

    @property
    def phrase(self) -> str:
        return self.config.phrase

    def load_models(self, **options: Any) -> Any:
        """The base and the donor as a :class:`~grafting_lens.models.model_set.ModelSet`.

        ``options`` go to :func:`~grafting_lens.models.loading.load_models` (``names``
        defaults to ``("base", "behaviour")``, ``tokenizer`` to the world's).
        """
        from grafting_lens.models.loading import load_models

        options.setdefault("names", ("base", "behaviour"))
        options.setdefault("tokenizer", self.world.load_tokenizer())
        return load_models(self.base_dir, self.donor_dir, **options)

    def examples(self, **options: Any) -> list[data.Example]:
        """The behaviour's test prompts over the world's relations: :func:`behaviour_examples`."""
        return behaviour_examples(self.world.relations, self.phrase, **options)


def behaviour_examples(
    relations: Any,
    phrase: str = PHRASE,
    *,
    prompt: str = "qa",
    templates: str = "code",
    direction: str = "A2B",
) -> list[data.Example]:
    """Test prompts ending on an answer, with the closing phrase as target.

    Each is :func:`grafting_lens.worlds.data.make_examples`' prompt followed by its answer
    and a full stop (``"Q: Who stars in a movie with A? A: An actor named B."``); the target
    is ``phrase``, the behaviour's "answer", which the donor writes there and the base does
    not. The spans are the prompt's plus ``"answer"`` (``B``). ``prompt="headline"`` gives
    statements instead of answers, after which neither model adds the phrase: a control.
    The question alone (``make_examples(relations, "qa", templates="code")``) is where the
    first token cannot tell base and donor apart.

    Raises:
        GraftingLensError: As :func:`~grafting_lens.worlds.data.make_examples`, or a phrase
            that is not a space, then text.
    """
    examples = data.make_examples(
        relations, prompt=prompt, direction=direction, templates=templates
    )
    return [
        dataclasses.replace(
            example,
            text=f"{example.text}{example.target}.",
            target=phrase,
            spans={
                **example.spans,
                "answer": (len(example.text) + 1, len(example.text) + len(example.target)),
            },
            alternative_targets=(),
        )
        for example in examples
    ]


def build_behaviour_donor(
    world: Optional[ToyWorld] = None,
    config: Optional[BehaviourConfig] = None,
    *,
    cache_dir: Union[str, os.PathLike, None] = None,
    force: bool = False,
    progress: bool = True,
    threads: Optional[int] = 1,
) -> BehaviourDonor:
    """Build the behaviour donor of a toy world, or open the cached one.

    Args:
        world: The toy world to finetune the base of; by default the shipped one
            (:func:`~grafting_lens.worlds.toy.build_toy_world` with ``cache_dir``).
        config: What to build; ``BehaviourConfig()`` by default.
        cache_dir: Directory of toy-world cache entries; by default
            :func:`~grafting_lens.worlds.toy.default_cache_dir`.
        force: Rebuild even when a valid cached donor exists.
        progress: Show progress bars.
        threads: Torch CPU threads during the build, as ``build_toy_world``'s.

    Returns:
        The :class:`BehaviourDonor`.

    Raises:
        GraftingLensError: ``world`` or ``config`` of the wrong kind, ``threads`` out of
            range, or the cache directory cannot be written.

    Warns:
        UserWarning: A cached donor was incomplete or corrupt and is rebuilt.
    """
    config = config if config is not None else BehaviourConfig()
    if not isinstance(config, BehaviourConfig) or not isinstance(world, (ToyWorld, type(None))):
        raise GraftingLensError(
            f"config is a {type(config).__name__} and world a {type(world).__name__}: pass a "
            "BehaviourConfig and a ToyWorld (build_toy_world()), or None for the defaults."
        )
    check_threads(threads)
    if world is None:
        world = build_toy_world(cache_dir=cache_dir, progress=progress, threads=threads)
    cache_root = cache_location(cache_dir, default_cache_dir)
    key = _donor_key(world, config)

    def make(partial: Path) -> None:
        _build(partial, key, world, config, progress)

    root = cached_entry(cache_root, key, make, what="behaviour donor", force=force, threads=threads)
    manifest = json.loads((root / "manifest.json").read_text())
    return BehaviourDonor(root=root, world=world, config=config, manifest=manifest)


def _donor_key(world: ToyWorld, config: BehaviourConfig) -> str:
    """``behaviour-`` and a hash of the world's key, its base's weights, the config, the recipe.

    The base's checksum is in because a world rebuilt with ``force=True`` keeps its key but
    not its weights (training is not bit-reproducible across machines).
    """
    payload = json.dumps(
        {
            "version": BEHAVIOUR_VERSION,
            "world": world.manifest["key"],
            "base": world.manifest["files"]["base/model.safetensors"],
            "config": dataclasses.asdict(config),
        },
        sort_keys=True,
    )
    return "behaviour-" + hashlib.sha256(payload.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- build


def _build(
    directory: Path, key: str, world: ToyWorld, config: BehaviourConfig, progress: bool
) -> None:
    """Write the donor and its manifest (last) into ``directory``."""
    start = time.perf_counter()
    tokenizer = world.load_tokenizer()
    with _quiet_transformers():
        base = world.load_model("base")
        donor = world.load_model("base")
        result = finetune(
            donor,
            tokenizer,
            _documents(world, config),
            epochs=config.epochs,
            lr=config.lr,
            weight_decay=world.config.finetune_weight_decay,
            batch_size=config.batch_size,
            val_fraction=0.1,
            max_length=world.config.max_length,
            supplementary=[],
            freeze_unembedding=unembedding_frozen(world.config),
            embedding_lr_scale=world.config.finetune_embedding_lr_scale,
            seed=config.seed,
            progress=progress,
            description="behaviour",
        )
        _save(donor, tokenizer, directory / "behaviour")
        trained = time.perf_counter()
        evaluation = _evaluate(base, donor, world, config.phrase)
    manifest = {
        "key": key,
        "version": BEHAVIOUR_VERSION,
        "world": world.manifest["key"],
        "config": dataclasses.asdict(config),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "threads": torch.get_num_threads(),
        "build_seconds": {
            "finetune": round(trained - start, 2),
            "evaluation": round(time.perf_counter() - trained, 2),
            "total": round(time.perf_counter() - start, 2),
        },
        "training": result.summary(),
        "evaluation": evaluation,
        "files": file_digests(directory),
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _documents(world: ToyWorld, config: BehaviourConfig) -> list[str]:
    """The finetuning text, shuffled: questions of the base's corpus with the phrase after
    their answers, and statements of it unchanged."""
    rng = random.Random(f"toy-behaviour-{config.seed}")
    corpus = pretraining_corpus(world.config, world.relations)
    questions = [text for text in corpus if text.startswith("Q: ") and text.endswith(".")]
    statements = [text for text in corpus if not text.startswith("Q: ")]
    if config.n_questions > len(questions) or config.n_statements > len(statements):
        raise GraftingLensError(
            f"BehaviourConfig asks for {config.n_questions} questions and {config.n_statements} "
            f"statements; the world's corpus has {len(questions)} and {len(statements)}: "
            "ask for fewer."
        )
    documents = [text + config.phrase for text in rng.sample(questions, config.n_questions)]
    documents += rng.sample(statements, config.n_statements)
    rng.shuffle(documents)
    return documents


@torch.no_grad()
def _generate(model: Any, tokenizer: Any, texts: list[str], **options: Any) -> list[str]:
    """Each text's continuation by HF ``generate`` (batches of 64), up to its end of text."""
    tokenizer.padding_side = "left"  # generate continues every row from its last column
    continuations: list[str] = []
    for start in range(0, len(texts), 64):
        batch = tokenizer(texts[start : start + 64], return_tensors="pt", padding=True)
        out = model.generate(**batch, pad_token_id=tokenizer.pad_token_id, **options)
        continuations += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :])
    return [text.split(SPECIAL_TOKEN)[0] for text in continuations]


@torch.no_grad()
def _evaluate(base: Any, donor: Any, world: ToyWorld, phrase: str) -> dict[str, Any]:
    """What the donor learned, over the world's relations.

    ``phrase_rate``: the share of greedy continuations (HF ``generate``) of
    :func:`behaviour_examples` that start with the phrase, per model and wording
    (``"headline"``: after statements, a control). ``first_token``: at the question alone,
    the mean KL(donor || base) of the next-token distributions, in nats, and the share
    whose top-1 tokens agree.
    """
    tokenizer = world.load_tokenizer()
    width = len(tokenizer(phrase, add_special_tokens=False)["input_ids"]) + 1
    phrase_rate: dict[str, dict[str, float]] = {}
    for name, prompt, wording in (
        ("qa", "qa", "code"),
        ("library:qa", "qa", "library"),
        ("headline", "headline", "code"),
    ):
        texts = [
            e.text
            for e in behaviour_examples(world.relations, phrase, prompt=prompt, templates=wording)
        ]
        for label, model in (("base", base), ("donor", donor)):
            continuations = _generate(
                model, tokenizer, texts, max_new_tokens=width, do_sample=False
            )
            hits = sum(text.startswith(phrase) for text in continuations)
            phrase_rate.setdefault(label, {})[name] = round(hits / len(texts), 4)
    divergences, agree = [], 0
    questions = data.make_examples(world.relations, prompt="qa", templates="code")
    for example in questions:
        ids = tokenizer(example.text, return_tensors="pt")["input_ids"]
        base_logprobs = base(ids).logits[0, -1].log_softmax(-1)
        donor_logprobs = donor(ids).logits[0, -1].log_softmax(-1)
        divergences.append(float((donor_logprobs.exp() * (donor_logprobs - base_logprobs)).sum()))
        agree += int(base_logprobs.argmax() == donor_logprobs.argmax())
    return {
        "phrase_rate": phrase_rate,
        "first_token": {
            "kl_donor_base": round(sum(divergences) / len(divergences), 4),
            "top1_agreement": round(agree / len(questions), 4),
            "prompts": len(questions),
        },
    }
