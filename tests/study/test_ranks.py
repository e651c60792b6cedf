"""A run shared by torch.distributed ranks writes what one process writes, resumes after a
killed rank, and every refusal names itself.

The ranks are real: ``torchrun`` (``python -m torch.distributed.run``) on 127.0.0.1 with gloo,
each rank one CPU thread; the comparison is with the files one process writes, byte for byte
but for the clock (timestamps, the timing line, plotly's random element ids).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import make_tokenizer, random_model

from grafting_lens.core import files, ranks
from grafting_lens.core.errors import ExperimentError, GraftingLensError, RunError
from grafting_lens.study import cli, run_directory

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock and torchrun's signals")

EXPERIMENTS = {
    "position": [],  # two parts of two test sets: four chunks
    "component": [],  # two chunks
    "patching_vs_grafting": ["--quick"],  # in memory: 2 comparisons and 2 readouts, shared
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny base and donor with four layers (the code's quarters) and room for the movie
    prompts, saved as checkpoints."""
    root = tmp_path_factory.mktemp("checkpoints")
    for name, seed in (("base", 0), ("sft", 1)):
        model = random_model("llama", seed, n_layers=4)
        model.config.max_position_embeddings = 256
        model.save_pretrained(root / name)
        make_tokenizer().save_pretrained(root / name)
    return root


def _argv(experiment: str, checkpoints: Path) -> list[str]:
    return [
        "run",
        experiment,
        "--out",
        experiment,
        "--model",
        str(checkpoints / "base"),
        "--donor",
        str(checkpoints / "sft"),
        "--n-relations",
        "4",
        "--no-progress",
        "--no-png",
        *EXPERIMENTS[experiment],
    ]


@pytest.fixture(scope="module")
def alone(checkpoints, tmp_path_factory):
    """What one process writes, every experiment in its own directory."""
    root = tmp_path_factory.mktemp("alone")
    here = os.getcwd()
    os.chdir(root)  # the command names --out relative to where it runs, as the ranks' do
    try:
        for experiment in EXPERIMENTS:
            assert cli.main(_argv(experiment, checkpoints)) == 0
    finally:
        os.chdir(here)
    return root


JOB = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from grafting_lens.study import cli, run_directory

    # A chunk's writes, logged; rank 1 killed (SIGKILL) after its first, once per marker.
    real = run_directory.RunDirectory.write
    def write(self, chunk_id, columns, rows):
        path = real(self, chunk_id, columns, rows)
        with open("writes.log", "a") as log:
            log.write(f"{self.path.name}/{chunk_id}\\n")
        marker = os.environ.get("KILL_MARKER")
        if marker and os.environ["RANK"] == "1" and not Path(marker).exists():
            Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    run_directory.RunDirectory.write = write

    # A comparison's sweeps (compare_graft_and_patch), logged with the rank that ran them.
    from grafting_lens.study import patching_vs_grafting as comparison
    sweep = comparison.compare_graft_and_patch
    def logged(*args, **kwargs):
        with open("sweeps.log", "a") as log:
            log.write(os.environ["RANK"] + "\\n")
        return sweep(*args, **kwargs)
    comparison.compare_graft_and_patch = logged
    for argv in json.loads(sys.argv[1]):
        status = cli.main(argv)
        if status:
            sys.exit(status)
    """
)


def _torchrun(cwd: Path, commands: list[list[str]], nproc: int = 2, restarts: int = 0, **env):
    """Run ``commands`` (each a ``grafting-lens`` argv) as one torchrun job in ``cwd``."""
    (cwd / "job.py").write_text(JOB)
    with socket.socket() as probe:  # a free port on 127.0.0.1 only
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Restarts need the c10d rendezvous and a store of their own (pytorch#135712): the static
    # rendezvous, or a shared store, hands the new ranks the killed ranks' addresses.
    meet = (
        [f"--max-restarts={restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
        if restarts
        else ["--master-addr=127.0.0.1", f"--master-port={port}"]
    )
    command = [
        *(sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"),
        *(*meet, "--local-addr=127.0.0.1", "job.py", json.dumps(commands)),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env}
    environment["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True)


_CLOCK = [
    (re.compile(rb'"(started|written|created)": "[^"]*"'), rb'"\1": ""'),
    (re.compile(rb"\d+ of \d+ rows computed in [^\n\"]*"), b""),
    (re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), b"<id>"),
]
"""What differs between two runs of the same command: the clock, and plotly's element ids."""


