"""What the library prints: progress bars, the loading bars of transformers, notebook set-up.

A progress bar helps a person watching and spams a log file, so ``progress=None``, the default,
means *when someone is watching* (:func:`show_progress`). :func:`quiet_loading` holds back
transformers' loading bars, and :func:`notebook` is the one line a notebook starts with.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

from grafting_lens.core.errors import ArgumentTypeError, GraftingLensError

__all__ = [
    "PLOTLY_RENDERER",
    "notebook",
    "progress_line",
    "quiet_loading",
    "say_line",
    "show_progress",
]

PLOTLY_RENDERER = "grafting_lens"
"""The plotly renderer :func:`notebook` registers: plotly.js embedded once, no CDN."""


def in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel (where tqdm draws a widget, not lines)."""
    shell = sys.modules.get("IPython")
    ipython = None if shell is None else shell.get_ipython()
    return type(ipython).__name__ == "ZMQInteractiveShell"


def show_progress(progress: bool | None) -> bool:
    """Whether to draw a progress bar: ``progress`` if a bool, else whether someone watches
    (standard error is a terminal, or the code runs in Jupyter).

    Raises:
        TypeError: ``progress`` is neither a bool nor None.
    """
    if progress is not None and not isinstance(progress, bool):
        raise ArgumentTypeError(f"progress must be True, False or None, got {progress!r}.")
    if progress is not None:
        return progress
    try:
        interactive = sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        interactive = False
    return interactive or in_notebook()


def say_line(what: str, text: str) -> None:
    """One progress line on standard error: ``[HH:MM:SS] what: text`` (a log file's form)."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}: {text}", file=sys.stderr, flush=True)


def progress_line(progress: bool | None, what: str, text: str) -> None:
    """:func:`say_line` where ``progress`` is None and nobody watches (a log file, where a
    bar would print a line per redraw); nothing otherwise."""
    if progress is None and not show_progress(None):
        say_line(what, text)


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Silence transformers' loading bars and info messages inside the block, then restore them
    (:func:`~grafting_lens.load_models` reads the report of weights a checkpoint lacks itself)."""
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity(max(verbosity, transformers_logging.WARNING))
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system has one): the
    bound on any thread count grafting-lens sets."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on macOS and Windows
        return max(1, os.cpu_count() or 1)


def threads_beyond_cores(threads: int, name: str = "threads") -> str | None:
    """Why ``threads`` is too many for this machine, or None when it is not."""
    cores = available_cores()
    if threads <= cores:
        return None
    return (
        f"{name} must be between 1 and {cores} (the CPU cores this process may use), got "
        f"{threads}: more threads than cores only slow torch down, and thousands of them "
        "make the machine unusable."
    )


def notebook(threads: int | None = 1, grad: bool = False, renderer: str | None = None) -> None:
    """Set a notebook up for grafting-lens in one line: ``gl.notebook()``.

    Turns transformers' loading bars off, quiets tqdm's missing-widgets warning, makes plotly
    figures render in Jupyter and offline pages, lets pandas print cells of 120 characters
    (tables wrap at 100 columns), and sets torch's threads and autograd.

    Args:
        threads: torch CPU threads (1 suits tiny models; ``None`` keeps torch's default).
        grad: Keep autograd on (off by default: grafting runs forward passes).
        renderer: A plotly renderer instead of Jupyter's own format plus offline HTML.

    Raises:
        GraftingLensError: ``threads`` is not a positive int, or more than this process's cores.
    """
    from tqdm import TqdmWarning

    from grafting_lens.core.arguments import is_integer

    if threads is not None and (not is_integer(threads) or threads < 1):
        too_many: str | None = f"threads must be a positive int or None, got {threads!r}."
    else:
        too_many = None if threads is None else threads_beyond_cores(threads)
    typed = isinstance(grad, bool) and isinstance(renderer, (str, type(None)))
    if too_many or not typed:
        typed = typed and (threads is None or is_integer(threads))
        raise (GraftingLensError if typed else ArgumentTypeError)(
            too_many
            or f"grad={grad!r} (True or False), renderer={renderer!r} (a plotly "
            "renderer's name or None): of another type."
        )
    # Before transformers is imported: it imports tqdm.auto, which warns on import.
    warnings.filterwarnings("ignore", category=TqdmWarning)
    import pandas as pd
    import plotly.io as pio
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    if threads is not None:
        torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    if PLOTLY_RENDERER not in pio.renderers:
        pio.renderers[PLOTLY_RENDERER] = _offline_renderer()
    pio.renderers.default = renderer or f"plotly_mimetype+{PLOTLY_RENDERER}"
    # Tables of configurations and prompts have long cells; pandas cuts them at 50 characters.
    pd.set_option("display.max_colwidth", 120)
    # A printed table wraps at 100 columns, what a page's code column shows without scrolling.
    pd.set_option("display.width", 100)


def _offline_renderer() -> Any:
    """plotly's notebook renderer without its CDN MathJax: plotly.js embedded once per notebook."""
    from plotly.io import to_html
    from plotly.io._base_renderers import NotebookRenderer

    class OfflineNotebookRenderer(NotebookRenderer):
        def to_mimebundle(self, fig_dict: Any) -> dict[str, str]:
            html = to_html(
                fig_dict,
                include_plotlyjs=False,  # the activation embedded it once
                include_mathjax=False,  # plotly's default fetches MathJax 2 from a CDN
                full_html=False,
                default_width="100%",
                default_height=525,
                validate=False,
            )
            return {"text/html": html}

    return OfflineNotebookRenderer(connected=False)
