"""The documentation: every page is reachable, the site builds strictly with every
tutorial executed, and the getting-started code computes what the demo reports."""

from __future__ import annotations

import html as htmllib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from mkdocs.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIALS = sorted((DOCS / "tutorials").glob("*.ipynb"))


def _environment() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_MKDOCS_2_WARNING": "1"}
    env.pop("GRAFTING_LENS_DOCS_EXECUTE", None)  # the tutorials must run
    return env


def _nav_files(nav: list) -> list[str]:
    files = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        files += _nav_files(value) if isinstance(value, list) else [value]
    return files


def test_every_page_and_tutorial_is_in_the_navigation():
    config = load_config(str(ROOT / "mkdocs.yml"))
    listed = set(_nav_files(config["nav"]))
    pages = {
        str(path.relative_to(DOCS))
        for pattern in ("**/*.md", "**/*.ipynb")
        for path in DOCS.glob(pattern)
    }
    assert pages - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - pages == set(), "nav entries without a page"
    assert len(TUTORIALS) == 8
    # The real-model tutorial is a page (its world takes an hour to build, so the docs build
    # cannot execute it); every other tutorial is a notebook the build executes.
    assert sorted(path.name for path in (DOCS / "tutorials").glob("*.md")) == ["07_a_real_model.md"]


@pytest.mark.parametrize("notebook", TUTORIALS, ids=lambda path: path.stem)
def test_tutorials_are_stored_without_outputs(notebook):
    """Outputs come from the build; stored ones could show what the code no longer does."""
    import nbformat

    cells = nbformat.read(notebook, as_version=4).cells
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# ")
    for cell in cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
            # 100 columns fit a code cell's column at 1280 px (docs/stylesheets/extra.css);
            # a longer line wraps back to column 0 and reads as mis-indented.
            long = [line for line in cell.source.splitlines() if len(line) > COLUMNS]
            assert not long, f"{notebook.name}: lines over {COLUMNS} columns: {long}"


def test_the_site_builds_strictly_and_runs_every_tutorial(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-20000:]
    for notebook in TUTORIALS:
        html = (site / "tutorials" / notebook.stem / "index.html").read_text()
        assert "jp-OutputArea" in html, f"{notebook.name} rendered without outputs"
        assert "Traceback" not in html
        # Printed output the prose argues from stays in view: no line wider than the column.
        wide = [line for line in _printed_lines(html) if len(line) > COLUMNS]
        assert not wide, f"{notebook.name}: printed lines over {COLUMNS} columns: {wide}"
    api = (site / "api" / "graft" / "index.html").read_text()
    assert "graft_forward_reference" in api and ":func:" not in api


COLUMNS = 100
"""What a tutorial's code or printed output may be wide: the columns its cell shows at
1280 px in the pages' code font (docs/stylesheets/extra.css; about 106 fit)."""


def _printed_lines(html: str) -> list[str]:
    """The lines of every text output of a rendered notebook page."""
    outputs = re.findall(
        r'<div class="[^"]*jp-OutputArea-output[^"]*"[^>]*>\s*<pre>(.*?)</pre>', html, re.S
    )
    return [
        line
        for text in outputs
        for line in htmllib.unescape(re.sub(r"<[^>]+>", "", text)).splitlines()
    ]


def _first_graft_blocks() -> list[str]:
    """The code blocks of getting-started's first section, which the docs build executes."""
    text = (DOCS / "getting-started.md").read_text()
    section = text.split("## Your first graft", 1)[1].split("\n## ", 1)[0]
    return re.findall(r'```python exec="on"[^\n]*\n(.*?)```', section, re.S)


def test_getting_started_opens_with_a_five_line_graft_and_an_eight_line_figure():
    text = (DOCS / "getting-started.md").read_text()
    assert text.split("\n## ", 2)[1].startswith("Your first graft")  # the page's first section
    graft, figure = (
        [line for line in block.splitlines() if line.strip() and "markdown-exec: hide" not in line]
        for block in _first_graft_blocks()
    )
    assert len(graft) <= 5 and graft[-1].startswith("table = gl.graft(")
    assert len(graft) + len(figure) <= 8 and figure[-1] == "gl.plot_graft(table)"