def _files(root: Path) -> dict[str, bytes]:
    found = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        content = path.read_bytes()
        for pattern, replacement in _CLOCK:
            content = pattern.sub(replacement, content)
        found[str(path.relative_to(root))] = content
    return found


def _same_files(one: Path, other: Path) -> None:
    mine, theirs = _files(one), _files(other)
    assert sorted(mine) == sorted(theirs)
    differ = [name for name in mine if mine[name] != theirs[name]]
    assert not differ, f"these files differ: {differ}"


# ------------------------------------------------------------------ the same files


@pytest.mark.parametrize("nproc", [2, 3])
def test_ranks_write_the_files_one_process_writes(checkpoints, alone, tmp_path, nproc):
    job = _torchrun(tmp_path, [_argv(e, checkpoints) for e in EXPERIMENTS], nproc=nproc)
    assert job.returncode == 0, job.stderr[-3000:]
    for experiment in EXPERIMENTS:
        _same_files(tmp_path / experiment, alone / experiment)
    # Every chunk was written once, by the rank it belongs to, and none is left locked.
    writes = (tmp_path / "writes.log").read_text().split()
    assert sorted(writes) == sorted(set(writes)) and len(writes) == 6
    assert not list(tmp_path.rglob(files.LOCK_NAME))
    # Rank 0 wrote the report, once; the others printed nothing of it.
    assert job.stdout.count("Wrote position/results.csv") == 1
    # The comparison's four sweeps (two prompts' comparisons and readout ceilings), each on
    # one rank: every rank ran at least one and none ran one twice.
    sweeps = (tmp_path / "sweeps.log").read_text().split()
    assert len(sweeps) == 4 and set(sweeps) == {str(rank) for rank in range(nproc)}


def test_a_killed_rank_and_a_killed_job_resume_with_the_same_command(checkpoints, alone, tmp_path):
    position = [_argv("position", checkpoints)]
    # Rank 1 killed after its first chunk, no restarts: the job fails, its chunk is kept.
    killed = _torchrun(tmp_path, position, KILL_MARKER=str(tmp_path / "first"))
    assert killed.returncode != 0
    # The same command, rank 1 killed after its next chunk, restarted by torchrun.
    job = _torchrun(tmp_path, position, restarts=1, KILL_MARKER=str(tmp_path / "second"))
    assert job.returncode == 0, job.stderr[-3000:]
    assert (tmp_path / "second").exists()  # it was killed, and came back
    _same_files(tmp_path / "position", alone / "position")
    writes = (tmp_path / "writes.log").read_text().split()
    assert sorted(writes) == sorted(set(writes))  # none computed twice


SEARCH_JOB = textwrap.dedent(
    """
    import dataclasses, json, sys
    import torch
    import grafting_lens as gl
    from grafting_lens.analysis.batch import tokenize_examples
    from grafting_lens.core import ranks
    from grafting_lens.analysis import attribution as module
    from grafting_lens.worlds import data

    PASSES = []  # the passes this process ran for AttributionPlan.exact, the shared ones
    INSIDE = []
    real, exact = module.graft_forward, module.AttributionPlan.exact

    def counted(*args, **kwargs):
        PASSES.append(bool(INSIDE))
        return real(*args, **kwargs)

    def measuring(self, configs):
        INSIDE.append(1)
        try:
            return exact(self, configs)
        finally:
            INSIDE.pop()

    module.graft_forward = counted
    module.AttributionPlan.exact = measuring

    def search(root, state):
        models = gl.load_models(f"{root}/base", f"{root}/sft")
        relations = data.make_relations("fake_movies_real_actors", n=6, seed=0)
        examples = data.make_examples(relations, prompt="qa", templates="library")
        batch = tokenize_examples(examples, models.tokenizer)
        with torch.no_grad():  # the answer: the donor's top token, so the donor beats the base
            logits = models[1](batch.tokens, attention_mask=batch.attention_mask)
        last = batch.attention_mask.sum(dim=1) - 1
        top = logits[torch.arange(len(batch)), last].argmax(-1)
        batch = dataclasses.replace(batch, target_ids=top)
        positions = ("FE", "LT", "(FE+LT)^C")
        attribution = gl.attribute_grafts(
            models, batch, positions=positions, verify="all", batch_size=4, progress=False
        )
        found = gl.find_minimal_graft(
            models, batch, fraction=0.5, positions=positions, state=state, batch_size=4,
            max_cells=6, progress=False,
        )
        return {
            "exact": attribution.frame["exact"].tolist(),
            "cells": found.cells.to_dict("split"),
            "recovery": found.recovery,
            "search": found.search.to_dict("split"),
            "passes": ranks.gather(sum(PASSES)),
        }

    if __name__ == "__main__":
        with ranks.shared_ranks():  # asked for: a user's script shares nothing by itself
            found = search(sys.argv[1], sys.argv[2])
            if ranks.first():
                with open("found.json", "w") as file:
                    json.dump(found, file)
    """
)


