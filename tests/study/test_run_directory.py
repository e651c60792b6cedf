"""Run directories trust nothing: tampered chunks, edited weights, kills, concurrent writers."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch
from conftest import make_tokenizer, random_model

import grafting_lens as gl
from grafting_lens.analysis import scoring
from grafting_lens.core import files
from grafting_lens.core.errors import GraftingLensError, RunError
from grafting_lens.study import (
    CLEAN,
    make_test_sets,
    report,
    run_directory,
    run_experiment,
)
from grafting_lens.study.report import REPORT_MANIFEST, write_experiment_report
from grafting_lens.study.run_directory import weights_digests
from grafting_lens.worlds import data

CONFIGS = ["PRE", "FE", "LT"]


@pytest.fixture(scope="module")
def models():
    return gl.load_models(
        random_model("llama", 0), random_model("llama", 1), tokenizer=make_tokenizer()
    )


@pytest.fixture(scope="module")
def test_sets():
    relations = data.make_relations("fake_movies_real_actors", n=5, seed=0)
    return make_test_sets(relations, prompts=("headline", "qa"), templates="library")


@pytest.fixture
def forwards(monkeypatch):
    """Count the runner's forward passes."""
    calls = {"n": 0}
    real = scoring.graft_forward  # the pass the runner asks the score for

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(scoring, "graft_forward", counted)
    return calls


DONOR_UNEMBED = dataclasses.replace(CLEAN, unembed="donor")
"""What --include-unembed asked for: the library's reading, decoded by the donor's unembedding."""


def _run(models, test_sets, out=None, **options):
    # The library's reading, which these runs were written against (the default is REFERENCE).
    options = {"chunk_size": 2, "batch_size": 2, "progress": False, "semantics": CLEAN, **options}
    return run_experiment(models, test_sets, CONFIGS, out=out, **options)


@pytest.fixture(scope="module")
def whole(models, test_sets):
    """The table of an uninterrupted run, kept in memory."""
    return _run(models, test_sets)


def _chunk(out, chunk_id="m0-t0-c1"):
    path = out / "chunks" / f"{chunk_id}.json"
    return path, json.loads(path.read_text())


def _save(path, payload, rehash=False):
    if rehash:  # as someone would who knows the format: the rows must still be checked
        payload["sha256"] = run_directory._content_hash(payload)
    path.write_text(json.dumps(payload))


# ------------------------------------------------------------------ chunks


def _edit_a_score(payload):
    payload["rows"][0][payload["columns"].index("target_prob")] = 0.99


def _drop_a_row(payload):
    payload["rows"].pop()


def _duplicate_a_row(payload):
    payload["rows"][-1] = list(payload["rows"][0])


TAMPERINGS = {
    "edited row": (_edit_a_score, False, "was changed after it was written"),
    "dropped row": (_drop_a_row, False, "was changed after it was written"),
    "duplicated row": (_duplicate_a_row, False, "was changed after it was written"),
    "dropped row, rehashed": (_drop_a_row, True, "does not hold this chunk's rows"),
    "duplicated row, rehashed": (_duplicate_a_row, True, "does not hold this chunk's rows"),
}


@pytest.mark.parametrize("tampering", TAMPERINGS, ids=list(TAMPERINGS))
def test_a_tampered_chunk_is_refused_and_recomputed_once_deleted(
    models, test_sets, whole, tmp_path, forwards, tampering
):
    change, rehash, message = TAMPERINGS[tampering]
    out = tmp_path / "run"
    _run(models, test_sets, out)
    path, payload = _chunk(out)
    change(payload)
    _save(path, payload, rehash)
    forwards["n"] = 0
    with pytest.raises(RunError, match=rf"(?s)m0-t0-c1.json {message}.*Delete them"):
        _run(models, test_sets, out)
    assert forwards["n"] == 0  # refused before any forward pass
    path.unlink()
    pd.testing.assert_frame_equal(_run(models, test_sets, out), whole)
    assert forwards["n"] == 1  # only the deleted chunk was recomputed


