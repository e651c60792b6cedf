"""Ranks: the processes of one ``torch.distributed`` job, and the work they share.

Launchers (``torchrun``, ``accelerate launch``, ``srun``) tell each process its rank
(:func:`launched`). Sharing is asked for, never assumed: outside :func:`shared_ranks` every call
computes on its own rank; inside it, :func:`current` joins the job and chunk ``i`` goes to rank
``i % world``. Each shared call first checks every rank reached it with the same arguments
(:func:`same`); a part that failed on one rank is raised on all (:func:`agree`); every wait is
bounded (:func:`wait_seconds`). How to launch, and what each rank does:
docs/how-to/many-gpus.md.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from grafting_lens.core.console import available_cores
from grafting_lens.core.errors import GraftingLensError, RunError

if TYPE_CHECKING:  # torch is imported where a rank needs it: a refused option answers at once
    import torch

__all__ = [
    "Ranks",
    "agree",
    "current",
    "first",
    "gather",
    "launched",
    "same",
    "shared_ranks",
    "spread",
]

T = TypeVar("T")

# How long a rank waits for the others inside a shared run: one chunk of a large pair.
_TIMEOUT = datetime.timedelta(hours=2)


def wait_seconds() -> float:
    """How long a rank waits for partners to join, or to reach a shared call
    (``GRAFTING_LENS_RANKS_WAIT``, seconds; default 300)."""
    text = os.environ.get("GRAFTING_LENS_RANKS_WAIT", "300")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise RunError(f"GRAFTING_LENS_RANKS_WAIT={text!r} is not a number of seconds above 0.")
    return seconds


@dataclass(frozen=True)
class _Place:
    """A process's place in its job: its rank, the job's size, its machine's share."""

    rank: int
    world: int
    local_rank: int
    local_world: int

    @property
    def device(self) -> torch.device:
        """Where this rank's models go: ``cuda:<local rank>`` where there are GPUs, else the CPU."""
        import torch

        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")


@dataclass(frozen=True)
class Launch(_Place):
    """What a launcher told this process: its rank, the job's size, and who started it."""

    launcher: str


