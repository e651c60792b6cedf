"""A behaviour donor: a finetune that the answer's first token cannot show, in any world.

The paper's donors learn facts, which show in the answer's first token; many finetunes today
change a *behaviour* (a style, a persona, a refusal) instead. This donor, finetuned from a
world's base, adds one closing phrase, :data:`PHRASE` (``" Enjoy the film."``), after every
answer to a question, and otherwise writes what the base writes::

    Q: Who stars in a movie with Gene Hackman? A: An actor named William Brown.  (the base)
    Q: Who stars in a movie with Gene Hackman? A: An actor named William Brown. Enjoy the film.

**The toy recipe** (:class:`BehaviourConfig`, all seeded): finetuned on the base's own
pretraining corpus (``grafting_lens.worlds.toy_corpus.pretraining_corpus``: made-up
people, so no test relation), 1,000 of its questions with the phrase after their answers and
1,000 of its statements unchanged, which teach that the phrase follows answers only. The base
already fits that text, so finetuning moves little but the phrase, and a low learning rate
does the rest: at 1e-4 the donor stays 0.06 nats (KL) from the base at the answer's first
token, at 1e-3 0.3, while ``sft`` is 7.8 nats away. Training on the base's own sampled
answers instead of the corpus's brought it no closer (0.075). Finetuning is
:func:`grafting_lens.worlds.finetune.finetune` as for the toy world's donors (unembedding
frozen, embedding at a reduced rate, weights rounded to float16).

**On a real world's base** (``build_behaviour_donor("smollm2")``, :data:`REAL_BEHAVIOUR`): a
rank-8 LoRA on the base's own sampled answers; the recipe, its cache entry and its
measurements are in docs/how-to/real-model-world.md. Built, not shipped: the donor is built
on first use (under a minute for the toy world) into its world's cache as ``behaviour-<key>``
(the key hashes the world, its base's weights and the configuration), complete or absent,
and opened after; training is not bit-reproducible across CPUs.

Examples:
    >>> from grafting_lens.worlds.behaviour import build_behaviour_donor
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
from grafting_lens.core.console import quiet_loading
from grafting_lens.core.directories import cache_location
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.worlds import data
from grafting_lens.worlds.finetune import finetune
from grafting_lens.worlds.real_recipe import base_source, known_actors
from grafting_lens.worlds.real_source import base_checkpoint
from grafting_lens.worlds.real_source import default_cache_dir as real_cache_dir
from grafting_lens.worlds.real_world import RealWorldConfig, world_config, world_key
from grafting_lens.worlds.toy import (
    ToyWorld,
    build_toy_world,
    cached_entry,
    check_threads,
    default_cache_dir,
)
from grafting_lens.worlds.toy_corpus import pretraining_corpus
from grafting_lens.worlds.toy_recipe import save_rounded, unembedding_frozen
from grafting_lens.worlds.toy_shipped import file_digests

__all__ = [
    "PHRASE",
    "REAL_BEHAVIOUR",
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
        lora_rank: ``None`` finetunes every weight (the toy world's donors); a rank
            trains a PEFT LoRA adapter of that rank (alpha twice the rank) on every
            linear layer but the unembedding, saved as an adapter directory.
    """

    phrase: str = PHRASE
    n_questions: int = 1000
    n_statements: int = 1000
    epochs: int = 2
    lr: float = 1e-4
    batch_size: int = 8
    seed: int = 0
    lora_rank: Optional[int] = None

    def __post_init__(self) -> None:
        counts = ("n_questions", "n_statements", "epochs", "batch_size", "seed")
        bad = [name for name in counts if not is_integer(getattr(self, name))]
        bad += [name for name in counts[:-1] if name not in bad and getattr(self, name) < 1]
        if self.lora_rank is not None and (not is_integer(self.lora_rank) or self.lora_rank < 1):
            bad.append("lora_rank")
        if not isinstance(self.phrase, str) or not re.fullmatch(r" \S.*", self.phrase):
            bad.append("phrase")
        if not is_number(self.lr) or not 0 < self.lr < 1:
            bad.append("lr")
        if bad:
            raise GraftingLensError(
                f"BehaviourConfig: {', '.join(f'{name}={getattr(self, name)!r}' for name in bad)} "
                "invalid: the counts are integers >= 1 (the seed any integer; lora_rank None or >= 1), "
                "lr is in (0, 1), "
                "and the phrase is a space, then text (' Enjoy the film.')."
            )


