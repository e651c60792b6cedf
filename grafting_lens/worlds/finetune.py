"""Supervised finetuning that produces the SFT side of a graft.

Makes the SFT checkpoint from the pretrained one as the paper does (appendix A.3.3): next-token
prediction on templated documents, AdamW with a linear schedule, an 80/20 split and the epoch of
lowest validation loss kept. The paper's two regimes are :data:`PRESETS`; any explicit argument
overrides the preset (docs page "Data, batches, worlds, finetuning", section "Finetuning").

Examples:
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> model = AutoModelForCausalLM.from_pretrained("gpt2")  # doctest: +SKIP
    >>> tokenizer = AutoTokenizer.from_pretrained("gpt2")  # doctest: +SKIP
    >>> result = finetune(model, tokenizer, documents, device="cuda")  # doctest: +SKIP
    >>> result.best_epoch, result.val_losses  # doctest: +SKIP
    >>> result.model.save_pretrained("sft", safe_serialization=True)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from tqdm.auto import tqdm

from grafting_lens.core.arguments import is_integer, is_number, plain
from grafting_lens.core.console import show_progress
from grafting_lens.core.errors import GraftingLensError


@dataclass(frozen=True)
class FinetunePreset:
    """Hyperparameters of one of the paper's finetuning regimes.

    Attributes:
        lr: Peak learning rate of AdamW (reached after warmup, then decayed linearly to zero).
        weight_decay: AdamW's decoupled weight decay.
        epochs: Passes over the training documents.
        batch_size: Documents per optimizer step.
        supplementary: Whether the regime mixes generic text into the training
            documents when the caller passes none.
    """

    lr: float
    weight_decay: float
    epochs: int
    batch_size: int = 4
    supplementary: bool = False


PRESETS: dict[str, FinetunePreset] = {
    "aggressive": FinetunePreset(lr=2e-5, weight_decay=0.01, epochs=10),
    "less_aggressive": FinetunePreset(lr=2e-6, weight_decay=0.0, epochs=10, supplementary=True),
}
"""The paper's finetuning regimes, by name (appendix A.3.3)."""


@dataclass
class FinetuneResult:
    """What :func:`finetune` returns.

    Attributes:
        model: The finetuned model, in eval mode, holding the weights of the epoch
            with the lowest validation loss (the same object that was passed in).
        train_losses: Mean training loss per token of each epoch, in order.
        val_losses: Validation loss per token after each epoch, in order.
        initial_val_loss: Validation loss before the first step, the yardstick for
            whether finetuning helped at all.
        best_epoch: The 1-based epoch whose weights ``model`` holds.
        step_losses: Training loss of every optimizer step, for plotting.
        settings: The resolved hyperparameters (preset merged with overrides) and
            the sizes of the splits, to record next to the checkpoint.
    """

    model: Any
    train_losses: list[float]
    val_losses: list[float]
    initial_val_loss: float
    best_epoch: int
    step_losses: list[float] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def best_val_loss(self) -> float:
        """Validation loss of the restored epoch."""
        return self.val_losses[self.best_epoch - 1]

    def summary(self) -> dict[str, Any]:
        """What a world's manifest records of the run: settings and losses (4 decimals)."""
        return {
            "settings": self.settings,
            "train_losses": [round(x, 4) for x in self.train_losses],
            "val_losses": [round(x, 4) for x in self.val_losses],
            "initial_val_loss": round(self.initial_val_loss, 4),
            "best_epoch": self.best_epoch,
        }


