"""Tensor- and expert-parallel ranks on the native CPU kernels (docs/parallel.md §11): the
ranks of one host sum their partial products through shared memory (kernels/tp_comm.py), the
fused blocks split at the row-parallel products, and a sharded model on the cpu backend gives
what one process on the cpu backend gives: logits within the stated tolerance, the same greedy
tokens; through the engine, `LLM(tensor_parallel_size=2)` picks the native kernels on its ranks
and generates the same text as one process, with and without expert parallelism."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import save_random_checkpoint
from test_parallel import CFG, PROMPT, _port

from musespark import LLM, SamplingParams
from musespark.config import ModelConfig
from musespark.kernels import cpu
from musespark.model import load_model

pytestmark = pytest.mark.skipif(cpu.native_ops() is None, reason="needs the native CPU kernels")
STEPS = 12
# Relative to the largest logit. fp32: the ranks' partial sums only change the fp32 summation
# order. bf16: each rank's o_proj/down partial stays fp32 until the sum is rounded once, but
# the native bf16 products sum in another order than one process's (measured: < 2e-3).
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
CAPACITY = 96  # floats per slot: every reduction of this test's model goes in several chunks


def _rank(rank: int, world: int, ep: bool, ckpt: str, port: int, out: str, dtype: str) -> None:
    torch.set_num_threads(1)
    from musespark.kernels.tp_comm import attach
    from musespark.parallel.state import init_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        par = attach(init_parallel(world, 1, ep), capacity=CAPACITY)
        assert par.comm is not None
        # the communicator itself: a sum in chunks, and an exact gather
        x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
        summed = par.all_reduce_fp32(x)
        gathered = par.gather_last_dim(torch.full((2, 3), float(rank)))
        model = load_model(ckpt, dtype=dtype, backend="cpu", parallel=par)
        result = {
            "backend": model.backend.name,
            "sum": summed,
            "gather": gathered,
            "logits": model.prompt_logits(PROMPT),
            "greedy": model.greedy_continuation(PROMPT, STEPS),
        }
        torch.save(result, Path(out) / f"rank{rank}.pt")
        par.comm.close()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("native") / "ckpt", ModelConfig(**CFG), seed=3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_native_ranks_match_one_native_process(checkpoint, tmp_path, ep, dtype):
    one = load_model(checkpoint, dtype=dtype, backend="cpu")
    ref_logits, ref_greedy = one.prompt_logits(PROMPT), one.greedy_continuation(PROMPT, STEPS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _rank,
        args=(2, ep, str(checkpoint), _port(), str(tmp_path), dtype),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        assert res["backend"] == "cpu"
        assert torch.equal(res["sum"], torch.arange(1000, dtype=torch.float32) * 3)
        assert torch.equal(res["gather"], torch.tensor([[0.0] * 3 + [1.0] * 3] * 2))
        err = ((res["logits"] - ref_logits).abs().max() / ref_logits.abs().max()).item()
        print(f"{dtype} TP2 (ep={ep}) native rank {r}: relative logit error {err:.3g}")
        assert err <= TOLERANCE[dtype], (r, err)
        assert res["greedy"] == ref_greedy, r


PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):\n", "import os\nimport sys\n\n"]


def _generate(**parallel) -> tuple[list[list[int]], str]:
    llm = LLM(dtype="bfloat16", max_model_len=128, **parallel)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs], llm.engine.core.model.backend.name
    finally:
        if llm.engine.core.executor is not None:
            llm.engine.core.executor.shutdown()


@pytest.fixture(scope="module")
def one_process():
    return _generate()


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_llm_tp2_runs_native_with_the_same_tokens(one_process, ep):
    tokens, backend = _generate(tensor_parallel_size=2, enable_expert_parallel=ep)
    ref_tokens, ref_backend = one_process
    assert ref_backend == backend == "cpu"
    assert tokens == ref_tokens
    # the process is left as it was: one process on the cpu backend computes as before
    assert _generate() == one_process