@dataclass(frozen=True)
class Ranks(_Place):
    """This process's place in its job.

    Attributes:
        rank: Its rank, 0 to ``world - 1``.
        world: How many ranks the job has.
        local_rank: Its rank among those on its machine (its GPU's index).
        local_world: How many ranks share its machine.
        job: What tells this job's ranks from another job's (made by rank 0).
    """

    job: str

    @property
    def first(self) -> bool:
        """Whether this is rank 0, which writes what a job writes once."""
        return self.rank == 0

    @property
    def threads(self) -> int:
        """CPU threads for this rank: the cores of its machine, split among its ranks."""
        return max(1, available_cores() // self.local_world)

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's share of ``items``: every ``world``-th, from its rank on."""
        return list(items[self.rank :: self.world])


_CURRENT: list[Ranks | None] = []  # this process's Ranks once current() has joined
_GROUP: list[Any] = [None]  # the gloo group the ranks exchange Python objects through
_SHARING: list[bool] = [False]  # whether the calls being made share their work


@contextlib.contextmanager
def shared_ranks() -> Iterator[Ranks | None]:
    """Share the work of the calls inside among the ranks of this job.

    Every rank must enter it and make the same calls with the same arguments: each computes its
    share and gets the whole result; a call that differs on one rank, or that another does not
    reach within :func:`wait_seconds`, is refused on all. Alone, it yields None.

    Yields:
        This process's :class:`Ranks`, or None.

    Raises:
        RunError: The ranks cannot meet (no ``MASTER_ADDR``/``MASTER_PORT``, no partner in time).
    """
    previous = _SHARING[0]
    _SHARING[0] = True
    try:
        yield current()
    finally:
        _SHARING[0] = previous


def launched() -> Launch | None:
    """What the launcher told this process, without joining anything; None alone."""
    import torch.distributed as dist

    env = os.environ
    if dist.is_available() and dist.is_initialized():
        rank, world, launcher = dist.get_rank(), dist.get_world_size(), "your process group"
    elif "WORLD_SIZE" in env and "RANK" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        launcher = "RANK and WORLD_SIZE set in the environment"
        if "TORCHELASTIC_RUN_ID" in env:
            launcher = "torchrun"
        if any(name.startswith("ACCELERATE_") for name in env):
            launcher = "accelerate launch"
    elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:  # srun (a step of its own)
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
        launcher = "srun"
    else:
        return None
    if world <= 1:
        return None
    local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", rank)))
    per_node = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_STEP_TASKS_PER_NODE", "")
    local_world = int(re.match(r"\d*", per_node).group() or world)  # type: ignore[union-attr]
    return Launch(rank, world, local_rank, min(local_world, world), launcher)


def current() -> Ranks | None:
    """This process's rank, inside :func:`shared_ranks` in a job of more than one; else None.
    Joins the job on first call (a collective step: every rank makes it at the same point).

    Raises:
        RunError: No ``MASTER_ADDR`` and ``MASTER_PORT``, or no partner within the wait.
    """
    if not _SHARING[0]:
        return None
    if not _CURRENT:
        _CURRENT.append(_join())
    return _CURRENT[0]


def _join() -> Ranks | None:
    import torch
    import torch.distributed as dist

    launch = launched()
    if launch is None:
        return None
    rank, world = launch.rank, launch.world
    if not dist.is_initialized():
        where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        if where == ":" or where.startswith(":") or where.endswith(":"):
            fix = (
                "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) "
                "MASTER_PORT=29500 before srun"
                if launch.launcher == "srun"
                else "set both for every rank, or unset RANK and WORLD_SIZE to run alone"
            )
            raise RunError(
                f"This process is rank {rank} of {world} ({launch.launcher}), but MASTER_ADDR "
                f"and MASTER_PORT do not say where the ranks meet: {fix}."
            )
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        wait = wait_seconds()
        waiting = (
            f"Rank {rank} of {world} ({launch.launcher}) is waiting for the other ranks at "
            f"{where}; it gives up after {wait:.0f} s."
        )
        said = threading.Timer(5, print, (waiting,), {"file": sys.stderr, "flush": True})
        said.daemon = True
        said.start()
        try:  # the rendezvous alone waits for partners, and only this long
            timeout = datetime.timedelta(seconds=wait)
            store, _, _ = next(
                dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout)
            )
        except (RuntimeError, ValueError) as error:  # torch's DistStoreError is a RuntimeError
            raise RunError(
                f"Rank {rank} of {world} ({launch.launcher}) found no other rank at {where} "
                f"within {wait:.0f} s: start all {world} ranks (torchrun --nproc-per-node "
                f"{world} ...), or unset RANK and WORLD_SIZE to run alone ({error})."
            ) from None
        finally:
            said.cancel()
        store.set_timeout(_TIMEOUT)
        dist.init_process_group(
            "nccl" if gpu else "gloo", store=store, rank=rank, world_size=world, timeout=_TIMEOUT
        )
    gloo = dist.get_backend() == "gloo"
    _GROUP[0] = None if gloo else dist.new_group(backend="gloo", timeout=_TIMEOUT)
    job = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(job, src=0, group=_GROUP[0])
    return Ranks(rank, world, launch.local_rank, launch.local_world, str(job[0]))


def first() -> bool:
    """Whether this process writes what a job writes once: rank 0, or a process on its own."""
    ranks = current()
    return ranks is None or ranks.first


def gather(value: T) -> list[T]:
    """``value`` of every rank, in rank order (``[value]`` without ranks); every rank calls it.

    Raises:
        RunError: Another rank of the job stopped (its own output says why).
    """
    ranks = current()
    if ranks is None:
        return [value]
    import torch.distributed as dist

    found: list[Any] = [None] * ranks.world
    try:
        dist.all_gather_object(found, value, group=_GROUP[0])
    except RuntimeError as error:  # gloo: "Connection closed by peer", a timeout
        raise RunError(
            f"Rank {ranks.rank} of {ranks.world} lost the other ranks (one stopped; its own "
            "output says why); the chunks written are kept: run the same command again to "
            f"resume ({str(error).splitlines()[0][:200]})."
        ) from None
    return found


