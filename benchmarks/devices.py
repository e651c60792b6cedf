"""What every timed benchmark shares about its device: the option, the clock, the label.

A GPU runs kernels asynchronously: ``time.perf_counter()`` around a call measures the
launches, not the work, unless the device is synchronised before the clock is read
(:func:`clock`). Each benchmark takes ``--device`` (default: ``cpu``) and reports
where it ran (:func:`describe`): CPU threads on a CPU, the GPU's name on CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time

import torch


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device``: where the models run (``cpu``, ``cuda``, ``cuda:1``...)."""
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device the models run on: cpu (the default), cuda, cuda:1... (timings "
        "synchronise the device before reading the clock)",
    )


def resolve(name: str) -> torch.device:
    """The device ``--device`` names, checked usable here."""
    device = torch.device(name)
    torch.empty(0, device=device)  # fails now, naming the device, not mid-benchmark
    return device


def synchronize(device: torch.device) -> None:
    """Wait for every kernel queued on ``device`` (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()


def describe(device: torch.device) -> dict:
    """Where a benchmark ran, for its JSON: the device, and its name or CPU threads."""
    if device.type == "cuda":
        return {
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
        }
    return {
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }


def compare_ranks(script: str, argv: list[str]) -> None:
    """Run ``script`` three ways, one after another, and print one JSON line: one process with
    one thread, one with two, two ranks of one thread each (torchrun, gloo on the CPU), with
    the speed-ups over the first. Each run prints its JSON (rank 0's) with ``seconds``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    torchrun += ["--master-addr=127.0.0.1", f"--master-port={port}"]
    settings = {
        "one_process_1_thread": [sys.executable, script, *argv, "--threads", "1"],
        "one_process_2_threads": [sys.executable, script, *argv, "--threads", "2"],
        "two_ranks_1_thread": [*torchrun, script, *argv, "--threads", "1"],
    }
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    found = {}
    for name, command in settings.items():
        done = subprocess.run(command, capture_output=True, text=True, env=environment, check=True)
        found[name] = json.loads(done.stdout.strip().splitlines()[-1])
    first = found["one_process_1_thread"]["seconds"]
    speedups = {f"speedup_{name}": round(first / run["seconds"], 2) for name, run in found.items()}
    print(json.dumps({**found, **speedups}))