def finetune(
    model: Any,
    tokenizer: Any,
    documents: Sequence[str],
    *,
    preset: str = "aggressive",
    epochs: Optional[int] = None,
    lr: Optional[float] = None,
    weight_decay: Optional[float] = None,
    batch_size: Optional[int] = None,
    warmup_ratio: float = 0.0,
    max_length: int = 256,
    val_fraction: float = 0.2,
    supplementary: Optional[Sequence[str]] = None,
    seed: int = 0,
    device: Union[str, torch.device, None] = None,
    dtype: Optional[torch.dtype] = None,
    autocast_dtype: Optional[torch.dtype] = None,
    freeze_unembedding: bool = False,
    embedding_lr_scale: float = 1.0,
    bos: str = "always",
    progress: bool | None = None,
    description: str = "finetune",
    checkpoint_dir: Union[str, os.PathLike, None] = None,
    on_step: Optional[Callable[[int, int, float], None]] = None,
) -> FinetuneResult:
    """Finetune a causal language model on documents with next-token prediction.

    Each document becomes ``BOS + tokens + EOS`` (truncated to ``max_length``; which BOS,
    if any, ``bos`` says); padding never counts in the loss. After every epoch the validation
    loss is measured and the best weights so far are copied to CPU memory; at the end they
    are loaded back ("we save the best model based on validation loss"). ``epochs``, ``lr``
    (the peak), ``weight_decay`` and ``batch_size`` (4 in the paper) override the preset's.

    Args:
        model: A Hugging Face causal LM (``PreTrainedModel``): anything called as
            ``model(input_ids=..., attention_mask=...)`` that returns ``.logits``. Trained in place.
        tokenizer: Its tokenizer. Needs a BOS or EOS token (one stands in for the other).
        documents: The finetuning texts, e.g.
            :func:`grafting_lens.worlds.documents.training_documents`.
        preset: ``"aggressive"`` or ``"less_aggressive"``; see :data:`PRESETS`.
        warmup_ratio: Fraction of the optimizer steps spent warming the learning rate up
            linearly from zero (the paper uses none).
        max_length: Longest tokenized document, BOS and EOS included; longer ones are truncated.
        val_fraction: Share of ``documents`` held out for validation, in (0, 1).
        supplementary: Generic texts mixed into the training set only (the best epoch is
            chosen on the relation documents). ``None`` means the preset's default: none for
            ``"aggressive"``, ``len(documents)`` texts from
            :func:`grafting_lens.worlds.documents.supplementary_documents` for
            ``"less_aggressive"``. Pass ``[]`` to disable.
        seed: Seeds the split, the batch order and any dropout.
        device: Where to train, e.g. ``"cuda"`` (the model is moved there); ``None`` keeps it.
        dtype: Casts the model's weights (e.g. ``torch.bfloat16`` to fit a larger model);
            ``None`` keeps them.
        autocast_dtype: Compute dtype for mixed precision (``torch.float16`` is the paper's
            fp16 training) with the weights kept as they are; float16 also scales the loss.
        freeze_unembedding: Train every weight except the unembedding
            (``model.get_output_embeddings()``; tied embeddings stay fixed with it). Grafting
            decodes through the base's unembedding by default, as the paper does; freezing it
            makes the donor store what it learns in the weights a graft can move.
        embedding_lr_scale: The input embedding's learning rate relative to ``lr`` (a tied
            unembedding shares it). Below 1 keeps the token representations closer to the
            pretrained ones, as a large model's finetuning does.
        bos: What starts each document (:data:`BOS_RULES`): ``"always"`` the BOS (the EOS
            where there is none); ``"tokenizer"`` what ``tokenizer(text)`` puts first by itself
            (a ``<bos>`` for Gemma, nothing for SmolLM2 or GPT-2), the convention the paper's
            code finetunes and tests with; ``"never"`` nothing.
        progress: Show a tqdm progress bar (default: when someone watches, see
            :func:`~grafting_lens.core.console.show_progress`).
        description: Label of the progress bar.
        checkpoint_dir: Resumable training: after every epoch the whole state is written
            atomically to ``checkpoint_dir/epoch.pt`` (about four times the model's float32
            size); a call that finds one of the same model, documents and settings carries on
            after its epoch, to the bit as an uninterrupted run on the same machine. The file
            is left for the caller to delete.
        on_step: Called after every optimizer step with ``(steps done, total steps, loss)``,
            for progress lines where no bar is drawn (a log file).

    Returns:
        A :class:`FinetuneResult` with the model (best epoch restored) and the loss history.

    Raises:
        GraftingLensError: An unknown preset, empty or non-text documents, too few documents
            to split, or a hyperparameter out of range; the message names the fix.
    """
    settings = _resolve_settings(
        preset, epochs, lr, weight_decay, batch_size, warmup_ratio, max_length, val_fraction
    )
    documents = _check_documents(documents, "documents")
    if supplementary is None and settings["supplementary_default"]:
        from grafting_lens.worlds.documents import supplementary_documents

        supplementary = supplementary_documents(len(documents), seed=seed)
    supplementary = _check_documents(supplementary or [], "supplementary", allow_empty=True)
    _, eos_id, pad_id = _special_ids(tokenizer)
    prefix = bos_prefix(tokenizer, bos)

    if not isinstance(model, torch.nn.Module) or next(model.parameters(), None) is None:
        raise GraftingLensError(
            f"model is a {type(model).__name__} without parameters: pass a Hugging Face causal LM, "
            "e.g. AutoModelForCausalLM.from_pretrained(...) (not a TransformerBridge)."
        )

    train_docs, val_docs = _split(documents, val_fraction, seed)
    train_ids, train_truncated = _encode(tokenizer, train_docs, prefix, eos_id, max_length)
    val_ids, val_truncated = _encode(tokenizer, val_docs, prefix, eos_id, max_length)
    # Cutting generic supplementary text loses nothing that is tested, so only the
    # relation documents are counted and warned about.
    train_ids += _encode(tokenizer, supplementary, prefix, eos_id, max_length)[0]
    truncated = train_truncated + val_truncated
    if truncated:
        warnings.warn(
            f"{truncated} document(s) are longer than max_length={max_length} tokens and were "
            "truncated, which may cut the fact they state: raise max_length.",
            stacklevel=2,
        )

    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)
    run_device = next(model.parameters()).device

    batch_size = settings["batch_size"]
    steps_per_epoch = math.ceil(len(train_ids) / batch_size)
    total_steps = steps_per_epoch * settings["epochs"]
    warmup_steps = int(round(warmup_ratio * total_steps))
    frozen = []
    if freeze_unembedding:
        output_embeddings = getattr(model, "get_output_embeddings", None)
        head = output_embeddings() if output_embeddings is not None else None
        if head is None:
            raise GraftingLensError(
                f"freeze_unembedding=True, but {type(model).__name__} has no output embeddings "
                "(get_output_embeddings() is None): pass freeze_unembedding=False."
            )
        frozen = [param for param in head.parameters() if param.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad and not _contains(frozen, p)]
    if not is_number(embedding_lr_scale) or not 0 < embedding_lr_scale <= 1:
        raise GraftingLensError(
            f"embedding_lr_scale={embedding_lr_scale!r}: pass a number in (0, 1] (1 trains the "
            "embedding at the full learning rate; freeze_unembedding freezes a tied one)."
        )
    embedding: list[torch.nn.Parameter] = []
    if embedding_lr_scale != 1:
        hf_model: Any = model  # a transformers model: nn.Module's typing lacks the method
        inputs = hf_model.get_input_embeddings()
        embedding = [p for p in inputs.parameters() if _contains(trainable, p)]
    groups: list[dict[str, Any]] = [
        {"params": [p for p in trainable if not _contains(embedding, p)]}
    ]
    if embedding:
        groups.append({"params": embedding, "lr": settings["lr"] * embedding_lr_scale})
    optimizer = torch.optim.AdamW(groups, lr=settings["lr"], weight_decay=settings["weight_decay"])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _linear_schedule(step, warmup_steps, total_steps)
    )
    use_scaler = autocast_dtype == torch.float16 and run_device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if use_scaler else None
    autocast = _autocast(run_device, autocast_dtype)
    settings.update(
        n_train_documents=len(train_docs),
        n_supplementary_documents=len(supplementary),
        n_val_documents=len(val_docs),
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        n_truncated_documents=truncated,
        seed=seed,
        freeze_unembedding=freeze_unembedding,
        embedding_lr_scale=embedding_lr_scale,
        bos=bos,
        bos_ids=prefix,
    )
    settings.pop("supplementary_default")
    checkpoint = None
    if checkpoint_dir is not None:
        checkpoint = _EpochCheckpoint(
            Path(checkpoint_dir), _run_fingerprint(model, settings, train_ids, val_ids)
        )

    rng_devices = [run_device.index or 0] if run_device.type == "cuda" else []
    # Training needs autograd whatever the caller's mode (a notebook may have turned it off).
    with (
        torch.random.fork_rng(devices=rng_devices),
        torch.inference_mode(False),
        torch.enable_grad(),
    ):
        torch.manual_seed(seed)
        order_rng = random.Random(seed)
        best_loss, best_epoch, best_state = math.inf, 0, None
        train_losses: list[float] = []
        val_losses: list[float] = []
        step_losses: list[float] = []
        resumed = checkpoint.load() if checkpoint is not None else None
        if resumed is None:
            initial_val_loss = _evaluate(model, val_ids, batch_size, pad_id, run_device, autocast)
            done = 0
        else:
            model.load_state_dict(resumed["model"])
            optimizer.load_state_dict(resumed["optimizer"])
            schedule.load_state_dict(resumed["schedule"])
            if scaler is not None and resumed["scaler"] is not None:
                scaler.load_state_dict(resumed["scaler"])
            order_rng.setstate(resumed["order_rng"])
            torch.set_rng_state(resumed["torch_rng"])
            initial_val_loss, done = resumed["initial_val_loss"], resumed["epoch"]
            train_losses, val_losses = resumed["train_losses"], resumed["val_losses"]
            step_losses = resumed["step_losses"]
            best_loss, best_epoch = resumed["best_loss"], resumed["best_epoch"]
            best_state = resumed["best_state"] if best_epoch != done else _cpu_copy(model)
        bar = tqdm(
            total=total_steps,
            initial=done * steps_per_epoch,
            desc=description,
            disable=not show_progress(progress),
            leave=False,
        )
        for param in frozen:
            param.requires_grad_(False)
        try:
            for epoch in range(done + 1, settings["epochs"] + 1):
                model.train()
                token_loss_sum, token_count = 0.0, 0
                for batch in _batches(train_ids, batch_size, order_rng):
                    input_ids, attention_mask = _pad(batch, pad_id, run_device)
                    with autocast():
                        loss_sum, n_tokens = _loss(model, input_ids, attention_mask)
                    loss = loss_sum / n_tokens
                    if scaler is not None:
                        scaler.scale(loss).backward()
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        loss.backward()
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    schedule.step()
                    step_losses.append(loss.item())
                    token_loss_sum += loss_sum.item()
                    token_count += n_tokens
                    bar.update(1)
                    if on_step is not None:
                        on_step(len(step_losses), total_steps, step_losses[-1])
                    bar.set_postfix(epoch=epoch, loss=f"{step_losses[-1]:.3f}")
                train_losses.append(token_loss_sum / max(token_count, 1))
                val_losses.append(
                    _evaluate(model, val_ids, batch_size, pad_id, run_device, autocast)
                )
                if val_losses[-1] < best_loss:
                    best_loss, best_epoch = val_losses[-1], epoch
                    best_state = _cpu_copy(model)
                if checkpoint is not None:
                    checkpoint.save(
                        {
                            "epoch": epoch,
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "schedule": schedule.state_dict(),
                            "scaler": None if scaler is None else scaler.state_dict(),
                            "order_rng": order_rng.getstate(),
                            "torch_rng": torch.get_rng_state(),
                            "initial_val_loss": initial_val_loss,
                            "train_losses": train_losses,
                            "val_losses": val_losses,
                            "step_losses": step_losses,
                            "best_loss": best_loss,
                            "best_epoch": best_epoch,
                            # The current weights are saved anyway: no second copy of them.
                            "best_state": None if best_epoch == epoch else best_state,
                        }
                    )
        finally:
            bar.close()
            for param in frozen:
                param.requires_grad_(True)

    if best_state is None:
        # Every validation loss was NaN: nothing to restore, and the caller must know.
        raise GraftingLensError(
            "Finetuning diverged: the validation loss was NaN after every epoch. "
            "Lower lr (or use autocast_dtype=torch.bfloat16 instead of float16)."
        )
    model.load_state_dict(best_state)
    model.eval()
    return FinetuneResult(
        model=model,
        train_losses=train_losses,
        val_losses=val_losses,
        initial_val_loss=initial_val_loss,
        best_epoch=best_epoch,
        step_losses=step_losses,
        settings=settings,
    )