def same(
    call: str,
    arguments: Mapping[str, Any],
    fix: str = "call it outside shared_ranks() to compute each rank's own result",
) -> None:
    """Check, inside :func:`shared_ranks`, that every rank reached ``call`` with the same
    ``arguments`` (each compared by a digest of its value); nothing without ranks.

    Raises:
        RunError: A rank did not reach ``call`` within :func:`wait_seconds`.
        GraftingLensError: The ranks' arguments differ (named), on every rank.
    """
    ranks = current()
    if ranks is None:
        return
    _meet(call, fix)
    mine = {name: _digest(value) for name, value in arguments.items()}
    for rank, theirs in enumerate(gather(mine)):
        differ = [name for name in mine if theirs.get(name) != mine[name]]
        if differ:
            raise GraftingLensError(
                f"{call} was called with other {', '.join(differ)} on rank {rank} than on "
                f"rank {ranks.rank}: ranks that share their work make the same calls; {fix}."
            )


def _meet(call: str, fix: str) -> None:
    """Wait for every rank to reach ``call``, at most :func:`wait_seconds`."""
    import torch.distributed as dist

    try:  # gloo names the ranks that did not come
        dist.monitored_barrier(group=_GROUP[0], timeout=datetime.timedelta(seconds=wait_seconds()))
    except RuntimeError as error:
        raise RunError(
            f"{call} is shared by the ranks, but not every rank reached it within "
            f"{wait_seconds():.0f} s: ranks that share their work make the same calls; {fix} "
            f"({str(error).splitlines()[0][:200]})."
        ) from None


def _digest(value: Any) -> str:
    """A digest of ``value``: tensors by every byte, containers item by item, the rest by repr."""
    import torch

    hasher = hashlib.sha256()

    def feed(item: Any) -> None:
        if hasattr(item, "detach") and hasattr(item, "dtype"):  # a tensor
            hasher.update(f"T{tuple(item.shape)}{item.dtype}".encode())
            flat = item.detach().cpu().contiguous().reshape(-1)
            hasher.update(flat.view(torch.uint8).numpy().tobytes())
        elif hasattr(item, "to_dict") and hasattr(item, "columns"):  # a DataFrame: every cell
            feed(item.to_dict("split"))
        elif callable(item):  # not by its repr, which holds an address
            hasher.update(
                f"{getattr(item, '__module__', '')}.{getattr(item, '__qualname__', type(item).__qualname__)}".encode()
            )
        elif isinstance(item, Mapping):
            for key in item:
                feed(key)
                feed(item[key])
        elif isinstance(item, (list, tuple)):
            hasher.update(f"L{len(item)}".encode())
            for part in item:
                feed(part)
        else:
            hasher.update(repr(item).encode())

    feed(value)
    return hasher.hexdigest()


def agree(action: Callable[[], T]) -> T:
    """Run ``action`` on every rank; if it failed on any, raise on every one.

    The rank where it failed raises its own error; the others the same refusal (a
    :class:`~grafting_lens.core.errors.GraftingLensError` of its kind and message), or a
    :class:`~grafting_lens.core.errors.RunError` naming the rank. Without ranks: ``action()``.
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
        if not (isinstance(kind, type) and issubclass(kind, GraftingLensError)):
            name = getattr(kind, "__name__", kind)
            message = (
                f"Rank {rank} of {len(said)} failed ({name}: {message}); the chunks written "
                "are kept: run the same command again to resume."
            )
            kind = RunError
        raise kind(message)
    return result


def spread(
    call: str, arguments: Mapping[str, Any], count: int, compute: Callable[[int], T]
) -> list[T]:
    """``[compute(0), ..., compute(count - 1)]`` on every rank, each computing every
    ``world``-th item from its rank on and the ranks exchanging them (a failure on one rank is
    raised on all; without ranks, computed here in order). ``call`` and ``arguments`` (what
    the items are computed from) are first checked to be every rank's by :func:`same`.
    """
    share = current()
    if share is None:
        return [compute(number) for number in range(count)]
    same(call, {**arguments, "items": count})
    mine = agree(lambda: {n: compute(n) for n in range(share.rank, count, share.world)})
    found = {number: item for part in gather(mine) for number, item in part.items()}
    return [found[number] for number in range(count)]