def test_getting_started_first_graft_computes_the_demos_rows(tmp_path):
    """The page's figure shows the demo's headline rows, each a graft over every fact."""
    code = "\n".join(_first_graft_blocks()) + "\ntable.to_json('figure.json')\n"
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=_environment(),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-5000:]
    figure = pd.read_json(tmp_path / "figure.json").groupby("config", sort=False)["top5"].mean()

    demo = subprocess.run(
        [
            str(Path(sys.executable).parent / "grafting-lens"),
            "demo",
            "--out",
            str(tmp_path / "demo"),
            "--no-progress",
            "--no-png",
        ],
        cwd=tmp_path,
        env=_environment(),
        capture_output=True,
        text=True,
    )
    assert demo.returncode == 0, demo.stderr[-5000:]
    summary = pd.read_csv(tmp_path / "demo" / "summary.csv")
    headline = summary[summary["prompt"] == "headline"].set_index("config")["top5"]
    for config, top5 in figure.items():
        assert top5 == pytest.approx(headline[config]), config
    assert list(figure.index) == ["PRE", "SFT", "FE", "LT", "FE+LT", "(FE+LT)^C"]


def test_the_site_loads_nothing_from_the_network(tmp_path):
    """Every script and stylesheet the pages load is in the site, so that it reads offline."""
    site = tmp_path / "site"
    env = {**_environment(), "GRAFTING_LENS_DOCS_EXECUTE": "false"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    remote = re.compile(r"""<(?:script|link|img)\b[^>]*(?:src|href)=["']?(https?:)?//""", re.I)
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 40
    offending = [str(p.relative_to(site)) for p in pages if remote.search(p.read_text())]
    assert offending == []
    assert (site / "javascripts" / "mathjax" / "tex-svg.js").exists()


def test_an_interval_never_wraps_after_its_comma():
    """A narrow table column would break "[94, 98]" after the comma: the results page joins an
    interval's bounds with a non-breaking space, in its tables and its prose alike."""
    text = (DOCS / "results.md").read_text()
    interval = r"\[[−+-]?[0-9.]+%?,(?P<space>\s|&nbsp;)[−+-]?[0-9.]+%?\]"
    found = list(re.finditer(interval, text))
    assert len(found) > 100
    assert [m.group(0) for m in found if m["space"] != "&nbsp;"] == []


def test_quoted_numbers_sit_between_markers_that_markdown_keeps_inline():
    """docs/scripts/prose_numbers.py rewrites what sits between the markers; a marker that
    starts a line would make Markdown read the line as raw HTML and drop its formatting."""
    pages = [
        ROOT / "README.md",
        DOCS / "getting-started.md",
        DOCS / "results.md",
        DOCS / "concepts" / "grafting-vs-patching.md",
    ]
    markers = [
        line for page in pages for line in page.read_text().splitlines() if "<!-- numbers:" in line
    ]
    assert markers, "no quoted numbers found"
    assert not [line for line in markers if line.lstrip().startswith("<!--")]


def _prose_numbers():
    """docs/scripts/prose_numbers.py, imported (it is a script, not a module of the package)."""
    path = DOCS / "scripts" / "prose_numbers.py"
    spec = importlib.util.spec_from_file_location("prose_numbers", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_every_marked_number_is_what_the_code_computes_today():
    """Every number between ``<!-- numbers:KEY -->`` markers in README, getting-started,
    results and grafting-vs-patching equals what today's runs give (the position, component,
    hybrid and patching experiments, two demos and the checkpoints' evaluation: several
    minutes), and the targets the manifest ships agree with today's runs where they measure
    the same thing (the position and hybrid rates)."""
    numbers = _prose_numbers()
    pages = {path.name: numbers.MARKER.findall(path.read_text()) for path in numbers.FILES}
    assert set(pages) == {
        "README.md",
        "getting-started.md",
        "results.md",
        "grafting-vs-patching.md",
    }
    assert all(pages.values()), f"a page lost its markers: {pages}"
    assert len(pages["results.md"]) >= 100  # every table of the toy world's runs

    sources = numbers.gather()
    assert numbers.stale_markers(sources) == [], "stale: run python docs/scripts/prose_numbers.py"

    runs = {"position": "reference", "hybrid": "hybrid"}
    rates = [t for t in sources.targets if t["experiment"] in runs and t["kind"] == "rate"]
    assert len(rates) == 5  # SFT, PRE, LT and FE top-5; hybrid LT+FE:ATTN top-5
    for target in rates:
        today = sources.runs[runs[target["experiment"]]]["top5"]
        config = target["target"].removeprefix("hybrid ").split()[0]
        for prompt in ("headline", "qa"):
            shipped = target["per_prompt"][prompt]["estimate"]
            assert shipped == pytest.approx(today[(config, prompt)]), (target["target"], prompt)


def test_a_link_to_a_missing_heading_fails_the_build(tmp_path):
    """A page linking to `other.md#no-such-heading` fails `mkdocs build --strict`, as the
    site's own build does (mkdocs.yml: ``validation: anchors: warn`` under ``strict``)."""
    config = load_config(str(ROOT / "mkdocs.yml"))
    assert config["strict"] and config["validation"]["links"]["anchors"] == 30  # logging.WARNING
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#no-such-heading)\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n")
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: anchors\nstrict: true\nvalidation:\n  anchors: warn\n"
    )
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "-d", str(tmp_path / "site")],
        cwd=tmp_path,
        env=_environment(),
        capture_output=True,
        text=True,
    )
    assert built.returncode != 0
    assert "no-such-heading" in built.stderr + built.stdout