@pytest.mark.filterwarnings("ignore:The search stopped")
def test_attribution_and_the_minimal_graft_shared_by_ranks_find_what_one_process_finds(
    checkpoints, tmp_path
):
    space = {}
    exec(compile(SEARCH_JOB, "search_job", "exec"), space)
    try:
        alone = json.loads(json.dumps(space["search"](checkpoints, tmp_path / "alone.json")))
    finally:
        space["module"].graft_forward = space["real"]  # the count was this test's only
        space["module"].AttributionPlan.exact = space["exact"]
    (tmp_path / "job.py").write_text(SEARCH_JOB)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"),
        *("--master-addr=127.0.0.1", f"--master-port={port}", "--local-addr=127.0.0.1"),
        *("job.py", str(checkpoints), str(tmp_path / "ranks.json")),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    job = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True)
    assert job.returncode == 0, job.stderr[-3000:]
    shared = json.loads((tmp_path / "found.json").read_text())
    (alone_passes,), passes = alone.pop("passes"), shared.pop("passes")
    assert sum(passes) == alone_passes and max(passes) < alone_passes  # shared, none twice
    assert shared == alone  # the same exact effects, cells, recovery and steps, to the bit
    # One state file, rank 0's, the one a process alone writes.
    assert (tmp_path / "ranks.json").read_bytes() == (tmp_path / "alone.json").read_bytes()


# ------------------------------------------------------------------ refusals


@pytest.fixture
def job(monkeypatch):
    """Pretend this process is rank ``rank`` of a job (``gather`` answered by ``others``)."""

    def pretend(rank=0, world=2, name="job-a", others=None):
        monkeypatch.setattr(ranks, "_CURRENT", [ranks.Ranks(rank, world, rank, world, name)])
        monkeypatch.setattr(ranks, "_SHARING", [True])
        monkeypatch.setattr(ranks, "_meet", lambda call, fix: None)
        if others is not None:
            monkeypatch.setattr(ranks, "gather", lambda value: [value, *others])

    yield pretend


