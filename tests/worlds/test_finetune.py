"""finetune(): the paper's SFT recipe on a tiny model, in seconds on a CPU."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import grafting_lens.worlds.finetune as finetune_module
from grafting_lens.core.errors import GraftingLensError
from grafting_lens.worlds.finetune import PRESETS, finetune

DOCUMENTS = [
    f"{name} starred in a movie alongside {costar}. Q: Who starred with {name}? A: {costar}."
    for name, costar in [
        ("Ada Lovelace", "Alan Turing"),
        ("Grace Hopper", "Claude Shannon"),
        ("Emmy Noether", "David Hilbert"),
        ("Marie Curie", "Niels Bohr"),
        ("Lise Meitner", "Otto Hahn"),
        ("Rosalind Franklin", "Francis Crick"),
    ]
] * 4


@pytest.fixture(scope="module")
def tokenizer():
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(DOCUMENTS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def tiny_model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def run(tokenizer, model=None, **kwargs):
    options = dict(epochs=3, lr=1e-2, batch_size=4, max_length=64, progress=False)
    options.update(kwargs)
    return finetune(model or tiny_model(tokenizer), tokenizer, DOCUMENTS, **options)


def test_finetuning_lowers_training_and_validation_loss(tokenizer):
    result = run(tokenizer)

    assert len(result.train_losses) == len(result.val_losses) == 3
    assert result.train_losses[-1] < 0.85 * result.train_losses[0]
    assert result.best_val_loss < 0.85 * result.initial_val_loss
    assert not result.model.training
    # 24 documents, 20% held out: 5 validation, 19 training, ceil(19 / 4) = 5 steps per epoch.
    assert result.settings["n_val_documents"] == 5
    assert result.settings["n_train_documents"] == 19
    assert len(result.step_losses) == result.settings["total_steps"] == 15


def test_best_validation_epoch_is_restored(tokenizer, monkeypatch):
    """The returned weights are the best epoch's, not the last epoch's."""
    scripted = iter([9.0, 5.0, 1.0, 3.0, 4.0])  # before training, then after epochs 1..4
    snapshots = []
    real_evaluate = finetune_module._evaluate

    def evaluate(model, *args):
        real_evaluate(model, *args)
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return next(scripted)

    monkeypatch.setattr(finetune_module, "_evaluate", evaluate)
    result = run(tokenizer, epochs=4)

    assert result.best_epoch == 2
    assert result.val_losses == [5.0, 1.0, 3.0, 4.0]
    assert result.best_val_loss == 1.0
    final = result.model.state_dict()
    best, last = snapshots[2], snapshots[4]
    assert all(torch.equal(final[name], best[name]) for name in best)
    assert not all(torch.equal(final[name], last[name]) for name in last)


def test_padding_is_masked_out_of_the_loss(tokenizer):
    """A padded batch gives each document the loss it has on its own."""
    model = tiny_model(tokenizer).eval()
    bos, eos, pad = finetune_module._special_ids(tokenizer)
    (short, long), n_truncated = finetune_module._encode(
        tokenizer, ["Ada Lovelace", DOCUMENTS[0]], [bos], eos, 64
    )
    assert n_truncated == 0
    assert short[0] == bos and short[-1] == eos
    assert len(short) < len(long)

    with torch.no_grad():
        together, count = finetune_module._loss(
            model, *finetune_module._pad([short, long], pad, "cpu")
        )
        alone = [
            finetune_module._loss(model, *finetune_module._pad([ids], pad, "cpu"))
            for ids in (short, long)
        ]

    assert count == sum(n for _, n in alone) == len(short) - 1 + len(long) - 1
    torch.testing.assert_close(together, sum(loss for loss, _ in alone), rtol=1e-4, atol=1e-4)


def test_same_seed_same_run(tokenizer):
    first = run(tokenizer, epochs=1)
    second = run(tokenizer, epochs=1)
    other = run(tokenizer, epochs=1, seed=1)

    assert first.step_losses == second.step_losses
    assert first.step_losses != other.step_losses


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_training_works_whatever_the_callers_autograd_mode(tokenizer, mode):
    """A notebook that turned autograd off must still be able to finetune."""
    expected = run(tokenizer, epochs=1)
    model = tiny_model(tokenizer)  # parameters made under inference_mode could never train
    with mode():
        result = run(tokenizer, model, epochs=1)
    assert result.step_losses == expected.step_losses


def test_presets_and_overrides(tokenizer):
    assert set(PRESETS) == {"aggressive", "less_aggressive"}
    assert (PRESETS["aggressive"].lr, PRESETS["aggressive"].weight_decay) == (2e-5, 0.01)
    assert (PRESETS["less_aggressive"].lr, PRESETS["less_aggressive"].weight_decay) == (2e-6, 0.0)

    result = run(tokenizer, preset="less_aggressive", epochs=1, lr=None, batch_size=8)
    assert result.settings["lr"] == 2e-6  # from the preset
    assert result.settings["weight_decay"] == 0.0  # from the preset
    assert result.settings["batch_size"] == 8  # overridden
    # The gentle regime mixes in as many generic documents as there are relation documents,
    # in the training set only.
    assert result.settings["n_supplementary_documents"] == len(DOCUMENTS)
    assert result.settings["n_val_documents"] == 5

    assert run(tokenizer, epochs=1).settings["n_supplementary_documents"] == 0
    explicit = run(tokenizer, epochs=1, supplementary=["Some generic text about films."] * 3)
    assert explicit.settings["n_supplementary_documents"] == 3


def test_unknown_preset_names_the_presets(tokenizer):
    with pytest.raises(GraftingLensError, match="aggressive.*less_aggressive"):
        run(tokenizer, preset="gentle")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(documents=[]), "documents is empty"),
        (dict(documents="one long string"), "single string"),
        (dict(documents=["fine", ""]), r"documents\[1\]"),
        (dict(documents=["only one"]), "Cannot split 1 document"),
        (dict(val_fraction=0.0), "val_fraction"),
        (dict(val_fraction=1.0), "val_fraction"),
        (dict(epochs=0), "epochs=0"),
        (dict(lr=-1.0), "lr=-1.0"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(batch_size=0), "batch_size"),
        (dict(max_length=2), "max_length"),
        (dict(supplementary=[3]), r"supplementary\[0\]"),
    ],
)
def test_bad_arguments_are_rejected_with_the_fix(tokenizer, kwargs, message):
    documents = kwargs.pop("documents", DOCUMENTS)
    model = tiny_model(tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        finetune(model, tokenizer, documents, progress=False, **kwargs)
    # Validation happens before any step: the model is untouched.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tokenizer_without_bos_or_eos_is_rejected(tokenizer):
    backend = tokenizer.backend_tokenizer
    bare = PreTrainedTokenizerFast(tokenizer_object=backend)
    with pytest.raises(GraftingLensError, match="neither a BOS nor an EOS"):
        finetune(tiny_model(tokenizer), bare, DOCUMENTS, progress=False)


def test_truncation_is_reported(tokenizer):
    with pytest.warns(UserWarning, match="longer than max_length=8"):
        result = run(tokenizer, epochs=1, max_length=8)
    assert result.settings["n_truncated_documents"] == len(DOCUMENTS)


def test_model_must_be_a_torch_module(tokenizer):
    with pytest.raises(GraftingLensError, match="Hugging Face causal LM"):
        finetune(object(), tokenizer, DOCUMENTS, progress=False)


def test_freeze_unembedding_trains_everything_else(tokenizer):
    model = tiny_model(tokenizer)
    head_before = model.lm_head.weight.detach().clone()
    body_before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    result = run(tokenizer, model=model, freeze_unembedding=True)
    assert torch.equal(model.lm_head.weight, head_before)
    assert not torch.equal(model.model.layers[0].mlp.down_proj.weight, body_before)
    assert model.lm_head.weight.requires_grad  # restored for the caller
    assert result.settings["freeze_unembedding"] is True


def test_a_killed_run_resumes_from_its_last_epoch_to_the_same_bits(
    tokenizer, tmp_path, monkeypatch
):
    settings = dict(epochs=3, lr=3e-3, batch_size=4, progress=False)
    whole = finetune(tiny_model(tokenizer), tokenizer, DOCUMENTS, **settings)

    saves = []
    real_save = finetune_module._EpochCheckpoint.save

    def killed_after_the_first_epoch(self, state):
        real_save(self, state)
        saves.append(state["epoch"])
        raise KeyboardInterrupt

    monkeypatch.setattr(finetune_module._EpochCheckpoint, "save", killed_after_the_first_epoch)
    with pytest.raises(KeyboardInterrupt):
        finetune(tiny_model(tokenizer), tokenizer, DOCUMENTS, checkpoint_dir=tmp_path, **settings)
    monkeypatch.setattr(finetune_module._EpochCheckpoint, "save", real_save)
    resumed = finetune(
        tiny_model(tokenizer), tokenizer, DOCUMENTS, checkpoint_dir=tmp_path, **settings
    )

    assert saves == [1]
    assert resumed.train_losses == whole.train_losses
    assert resumed.val_losses == whole.val_losses
    assert resumed.step_losses == whole.step_losses
    assert resumed.best_epoch == whole.best_epoch
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_another_runs_checkpoint_is_not_resumed(tokenizer, tmp_path):
    finetune(
        tiny_model(tokenizer), tokenizer, DOCUMENTS, epochs=1, lr=3e-3, checkpoint_dir=tmp_path
    )
    with pytest.warns(UserWarning, match="another run's"):
        other = finetune(
            tiny_model(tokenizer), tokenizer, DOCUMENTS, epochs=1, lr=1e-3, checkpoint_dir=tmp_path
        )
    fresh = finetune(tiny_model(tokenizer), tokenizer, DOCUMENTS, epochs=1, lr=1e-3)
    assert other.val_losses == fresh.val_losses


@pytest.mark.parametrize("content", [b"my own notes", None])
def test_a_file_in_the_checkpoint_dir_that_finetune_did_not_write_is_never_replaced(
    tokenizer, tmp_path, content
):
    path = tmp_path / "epoch.pt"
    if content is None:  # a readable torch file, but not a checkpoint of finetune's
        torch.save({"weights": torch.zeros(2)}, path)
    else:
        path.write_bytes(content)
    before = path.read_bytes()

    with pytest.raises(GraftingLensError, match=r"epoch\.pt is not a finetuning checkpoint"):
        finetune(
            tiny_model(tokenizer), tokenizer, DOCUMENTS, epochs=1, lr=1e-3, checkpoint_dir=tmp_path
        )
    assert path.read_bytes() == before
