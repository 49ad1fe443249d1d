"""The engine across processes: `LLM(tensor_parallel_size=2)` (with and without expert
parallelism), `pipeline_parallel_size=2` and TP2 x PP2 give the same greedy text as one process
for mixed-length prompts with prefix caching and preemption active; `musespark serve -tp 2`
answers the `openai` client the same; a worker killed mid-generation makes the server exit non-zero within 30 s, naming
the rank, and leaves no orphan processes."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import psutil
import pytest
from test_server import ServerProcess, metrics

from musespark import LLM, SamplingParams

SHARED = (
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path, name=None):\n        self.path = path\n"
)
PROMPTS = [
    SHARED + "        self.name",
    "def fibonacci(n):",
    SHARED + "\n    def load(self):\n",
    "x = [",
    SHARED + "        self.items = []\n",
    "class Stack:\n    def push(self, item):\n",
]
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=6, kv_cache_memory=2_400_000, block_size=16)


def run(**parallel) -> tuple[list[str], int, int]:
    # Each rank's KV cache holds its own heads: half the bytes per block at tp=2, so half
    # the budget gives the same blocks (and the same schedule) as one process.
    tp = parallel.get("tensor_parallel_size", 1)
    llm = LLM(**{**ENGINE, "kv_cache_memory": ENGINE["kv_cache_memory"] // tp}, **parallel)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        stats = llm.engine.get_stats()
        return [o.outputs[0].text for o in outs], stats.num_preemptions, stats.prefix_hits
    finally:
        executor = llm.engine.core.executor
        if executor is not None:
            executor.shutdown()


@pytest.fixture(scope="module")
def one_process():
    return run()


@pytest.mark.parametrize(
    "tp, pp, ep", [(2, 1, False), (2, 1, True), (1, 2, False), (2, 2, True)], ids=["tp2", "tp2-ep", "pp2", "tp2-ep-pp2"]
)
def test_llm_parallel_matches_one_process(one_process, tp, pp, ep):
    texts, preemptions, hits = run(tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep)
    ref_texts, ref_preemptions, ref_hits = one_process
    assert ref_preemptions > 0 and ref_hits > 0  # the case exercises preemption and prefix caching
    assert texts == ref_texts
    assert (preemptions, hits) == (ref_preemptions, ref_hits)


@pytest.mark.slow
def test_serve_tp2_and_a_dead_worker(tmp_path, one_process):
    # The same engine settings as `run` (half the per-rank KV budget: the same blocks), so the
    # server schedules as one process does: prefix hits and preemptions included.
    srv = ServerProcess(
        tmp_path / "tp.log",
        "-tp",
        "2",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "6",
        "--kv-cache-memory",
        str(ENGINE["kv_cache_memory"] // 2),
        "--block-size",
        "16",
    )
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
        got = client.completions.create(
            model="musespark-tiny", prompt=PROMPTS, max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
        )
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == one_process[0]
        m = metrics(srv.url)
        assert m["vllm:prefix_cache_hits_total"] > 0 and m["vllm:num_preemptions_total"] > 0
        children = psutil.Process(srv.proc.pid).children(recursive=True)  # the worker and spawn's resource tracker
        workers = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 1

        def stream() -> None:  # a long generation in flight when the worker dies
            try:
                body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
                with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.5)
        workers[0].send_signal(signal.SIGKILL)
        code = srv.proc.wait(30)  # exits on its own, non-zero
        assert code != 0
        t.join(30)
        log = (tmp_path / "tp.log").read_text()
        assert "worker rank 1" in log and "exited" in log
        deadline = time.monotonic() + 10
        while (
            any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children) and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)  # no orphans
    finally:
        srv.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_signals_tear_down_every_worker(tmp_path, sig):
    srv = ServerProcess(tmp_path / "sig.log", "-tp", "2")
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        assert any("spawn_main" in " ".join(p.cmdline()) for p in children)
        srv.proc.send_signal(sig)
        # SIGTERM: a clean exit; Ctrl-C: uvicorn re-raises SIGINT once it has shut down.
        assert srv.proc.wait(30) == (0 if sig == signal.SIGTERM else -signal.SIGINT)
        deadline = time.monotonic() + 10
        while (
            any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children) and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)
    finally:
        srv.stop()


@pytest.mark.slow
def test_torchrun_launch(tmp_path):
    """The multi-node path, on one machine: torchrun starts both ranks; rank 0 generates,
    rank 1 serves it as a worker; the text equals one process's."""
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).with_name("torchrun")
    common = ["--max-tokens", "24", "--temperature", "0", "--dtype", "float32", "def fibonacci(n):"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, "-m", "musespark", "generate", "--backend", "torch", *common],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    two = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "musespark",
            "generate",
            "--tensor-parallel-size",
            "2",
            *common,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.strip()