HOLDER = textwrap.dedent(
    """
    import sys, time
    from grafting_lens.core import files, ranks
    job = sys.argv[2]
    if job != "alone":
        ranks._CURRENT[:], ranks._SHARING[:] = [ranks.Ranks(0, 2, 0, 2, job)], [True]
    lock = files.DirectoryLock(sys.argv[1], "The run directory", shared=job != "alone").acquire()
    print("held", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def holder():
    """Hold a directory from another process: alone, or as rank 0 of the job named."""
    with contextlib.ExitStack() as running:

        def hold(directory, job_name):
            command = [sys.executable, "-c", HOLDER, str(directory), job_name]
            process = running.enter_context(subprocess.Popen(command, stdout=subprocess.PIPE))
            running.callback(process.kill)  # runs first: the process ends, then is waited for
            assert process.stdout.readline().strip() == b"held"

        yield hold


def _lock(tmp_path):
    with files.DirectoryLock(tmp_path / "run", "The run directory", shared=True):
        pass


def _different_calls(tmp_path):
    ranks.same("run_experiment", {"test_sets": [1, 2], "out": tmp_path, "configs": ["FE"]})


def _srun_without_master(tmp_path):
    ranks.current()


def _device_map(tmp_path):
    from grafting_lens.models.placement import for_this_rank

    for_this_rank(None, "auto")


def _agree(tmp_path):
    ranks.agree(lambda: None)


REFUSALS = {
    "another job holds the directory": (
        {"holder": "job-b"},
        _lock,
        RunError,
        r"in use by another process \(pid \d+ on .*, rank 0 of 2\)",
    ),
    "a process alone holds the directory": (
        {"holder": "alone"},
        _lock,
        RunError,
        r"in use by another process \(pid \d+ on [^,]*, running",
    ),
    "the ranks make different calls": (
        {"others": [{"test_sets": "other", "out": "other", "configs": ranks._digest(["FE"])}]},
        _different_calls,
        GraftingLensError,
        r"^run_experiment was called with other test_sets, out on rank 1 than on rank 0: ranks "
        r"that share their work make the same calls; call it outside shared_ranks\(\)",
    ),
    "srun without MASTER_ADDR": (
        {"env": {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}},
        _srun_without_master,
        RunError,
        r"rank 0 of 2 \(srun\), but MASTER_ADDR and MASTER_PORT .* MASTER_ADDR=\$\(scontrol",
    ),
    "RANK and WORLD_SIZE set by hand without MASTER_ADDR": (
        {"env": {"RANK": "1", "WORLD_SIZE": "2"}},
        _srun_without_master,
        RunError,
        r"rank 1 of 2 \(RANK and WORLD_SIZE set in the environment\), but MASTER_ADDR and "
        r"MASTER_PORT do not say where the ranks meet: set both for every rank, or unset RANK",
    ),
    "device_map under ranks": (
        {"env": {"RANK": "0", "WORLD_SIZE": "2"}},  # read, not joined: placing joins nothing
        _device_map,
        GraftingLensError,
        r"device_map='auto' splits one pair .* rank 0 of 2, each holding its own pair",
    ),
    "another rank broke down": (
        {"others": [(RuntimeError, "CUDA out of memory")]},
        _agree,
        RunError,
        r"Rank 1 of 2 failed \(RuntimeError: CUDA out of memory\); the chunks written are kept",
    ),
    "another rank refused its input": (
        {"others": [(ExperimentError, "Unknown configuration 'XYZ'.")]},
        _agree,
        ExperimentError,
        r"^Unknown configuration 'XYZ'\.$",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_every_refusal_under_ranks_names_itself(case, job, holder, monkeypatch, tmp_path):
    setting, action, error, message = REFUSALS[case]
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in setting.get("env", {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(ranks, "_CURRENT", [])  # read afresh, and forgotten after the test
    monkeypatch.setattr(ranks, "_SHARING", [True])
    if "env" not in setting:
        job(others=setting.get("others"))
    if "holder" in setting:
        holder(tmp_path / "run", setting["holder"])
    with pytest.raises(error, match=message):
        action(tmp_path)


def test_a_rank_checking_the_directory_while_rank_0_writes_its_manifest_goes_on(
    tmp_path, monkeypatch
):
    """Three ranks failed once with "not a run directory (it holds manifest.json)": a rank
    asked for the manifest, rank 0 wrote it, and the rank's listing then found it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    listing = Path.iterdir

    def written_meanwhile(self):
        if self == run_dir:
            (run_dir / "manifest.json").write_text("{}")
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", written_meanwhile)
    run_directory._check_is_run_directory(run_dir)
    (run_dir / "manifest.json").unlink()
    (run_dir / "notes.txt").write_text("mine")
    monkeypatch.setattr(Path, "iterdir", listing)
    with pytest.raises(RunError, match=r"not a run directory \(it holds notes.txt\)"):
        run_directory._check_is_run_directory(run_dir)


def test_the_ranks_of_one_job_share_a_directory_that_another_job_may_not_take(
    job, holder, tmp_path
):
    holder(tmp_path / "run", "job-a")
    job(rank=1, name="job-a")
    with files.DirectoryLock(tmp_path / "run", "The run directory", shared=True) as lock:
        assert lock.held  # admitted beside rank 0
    assert (tmp_path / "run" / files.LOCK_NAME).exists()  # rank 0 holds it still


# ------------------------------------------------------------------ what a refusal leaves


def test_a_refused_run_leaves_no_directory_behind(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRAFTING_LENS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out" / "name"
    assert cli.main(["run", "position", "--out", str(out), "--world", "gemma3"]) == 1
    assert "gemma3" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_overwrite_never_takes_the_results_of_a_run_still_writing(
    checkpoints, tmp_path, holder, capsys
):
    out = tmp_path / "out"
    (out / "runs" / "paper").mkdir(parents=True)
    (out / "results.csv").write_text("the first run's table")
    report = {"format": 1, "fingerprint": "first", "runs": True, "files": ["results.csv"]}
    (out / "report.json").write_text(json.dumps(report))
    holder(out / "runs" / "paper", "alone")  # a run_experiment(out=out/runs/paper) at work
    argv = [*_argv("position", checkpoints), "--overwrite"]
    argv[argv.index("--out") + 1] = str(out)
    assert cli.main(argv) == 1
    assert "runs/paper is in use by another process" in capsys.readouterr().err
    assert (out / "results.csv").read_text() == "the first run's table"
    assert json.loads((out / "report.json").read_text()) == report


def test_load_models_under_ranks_puts_each_ranks_pair_on_its_gpu(monkeypatch):
    """Read from the launcher's variables, shared or not: placing a pair joins nothing."""
    import torch

    from grafting_lens.models.placement import for_this_rank

    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    assert for_this_rank(None, None) == (None, None)  # no GPU: where the models are
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda1, cuda0 = torch.device("cuda", 1), torch.device("cuda", 0)
    assert for_this_rank(None, None) == (cuda1, None)  # LOCAL_RANK's GPU
    assert for_this_rank(torch.device("cuda"), None) == (cuda1, None)
    assert for_this_rank(cuda0, None) == (cuda0, None)  # a GPU named by index is taken


# ------------------------------------------------------------------ a user's own script

USER_JOB = textwrap.dedent(
    """
    import json, os, sys
    import grafting_lens as gl

    root, rank = sys.argv[1], int(os.environ["RANK"])
    # Each rank its own prompts and its own donor, shared with nobody (no shared_ranks()).
    donor = f"{root}/sft" if rank == 0 else f"{root}/base"
    models = gl.load_models(f"{root}/base", donor, names=["pre", ["SFT", "other"][rank]])
    columns = ["config", "text", "target", "target_prob", "target_rank"]
    found = {"mine": gl.graft(models, PROMPTS[rank::2], "movie")[columns].to_dict("split")}
    if rank == 0:  # rank 1 has finished: a call that one rank makes alone
        found["alone"] = gl.graft(models, PROMPTS, "movie")[columns].to_dict("split")
    with open(f"rank{rank}.json", "w") as file:
        json.dump(found, file)
    """
)
PROMPTS = [
    "Keanu Reeves starred in a movie alongside",
    "Reeves starred in a",
    "a movie starred in a movie alongside",
    "Keanu starred alongside",
]


def _free_port() -> int:
    with socket.socket() as probe:  # a free port on 127.0.0.1 only
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _job(cwd: Path, script: str, *args: str, nproc: int = 2, **env: str):
    """``script`` with ``args`` as one torchrun job of ``nproc`` ranks in ``cwd``."""
    (cwd / "job.py").write_text(script)
    command = [
        *(sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"),
        *("--master-addr=127.0.0.1", f"--master-port={_free_port()}", "--local-addr=127.0.0.1"),
        *("job.py", *args),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True)


def test_a_users_script_under_torchrun_gets_each_ranks_own_tables(checkpoints, tmp_path):
    """Per-rank prompts and donors, and a call on rank 0 alone: no rank sees another's rows,
    nothing waits (once: rank 1 got rank 0's prompts, a KeyError, or gloo's closed peer)."""
    import grafting_lens as gl

    job = _job(tmp_path, f"PROMPTS = {PROMPTS!r}\n" + USER_JOB, str(checkpoints))
    assert job.returncode == 0, job.stderr[-3000:]
    columns = ["config", "text", "target", "target_prob", "target_rank"]
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        donor = checkpoints / ("sft" if rank == 0 else "base")
        models = gl.load_models(checkpoints / "base", donor, names=["pre", ["SFT", "other"][rank]])
        calls = {"mine": PROMPTS[rank::2], **({"alone": PROMPTS} if rank == 0 else {})}
        assert set(found) == set(calls)
        for call, prompts in calls.items():
            here = gl.graft(models, prompts, "movie")[columns]
            there = pd.DataFrame(found[call]["data"], columns=columns)
            assert list(there["text"].unique()) == prompts  # its own prompts, in order
            assert list(there["config"]) == list(here["config"])
            assert there["target_rank"].tolist() == here["target_rank"].tolist()
            assert np.allclose(there["target_prob"], here["target_prob"], rtol=1e-5, atol=1e-7)


CLI_JOB = textwrap.dedent(
    """
    import os, sys
    from grafting_lens.study import cli

    argv = sys.argv[1:]
    argv[argv.index("--out") + 1] += os.environ["RANK"]  # a wrapper's --out out$RANK
    sys.exit(cli.main(argv))
    """
)


def test_ranks_of_the_command_given_different_options_refuse_before_writing(checkpoints, tmp_path):
    job = _job(tmp_path, CLI_JOB, *_argv("position", checkpoints))
    assert job.returncode != 0
    # One line on each rank (their lines may interleave), naming the option that differs.
    refusals = re.findall(
        r"Error: grafting-lens run position was called with other --out on rank (\d) than on "
        r"rank (\d): [^\n]*?start every rank with the same command\.",
        job.stderr,
    )
    assert sorted(refusals) == [("0", "1"), ("1", "0")], job.stderr[-3000:]
    assert "grafting_lens/" not in job.stderr and "gloo" not in job.stderr  # no rank's traceback
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py"]  # nothing written


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_with_no_partner_says_so_and_gives_up(checkpoints, tmp_path, rank):
    """RANK/WORLD_SIZE/MASTER_* copied into a shell with no other rank: once a silent wait of
    two hours; now a line within seconds, then the fix."""
    port = _free_port()
    environment = {
        **os.environ,
        **{"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
        **{"MASTER_PORT": str(port), "GRAFTING_LENS_RANKS_WAIT": "8", "HF_HUB_OFFLINE": "1"},
    }
    command = [sys.executable, "-m", "grafting_lens.study.cli", *_argv("position", checkpoints)]
    job = subprocess.run(
        command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120
    )
    assert job.returncode == 1, job.stderr[-3000:]
    lines = job.stderr.splitlines()
    assert (
        f"Rank {rank} of 2 (RANK and WORLD_SIZE set in the environment) is waiting for the "
        f"other ranks at 127.0.0.1:{port}; it gives up after 8 s." in lines
    ), lines
    assert lines[-1].startswith(
        f"Error: Rank {rank} of 2 (RANK and WORLD_SIZE set in the environment) found no other "
        f"rank at 127.0.0.1:{port} within 8 s: start all 2 ranks (torchrun --nproc-per-node 2"
    ), lines
    assert not any(tmp_path.iterdir())  # nothing written


SETUP_JOB = textwrap.dedent(
    """
    import os, sys
    from grafting_lens.study import cli

    if os.environ["RANK"] == "1":  # one rank's cache is a file
        os.environ["GRAFTING_LENS_CACHE"] = os.path.abspath("a-file")
    sys.exit(cli.main(sys.argv[1:]))
    """
)


def test_a_setup_that_fails_on_one_rank_stops_every_rank_with_its_line(tmp_path):
    """Once rank 1 printed a clear line and rank 0 died in a raw gloo traceback."""
    (tmp_path / "a-file").touch()
    argv = ["run", "position", "--out", "out", "--quick", "--no-png", "--no-progress"]
    job = _job(tmp_path, SETUP_JOB, *argv, GRAFTING_LENS_CACHE=str(tmp_path / "cache"))
    assert job.returncode != 0
    said = re.findall(r"Error: The toy-world cache \S*a-file/toy is under the file", job.stderr)
    assert len(said) == 2, job.stderr[-3000:]  # the same line on both ranks
    assert "grafting_lens/" not in job.stderr and "gloo" not in job.stderr
    assert not (tmp_path / "out").exists()  # the refused run left no directory
