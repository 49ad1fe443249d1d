"""A worker rank's engine loop (tensor/pipeline parallel): rank 0 is the engine process
(`EngineCore`); every other rank loads its shard, sizes its cache as rank 0 says, then runs
each model call rank 0 broadcasts until rank 0 says stop. The processes and the group are
`parallel/executor.py`'s; the core hands it this loop (parallel/ never imports the engine).
"""

from __future__ import annotations

import torch.distributed as dist

from ..config import EngineConfig
from ..kernels.tp_comm import attach
from ..model.load import load_model
from ..parallel.state import init_parallel
from .model_runner import ModelRunner


def run_worker(config: EngineConfig) -> None:
    """A worker rank in an initialized process group: load the shard, size the cache as rank
    0 says, then run each step rank 0 broadcasts until it says stop."""
    p = config.parallel
    par = attach(init_parallel(p.tensor_parallel_size, p.pipeline_parallel_size, p.enable_expert_parallel))
    model = load_model(
        config.model.path,
        dtype=config.model.dtype,
        backend=config.model.backend,  # as rank 0 chooses: the native kernels where they can run a shard
        parallel=par,
        nvfp4_mode=config.model.nvfp4_mode,
    )
    sizes = [None]
    dist.broadcast_object_list(sizes, src=0)
    runner = ModelRunner(
        model, config.cache, config.scheduler.max_model_len, config.scheduler.max_num_seqs, num_blocks=sizes[0]
    )
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        runner.forward(box[0])
    if par.comm is not None:
        par.comm.close()
    dist.destroy_process_group()
