"""Independent computations the fuzzer checks results against: the HF models' own forwards."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def semantics_rules(semantics: object) -> tuple[bool, str]:
    """``(bos, target)`` a semantics string implies: a BOS before the prompt (the clean
    reading, or ``bos=always``), and the answer's first token ``"in_context"`` (clean) or
    ``"standalone"`` (the paper's code, the default)."""
    name = semantics if isinstance(semantics, str) else "reference"
    clean = name.startswith("clean")
    bos = ("bos=always" in name) or (clean and "bos=tokenizer" not in name)
    return bos, "in_context" if clean else "standalone"


@torch.no_grad()
def answer_probabilities(model, world: SimpleNamespace, text: str, target: str, semantics: object):
    """The answer's probability and the whole distribution at the prompt's last token, by
    ``model``'s own forward pass, tokenized as ``semantics`` says by hand."""
    tokenizer = world.tokenizer
    bos, rule = semantics_rules(semantics)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if rule == "in_context":
        joint = tokenizer(text + target, add_special_tokens=False)["input_ids"]
        target_id = joint[len(ids)]
    else:
        target_id = tokenizer(target, add_special_tokens=False)["input_ids"][0]
    tokens = torch.tensor([[tokenizer.bos_token_id, *ids] if bos else ids])
    probabilities = torch.softmax(model(tokens).logits[0, -1].float(), dim=-1)
    return float(probabilities[target_id]), probabilities


def rank_fits(rank: int, p: float, probabilities: torch.Tensor) -> bool:
    """Whether ``rank`` is the answer's rank under some rule for ties."""
    return (
        int((probabilities > p * (1 + 1e-5)).sum())
        <= rank
        <= int((probabilities >= p * (1 - 1e-5)).sum())
    )


@torch.no_grad()
def hf_last_logits(model, tokens: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """``[batch, 1, d_vocab]``: each row's logits at its last real token, row by row."""
    rows = []
    for row in range(tokens.shape[0]):
        length = int(attention_mask[row].sum()) if attention_mask is not None else tokens.shape[1]
        rows.append(model(tokens[row : row + 1, :length]).logits[0, -1])
    return torch.stack(rows)[:, None]


@torch.no_grad()
def hf_greedy(model, tokens: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy generation by the HF model's forward, one token at a time, no cache."""
    for _ in range(new):
        tokens = torch.cat([tokens, model(tokens).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return tokens


@torch.no_grad()
def hf_resid_pre_sweep(base, donor, tokens: torch.Tensor, metric) -> torch.Tensor:
    """``[layer, pos]``: the metric of the base's logits with the donor's residual stream
    written in before one layer at one position (TransformerLens's resid_pre patching),
    by hooks on the HF models themselves."""
    donor_states = donor(tokens, output_hidden_states=True).hidden_states
    layers = base.model.layers
    values = torch.zeros(len(layers), tokens.shape[1])
    for layer in range(len(layers)):
        for pos in range(tokens.shape[1]):

            def swap(_module, args, kwargs, layer=layer, pos=pos):
                if args:
                    hidden = args[0].clone()
                    hidden[:, pos] = donor_states[layer][:, pos]
                    return (hidden, *args[1:]), kwargs
                hidden = kwargs["hidden_states"].clone()
                hidden[:, pos] = donor_states[layer][:, pos]
                return args, {**kwargs, "hidden_states": hidden}

            handle = layers[layer].register_forward_pre_hook(swap, with_kwargs=True)
            try:
                values[layer, pos] = float(metric(base(tokens).logits))
            finally:
                handle.remove()
    return values
