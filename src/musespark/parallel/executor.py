"""Tensor- and pipeline-parallel execution: the engine process is rank 0 (it schedules and
samples), and it spawns tp * pp - 1 worker processes (`multiprocessing` "spawn") joined over
gloo. Each step rank 0 broadcasts the model call's inputs (`StepInputs`: token ids,
positions, slots, block tables, which rows to score), every rank runs the same forward on
its shard, and the collectives inside give rank 0 the full logits (docs/parallel.md §9). What a
worker rank runs is the engine's loop (`engine/parallel_worker.py`), handed in by the engine:
this module only makes the processes and the group.

Several machines: launch one process per rank with torchrun (or anything that sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT); rank 0 serves, the others run worker loops (NCCL
when CUDA is present, else gloo). Then the launcher, not the watchdog, watches the ranks.

Signals: workers ignore SIGINT and SIGTERM (sent to the whole process group they reach every
rank); rank 0 shuts down and stops them, so a group-wide SIGTERM is a clean exit (status 0).

Faults: a watchdog thread on rank 0 polls spawned workers; when one exits, it logs which rank
and its exit code, stops the others and ends this process with status 1 — a collective
waiting on a dead peer would otherwise hang for ever. Workers die with their parent
(PR_SET_PDEATHSIG), so a killed engine leaves no orphans; a clean shutdown broadcasts a
stop and joins them.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import numa
from .state import ParallelContext, init_parallel
from .step_channel import StepChannel

logger = logging.getLogger("musespark.parallel")
WorkerLoop = Callable[[Any], None]  # a worker rank's loop, given the engine config
_TIMEOUT = timedelta(minutes=10)  # loading a large shard can take minutes before the first collective


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (no orphaned workers)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launched_externally() -> bool:
    """True under torchrun (or any launcher that sets RANK, WORLD_SIZE and MASTER_ADDR): the
    ranks already exist, on one machine or several; nothing is spawned."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _worker(rank: int, world: int, port: int, config: Any, worker_loop: WorkerLoop) -> None:
    """A spawned worker rank: join the group, then run `worker_loop(config)`."""
    _die_with_parent()
    # Ctrl-C and SIGTERM sent to the whole process group (a terminal, `timeout`, systemd, `kill -- -PGID`)
    # are rank 0's to act on: it shuts down cleanly and broadcasts the stop that ends this loop. A
    # worker dying of them first would look like a crashed rank; a dead rank 0 still takes us with it
    # (PR_SET_PDEATHSIG).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    place = numa.placement(rank, world)
    numa.pin(place)  # before loading: the shard is first touched on this rank's node
    if place is not None:
        logger.info("%s", place.describe())
    torch.set_num_threads(len(place.cpus) if place is not None else max(1, torch.get_num_threads() // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=_TIMEOUT
    )
    worker_loop(config)


class TensorParallelExecutor:
    """Rank 0's side: spawn the workers, join the group, broadcast each step, watch them.

    `worker_loop(config)` is what every other rank runs once the group is joined (the
    engine's loop, `engine/parallel_worker.py`): a module-level function, since spawned
    processes receive it by its qualified name."""

    def __init__(self, config: Any, worker_loop: WorkerLoop) -> None:
        par = config.parallel
        self.world = par.world_size  # tensor_parallel_size * pipeline_parallel_size
        self.workers: list[Any] = []
        self._closed = False
        self._threads = torch.get_num_threads()  # rank 0's, restored at shutdown
        self._affinity: tuple[int, ...] | None = None
        self.placement: numa.Placement | None = None  # rank 0's (spawned ranks place themselves)
        self.channel: StepChannel | None = None  # the step messages through shared memory (one host)
        self._sent = 0
        if launched_externally():  # torchrun: rank 0 serves, every other rank is a worker
            world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
            if world != self.world:
                raise ValueError(
                    f"the launcher started {world} ranks but tensor_parallel_size x "
                    f"pipeline_parallel_size = {self.world}"
                )
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "gloo":  # CPU ranks: placed among the ranks the launcher started on this host
                local = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
                self._place(numa.placement(*local))
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=_TIMEOUT)
            if rank != 0:
                worker_loop(config)
                raise SystemExit(0)  # a worker rank never serves: it ends with rank 0's stop
        else:
            port = _free_port()
            ctx = mp.get_context("spawn")
            self.workers = [
                ctx.Process(
                    target=_worker,
                    args=(r, self.world, port, config, worker_loop),
                    daemon=True,
                    name=f"musespark-tp{r}",
                )
                for r in range(1, self.world)
            ]
            for w in self.workers:
                w.start()
            # Rank 0 shares the host's cores with the workers: its own node and CPUs (after
            # starting them: they inherit the CPUs a process may use when it starts).
            self._place(numa.placement(0, self.world))
            if self.placement is None:
                torch.set_num_threads(max(1, self._threads // self.world))
            self._watch = threading.Thread(target=self._watchdog, name="musespark-tp-watchdog", daemon=True)
            self._watch.start()
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=self.world, timeout=_TIMEOUT
            )
        self.parallel: ParallelContext = init_parallel(
            par.tensor_parallel_size, par.pipeline_parallel_size, par.enable_expert_parallel
        )
        atexit.register(self.shutdown)

    def _place(self, place: numa.Placement | None) -> None:
        """Pins this process's threads to its placement (parallel/numa.py), one thread per CPU."""
        self.placement = place
        self._affinity = numa.pin(place)
        if place is not None:
            torch.set_num_threads(len(place.cpus))
            logger.info("%s", place.describe())

    def start(self, num_blocks: int) -> None:
        """Tell the workers how many KV blocks rank 0's scheduler hands out, and where the step
        channel is (ranks of one host: parallel/step_channel.py; else None: gloo)."""
        local = not launched_externally() or os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
        if local and dist.get_backend() == "gloo":
            self.channel = StepChannel.create(self.world)
        dist.broadcast_object_list([(num_blocks, None if self.channel is None else self.channel.path)], src=0)

    def broadcast(self, inputs: Any) -> None:
        if self.channel is None:
            dist.broadcast_object_list([inputs], src=0)
            return
        self.channel.send(inputs)
        self._sent += 1
        if self._sent == 2:  # every worker has read the first message, so has opened the file
            self.channel.unlink()

    def _watchdog(self) -> None:
        while not self._closed:
            for rank, w in enumerate(self.workers, start=1):
                if w.exitcode is not None and not self._closed:
                    logger.error(
                        "tensor-parallel worker rank %d (pid %s) exited with code %s; stopping every rank",
                        rank,
                        w.pid,
                        w.exitcode,
                    )
                    print(
                        f"musespark: tensor-parallel worker rank {rank} exited with code {w.exitcode}; "
                        "stopping every rank",
                        flush=True,
                    )
                    for other in self.workers:
                        if other.is_alive():
                            other.kill()
                    os._exit(1)  # a collective waiting on the dead rank would never return
            time.sleep(0.2)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.channel is not None:
                self.channel.unlink()
                self.channel.send(None, timeout=10.0)
            else:
                dist.broadcast_object_list([None], src=0)
        except Exception:  # a broken group: the workers are killed below
            pass
        for w in self.workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
        if self.parallel.comm is not None:
            self.parallel.comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads)
        if self._affinity is not None:
            os.sched_setaffinity(0, self._affinity)
