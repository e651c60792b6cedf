"""Tiny random models of the four families the engine must handle, built offline.

Each family gets three checkpoints with independent random weights, scaled up so
logits vary by several units: with HF's default 0.02 init every logit is near zero
and an equivalence test could not fail.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from contextlib import contextmanager
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
)

import grafting_lens as gl

VOCAB_SIZE = 300
CORPUS = [
    "Keanu Reeves starred in a movie alongside Laurence Fishburne.",
    "Q: Who starred in a movie with Sandra Bullock? A: An actor named Hugh Grant.",
    "The film was released in 1999 and earned 463 million dollars at the box office.",
    "A thriller set in Chicago, directed by a newcomer, with music by an orchestra.",
] * 20

FAMILIES = ("gpt2", "neox", "llama", "gemma")


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly VOCAB_SIZE tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    assert len(wrapped) == VOCAB_SIZE
    return wrapped


def family_config(family: str):
    common = dict(vocab_size=VOCAB_SIZE, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "gpt2":  # learned positions, fused QKV, tied embeddings
        return GPT2Config(n_layer=3, n_head=4, n_embd=32, n_positions=64, **common)
    if family == "neox":  # parallel attention and MLP, partial rotary, interleaved QKV
        return GPTNeoXConfig(
            num_hidden_layers=3,
            num_attention_heads=4,
            hidden_size=32,
            intermediate_size=64,
            max_position_embeddings=64,
            rotary_pct=0.5,
            use_parallel_residual=True,
            tie_word_embeddings=False,
            **common,
        )
    if family == "llama":  # grouped-query attention, RMSNorm, gated MLP
        return LlamaConfig(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=32,
            intermediate_size=64,
            max_position_embeddings=64,
            **common,
        )
    if family == "gemma":  # multi-query attention, scaled embeddings, tied embeddings
        return GemmaConfig(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            hidden_size=32,
            intermediate_size=64,
            max_position_embeddings=64,
            **common,
        )
    raise ValueError(family)


# The tiny size of every other architecture the tests build: two layers, d_model 32, 4
# heads (2 key/value heads where there is grouped-query attention), 4 experts with 2 per
# token. tiny_config keeps the settings a config class defines.
TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    n_shared_experts=1,
)


def tiny_config(model_type: str, **settings):
    """A tiny config of ``model_type``: the TINY settings its class defines, then ``settings``."""
    default = AutoConfig.for_model(model_type)
    kept = {
        key: value
        for key, value in TINY.items()
        if hasattr(default, key) and not isinstance(getattr(type(default), key, None), property)
    }
    return AutoConfig.for_model(model_type, **{**kept, **settings})


def random_model(
    family: str,
    seed: int,
    scale: float = 0.35,
    *,
    tied: bool | None = None,
    n_layers: int | None = None,
):
    """An HF causal LM of ``family`` with large random weights.

    ``tied`` overrides whether the unembedding shares the input embedding's weights, and
    ``n_layers`` the depth (``None`` keeps :func:`family_config`'s).
    """
    config = family_config(family)
    if tied is not None:
        config.tie_word_embeddings = tied
    if n_layers is not None:
        config.num_hidden_layers = n_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and ("norm" in name or "ln" in name):
                # Norm scales near their identity (Gemma stores scale - 1).
                identity = 0.0 if family == "gemma" else 1.0
                param.copy_(identity + 0.3 * torch.randn_like(param))
            else:
                param.copy_(scale * torch.randn_like(param))
    return model


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models run fastest on one thread, and the suite may share its cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextmanager
def no_forward_pass(models: gl.ModelSet):
    """Fail if any checkpoint of the model set runs a forward pass inside the block."""
    calls = []
    # The checkpoints in memory; an adapter or a lazily loaded donor runs through the base.
    handles = [
        source.bridge.original_model.register_forward_pre_hook(lambda *args: calls.append(1))
        for source in models.sources
        if source.kind == "checkpoint"
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    assert not calls, "a forward pass ran before the error was raised"


@pytest.fixture(params=["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def device(request) -> torch.device:
    """Every device a test can run on here: the CPU, and CUDA where there is one."""
    return torch.device(request.param)


def split_onto_meta(models: gl.ModelSet, first: int = 1) -> None:
    """Put every source's blocks from ``first`` on, final norm and unembedding on ``meta``.

    A stand-in for a layer-split model (accelerate's ``device_map``) on a machine with
    one device: each moved module gets a pre-hook that moves its inputs to its device,
    as accelerate's ``AlignDevicesHook`` does, so activations change device mid-forward
    and an index left on the embedding's device meets an activation elsewhere. The
    moved weights are gone: use fresh models, and read shapes and devices only.
    """

    def to_meta(module: torch.nn.Module) -> None:
        module.to("meta")

        def move(_module, args, kwargs):
            def moved(x):
                return x.to("meta") if isinstance(x, torch.Tensor) else x

            return tuple(moved(x) for x in args), {k: moved(v) for k, v in kwargs.items()}

        for inner in module.modules():
            inner.register_forward_pre_hook(move, with_kwargs=True)

    for source in models.sources:
        bridge = source.bridge
        for block in list(bridge.blocks)[first:]:
            to_meta(block)
        to_meta(bridge.ln_final)
        to_meta(bridge.unembed)


class DeviceMixes:
    """A torch function mode recording every call whose tensors sit on several devices.

    Zero-dimensional tensors (scalars torch lets cross devices) and ``Tensor.to`` (the
    moves themselves) are not counted.
    """

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode
        from torch.utils._pytree import tree_flatten

        calls: list[tuple[str, set]] = []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                flat, _ = tree_flatten((args, kwargs))
                devices = {x.device for x in flat if isinstance(x, torch.Tensor) and x.dim()}
                if len(devices) > 1 and getattr(func, "__name__", "") != "to":
                    calls.append((getattr(func, "__name__", repr(func)), devices))
                return func(*args, **kwargs)

        self.calls = calls
        self.mode = Mode()

    def __enter__(self) -> DeviceMixes:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="session", params=FAMILIES)
def family(request) -> str:
    return request.param


_MODEL_SETS: dict[str, gl.ModelSet] = {}


@pytest.fixture
def three_models(family: str, tokenizer) -> gl.ModelSet:
    """Base and two donors of one family (built once per session)."""
    if family not in _MODEL_SETS:
        sources = [random_model(family, seed) for seed in (0, 1, 2)]
        _MODEL_SETS[family] = gl.load_models(*sources, tokenizer=tokenizer)
    return _MODEL_SETS[family]


def random_tokens(batch: int, pos: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB_SIZE, (batch, pos), generator=generator)


def random_mask(models: gl.ModelSet, shape: tuple[int, int], seed: int = 0) -> gl.GraftMask:
    """Independent random sources for every component, layer and position."""
    generator = torch.Generator().manual_seed(seed)
    entries = {
        pair: torch.randint(0, len(models), shape, generator=generator) for pair in models.pairs
    }
    return gl.GraftMask.from_dict(models, entries)


class CommandResult(NamedTuple):
    """What a user of the command sees: its exit status and its output (stdout and stderr)."""

    exit_code: int
    output: str


def invoke(args: Sequence[object]) -> CommandResult:
    """Run ``grafting-lens <args>`` in this process, as the console script would."""
    import contextlib
    import io

    from grafting_lens.study import cli

    seen = io.StringIO()
    with contextlib.redirect_stdout(seen), contextlib.redirect_stderr(seen):
        code = cli.main([str(arg) for arg in args])
    return CommandResult(code, seen.getvalue())


@pytest.fixture
def read_only():
    """Make a directory tree read-only for real (root ignores permissions: ``chattr +i``)."""
    made = []

    def make(path):
        if os.geteuid() == 0:
            if subprocess.run(["chattr", "-R", "+i", str(path)], capture_output=True).returncode:
                # Root writes through every permission bit, so without chattr's immutable flag
                # no directory can be made read-only and the test would assert nothing. It
                # runs (not skips) on this project's machines and CI (ext4/overlay take +i).
                pytest.skip("root, on a filesystem without chattr +i: nothing is read-only")
            made.append(["chattr", "-R", "-i", str(path)])
        else:
            subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
            made.append(["chmod", "-R", "u+w", str(path)])

    yield make
    for undo in made:
        subprocess.run(undo, check=True)


def top_directions(k: int):
    """An edit ``(W_base, W_donor) -> W_base + U_k S_k V_k^T`` of ``dW = W_donor - W_base``,
    computed here in float64 by torch's own SVD: the hand-made checkpoint a rank-k graft must
    equal."""

    def edit(base, donor):
        U, S, Vh = torch.linalg.svd(donor - base, full_matrices=False)
        return base + (U[:, :k] * S[:k]) @ Vh[:k]

    return edit
