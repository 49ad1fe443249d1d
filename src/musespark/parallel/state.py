"""Where this process sits in a tensor/pipeline/expert-parallel deployment, and the few
collectives the sharded decoder needs (torch.distributed: gloo on CPUs, NCCL on GPUs).

Rank layout (vLLM's, docs/parallel.md §0): global rank = pp_rank * tp + tp_rank, TP innermost.
A TP group is a stage's `tp` consecutive ranks; with expert parallelism the EP group is the
TP group (DP = 1). `ParallelContext()` (the default) is one process: every helper is then
the identity and the model is built exactly as without parallelism.

Numerics (docs/parallel.md §2): partial sums (row-parallel o_proj and dense down_proj, TP-split
experts) are reduced in fp32 and rounded once afterwards; the embedding all-reduce, the EP
combine and the vocab gather have one contributor per element, so they are exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .plan import expert_range, pp_indices


@dataclass(frozen=True)
class ParallelContext:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    expert_parallel: bool = False
    tp_group: Any = None  # torch.distributed ProcessGroup of this stage's TP ranks (None: one process)
    # The TP group's shared-memory all-reduce when its ranks share a host (kernels/tp_comm.py
    # ShmComm: `all_reduce_(x)` sums a contiguous fp32 tensor in place, in rank order); None: gloo.
    comm: Any = None

    def __post_init__(self) -> None:
        for name, size, rank in (
            ("tensor_parallel_size", self.tp_size, self.tp_rank),
            ("pipeline_parallel_size", self.pp_size, self.pp_rank),
        ):
            if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
                raise ValueError(f"{name}={size!r} with rank {rank!r}: need size >= 1 and 0 <= rank < size")

    # -- layout ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of this TP rank's peer in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank

    @property
    def ep_size(self) -> int:
        return self.tp_size if self.expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.expert_parallel else 0

    # -- how things split --------------------------------------------------------------------
    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, size) of this TP rank's equal share of `n` (heads, intermediate width)."""
        if n % self.tp_size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.tp_size}")
        size = n // self.tp_size
        return self.tp_rank * size, size

    def vocab_split(self, vocab: int) -> tuple[int, int]:
        """(start, rows) of this rank's vocabulary block: ceil(V / tp) rows each (the last
        block is zero-padded past V, so the gather needs equal blocks)."""
        rows = -(-vocab // self.tp_size)
        return self.tp_rank * rows, rows

    def expert_split(self, num_experts: int) -> tuple[int, int]:
        """(first expert, count) this EP rank owns: a contiguous block, the remainder going
        one each to the low ranks (vLLM's "linear" placement; `plan.expert_range`)."""
        start, end = expert_range(num_experts, self.ep_rank, self.ep_size)
        return start, end - start

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of this stage's layers (vLLM's get_pp_indices; `plan.pp_indices`)."""
        return pp_indices(num_layers, self.pp_rank, self.pp_size)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group in fp32, rounded once to x's dtype (identity for tp=1)."""
        if self.tp_size == 1:
            return x
        acc = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # reduced in place
        t = time.perf_counter()
        if self.comm is not None:
            self.comm.all_reduce_(acc)
        else:
            import torch.distributed as dist

            dist.all_reduce(acc, group=self.tp_group)
        COMM_SECONDS[0] += time.perf_counter() - t
        return acc.to(x.dtype)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., tp * n], rank-major (identity for tp=1)."""
        if self.tp_size == 1:
            return x
        if self.comm is not None:  # each block placed in zeros and summed: one contributor per element, exact
            n = x.shape[-1]
            full = torch.zeros(*x.shape[:-1], self.tp_size * n, dtype=torch.float32)
            full[..., self.tp_rank * n : (self.tp_rank + 1) * n] = x
            t = time.perf_counter()
            self.comm.all_reduce_(full)
            COMM_SECONDS[0] += time.perf_counter() - t
            return full.to(x.dtype)
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        t = time.perf_counter()
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        COMM_SECONDS[0] += time.perf_counter() - t
        return torch.cat(parts, dim=-1)

    def send_next(self, s: torch.Tensor) -> None:
        """Pipeline: this stage's fp32 stream [T, H] to the same TP rank of the next stage."""
        import torch.distributed as dist

        dist.send(s.float().contiguous(), dst=self.stage_rank(self.pp_rank + 1))

    def recv_prev(self, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
        import torch.distributed as dist

        s = torch.empty(shape, dtype=torch.float32, device=device)
        dist.recv(s, src=self.stage_rank(self.pp_rank - 1))
        return s


SINGLE = ParallelContext()

# Seconds this process has spent inside TP collectives (benchmarks/parallel.py reads it).
COMM_SECONDS = [0.0]


def init_parallel(tp: int, pp: int = 1, expert_parallel: bool = False) -> ParallelContext:
    """This process's context in an initialized default process group of tp * pp ranks.
    Every rank must call it (group creation is collective)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp * pp:
        raise ValueError(
            f"the process group has {world} ranks but tensor_parallel_size={tp} x "
            f"pipeline_parallel_size={pp} needs {tp * pp}"
        )
    group = None
    for stage in range(pp):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        g = dist.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            group = g
    return ParallelContext(
        tp_size=tp, tp_rank=rank % tp, pp_size=pp, pp_rank=rank // tp, expert_parallel=expert_parallel, tp_group=group
    )
