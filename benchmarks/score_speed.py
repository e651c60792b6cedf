"""Benchmark: what a score beyond the answer's first token costs (issue 49).

Builds two GPT-2-small-shaped checkpoints with random weights (12 layers, d_model 768,
vocabulary 50,257; nothing is downloaded) and scores ``--batch`` prompts of ``--pos``
tokens, each with a ``--answer``-token answer, under the grafts ``gl.graft`` runs for one
place: the base, the whole donor, and the donor's every component at the middle half of
each prompt (one pass, every configuration a block of rows). Prints one JSON line:

* ``answer_logprob_ratio``: ``score="answer_logprob"`` (the answer teacher-forced after each
  prompt, its tokens' log-probabilities read) over ``score="first_token"`` (the paper's);
* ``kl_ratio``: ``score="kl"`` at one position (the prompt's last token, ``at="last"``) over
  ``first_token``; ``kl_answer_ratio``: ``kl`` at the last token and each answer token;
* ``logits_mib``: the logits each pass returns (what a score adds in memory: a pass's
  activations are the same but for the answer's positions), and ``max_rss_mib``;
* ``answer_logprob_floor``: what the answer's positions cost by arithmetic alone, the
  multiply-adds of ``pos + answer`` positions through the blocks and ``answer`` through the
  unembedding over ``pos`` and one: no implementation of a teacher-forced score is cheaper,
  and ``answer_logprob_over_floor`` is the ratio's part above it;
* ``by_pos``: the ratios at every ``--pos`` given (``--pos 16,48``), the first one's at the
  top level.

Timings are taken in rounds (each round runs every variant once) and ratios use each
variant's best, as ``graft_speed.py`` does.

Run: ``python benchmarks/score_speed.py [--batch 8] [--pos 16,48] [--answer 4] [--threads 1]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a benchmark never downloads

import torch
from graft_speed import gpt2_small, placeholder_tokenizer, rounds, spread

import grafting_lens as gl
from grafting_lens.analysis import scoring
from grafting_lens.analysis.batch import TokenizedExamples
from grafting_lens.analysis.scoring import LastTokenScorer, Score, score_pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pos", default="16", help="prompt tokens, or several: 16,48")
    parser.add_argument("--answer", type=int, default=4, help="answer tokens (default 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = gl.load_models(gpt2_small(0), gpt2_small(1), tokenizer=placeholder_tokenizer())
    results = [measure(models, args, int(pos)) for pos in args.pos.split(",")]
    first = results[0]
    first["by_pos"] = {
        result["pos"]: {k: v for k, v in result.items() if k.endswith(("_ratio", "_floor"))}
        for result in results
    }
    first["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(first))


def floor(models, pos: int, answer: int) -> float:
    """``answer_logprob`` over ``first_token`` in multiply-adds: the blocks' weights at every
    position, the unembedding at the positions read (``answer`` of them, against one)."""
    d_model, vocab = models.base.cfg.d_model, models.base.cfg.d_vocab
    unembed = d_model * vocab
    blocks = sum(  # the transformer blocks' weights (GPT-2's transformer.h)
        p.numel() for name, p in models.base.original_model.named_parameters() if ".h." in name
    )
    return ((pos + answer) * blocks + answer * unembed) / (pos * blocks + unembed)


def measure(models, args, pos: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    vocab = models.base.cfg.d_vocab
    args.pos = pos
    shape = (args.batch, args.pos)
    answers = torch.randint(0, vocab, (args.batch, args.answer), generator=generator)
    batch = TokenizedExamples(
        examples=None,
        tokens=torch.randint(0, vocab, shape, generator=generator),
        attention_mask=torch.ones(shape, dtype=torch.long),
        target_ids=answers[:, 0],
        target_full_ids=answers.tolist(),
        spans={},
    )
    half = torch.zeros(shape, dtype=torch.bool)
    half[:, args.pos // 4 : args.pos // 4 + args.pos // 2] = True
    # gl.graft's runs for one place: the base, the whole donor, the graft.
    selections = [[], [torch.ones(shape, dtype=torch.bool)], [half]]

    def mask_of(laid_out, block):
        return gl.GraftMask.cat(
            [
                gl.GraftMask.build(models, block, positions=chosen[0])
                if chosen
                else gl.GraftMask({}, block, len(models))
                for chosen in laid_out
            ]
        )

    scorer = LastTokenScorer(top_k=10)
    sizes: dict[str, float] = {}
    real = scoring.graft_forward

    def variant(name: str, score: Score):
        def run():
            def measured(*args, **kwargs):
                logits = real(*args, **kwargs)
                sizes[name] = round(logits.numel() * logits.element_size() / 2**20, 2)
                return logits

            scoring.graft_forward = measured
            try:
                with torch.inference_mode():
                    return score_pass(models, score, batch, selections, mask_of, scorer)
            finally:
                scoring.graft_forward = real

        return run

    variants = {
        "first_token": variant("first_token", Score.of()),
        "answer_logprob": variant("answer_logprob", Score.of("answer_logprob")),
        "kl": variant("kl", Score.of("kl", at="last")),
        "kl_answer": variant("kl_answer", Score.of("kl")),
    }
    times = rounds(variants, args.repeats)
    best = {name: min(seconds) for name, seconds in times.items()}
    ratio = best["answer_logprob"] / best["first_token"]
    lowest = floor(models, args.pos, args.answer)
    return {
        "answer_logprob_ratio": round(ratio, 3),
        "answer_logprob_floor": round(lowest, 3),
        "answer_logprob_over_floor": round(ratio / lowest, 3),
        "kl_ratio": round(best["kl"] / best["first_token"], 3),
        "kl_answer_ratio": round(best["kl_answer"] / best["first_token"], 3),
        "times": {name: spread(seconds) for name, seconds in times.items()},
        "logits_mib": dict(sizes),
        "batch": args.batch,
        "pos": args.pos,
        "answer_tokens": args.answer,
        "configurations": len(selections),
        "threads": torch.get_num_threads(),
        "model": "gpt2-small-shaped, random weights",
    }


if __name__ == "__main__":
    main()