def test_the_gallerys_figures_come_from_the_commands_their_captions_name():
    """Each gallery figure's caption names the command that writes it; docs/scripts/gallery.py
    must run exactly that command (never ``--quick``, whose few relations and layer ranges
    the caption does not describe), and the image must fit a page column at scale 2."""
    path = DOCS / "scripts" / "gallery.py"
    spec = importlib.util.spec_from_file_location("gallery", path)
    assert spec and spec.loader
    gallery = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gallery)
    text = (DOCS / "gallery.md").read_text()
    figures = re.findall(
        r"!\[[^\]]*\]\(assets/gallery/([a-z_]+)-([a-z_0-9]+)\.png\)(.*?)"
        r"written by\s+`grafting-lens ([^`]+)`",
        text,
        re.S,
    )
    assert len(figures) >= 5
    for run, name, _, command in figures:
        ran = gallery.RUNS[run]
        assert command == " ".join(ran if run == "demo" else ["run", *ran]), (run, command)
        image = DOCS / "assets" / "gallery" / f"{run}-{name}.png"
        width = int.from_bytes(image.read_bytes()[16:20], "big")  # the PNG header's width
        assert width <= 2 * 960, f"{image.name} is {width} px wide"


def test_the_real_world_tables_give_every_cell_its_interval(tmp_path, capsys):
    """docs/scripts/real_world_tables.py prints the real-model tables of the results page: every
    number of every column with its 95% interval, not only the first run's."""
    path = DOCS / "scripts" / "real_world_tables.py"
    spec = importlib.util.spec_from_file_location("real_world_tables", path)
    assert spec and spec.loader
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    import json

    def run(name: str, semantics: str, configs: list[str]) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "report.json").write_text(
            json.dumps({"description": {"semantics": semantics}})
        )
        rows = [
            dict(config=c, prompt=p, top5=0.25, top5_low=0.125, top5_high=0.375)
            for c in configs
            for p in ("headline", "qa")
        ]
        pd.DataFrame(rows).to_csv(directory / "summary.csv", index=False)
        return directory

    cell = re.compile(r"\d+% \[\d+,&nbsp;\d+\]")
    position = [
        run(f"p{i}", s, list(tables.POSITION)) for i, s in enumerate(("reference", "clean"))
    ]
    grid = ["BASE", "DONOR"] + [
        f"{name}@{key}" for name in tables.COMPONENT_SETS for key in tables.COMPONENT_RANGES
    ]
    component = run("c", "reference", grid)
    for arguments in (["position", *map(str, position)], ["component", str(component)]):
        assert tables.main(arguments) == 0
        rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
        body = [line.strip("|").split("|")[1:] for line in rows[1:]]
        values = [value.strip() for line in body for value in line if value.strip()]
        assert values and all(cell.fullmatch(value) for value in values), values
        assert len(rows[0].split("|")) - 2 == len(body[0]) + 1  # a header for every column
    assert "25% [12,&nbsp;38]" in rows[-1]  # half-even rounding: 12.5 -> 12, 37.5 -> 38


