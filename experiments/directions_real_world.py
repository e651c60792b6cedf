"""How many directions of a real world's minimal graft carry its facts, and what they write.

Issue 50's question on a real world: the minimal graft of SFT into PRE (the cells
``benchmarks/minimal_graft.py --cells FILE`` writes, or this script's own search when the
file is missing), every cell grafted with only the top ``k`` singular directions of its
``dW`` (norms and biases stay the base's below the whole cell), for k = 0, 1, 2, 4, ... and
the whole cells; recovery of the whole cells' effect on the search prompts (headline) and on
the held-out ones (QA), with 95% paired bootstrap intervals over prompts. Then the SVDs'
one-time cost (every weight matrix of the model: seconds and bytes), and the top directions
of the first matrix cells the search took, read through the vocabulary. The results page's
"Below the matrix" sections come from it.

Run (``toy``: the shipped toy world, in seconds)::

    python benchmarks/minimal_graft.py --world smollm2 --cells out/minimal_smollm2.csv
    python experiments/directions_real_world.py smollm2 --cells out/minimal_smollm2.csv

``--world-dir DIR`` reads the world from a directory (a built world's, or a build under way
whose ``sft`` is done: the stages are written bit for bit as the finished build's) instead
of the cache's finished build.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # an experiment never downloads

import pandas as pd
import torch

import grafting_lens as gl
from grafting_lens import study
from grafting_lens.analysis.directions import dose_response, read_directions
from grafting_lens.models.directions import DirectionsSource
from grafting_lens.study.graft_attribution import POSITIONS
from grafting_lens.study.named import real_world_setup
from grafting_lens.study.testsets import library_batches
from grafting_lens.worlds import data
from grafting_lens.worlds.directories import read_relations
from grafting_lens.worlds.real_recipe import WORLDS

MATRIX_CELLS = ("q", "k", "v", "o", "mlp_in", "mlp_gate", "mlp_out", "unembed", "embed")


def load(world: str, world_dir: str | None) -> tuple[gl.ModelSet, list[data.Relation]]:
    """PRE and SFT and the world's relations, from the cache or from ``world_dir``."""
    if world == "toy":  # the shipped toy world: what the tests run
        models, relations, _ = study.toy_setup("graft_attribution", progress=False)
        return models, relations
    if world_dir is None:
        models, relations, _ = real_world_setup("graft_attribution", world=world)
        return models, relations
    root = Path(world_dir).expanduser()
    relations = read_relations(root)[0]
    tokenizer = root / "tokenizer" if (root / "tokenizer").is_dir() else None  # the toy's
    models = gl.load_models(root / "base", root / "sft", names=["PRE", "SFT"], tokenizer=tokenizer)
    return models, relations


def svd_cost(models: gl.ModelSet) -> dict:
    """Every weight matrix's SVD of SFT's change, computed once: seconds and bytes held."""
    source = models.directions(1).sources[-1]
    assert isinstance(source, DirectionsSource)
    slots = {slot.path: slot for pair in models.pairs for slot in models.slots(*pair)}
    started = time.perf_counter()
    found = [source.factors(slot) for slot in slots.values()]
    return {
        "matrices": sum(factors is not None for factors in found),
        "seconds": round(time.perf_counter() - started, 1),
        "gib": round(source.svd_bytes() / 2**30, 3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("world", choices=["toy", *WORLDS])
    parser.add_argument("--cells", required=True, help="the minimal graft's cells (CSV)")
    parser.add_argument("--world-dir", help="read the world from this directory")
    parser.add_argument("--relations", type=int, default=64, help="relations per prompt")
    parser.add_argument("--fraction", type=float, default=0.8, help="the search's recovery")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--read", type=int, default=3, help="matrix cells whose directions to read")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    models, relations = load(args.world, args.world_dir)
    batches = library_batches(relations, models.tokenizer, ("headline", "qa"), args.relations)
    cells_file = Path(args.cells)
    if cells_file.exists():
        cells = pd.read_csv(cells_file)
    else:
        gl.notebook(threads=args.threads, grad=True)  # the search differentiates
        found = gl.find_minimal_graft(
            models,
            batches["headline"],
            held_out=batches["qa"],
            fraction=args.fraction,
            positions=POSITIONS,
        )
        cells_file.parent.mkdir(parents=True, exist_ok=True)
        found.cells.to_csv(cells_file, index=False)
        cells = found.cells
    svd = svd_cost(models)
    widest = max(min(p.shape) for p in models.base.original_model.parameters() if p.dim() == 2)
    ranks = [0] + [2**i for i in range(widest.bit_length()) if 2**i <= widest] + [None]
    curves = {}
    for prompt, batch in batches.items():
        frame = dose_response(models, batch, ranks=ranks, cells=cells)
        curves[prompt] = [
            {
                "rank": None if pd.isna(row.rank) else int(row.rank),
                "metric": round(row.metric, 4),
                "recovery": round(row.recovery, 4),
                "low": round(row.recovery_low, 4),
                "high": round(row.recovery_high, 4),
            }
            for row in frame.itertuples()
        ]
    first_tokens = torch.cat([batch.target_ids for batch in batches.values()]).tolist()
    answers = sorted({models.tokenizer.decode([token]) for token in first_tokens})
    readings = []
    matrix_cells = [c for c in cells.itertuples() if c.component in MATRIX_CELLS]
    for cell in matrix_cells[: args.read]:
        layer = None if pd.isna(cell.layer) else int(cell.layer)
        read = read_directions(models, cell.component, layer, k=4, tokens=8, answers=answers)
        for row in read.itertuples():
            readings.append(
                {
                    "cell": f"{cell.component}[{layer}]@{cell.positions}",
                    "direction": int(row.direction),
                    "share": round(row.share, 4),
                    "writes": row.output_top or row.input_top,
                    "pushes_down": row.output_bottom or row.input_bottom,
                    "answers_found": row.answers_found,
                }
            )
    result = {
        "experiment": "directions_real_world",
        "world": args.world,
        "cells": len(cells),
        "cells_by_positions": cells["positions"].value_counts().to_dict(),
        "relations": {prompt: len(batch) for prompt, batch in batches.items()},
        "svd": svd,
        "by_rank": curves,
        "directions": readings,
        "seconds": round(time.perf_counter() - started, 1),
        "peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
