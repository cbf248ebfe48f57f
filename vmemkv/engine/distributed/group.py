"""The process group the ranks of one engine share, and how they find each other.

Two launches: vmemkv starts ranks 1..N-1 itself (``torch.multiprocessing``, forked from a fork server
that has imported vmemkv's engine once per process: ``leader._worker_context``; rendezvous on a
free localhost port), or ``torchrun`` starts every rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment; across machines too).

Three groups: the default one carries the model's collectives (NCCL on GPUs, gloo on CPUs) under
the engine's timeout, so a rank that dies or hangs mid-step stops the step within it; a gloo
``steps`` group, under the same timeout, carries rank 0's step messages and the digest checks; a
gloo ``idle`` group carries the small header that announces each message (and holds it when it
fits), with no practical timeout, because a worker waits there for as long as the engine is idle
(a dead rank 0 still ends the wait: gloo sees the closed connection). Rank 0's send of 1 KiB
completes into the socket buffer without waiting on a receiver, so a hung worker is still found
by the next collective under the engine's timeout.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vmemkv.errors import VmemkvError

IDLE_TIMEOUT = timedelta(days=365)  # the step-message group: workers wait there while idle
START_TIMEOUT = timedelta(minutes=10)  # every rank started and its model loaded


class TensorParallelError(VmemkvError):
    """A rank of a tensor-parallel engine died, hung past the timeout, or diverged; the engine
    has stopped (every rank), and a new one must be built."""


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    address: str  # rank 0's host
    port: int
    by_torchrun: bool


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def torchrun_rendezvous(size: int) -> Rendezvous:
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise TensorParallelError(f"tensor_parallel_size={size} but torchrun started {world} "
                                  f"processes; pass --nproc-per-node/--nnodes that multiply to {size}")
    return Rendezvous(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", 0)),
                      os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), True)


def local_rendezvous(size: int) -> Rendezvous:
    """Rank 0 of ranks this process will spawn on this machine."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return Rendezvous(0, size, 0, "127.0.0.1", port, False)


def rank_device(device: str, local_rank: int) -> str:
    """This rank's device: one GPU per rank on a machine (``cuda:<local rank>``), or the CPU."""
    return f"cuda:{local_rank}" if str(device).startswith("cuda") else str(device)


@dataclass(frozen=True)
class Groups:
    idle: object  # each step message's header: workers wait here between steps
    steps: object  # long step messages and digests, under the engine's timeout


def join(rendezvous: Rendezvous, device: str, timeout_s: float) -> Groups:
    """Join the default group (the model's collectives) and create the message groups."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    # Under torchrun, env:// shares the store torchrun's agent already serves on MASTER_PORT.
    # Finding each other may take as long as the slowest rank's start (START_TIMEOUT); only
    # then does the engine's timeout apply.
    url = "env://" if rendezvous.by_torchrun else f"tcp://{rendezvous.address}:{rendezvous.port}"
    store, _, _ = next(dist.rendezvous(url, rendezvous.rank, rendezvous.world_size,
                                       timeout=START_TIMEOUT))
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rendezvous.rank,
                            world_size=rendezvous.world_size, timeout=timeout)
    return Groups(idle=dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT),
                  steps=dist.new_group(backend="gloo", timeout=timeout))


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
