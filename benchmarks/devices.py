"""What every timed benchmark shares about its device: the option, the clock, the label.

A GPU runs kernels asynchronously: ``time.perf_counter()`` around a call measures the
launches, not the work, unless the device is synchronised before the clock is read
(:func:`clock`). Each benchmark takes ``--device`` (default: ``cpu``) and reports
where it ran (:func:`describe`): CPU threads on a CPU, the GPU's name on CUDA.
"""

from __future__ import annotations

import argparse
import os
import platform
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
