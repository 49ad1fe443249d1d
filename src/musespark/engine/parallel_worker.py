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
from ..parallel.step_channel import StepChannel
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
    start = [None]
    dist.broadcast_object_list(start, src=0)
    num_blocks, channel_path = start[0]  # TensorParallelExecutor.start
    runner = ModelRunner(
        model, config.cache, config.scheduler.max_model_len, config.scheduler.max_num_seqs, num_blocks=num_blocks
    )
    channel = None if channel_path is None else StepChannel(channel_path, par.rank, par.world_size)
    while True:
        if channel is not None:
            inputs = channel.recv()
        else:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            inputs = box[0]
        if inputs is None:
            break
        runner.forward(inputs)
    if par.comm is not None:
        par.comm.close()
    dist.destroy_process_group()
