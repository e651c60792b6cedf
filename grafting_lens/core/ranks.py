"""Ranks: the processes of one ``torch.distributed`` job, and what each holds.

``torchrun``, ``accelerate launch`` (which wraps it) and SLURM's ``srun`` start one process
per rank and tell it who it is in its environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
(``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID`` under ``srun``). A process
whose program already joined a process group is a rank too. :func:`current` reads that, joins
the job (gloo on CPUs, NCCL on GPUs, with a gloo group beside it for the small Python objects
the ranks exchange) and names the rank's device: ``LOCAL_RANK``'s GPU where there are GPUs,
else the CPU. Without a job of more than one rank it is ``None`` and nothing changes.

The ranks of a run share its chunks by a fixed rule (chunk ``i`` goes to rank ``i % world``),
so no chunk is claimed, computed twice or lost; they meet only where a run needs every rank at
once, through :func:`agree`: every rank does its part, and a part that failed on one rank is
raised on all of them, so no rank waits for a partner that has given up.
"""

from __future__ import annotations

import datetime
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from grafting_lens.core.console import available_cores
from grafting_lens.core.errors import GraftingLensError, RunError

if TYPE_CHECKING:  # torch is imported where a rank needs it: a refused option answers at once
    import torch

__all__ = ["Ranks", "agree", "current", "first", "gather", "spread"]

T = TypeVar("T")

_TIMEOUT = datetime.timedelta(hours=2)
"""How long a rank waits for the others: the slowest rank's share of a run, one chunk more
than the fastest's (torch's default, 30 minutes, is shorter than one chunk of a large pair)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in its job.

    Attributes:
        rank: Its rank, 0 to ``world - 1``.
        world: How many ranks the job has.
        local_rank: Its rank among those on its machine (its GPU's index).
        local_world: How many ranks share its machine.
        job: What tells this job's ranks from another job's (made by rank 0).
    """

    rank: int
    world: int
    local_rank: int
    local_world: int
    job: str

    @property
    def first(self) -> bool:
        """Whether this is rank 0, which writes what a job writes once."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where this rank's models go: ``cuda:<local rank>`` where there are GPUs, else the CPU."""
        import torch

        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def threads(self) -> int:
        """CPU threads for this rank: the cores of its machine, split among its ranks."""
        return max(1, available_cores() // self.local_world)

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's share of ``items``: every ``world``-th, from its rank on."""
        return list(items[self.rank :: self.world])


_CURRENT: list[Ranks | None] = []
"""This process's :class:`Ranks` once :func:`current` has read it (a one-item cache)."""
_GROUP: list[Any] = [None]
"""The gloo group the ranks exchange Python objects through."""


def current() -> Ranks | None:
    """This process's rank in a job of more than one, joining it on first call; else None.

    Every rank must make its first call at the same point of its program (joining is a
    collective step); :func:`~grafting_lens.study.runner.run_experiment` and ``grafting-lens
    run`` make it first thing.

    Raises:
        RunError: ``srun`` started the ranks but no ``MASTER_ADDR`` and ``MASTER_PORT`` say
            where they meet.
    """
    if not _CURRENT:
        _CURRENT.append(_join())
    return _CURRENT[0]


def _join() -> Ranks | None:
    import torch
    import torch.distributed as dist

    env = os.environ
    ready = dist.is_available() and dist.is_initialized()
    if ready:
        rank, world = dist.get_rank(), dist.get_world_size()
    elif "WORLD_SIZE" in env and "RANK" in env:  # torchrun, accelerate launch
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:  # srun (a step of its own)
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
    else:
        return None
    if world <= 1:
        return None
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", rank)))
    per_node = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_STEP_TASKS_PER_NODE", "")
    local_world = int(re.match(r"\d*", per_node).group() or world)  # type: ignore[union-attr]
    if not ready:
        if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
            raise RunError(
                f"This process is rank {rank} of {world} (srun), but MASTER_ADDR and "
                "MASTER_PORT do not say where the ranks meet: export MASTER_ADDR=$(scontrol show "
                "hostnames $SLURM_JOB_NODELIST | head -n1) MASTER_PORT=29500 before srun."
            )
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group(
            "nccl" if gpu else "gloo", rank=rank, world_size=world, timeout=_TIMEOUT
        )
    gloo = dist.get_backend() == "gloo"
    _GROUP[0] = None if gloo else dist.new_group(backend="gloo", timeout=_TIMEOUT)
    job = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(job, src=0, group=_GROUP[0])
    return Ranks(rank, world, local_rank, min(local_world, world), str(job[0]))


def first() -> bool:
    """Whether this process writes what a job writes once: rank 0, or a process on its own."""
    ranks = current()
    return ranks is None or ranks.first


def gather(value: T) -> list[T]:
    """``value`` of every rank, in rank order (``[value]`` without ranks); every rank calls it."""
    ranks = current()
    if ranks is None:
        return [value]
    import torch.distributed as dist

    found: list[Any] = [None] * ranks.world
    dist.all_gather_object(found, value, group=_GROUP[0])
    return found


def agree(action: Callable[[], T]) -> T:
    """Run ``action`` on every rank; if it failed on any, raise on every one.

    The rank where it failed raises its own error; the others raise the same refusal
    (a :class:`~grafting_lens.core.errors.GraftingLensError` of the same kind and message),
    or a :class:`~grafting_lens.core.errors.RunError` naming the rank that broke down.
    Without ranks it is ``action()``.
    """
    if current() is None:
        return action()
    result: Any = None
    failure: BaseException | None = None
    try:
        result = action()
    except Exception as error:  # raised below, after every rank has said how it went
        failure = error
    said = gather(None if failure is None else (type(failure), str(failure)))
    if failure is not None:
        raise failure
    for rank, outcome in enumerate(said):
        if outcome is None:
            continue
        kind, message = outcome
        if isinstance(kind, type) and issubclass(kind, GraftingLensError):
            raise kind(message)
        raise RunError(
            f"Rank {rank} of {len(said)} failed ({getattr(kind, '__name__', kind)}: {message}); "
            "the chunks written are kept: run the same command again to resume."
        )
    return result


def spread(count: int, compute: Callable[[int], T]) -> list[T]:
    """``[compute(0), ..., compute(count - 1)]`` on every rank, each rank computing every
    ``world``-th item from its rank on and the ranks exchanging the results: the same items,
    computed the same way, as one process (a failure on one rank is raised on all). Without
    ranks, computed here in order."""
    share = current()
    if share is None:
        return [compute(number) for number in range(count)]
    mine = agree(lambda: {n: compute(n) for n in range(share.rank, count, share.world)})
    found = {number: item for part in gather(mine) for number, item in part.items()}
    return [found[number] for number in range(count)]