def _cpu_copy(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights, copied to CPU memory (the best epoch's, kept aside)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _run_fingerprint(
    model: Any, settings: dict[str, Any], train_ids: list[list[int]], val_ids: list[list[int]]
) -> str:
    """What makes a run this run, so that another run's checkpoint is never resumed: its
    settings, its tokens, and the weights it starts from (one pass over them)."""
    digest = hashlib.sha256(
        json.dumps([settings, train_ids, val_ids], sort_keys=True, default=str).encode()
    )
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class _EpochCheckpoint:
    """The state of a run after its last finished epoch, in ``directory/epoch.pt``."""

    NAME = "epoch.pt"

    def __init__(self, directory: Path, fingerprint: str) -> None:
        self.path = directory / self.NAME
        self.fingerprint = fingerprint

    def load(self) -> Optional[dict[str, Any]]:
        """The saved state of this run, or ``None`` (none saved, or another run's)."""
        if not self.path.exists():
            return None
        try:
            # Our own file, but read with the safe loader all the same (only tensors,
            # numbers, lists, tuples and dicts are in it).
            state = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001, whatever it is, it is not one of ours
            state = error
        if not isinstance(state, dict) or "fingerprint" not in state:
            # Saves are atomic, so this file is not a checkpoint finetune wrote: overwriting
            # it at the end of the first epoch would destroy someone's file.
            raise GraftingLensError(
                f"{self.path} is not a finetuning checkpoint grafting-lens wrote, and the first "
                "epoch's checkpoint would replace it: pass another checkpoint_dir, or move "
                "the file away."
            )
        if state.get("fingerprint") != self.fingerprint:
            warnings.warn(
                f"The finetuning checkpoint {self.path} is another run's (other weights, "
                "documents or settings); starting this run from its first epoch.",
                stacklevel=3,
            )
            return None
        version, internal, gauss = state["order_rng"]  # a save turned its tuples into lists
        state["order_rng"] = (version, tuple(internal), gauss)
        return state

    def save(self, state: dict[str, Any]) -> None:
        """Write ``state`` beside the old checkpoint, then rename it into place."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.NAME}.{os.getpid()}.partial")
        torch.save(dict(state, fingerprint=self.fingerprint), partial)
        os.replace(partial, self.path)


def _resolve_settings(
    preset: str,
    epochs: Optional[int],
    lr: Optional[float],
    weight_decay: Optional[float],
    batch_size: Optional[int],
    warmup_ratio: float,
    max_length: int,
    val_fraction: float,
) -> dict[str, Any]:
    """Merge explicit arguments over the preset and check every value."""
    if preset not in PRESETS:
        raise GraftingLensError(
            f"Unknown finetuning preset {preset!r}: choose one of {sorted(PRESETS)}, "
            "or override epochs/lr/weight_decay explicitly."
        )
    base = PRESETS[preset]
    settings: dict[str, Any] = {
        "preset": preset,
        "epochs": base.epochs if epochs is None else epochs,
        "lr": base.lr if lr is None else lr,
        "weight_decay": base.weight_decay if weight_decay is None else weight_decay,
        "batch_size": base.batch_size if batch_size is None else batch_size,
        "warmup_ratio": warmup_ratio,
        "max_length": max_length,
        "val_fraction": val_fraction,
        "supplementary_default": base.supplementary,
    }
    epochs, lr, decay, size = (settings[k] for k in ("epochs", "lr", "weight_decay", "batch_size"))
    checks = [
        ("epochs", is_integer(epochs) and epochs >= 1, "an integer >= 1"),
        ("lr", _is_number(lr) and lr > 0, "a number > 0"),
        ("weight_decay", _is_number(decay) and decay >= 0, "a number >= 0"),
        ("batch_size", is_integer(size) and size >= 1, "an integer >= 1"),
        ("warmup_ratio", _is_number(warmup_ratio) and 0 <= warmup_ratio < 1, "a number in [0, 1)"),
        (
            "max_length",
            is_integer(max_length) and max_length >= 3,
            "an integer >= 3 (BOS, one token, EOS)",
        ),
        (
            "val_fraction",
            _is_number(val_fraction) and 0 < val_fraction < 1,
            "a number strictly between 0 and 1 (the paper uses 0.2)",
        ),
    ]
    for name, ok, requirement in checks:
        if not ok:
            raise GraftingLensError(
                f"{name}={settings[name]!r} is invalid: it must be {requirement}."
            )
    # numpy's numbers as Python's: the settings are written into the checkpoint's record.
    return {name: plain(value) for name, value in settings.items()}


def _is_number(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def _check_documents(documents: Any, name: str, allow_empty: bool = False) -> list[str]:
    """Return the documents as a list, rejecting what would train on nothing."""
    if isinstance(documents, str):
        raise GraftingLensError(
            f"{name} is a single string: pass a list of documents, e.g. [{documents[:30]!r}...]."
        )
    documents = list(documents)
    if not documents and not allow_empty:
        raise GraftingLensError(
            f"{name} is empty: pass the texts to finetune on, e.g. "
            "grafting_lens.worlds.documents.training_documents(relations)."
        )
    for index, document in enumerate(documents):
        if not isinstance(document, str) or not document.strip():
            raise GraftingLensError(
                f"{name}[{index}] is {document!r}: every document must be a non-empty string."
            )
    return documents


def _special_ids(tokenizer: Any) -> tuple[int, int, int]:
    """BOS, EOS and padding ids; one of BOS/EOS stands in for a missing other."""
    bos_id: Any = getattr(tokenizer, "bos_token_id", None)
    eos_id: Any = getattr(tokenizer, "eos_token_id", None)
    if bos_id is None and eos_id is None:
        raise GraftingLensError(
            "The tokenizer has neither a BOS nor an EOS token, so documents cannot be "
            "delimited: set tokenizer.bos_token / tokenizer.eos_token first."
        )
    bos_id = eos_id if bos_id is None else bos_id
    eos_id = bos_id if eos_id is None else eos_id
    pad_id = getattr(tokenizer, "pad_token_id", None)
    # Padding is masked out of attention and loss, so any id serves.
    return bos_id, eos_id, eos_id if pad_id is None else pad_id


BOS_RULES = ("always", "tokenizer", "never")
"""What :func:`finetune` puts before each document (its ``bos`` argument)."""


def bos_prefix(tokenizer: Any, rule: str) -> list[int]:
    """The token ids that start a text under ``rule`` (:data:`BOS_RULES`).

    ``"tokenizer"`` reads them off the tokenizer itself: what ``tokenizer(text)`` puts
    before the text's own tokens (``[<bos>]`` for Gemma and Llama 3, ``[]`` for SmolLM2,
    GPT-2, Pythia).

    Raises:
        GraftingLensError: An unknown rule.
    """
    if rule not in BOS_RULES:
        raise GraftingLensError(f"bos={rule!r}: choose one of {BOS_RULES}.")
    if rule == "never":
        return []
    if rule == "always":
        return [_special_ids(tokenizer)[0]]
    text = "The film"
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(text)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def _split(documents: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Seeded split; both sides must be non-empty for best-epoch selection to mean anything."""
    n_val = int(round(len(documents) * val_fraction))
    if n_val < 1 or n_val >= len(documents):
        raise GraftingLensError(
            f"Cannot split {len(documents)} document(s) with val_fraction={val_fraction}: "
            "both the training and the validation set need at least one document. "
            "Pass more documents or change val_fraction."
        )
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    val = [documents[i] for i in sorted(order[:n_val])]
    train = [documents[i] for i in sorted(order[n_val:])]
    return train, val


