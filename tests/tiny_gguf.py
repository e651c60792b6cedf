"""A tiny Llama written as a GGUF file the way llama.cpp writes one, for tests.

llama.cpp's converter stores Llama weights under its own names (``blk.0.attn_q.weight``),
permutes the rows of the query and key projections for its rotary layout, and carries the
tokenizer in the metadata (``tokenizer.ggml.*``: the byte-level BPE's tokens, their types
and its merges). This writes all of that with the ``gguf`` package's writer, so that a
test can check that grafting-lens's conversion gives back the very model it started from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"))


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
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that a dropped norm weight shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return model


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's reordering of query/key rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(model, path: Path, architecture: str = "llama") -> Path:
    """Write ``model`` (from :func:`tiny_llama`) and the tokenizer as a float32 GGUF file."""
    from gguf import GGUFWriter, TokenType

    config = model.config
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    tokens = vocabulary()
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

    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
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
        for gguf_name, hf_name in names.items():
            weights = state[prefix + hf_name + ".weight"]
            if gguf_name == "attn_q":
                weights = _permute(weights, heads)
            elif gguf_name == "attn_k":
                weights = _permute(weights, kv_heads)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", np.ascontiguousarray(weights))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not config.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
