"""Draw every figure the library makes, from toy-world runs, for docs/gallery.md.

Runs ``grafting-lens`` on the toy world, each command as the gallery's captions name it
(``demo``, which is the position experiment, ``run component``, ``run hybrid``, ``run
patching_vs_grafting``, with their defaults: never ``--quick``, whose few relations and layer
ranges the captions do not describe) and copies each report's PNG figures into
``docs/assets/gallery/``; the results page shows the position, component and hybrid figures
too. The figures' subtitles carry their setting (models, semantics, unembedding, prompts,
n), so the gallery's text quotes no number. After the toy world changes:

    python docs/scripts/gallery.py

Needs a Chrome or Chromium for kaleido (``BROWSER_PATH``); builds the toy world on first
use (cached; set ``GRAFTING_LENS_CACHE`` to reuse one).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GALLERY = ROOT / "docs" / "assets" / "gallery"
RUNS = {
    "demo": ["demo"],
    "component": ["component"],
    "hybrid": ["hybrid"],
    "patching_vs_grafting": ["patching_vs_grafting"],
}


def main() -> int:
    GALLERY.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, arguments in RUNS.items():
            out = Path(tmp) / name
            command = [sys.executable, "-m", "grafting_lens.study.cli", "run", *arguments]
            subprocess.run([*command, "--out", str(out), "--no-progress"], check=True, cwd=ROOT)
            pngs = sorted(p for p in out.glob("*.png") if not p.name.startswith("prob_"))
            if not pngs:
                raise SystemExit(
                    f"{name}: no PNG written (is a Chrome installed? see BROWSER_PATH)"
                )
            for png in pngs:
                shutil.copyfile(png, GALLERY / f"{name}-{png.name}")
                print(GALLERY / f"{name}-{png.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