def test_a_chunk_copied_from_another_run_is_refused(models, test_sets, whole, tmp_path):
    # The case of the issue: a chunk of an --include-unembed run, same id and columns.
    other = tmp_path / "unembed"
    _run(models, test_sets, other, semantics=DONOR_UNEMBED)
    out = tmp_path / "run"
    _run(models, test_sets, out)
    shutil.copy(other / "chunks" / "m0-t0-c0.json", out / "chunks" / "m0-t0-c0.json")
    with pytest.raises(RunError, match=r"m0-t0-c0.json belongs to another run"):
        _run(models, test_sets, out)
    # Renamed within its own run: the id inside says which chunk it is.
    shutil.copy(other / "chunks" / "m0-t0-c1.json", other / "chunks" / "m0-t0-c0.json")
    with pytest.raises(RunError, match=r"holds the chunk 'm0-t0-c1', not 'm0-t0-c0'"):
        _run(models, test_sets, other, semantics=DONOR_UNEMBED)


def test_a_directory_where_a_chunk_goes_is_refused(models, test_sets, tmp_path):
    out = tmp_path / "run"
    _run(models, test_sets, out)
    path, _ = _chunk(out)
    path.unlink()
    path.mkdir()
    with pytest.raises(RunError, match=r"m0-t0-c1.json is not a file"):
        _run(models, test_sets, out)


def test_a_chunk_written_by_the_previous_format_is_refused(models, test_sets, tmp_path):
    out = tmp_path / "run"
    _run(models, test_sets, out)
    path, payload = _chunk(out)
    _save(path, {"chunk": payload["chunk"], "columns": payload["columns"], "rows": payload["rows"]})
    with pytest.raises(RunError, match="belongs to another run"):
        _run(models, test_sets, out)


# ------------------------------------------------------------------ weights