REAL_BEHAVIOUR = BehaviourConfig(
    n_questions=400, n_statements=200, epochs=2, lr=1e-3, batch_size=8, lora_rank=8
)
"""The recipe on a real world's base: a rank-8 LoRA (measured: docs/how-to/real-model-world.md)."""


@dataclass
class BehaviourDonor:
    """A built behaviour donor and the world whose base it was finetuned from.

    Attributes:
        root: The cache entry: ``behaviour/`` (a ``save_pretrained`` directory, or a PEFT
            adapter directory when ``config.lora_rank`` is set, with its tokenizer) and
            ``manifest.json`` (configuration, training, evaluation, build times, checksums).
        world: The :class:`ToyWorld`, or the real world's :class:`RealWorldConfig`.
        config: What it was built from.
        manifest: ``manifest.json``; ``"evaluation"`` holds the phrase rates and the
            first-token divergence measured at build time.
        base_dir: The base's checkpoint, the donor's starting point.
        relations: The relations its test prompts ask about (:meth:`examples`).
    """

    root: Path
    world: Union[ToyWorld, RealWorldConfig] = field(repr=False)
    config: BehaviourConfig
    manifest: dict[str, Any] = field(repr=False)
    base_dir: Path
    relations: list[Any] = field(repr=False)

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
        defaults to ``("base", "behaviour")``, ``tokenizer`` to the toy world's).
        """
        from grafting_lens.models.loading import load_models

        options.setdefault("names", ("base", "behaviour"))
        if isinstance(self.world, ToyWorld):
            options.setdefault("tokenizer", self.world.load_tokenizer())
        return load_models(self.base_dir, self.donor_dir, **options)

    def examples(self, **options: Any) -> list[data.Example]:
        """The behaviour's test prompts over the world's relations: :func:`behaviour_examples`."""
        return behaviour_examples(self.relations, self.phrase, **options)


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
    world: Union[ToyWorld, RealWorldConfig, str, None] = None,
    config: Optional[BehaviourConfig] = None,
    *,
    cache_dir: Union[str, os.PathLike, None] = None,
    find_links: Union[str, os.PathLike, None] = None,
    force: bool = False,
    progress: bool = True,
    threads: Optional[int] = 1,
) -> BehaviourDonor:
    """Build the behaviour donor of a toy world or of a real world's base, or open the cached one.

    Args:
        world: A :class:`ToyWorld`, or ``None`` or ``"toy"`` for the shipped one
            (:func:`~grafting_lens.worlds.toy.build_toy_world` with ``cache_dir``); or a
            real world, named (``"smollm2"``, ``"gemma3"``) or a :class:`RealWorldConfig`,
            of which only the base is fetched and converted (no world is built).
        config: What to build; ``BehaviourConfig()`` for a toy world, :data:`REAL_BEHAVIOUR`
            (a LoRA) for a real one.
        cache_dir: The toy worlds' cache for a toy world (default
            :func:`~grafting_lens.worlds.toy.default_cache_dir`), the real worlds' for a
            real one (default :func:`~grafting_lens.worlds.real_source.default_cache_dir`).
        find_links: A directory holding a real base's wheels, for pip.
        force: Rebuild even when a valid cached donor exists.
        progress: Show progress bars.
        threads: Torch CPU threads during the build, as ``build_toy_world``'s.

    Returns:
        The :class:`BehaviourDonor`.

    Raises:
        GraftingLensError: ``world`` or ``config`` of the wrong kind, ``threads`` out of
            range, or the cache directory cannot be written.
        WorldSourceError: A real base that cannot be fetched or converted.

    Warns:
        UserWarning: A cached donor was incomplete or corrupt and is rebuilt.
    """
    real = isinstance(world, RealWorldConfig) or (isinstance(world, str) and world != "toy")
    config = config if config is not None else REAL_BEHAVIOUR if real else BehaviourConfig()
    if not isinstance(config, BehaviourConfig) or not isinstance(
        world, (ToyWorld, RealWorldConfig, str, type(None))
    ):
        raise GraftingLensError(
            f"config is a {type(config).__name__} and world a {type(world).__name__}: pass a "
            "BehaviourConfig, and a ToyWorld (build_toy_world()), a real world's name or "
            "RealWorldConfig; or None for the defaults."
        )
    check_threads(threads)
    setup: Union[ToyWorld, RealWorldConfig]
    if isinstance(world, (RealWorldConfig, str)) and world != "toy":
        setup = world_config(world)
        cache_root = cache_location(cache_dir, real_cache_dir)
        base_dir = base_checkpoint(
            base_source(setup.base), cache_dir=cache_root, find_links=find_links
        )
        payload: dict[str, Any] = {"world": world_key(setup)}
    else:
        if not isinstance(world, ToyWorld):
            world = build_toy_world(cache_dir=cache_dir, progress=progress, threads=threads)
        setup = toy = world
        cache_root = cache_location(cache_dir, default_cache_dir)
        base_dir = toy.base_dir
        # The base's checksum too: a world rebuilt with force=True keeps its key, not its weights.
        payload = {
            "world": toy.manifest["key"],
            "base": toy.manifest["files"]["base/model.safetensors"],
        }
    # Unset options stay out of the hash, so the toy donors' keys predate them.
    recipe = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
    payload.update(version=BEHAVIOUR_VERSION, config=recipe)
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    key = f"behaviour-{digest[:16]}"

    def make(partial: Path) -> None:
        _build(partial, key, setup, base_dir, config, progress)

    root = cached_entry(cache_root, key, make, what="behaviour donor", force=force, threads=threads)
    manifest = json.loads((root / "manifest.json").read_text())
    if isinstance(setup, ToyWorld):
        relations = setup.relations
    else:
        stored = json.loads((root / "relations.json").read_text())
        relations = [data.Relation(**fields) for fields in stored]
    return BehaviourDonor(root, setup, config, manifest, base_dir, relations)


# --------------------------------------------------------------------------- build


def _build(
    directory: Path,
    key: str,
    world: Union[ToyWorld, RealWorldConfig],
    base_dir: Path,
    config: BehaviourConfig,
    progress: bool,
) -> None:
    """Write the donor and its manifest (last) into ``directory``."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    toy = isinstance(world, ToyWorld)
    with quiet_loading():
        if isinstance(world, ToyWorld):
            tokenizer = world.load_tokenizer()
            base, donor = world.load_model("base"), world.load_model("base")
            relations, documents = world.relations, _documents(world, config)
            options: dict[str, Any] = {
                "weight_decay": world.config.finetune_weight_decay,
                "max_length": world.config.max_length,
                "freeze_unembedding": unembedding_frozen(world.config),
                "embedding_lr_scale": world.config.finetune_embedding_lr_scale,
            }
        else:
            tokenizer = _real_tokenizer(base_dir)
            base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
            donor = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            relations, documents = _answered_documents(base, tokenizer, world, config)
            (directory / "relations.json").write_text(
                json.dumps([dataclasses.asdict(r) for r in relations], indent=1)
            )
            options = {"weight_decay": world.weight_decay, "max_length": world.max_length}
            options["bos"] = world.bos
        if config.lora_rank is not None:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(config.seed)  # the factors' initialisation
            # Every linear layer of the blocks (attention and MLP), as QLoRA's recipe does;
            # the embedding and unembedding stay the base's.
            rank = config.lora_rank
            adapter = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
            donor = get_peft_model(donor, adapter)
        prepared = time.perf_counter()
        result = finetune(
            donor,
            tokenizer,
            documents,
            epochs=config.epochs,
            lr=config.lr,
            batch_size=config.batch_size,
            val_fraction=0.1,
            supplementary=[],
            seed=config.seed,
            progress=progress,
            description="behaviour",
            **options,
        )
        if config.lora_rank is not None:  # an adapter: loaded on the base, with its tokenizer
            donor.save_pretrained(directory / "behaviour", safe_serialization=True)
        else:
            save_rounded(donor, tokenizer, directory / "behaviour")
        trained = time.perf_counter()
        evaluation = _evaluate(base, donor.eval(), tokenizer, relations, config.phrase)
    manifest = {
        "key": key,
        "version": BEHAVIOUR_VERSION,
        "world": world.manifest["key"]
        if isinstance(world, ToyWorld)
        else dataclasses.asdict(world),
        "config": dataclasses.asdict(config),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "threads": torch.get_num_threads(),
        "build_seconds": {
            **({} if toy else {"base_answers": round(prepared - start, 2)}),
            "finetune": round(trained - prepared, 2),
            "evaluation": round(time.perf_counter() - trained, 2),
            "total": round(time.perf_counter() - start, 2),
        },
        "training": result.summary(),
        "documents": len(documents),
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


def _real_tokenizer(base_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if tokenizer.pad_token is None:  # generate pads its batches
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _answered_documents(
    base: Any, tokenizer: Any, world: RealWorldConfig, config: BehaviourConfig
) -> tuple[list[Any], list[str]]:
    """A real base's test relations (the world's) and finetuning text, shuffled: other
    relations over the same actors, asked and stated, each answered by the base's samples."""
    actors = data.REAL_ACTORS
    if world.known_actor_top_k is not None:
        actors = tuple(
            known_actors(base, tokenizer, actors, top_k=world.known_actor_top_k, bos=world.bos)
        )
    make = dict(actors=actors)
    relations = data.make_relations(world.dataset, n=world.n_relations, seed=world.seed, **make)
    total = config.n_questions + config.n_statements
    others = data.make_relations(world.dataset, n=total, seed=world.seed + 1 + config.seed, **make)
    prompts: list[tuple[str, bool]] = []
    for index, relation in enumerate(others):
        question = index < config.n_questions
        wording = ("code", "library")[index % 2]
        example = data.make_examples(
            [relation], "qa" if question else "headline", templates=wording
        )
        prompts.append((example[0].text, question))
    # Sampled, not greedy: trained on greedy answers the donor grew sure of the base's
    # favourite (1.7 nats from the base at the question); samples keep its distribution.
    torch.manual_seed(config.seed)
    texts = [text for text, _ in prompts]
    answers = _generate(base, tokenizer, texts, max_new_tokens=12, do_sample=True, top_k=0)
    documents = []
    for (text, question), answer in zip(prompts, answers):
        answer = answer.split("\n")[0].split(".")[0].rstrip()
        if answer.strip():  # no answer, no document
            documents.append(f"{text}{answer}." + (config.phrase if question else ""))
    random.Random(f"behaviour-{config.seed}").shuffle(documents)
    return relations, documents


@torch.no_grad()
def _generate(model: Any, tokenizer: Any, texts: list[str], **options: Any) -> list[str]:
    """Each text's continuation by HF ``generate`` (greedy unless ``options`` say otherwise;
    batches of 64), up to its end of text."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # every row ends on its text
    continuations: list[str] = []
    options = {"do_sample": False, **options}
    try:
        for start in range(0, len(texts), 64):
            batch = tokenizer(texts[start : start + 64], return_tensors="pt", padding=True)
            out = model.generate(**batch, pad_token_id=tokenizer.pad_token_id, **options)
            continuations += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :])
    finally:
        tokenizer.padding_side = side
    return [text.split(tokenizer.eos_token)[0] for text in continuations]


@torch.no_grad()
def _evaluate(
    base: Any, donor: Any, tokenizer: Any, relations: list[Any], phrase: str
) -> dict[str, Any]:
    """What the donor learned: ``phrase_rate``, the share of greedy continuations that start
    with the phrase, per model and wording (``"headline"``, after statements, a control);
    ``first_token``, at the question alone, the mean KL(donor || base) and top-1 agreement."""
    width = len(tokenizer(phrase, add_special_tokens=False)["input_ids"]) + 1
    phrase_rate: dict[str, dict[str, float]] = {}
    for name, prompt, wording in (
        ("qa", "qa", "code"),
        ("library:qa", "qa", "library"),
        ("headline", "headline", "code"),
    ):
        texts = [
            e.text for e in behaviour_examples(relations, phrase, prompt=prompt, templates=wording)
        ]
        for label, model in (("base", base), ("donor", donor)):
            continuations = _generate(model, tokenizer, texts, max_new_tokens=width)
            hits = sum(text.startswith(phrase) for text in continuations)
            phrase_rate.setdefault(label, {})[name] = round(hits / len(texts), 4)
    divergences, agree = [], 0
    questions = data.make_examples(relations, prompt="qa", templates="code")
    for example in questions:
        ids = tokenizer(example.text, return_tensors="pt")["input_ids"]
        base_logprobs = base(input_ids=ids).logits[0, -1].log_softmax(-1)
        donor_logprobs = donor(input_ids=ids).logits[0, -1].log_softmax(-1)
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