def test_the_targets_across_worlds_table_gives_each_world_its_interval_and_verdict(
    tmp_path, capsys
):
    import json

    path = DOCS / "scripts" / "targets_across_worlds.py"
    spec = importlib.util.spec_from_file_location("targets_across_worlds", path)
    assert spec and spec.loader
    across = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(across)

    def target(name, kind, estimate, low, high, verdict, threshold=">= 0.3"):
        pooled = {"estimate": estimate, "ci95": [low, high], "n": 128}
        return dict(
            target=name, kind=kind, threshold=threshold, pooled=pooled, verdict=verdict, paper="p"
        )

    toy = {"targets": [target("LT top-5", "rate", 0.39, 0.32, 0.46, "met")]}
    gemma = {
        "targets": [
            target("LT top-5", "rate", 0.17, 0.11, 0.24, "not met"),
            target("O+FFN - FFN", "difference", 0.01, -0.02, 0.04, "not met", "<= 0.15"),
        ]
    }
    files = {}
    for name, content in (("toy", toy), ("gemma3", gemma)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(content))
    assert across.main([f"{name}={file}" for name, file in files.items()]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| target | threshold | toy world | Gemma 3 270M | paper |"
    assert (
        lines[2] == "| LT top-5 | ≥ 30% | 39% [32,&nbsp;46], met | 17% [11,&nbsp;24], not met | p |"
    )
    # A target the toy's runs did not measure: an empty cell, not a guess.
    assert (
        lines[3] == "| O+FFN - FFN | ≤ +15&nbsp;pts |  | +1&nbsp;pts [−2,&nbsp;+4], not met | p |"
    )

    # A second seed of the world's sft: its cell and the spread between the two estimates;
    # targets its runs did not measure (the task and relation models') stay empty.
    run = tmp_path / "seed1_position"
    run.mkdir()
    command = "grafting-lens run position --world gemma3 --sft-seed 1 --out x"
    (run / "report.json").write_text(json.dumps({"command": command}))
    seed = {
        "runs": [str(run)],
        "targets": [target("LT top-5", "rate", 0.25, 0.18, 0.32, "undecided")],
    }
    files["seed"] = tmp_path / "seed.json"
    files["seed"].write_text(json.dumps(seed))
    arguments = [
        f"toy={files['toy']}",
        f"gemma3={files['gemma3']}",
        f"--seed=gemma3={files['seed']}",
    ]
    assert across.main(arguments) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "| target | threshold | toy world | Gemma 3 270M | Gemma 3 270M, sft seed 1 "
        "| seed spread | paper |"
    )
    assert lines[2].endswith(
        "| 17% [11,&nbsp;24], not met | 25% [18,&nbsp;32], undecided | 8&nbsp;pts | p |"
    )
    assert lines[3].endswith("| +1&nbsp;pts [−2,&nbsp;+4], not met |  |  | p |")
    with pytest.raises(SystemExit):  # a seed of a world whose own targets are not given
        across.main([f"toy={files['toy']}", f"--seed=gemma3={files['seed']}"])


