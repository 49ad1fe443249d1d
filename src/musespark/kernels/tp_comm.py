"""The tensor-parallel ranks' shared-memory all-reduce on one host (csrc/blocks/tp_comm.cpp).

On one machine the TP ranks of a stage map one file in /dev/shm and sum their partial
products through it: each rank copies its values into its own slot, publishes a sequence
number and sums every rank's slot in rank order once all have published (so every rank holds
the same bits). A gloo all-reduce of one decode row costs tens of microseconds in the kernel's
socket path; this costs a copy and a cache-line handshake. The fused blocks call the same
communicator at their split point (docs/parallel.md §11), so a sharded decode step stays one
native call per rank.

`attach(par)` makes it for a rank's `ParallelContext` (every TP rank of the stage calls it,
after `init_parallel`): it returns the context with `comm` set, or the context unchanged when
the ranks are not on one host, the native kernels are unavailable, or there is no TP. One
communicator per process: `close()` detaches it (the executor does at shutdown).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from typing import Any

import torch

from ..parallel.state import ParallelContext
from . import cpu

_LINE = 64  # bytes per rank's sequence counter (tp_comm.cpp kLine)
CAPACITY = 1 << 20  # floats per slot: a decode step's rows in one piece, a prompt's in chunks of 4 MiB


class ShmComm:
    """One rank's end of the shared-memory all-reduce (ParallelContext.comm)."""

    def __init__(self, ops: Any, region: torch.Tensor, rank: int, world: int, capacity: int) -> None:
        self.ops, self.region, self.rank, self.world, self.capacity = ops, region, rank, world, capacity
        ops.tp_comm_attach(region, rank, world, capacity)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous fp32) <- the sum over the ranks, in rank order, in place."""
        return self.ops.tp_all_reduce_(x)

    def blocks(self, on: bool, expert_parallel: bool) -> bool:
        """Whether the fused blocks reduce at their split point (the cpu backend's step); the previous setting."""
        return bool(self.ops.tp_comm_blocks(on, expert_parallel))

    def close(self) -> None:
        if self.region is not None:
            self.ops.tp_comm_detach()
            self.region = None


def region_bytes(world: int, capacity: int) -> int:
    return world * _LINE + 2 * world * capacity * 4


def one_host(par: ParallelContext) -> bool:
    """Whether every rank of this process group runs on this machine: spawned ranks always;
    under a launcher, when it started every rank on this node (LOCAL_WORLD_SIZE == WORLD_SIZE)."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return True
    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]


def attach(par: ParallelContext, capacity: int = CAPACITY) -> ParallelContext:
    """`par` with a shared-memory communicator over its TP group, where one can be made (the
    module docstring); collective: every rank of the TP group calls it."""
    import torch.distributed as dist

    ops = cpu.native_ops()
    # CPU ranks only (a gloo group): NCCL ranks sum on their GPUs.
    usable = par.tp_size > 1 and dist.get_backend() == "gloo" and one_host(par) and ops is not None
    # Every rank of the group must take the same choice (each would otherwise wait for the others).
    flags = [None] * par.world_size
    dist.all_gather_object(flags, usable)
    if not all(flags):
        return par
    nbytes = region_bytes(par.tp_size, capacity)
    leader = par.stage_rank(par.pp_rank) - par.tp_rank  # the global rank of this stage's TP rank 0
    box: list[Any] = [None]
    if par.tp_rank == 0:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="musespark-tp-", dir=base)
        os.ftruncate(fd, nbytes)  # zero-filled: every counter starts at 0
        os.close(fd)
        box[0] = path
    dist.broadcast_object_list(box, src=leader, group=par.tp_group)
    region = torch.from_file(box[0], shared=True, size=nbytes, dtype=torch.uint8)
    dist.barrier(group=par.tp_group)  # every rank has mapped it: the name can go
    if par.tp_rank == 0:
        os.unlink(box[0])
    return replace(par, comm=ShmComm(ops, region, par.tp_rank, par.tp_size, capacity))
