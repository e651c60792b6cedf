"""What the library prints: progress bars only when watched, quiet loading, the notebook
set-up, and an import that loads nothing heavy."""

from __future__ import annotations

import importlib
import io
import subprocess
import sys
import warnings

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import pytest
import torch
from conftest import random_model, random_tokens
from transformers.utils import logging as transformers_logging

import grafting_lens as gl
from grafting_lens.core import console
from grafting_lens.core.console import PLOTLY_RENDERER, show_progress


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(("tty", "expected"), [(True, True), (False, False)])
def test_progress_follows_the_terminal_unless_told(monkeypatch, tty, expected):
    monkeypatch.setattr(sys, "stderr", _Stream(tty))
    assert show_progress(None) is expected
    assert show_progress(True) is True
    assert show_progress(False) is False


def test_progress_refuses_what_is_not_a_switch():
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        show_progress("yes")  # type: ignore[arg-type]


def test_a_sweep_draws_no_bar_into_a_log(monkeypatch, three_models):
    """A redirected stderr gets no bar by default, and one when asked for."""
    tokens = random_tokens(2, 4)
    for progress, drawn in ((None, False), (True, True)):
        log = _Stream(tty=False)
        monkeypatch.setattr(sys, "stderr", log)
        gl.resid_patch_sweep(
            three_models, tokens, lambda logits: logits[:, -1, 0], chunk_size=2, progress=progress
        )
        assert ("sweep" in log.getvalue()) is drawn


def test_load_models_prints_no_loading_bars_and_restores_the_setting(tmp_path, tokenizer, capfd):
    for name, seed in (("base", 0), ("donor", 1)):
        random_model("llama", seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    transformers_logging.enable_progress_bar()
    capfd.readouterr()
    gl.load_models(tmp_path / "base", tmp_path / "donor")
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err + captured.out
    assert transformers_logging.is_progress_bar_enabled()  # as it was before


def test_quiet_loading_restores_what_was_set():
    transformers_logging.disable_progress_bar()
    before = transformers_logging.get_verbosity()
    with gl.core.console.quiet_loading():
        assert not transformers_logging.is_progress_bar_enabled()
    assert not transformers_logging.is_progress_bar_enabled()
    assert transformers_logging.get_verbosity() == before
    transformers_logging.enable_progress_bar()


@pytest.fixture
def restored_session():
    """Undo what gl.notebook() sets, so that later tests see the defaults."""
    threads, grad, renderer = (
        torch.get_num_threads(),
        torch.is_grad_enabled(),
        pio.renderers.default,
    )
    bars, verbosity = (
        transformers_logging.is_progress_bar_enabled(),
        transformers_logging.get_verbosity(),
    )
    colwidth, width = pd.get_option("display.max_colwidth"), pd.get_option("display.width")
    with warnings.catch_warnings():
        yield
    pd.set_option("display.max_colwidth", colwidth)
    pd.set_option("display.width", width)
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    pio.renderers.default = renderer
    transformers_logging.set_verbosity(verbosity)
    if bars:
        transformers_logging.enable_progress_bar()


def test_notebook_sets_a_session_up_in_one_line(restored_session):
    torch.set_grad_enabled(True)
    gl.notebook(threads=1)
    assert torch.get_num_threads() == 1
    assert not torch.is_grad_enabled()
    assert pd.get_option("display.max_colwidth") == 120
    assert pd.get_option("display.width") == 100
    assert not transformers_logging.is_progress_bar_enabled()
    assert pio.renderers.default == f"plotly_mimetype+{PLOTLY_RENDERER}"
    html = pio.renderers[PLOTLY_RENDERER].to_mimebundle(go.Figure(go.Bar(y=[1, 2])).to_dict())
    # The figure draws with the plotly.js the notebook embeds once; nothing from a CDN.
    assert "Plotly.newPlot" in html["text/html"]
    assert "https://" not in html["text/html"]


def test_notebook_refuses_a_bad_thread_count(restored_session):
    with pytest.raises(gl.GraftingLensError, match="threads must be a positive int"):
        gl.notebook(threads=0)
    cores = console.available_cores()
    with pytest.raises(gl.GraftingLensError, match=f"threads must be between 1 and {cores} "):
        gl.notebook(threads=cores + 1)
    with pytest.raises(gl.GraftingLensError, match=f"threads must be between 1 and {cores} "):
        gl.worlds.toy.build_toy_world(threads=4096 + cores)
    gl.notebook(threads=cores)
    assert torch.get_num_threads() == cores


def _heavy_modules_after(code: str) -> str:
    """Which heavy libraries a fresh interpreter has imported after running ``code``."""
    heavy = ("torch", "transformers", "transformer_lens", "pandas", "plotly")
    code += f"\nimport sys\nprint(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_import_loads_nothing_heavy_and_every_name_resolves():
    assert _heavy_modules_after("import grafting_lens as gl") == "[]"
    for name in gl.__all__:
        assert getattr(gl, name) is not None
    assert set(gl.__all__) <= set(dir(gl))
    with pytest.raises(AttributeError, match="no attribute 'load_model'"):
        gl.load_model  # noqa: B018


def test_the_study_and_the_command_lines_help_load_nothing_heavy():
    # `grafting-lens --help` answers in well under a second because nothing heavy loads.
    code = (
        "import contextlib, io\n"
        "from grafting_lens import study\n"
        "from grafting_lens.study import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['--help'])"
    )
    assert _heavy_modules_after(code) == "[]"
    from grafting_lens import study

    for name in study.__all__:
        assert getattr(study, name) is getattr(
            importlib.import_module(f"grafting_lens.study.{study._EXPORTS[name]}"), name
        )
    assert sorted(study._EXPORTS, key=str.lower) == study.__all__
    with pytest.raises(AttributeError, match="no attribute 'select_positions'"):
        study.select_positions  # noqa: B018  (it lives in grafting_lens.engine.positions)