def test_the_real_world_heatmaps_are_drawn_one_prompt_per_figure(tmp_path, monkeypatch, capsys):
    import json

    from grafting_lens.analysis import figure_style

    path = DOCS / "scripts" / "real_world_tables.py"
    spec = importlib.util.spec_from_file_location("real_world_tables", path)
    assert spec and spec.loader
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    run = tmp_path / "component"
    run.mkdir()
    description = {"semantics": "reference", "options": {"world": "gemma3"}}
    (run / "report.json").write_text(json.dumps({"description": description}))
    pd.DataFrame({"semantics": ["reference"]}).to_csv(run / "results.csv", index=False)
    rows = [
        dict(config=f"{s}@{r}", component_set=s, layer_range=r, prompt=p, n=24, top5=0.25)
        for s in tables.COMPONENT_SETS
        for r in tables.COMPONENT_RANGES
        for p in ("headline", "qa")
    ]
    summary = pd.DataFrame(rows).assign(top5_low=0.125, top5_high=0.375)
    summary.to_csv(run / "summary.csv", index=False)
    drawn = {}

    def save(figure, target, warn=True):
        drawn[Path(target).name] = figure
        return {"html": None, "png": None, "png_error": None}

    monkeypatch.setattr(figure_style, "save_figure", save)
    assert tables.main(["heatmaps", str(run), str(tmp_path)]) == 0
    assert sorted(drawn) == ["component_heatmap_headline", "component_heatmap_qa"]
    figure = drawn["component_heatmap_qa"]
    assert "gemma3 world" in figure.layout.title.subtitle.text
    assert figure.data[0].text[0][0] == "25%<br>[12%, 38%]"  # the cell and its interval


def test_the_minimal_graft_cells_table_counts_each_cell_once_by_quarter(
    tmp_path, capsys, monkeypatch
):
    import json

    monkeypatch.syspath_prepend(str(DOCS / "scripts"))  # as when run: it imports a sibling
    path = DOCS / "scripts" / "minimal_graft_cells.py"
    spec = importlib.util.spec_from_file_location("minimal_graft_cells", path)
    assert spec and spec.loader
    cells_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cells_script)
    rows = [
        ("mlp_out", 0, "FE"),
        ("mlp_in", 4, "FE"),  # 10 layers: quarters 0-1, 2-3, 4-5, 6-9
        ("q", 9, "LT"),
        ("o", 6, "LT"),
        ("unembed", None, "LT"),
        ("ln2_post", 3, "FE"),  # a layer's norm, whichever
    ]
    cells = pd.DataFrame(rows, columns=["component", "layer", "positions"])
    cells.insert(0, "cell", [f"{c}[{l}]@{p}" for c, l, p in rows])
    cells.insert(0, "order", range(1, len(rows) + 1))
    cells.to_csv(tmp_path / "cells.csv", index=False)
    measured = dict(
        layers=10,
        recovery=0.81,
        held_out_recovery=0.62,
        relations={"headline": 64},
        cells_file=str(tmp_path / "cells.csv"),
    )
    (tmp_path / "m.json").write_text(json.dumps(measured))
    assert cells_script.main([f"smollm2={tmp_path / 'm.json'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("SmolLM2-135M: 6 cells recover 0.81")
    assert (
        lines[2]
        == "| positions | component | layers 0-1 | layers 2-3 | layers 4-5 | layers 6-9 | all |"
    )
    assert "| FE | MLP (in, gate, out) | 1 |  | 1 |  | 2 |" in lines
    assert "| LT | attention (q, k, v) |  |  |  | 1 | 1 |" in lines
    assert "| LT | attention output (O) |  |  |  | 1 | 1 |" in lines
    assert "| LT | unembedding |  |  |  |  | 1 |" in lines
    assert "| FE | norms |  | 1 |  |  | 1 |" in lines
    measured["cells_file"] = None
    (tmp_path / "m.json").write_text(json.dumps(measured))
    with pytest.raises(SystemExit):  # no cells to show: said, not guessed
        cells_script.main([f"smollm2={tmp_path / 'm.json'}"])