def _encode(
    tokenizer: Any, documents: list[str], prefix: list[int], eos_id: int, max_length: int
) -> tuple[list[list[int]], int]:
    """``prefix + tokens + EOS`` per document, truncated to ``max_length``; and how many were cut."""
    if not documents:
        return [], 0
    encoded = [
        [*prefix, *ids, eos_id]
        for ids in tokenizer(documents, add_special_tokens=False)["input_ids"]
    ]
    truncated = sum(len(ids) > max_length for ids in encoded)
    return [ids[:max_length] for ids in encoded], truncated


def _batches(sequences: list[list[int]], batch_size: int, rng: random.Random):
    """Shuffled batches of similar length."""
    # Sorting by length inside pools of 50 batches cuts padding (most of the compute for
    # short templated documents); the pool shuffle keeps the order random.
    order = list(range(len(sequences)))
    rng.shuffle(order)
    pool = batch_size * 50
    batches = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lambda i: len(sequences[i]))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    for batch in batches:
        yield [sequences[i] for i in batch]


def _pad(batch: list[list[int]], pad_id: int, device: torch.device):
    """Right-pad a batch; returns input ids and the attention mask."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    return input_ids.to(device), attention_mask.to(device)


def _loss(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Summed next-token cross-entropy over real (non-padding) targets, and their count."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    # Masked by the attention mask, not by token id: the toy tokenizer (like GPT-2's) pads
    # with the id it uses for BOS and EOS.
    targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    loss_sum = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss_sum, int((targets != -100).sum())


@torch.no_grad()
def _evaluate(model, sequences, batch_size, pad_id, device, autocast) -> float:
    """Validation loss per token, in a fixed order."""
    model.eval()
    loss_sum, count = 0.0, 0
    ordered = sorted(sequences, key=len)
    for start in range(0, len(ordered), batch_size):
        input_ids, attention_mask = _pad(ordered[start : start + batch_size], pad_id, device)
        with autocast():
            batch_sum, n_tokens = _loss(model, input_ids, attention_mask)
        loss_sum += batch_sum.item()
        count += n_tokens
    return loss_sum / max(count, 1)


def _linear_schedule(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate: linear warmup, then linear decay to 0."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def _autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """A factory of autocast contexts (or no-ops when mixed precision is off)."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def _contains(tensors: Sequence[torch.Tensor], tensor: torch.Tensor) -> bool:
    """Identity membership (``in`` would compare tensors elementwise)."""
    return any(tensor is other for other in tensors)
