"""Tiny models written as GGUF files the way llama.cpp writes them, for tests.

llama.cpp's converter stores weights under its own names (``blk.0.attn_q.weight``), and
carries the tokenizer in the metadata (``tokenizer.ggml.*``). For a Llama it permutes the
rows of the query and key projections for its rotary layout and writes a byte-level BPE
(tokens, types, merges); for Gemma 3 it stores every RMSNorm weight plus one (Gemma's
norms scale by ``1 + w``) and writes a SentencePiece vocabulary (tokens, scores, types,
no merges). This writes all of that with the ``gguf`` package's writer, so that a test can
check that grafting-lens's conversion gives back the very model it started from, and can
damage a file on purpose (``skip`` a tensor, declare ``extra_blocks``, leave the
tokenizer out).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"))

GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
GEMMA_PIECES = ("▁", "▁t", "he", "▁the", "▁a", "in", "▁in", "▁h", "at")


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 symbols a byte-level BPE starts from."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return [chr(code) for _, code in sorted(zip(printable, codes))]


def vocabulary() -> list[str]:
    return [*SPECIALS, *_byte_symbols(), *("".join(pair) for pair in MERGES)]


def gemma_vocabulary() -> list[str]:
    """A SentencePiece vocabulary: Gemma's specials, the 256 byte tokens, letters, pieces."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    letters += [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    letters += list(".,':?-")
    return [*GEMMA_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *letters, *GEMMA_PIECES]


def _rough_norms(model):
    with torch.no_grad():  # norms away from their identity, so that a dropped norm weight shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return model


def tiny_llama(seed: int = 0, tied: bool = True):
    """A randomly initialised 2-layer Llama whose vocabulary is :func:`vocabulary`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(vocabulary()),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    return _rough_norms(LlamaForCausalLM(config).eval())


def tiny_gemma3(seed: int = 0):
    """A randomly initialised 2-layer Gemma 3 (text) whose vocabulary is :func:`gemma_vocabulary`.

    Tied embeddings, one key-value head, query/key norms, sliding-window attention: Gemma 3
    270M's shape in miniature.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=len(gemma_vocabulary()),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        sliding_window=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return _rough_norms(Gemma3ForCausalLM(config).eval())


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of query/key rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _llama_tensors(model) -> dict[str, np.ndarray]:
    config = model.config
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"]}
    names = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for layer in range(config.num_hidden_layers):
        for gguf_name, hf_name in names.items():
            weights = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weights = _permute(weights, heads)
            elif gguf_name == "attn_k":
                weights = _permute(weights, kv_heads)
            tensors[f"blk.{layer}.{gguf_name}.weight"] = weights
    tensors["output_norm.weight"] = state["model.norm.weight"]
    if not config.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    return tensors


def _gemma3_tensors(model) -> dict[str, np.ndarray]:
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp writes the embedding once
            continue
        weights = tensor.detach().numpy()
        tensors[names.get_name(name, try_suffixes=(".weight",))] = (
            weights + 1 if "norm" in name else weights
        )
    return tensors


def write_gguf(
    model,
    path: Path,
    architecture: str | int | None = None,
    *,
    skip: Collection[str] = (),
    misshape: Collection[str] = (),
    extra_blocks: int = 0,
    tokenizer: bool = True,
) -> Path:
    """Write ``model`` (:func:`tiny_llama` or :func:`tiny_gemma3`) and its tokenizer as a GGUF.

    Args:
        model: The model to write, in float32.
        path: The file to write.
        architecture: ``general.architecture`` (default: the model's, ``llama`` or ``gemma3``);
            a number is written as one (a miswritten file), the other keys named as the model's.
        skip: GGUF tensor names to leave out (a damaged file).
        misshape: GGUF tensor names written without their last row.
        extra_blocks: Declare this many blocks more than the file holds (fewer if negative).
        tokenizer: Write the tokenizer's metadata.
    """
    from gguf import GGUFWriter, TokenType

    config = model.config
    gemma = config.model_type == "gemma3_text"
    named = architecture if isinstance(architecture, str) else None
    writer = GGUFWriter(str(path), named or ("gemma3" if gemma else "llama"))
    if isinstance(architecture, int):
        writer.add_uint32("general.architecture", architecture)  # in place of the name
    writer.add_name("tiny gemma 3" if gemma else "tiny llama")
    writer.add_block_count(config.num_hidden_layers + extra_blocks)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if gemma:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    if tokenizer and gemma:
        tokens = gemma_vocabulary()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types(
            [
                TokenType.CONTROL
                if t in GEMMA_SPECIALS
                else TokenType.BYTE
                if t.startswith("<0x")
                else TokenType.NORMAL
                for t in tokens
            ]
        )
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
    elif tokenizer:
        tokens = vocabulary()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types(
            [TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL for t in tokens]
        )
        writer.add_token_merges([" ".join(pair) for pair in MERGES])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)

    tensors = _gemma3_tensors(model) if gemma else _llama_tensors(model)
    for name, weights in tensors.items():
        if name in misshape:
            weights = weights[:-1]
        if name not in skip:
            writer.add_tensor(name, np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
