"""Reversal (paper figure 4's caption, appendix C.6): which components carry the reversed fact?

A model finetuned on one direction of each relation ("A starred in M alongside B")
generally cannot answer the reversed question ("B starred in a movie alongside ?"): the
reversal curse. Grafting components of a model finetuned on *both* directions into the
one-direction model, at the last token, shows which of them carry the reversed fact. The
same component sets and layer ranges as ``component_grafting.py``, asked the reversed
(B2A) headline and QA prompts about every relation.

Writes the same files as ``component_grafting.py`` into ``--out``.

Run:
    python experiments/reversal_grafting.py --out results/reversal
    python experiments/reversal_grafting.py --out results/reversal --quick
    python experiments/reversal_grafting.py --out results/llama_reversal \\
        --model one_direction_dir --donor both_directions_dir --device cuda
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from component_grafting import main as component_main  # noqa: E402 (a sibling script)


def main(argv: list[str] | None = None) -> int:
    return component_main(argv, setting="reversal", script="reversal_grafting.py")


if __name__ == "__main__":
    sys.exit(main())