def test_an_edited_donor_weight_makes_another_run(models, test_sets, tmp_path, forwards):
    out = tmp_path / "run"
    _run(models, test_sets, out)
    donor = random_model("llama", 1)  # the fixture's donor, loaded afresh
    weight = dict(donor.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    with torch.no_grad():
        # A finetune of one matrix: every value moves (the fingerprint samples 64 of
        # each tensor). Through .data, which no version counter sees.
        weight.data += 1e-3 * torch.randn_like(weight)
    edited = gl.load_models(random_model("llama", 0), donor, tokenizer=models.tokenizer)
    forwards["n"] = 0
    with pytest.raises(
        RunError, match=r"differs in models \(.*weights or configuration of 'source1'"
    ):
        _run(edited, test_sets, out)
    assert forwards["n"] == 0


def test_weights_digests_are_every_value_of_the_sources_with_the_configuration(models):
    digests = weights_digests(models)
    assert len(digests) == len(models) and len(set(digests)) == len(models)

    def load(dtype=None, rope_theta=None):
        pair = [random_model("llama", seed) for seed in (0, 1)]
        for model in pair:
            if rope_theta is not None:
                model.config.rope_theta = rope_theta  # changes the forward, not a weight
        return gl.load_models(*pair, tokenizer=models.tokenizer, dtype=dtype)

    again = load()
    assert weights_digests(again) == digests  # the same weights, the same digests
    with torch.no_grad():
        next(iter(again[1].original_model.parameters())).add_(1e-3)
    assert weights_digests(again)[1] != digests[1]  # changed in place: a different run
    assert weights_digests(load(dtype=torch.bfloat16))[1] != digests[1]
    assert weights_digests(load(rope_theta=500000.0))[0] != digests[0]


def test_an_ablation_of_one_weight_between_the_sampled_values_is_a_different_run(models):
    # The fingerprint samples 64 values per tensor and keeps its hash until a version
    # counter moves; a write through .data moves none. The run directory must see it.
    pair = [random_model("llama", seed) for seed in (0, 1)]
    ablated = gl.load_models(*pair, tokenizer=models.tokenizer)
    before, fingerprint = weights_digests(ablated), ablated.sources[1].fingerprint()
    weight = next(p for _, p in ablated[1].original_model.named_parameters() if p.dim() == 2)
    weight.data.view(-1)[1] = 0.0  # index 1 is never sampled (the stride is >= 2)
    assert ablated.sources[1].fingerprint() == fingerprint  # why the digest is not it
    assert weights_digests(ablated)[1] != before[1]
    assert weights_digests(ablated)[0] == before[0]


def test_a_lazy_donor_is_digested_from_its_files_and_nothing_is_kept(tmp_path):
    for name, seed in (("base", 0), ("sft", 1)):
        random_model("llama", seed).save_pretrained(tmp_path / name)
        make_tokenizer().save_pretrained(tmp_path / name)
    whole = gl.load_models(tmp_path / "base", tmp_path / "sft")
    lazy = gl.load_models(tmp_path / "base", tmp_path / "sft", lazy=True)
    assert weights_digests(lazy) == weights_digests(whole)
    assert lazy.sources[1].loaded == () and lazy.memory().resident_bytes[1] == 0


# ------------------------------------------------------------------ kills


def test_a_kill_while_the_first_manifest_is_written_leaves_a_recoverable_directory(
    models, test_sets, whole, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    real = run_directory.atomic_write

    def killed(path, content, **kwargs):
        if path.name == "manifest.json":  # SIGKILL in the middle: half a temporary file
            (path.parent / ".manifest.json.x1.partial").write_bytes(content[: len(content) // 2])
            raise KeyboardInterrupt
        return real(path, content, **kwargs)

    monkeypatch.setattr(run_directory, "atomic_write", killed)
    with pytest.raises(KeyboardInterrupt):
        _run(models, test_sets, out)
    monkeypatch.setattr(run_directory, "atomic_write", real)
    assert not (out / "manifest.json").exists()
    pd.testing.assert_frame_equal(_run(models, test_sets, out), whole)
    assert not list(out.glob(".*.partial"))


@pytest.mark.parametrize(
    "left", ["an empty chunks/", "a truncated manifest", "chunks and no manifest"]
)
def test_what_a_killed_first_write_leaves_is_never_refused_forever(
    models, test_sets, whole, tmp_path, left
):
    out = tmp_path / "run"
    if left == "chunks and no manifest":
        _run(models, test_sets, out)
        (out / "manifest.json").unlink()  # the chunks are checked one by one instead
    else:
        (out / "chunks").mkdir(parents=True)  # what the previous version left
        if left == "a truncated manifest":
            (out / "manifest.json").write_text('{"fingerprint": "ab')
    pd.testing.assert_frame_equal(_run(models, test_sets, out), whole)


def test_a_truncated_manifest_beside_chunks_is_refused(models, test_sets, tmp_path):
    out = tmp_path / "run"
    _run(models, test_sets, out)
    (out / "manifest.json").write_text('{"fingerprint": "ab')
    with pytest.raises(RunError, match="cannot be read .* holds chunks"):
        _run(models, test_sets, out)


# ------------------------------------------------------------------ concurrent writers

_HOLDER = textwrap.dedent(
    """
    import fcntl, json, os, sys, time
    directory = sys.argv[1]
    os.makedirs(directory, exist_ok=True)
    handle = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(handle, fcntl.LOCK_EX)
    os.ftruncate(handle, 0)
    os.write(handle, json.dumps({"pid": os.getpid(), "host": "here", "command": "a long run",
                                 "since": "now"}).encode())
    print("held", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def holder():
    """Hold a directory's lock from another process, as a running run does."""
    started = []

    def hold(directory):
        process = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(directory)], stdout=subprocess.PIPE, text=True
        )
        assert process.stdout.readline().strip() == "held"
        started.append(process)
        return process

    yield hold
    for process in started:
        process.kill()
        process.wait()


HOSTILE_NAMES = ["../victim.txt", "{victim}", "sub/../../victim.txt", "victim_dir", "..", ""]
"""Names an edited report.json may list: outside the report, absolute, a directory."""


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("hostile", HOSTILE_NAMES)
def test_a_report_json_never_decides_what_is_deleted_outside_the_report(
    models, test_sets, tmp_path, hostile, overwrite
):
    results = _run(models, test_sets)
    out = tmp_path / "shared" / "report"
    write_experiment_report("demo", {"results": results}, out, label="tiny", png=False)
    victim = tmp_path / "shared" / "victim.txt"
    victim.write_text("keep me")
    (out / "victim_dir").mkdir()
    (out / "victim_dir" / "inside.txt").write_text("keep me")
    manifest = json.loads((out / REPORT_MANIFEST).read_text())
    manifest["files"].append(hostile.format(victim=victim))
    (out / REPORT_MANIFEST).write_text(json.dumps(manifest))
    # The same run again (a resume drops files the report no longer writes), or another
    # run with --overwrite (the old report's files are cleared first): both refuse.
    other = results if not overwrite else results.assign(target_prob=0.5)
    with pytest.raises(RunError, match="not a file a report writes"):
        write_experiment_report(
            "demo", {"results": other}, out, label="tiny", png=False, overwrite=overwrite
        )
    assert victim.read_text() == "keep me"
    assert (out / "victim_dir" / "inside.txt").read_text() == "keep me"
    assert (out / "results.csv").exists()  # refused before anything was deleted


def test_a_symlinked_runs_directory_is_refused_before_anything_is_deleted(
    models, test_sets, tmp_path
):
    results = _run(models, test_sets)
    out = tmp_path / "report"
    write_experiment_report("demo", {"results": results}, out, label="tiny", png=False)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "a-run").mkdir(parents=True)
    (elsewhere / "a-run" / "keep.txt").write_text("keep me")
    (out / "runs").symlink_to(elsewhere, target_is_directory=True)
    manifest = json.loads((out / REPORT_MANIFEST).read_text())
    (out / REPORT_MANIFEST).write_text(json.dumps({**manifest, "runs": True}))  # as `run` writes
    with pytest.raises(RunError, match="runs is a symbolic link"):
        write_experiment_report(
            "demo",
            {"results": results.assign(target_prob=0.5)},
            out,
            label="tiny",
            png=False,
            overwrite=True,
        )
    assert (elsewhere / "a-run" / "keep.txt").read_text() == "keep me"
    assert (out / "results.csv").exists()


# The holder is a second, independent implementation of the lock protocol (flock on
# ".lock", then its JSON), so that the test does not trust the library's own locking;
# flock exists on POSIX only, so on Windows the test has no holder to run.
@pytest.mark.skipif(sys.platform == "win32", reason="the holder uses fcntl")
def test_a_second_process_is_refused_and_a_dead_ones_lock_is_no_obstacle(
    models, test_sets, whole, tmp_path, holder, forwards
):
    out = tmp_path / "run"
    _run(models, test_sets, out, chunk_size=4)
    (out / "chunks" / ".m0-t0-c0.json.abc.partial").write_text("another run's write in flight")
    process = holder(out)
    forwards["n"] = 0
    with pytest.raises(RunError, match=rf"in use by another process \(pid {process.pid} on here"):
        _run(models, test_sets, out, chunk_size=4)
    assert forwards["n"] == 0
    assert (out / "chunks" / ".m0-t0-c0.json.abc.partial").exists()  # its file is left alone
    process.send_signal(signal.SIGKILL)
    process.wait()
    # The dead process's lock file is still there, holding nothing.
    resumed = _run(models, test_sets, out, chunk_size=4)
    pd.testing.assert_frame_equal(resumed, whole)


def test_the_lock_is_reentrant_within_a_process_and_leaves_nothing_it_made(tmp_path):
    with files.DirectoryLock(tmp_path / "a" / "d") as first, files.DirectoryLock(tmp_path / "a/d"):
        assert first.held
        held = json.loads((tmp_path / "a" / "d" / files.LOCK_NAME).read_text())
        assert held["pid"] == os.getpid()
    assert not first.held
    assert list(tmp_path.iterdir()) == []  # the directories it made, and its file, are gone
    (tmp_path / "kept").mkdir()
    with files.DirectoryLock(tmp_path / "kept"):
        (tmp_path / "kept" / "results.csv").write_text("x")
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["results.csv"]


# ------------------------------------------------------------------ paths


def test_empty_and_unwritable_paths_are_refused_before_any_forward_pass(
    models, test_sets, tmp_path, forwards, monkeypatch
):
    with pytest.raises(RunError, match=r"\(out=''\) is not a path, or an empty one"):
        _run(models, test_sets, "")
    with pytest.raises(gl.errors.ArgumentTypeError, match=r"\(out=3\) is not a path"):  # raw once
        _run(models, test_sets, 3)
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: make the directory refuse it as a mount would
        real_open = os.open

        def read_only(path, flags, *args):
            if str(path).startswith(str(locked)):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args)

        monkeypatch.setattr(files.os, "open", read_only)
    with pytest.raises(RunError, match=r"read-only/run cannot be written \(Permission denied\)"):
        _run(models, test_sets, locked / "run")
    assert forwards["n"] == 0
    with pytest.raises(GraftingLensError, match="is an empty path"):
        files.check_writable("  ")


def test_a_report_of_another_run_is_refused_and_overwritten_completely(models, test_sets, tmp_path):
    results = _run(models, test_sets)
    out = tmp_path / "report"
    report = write_experiment_report("demo", {"results": results}, out, label="tiny", png=False)
    assert json.loads((out / REPORT_MANIFEST).read_text())["files"] == [
        path.name for path in report.files
    ]
    # The same results again: the same report, rewritten.
    write_experiment_report("demo", {"results": results}, out, label="tiny", png=False)
    other = results.assign(target_prob=0.5)
    with pytest.raises(RunError, match="holds the report of another run"):
        write_experiment_report("demo", {"results": other}, out, label="tiny", png=False)
    # The file is unchanged: compared through the same parser on both sides, since pandas'
    # default float parser may land one ulp from the written digits (pandas 3.0.6 does).
    written = pd.read_csv(io.StringIO(results.to_csv(index=False)))
    assert pd.read_csv(out / "results.csv").target_prob.tolist() == written.target_prob.tolist()
    stale = out / "position_grafting.png"  # as if a PNG had been written the first time
    stale.write_bytes(b"png")
    manifest = json.loads((out / REPORT_MANIFEST).read_text())
    manifest["files"].append(stale.name)
    (out / REPORT_MANIFEST).write_text(json.dumps(manifest))
    write_experiment_report(
        "demo", {"results": other}, out, label="tiny", png=False, overwrite=True
    )
    assert not stale.exists()
    assert set(pd.read_csv(out / "results.csv").target_prob) == {0.5}


def test_a_full_disk_at_the_first_chunk_names_the_file_and_resumes(
    models, test_sets, whole, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    real = run_directory.atomic_write

    def disk_full_for_chunks(path, content, **options):
        if path.parent.name == "chunks":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, content, **options)

    monkeypatch.setattr(run_directory, "atomic_write", disk_full_for_chunks)
    with pytest.raises(
        RunError,
        match=r"A chunk of the run in .*run, .*chunks/m0-t0-c0\.json cannot be written \(No "
        r"space left on device\); its disk is full.*run again once it can be, to resume\.",
    ):
        _run(models, test_sets, out)
    monkeypatch.undo()
    pd.testing.assert_frame_equal(_run(models, test_sets, out), whole)


def test_a_directory_where_a_table_goes_is_refused_before_the_report(models, test_sets, tmp_path):
    results = _run(models, test_sets)
    out = tmp_path / "report"
    (out / "results.csv").mkdir(parents=True)
    with pytest.raises(RunError, match=r"results\.csv is a directory where the report writes"):
        write_experiment_report("demo", {"results": results}, out, label="tiny", png=False)
    assert not (out / REPORT_MANIFEST).exists()
    # Written later than that check (a directory made during the run): named too.
    with pytest.raises(RunError, match=r"results\.csv cannot be written \(Is a directory\); .*"):
        report.write_table(results, out / "results.csv")


# The holder is a second, independent implementation of the lock protocol (flock on
# ".lock", then its JSON), so that the test does not trust the library's own locking;
# flock exists on POSIX only, so on Windows the test has no holder to run.
@pytest.mark.skipif(sys.platform == "win32", reason="the holder uses fcntl")
def test_a_second_command_into_the_same_out_is_refused_before_loading(
    tmp_path, monkeypatch, holder, capsys
):
    from grafting_lens.study import cli
    from grafting_lens.worlds import toy

    monkeypatch.setattr(toy, "build_toy_world", lambda *a, **k: pytest.fail("built a toy world"))
    out = tmp_path / "out"
    process = holder(out)
    assert cli.main(["run", "position", "--out", str(out)]) == 1
    message = " ".join(capsys.readouterr().err.split())
    assert f"--out) {out} is in use by another process (pid {process.pid} on here" in message
