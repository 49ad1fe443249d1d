"""Tensor parallel against one process on the same cores, alternated, with the time rank 0
spends in collectives per step.

    python benchmarks/parallel.py [--model DIR | --preset bench-small] [--tokens 64] [--batches 1,4]
                                  [--pairs 3] [--cpus 2] [--backend auto] [--seed 0]

For each batch size, `LLM(tensor_parallel_size=1)` with `--cpus` threads and
`LLM(tensor_parallel_size=2)` with `--cpus / 2` threads per rank decode the same seeded random
prompts (greedy, ignore_eos, `--tokens` each), each in a fresh process, alternating TP=1 and
TP=2 `--pairs` times so that a busy neighbour slows both alike. The process is first confined to
`--cpus` of the CPUs it may use (so on a larger machine the comparison is still "two threads
against one thread per rank"); the TP=2 ranks split them (parallel/numa.py). The figure is each
side's median output tokens/s (decode: the prompts are 8 tokens, the warm-up run excluded),
their ratio, and rank 0's milliseconds inside all-reduce/all-gather per engine step at TP=2.
A third side, one process on `--cpus / 2` threads, gives `tp2_over_ideal_tp1`: TP=2 against
twice that (one process whose threads scaled perfectly), a floor for the ratio that holds when
neighbours load the machine: a process whose threads wait for each other at every parallel
region stalls far more under load than single-threaded ranks do.
`--backend auto` runs the native kernels on both sides (the TP ranks sum through shared
memory, kernels/tp_comm.py); `--backend torch` gives the old comparison. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(args: argparse.Namespace, tp: int, batch: int, threads: int) -> dict:
    """One side in this process: load, warm up, time `--tokens` decode steps of `batch` requests."""
    import random

    import torch

    from musespark import LLM, SamplingParams
    from musespark.bench.presets import make_checkpoint
    from musespark.parallel import state

    torch.set_num_threads(threads)  # TP: rank 0's; the executor gives each rank its share of the CPUs
    model = args.model or str(make_checkpoint(args.preset))
    llm = LLM(
        model=model,
        tensor_parallel_size=tp,
        max_model_len=args.tokens + 64,
        enable_prefix_caching=False,
        backend=args.backend,
        seed=args.seed,
    )
    rng = random.Random(args.seed)
    vocab = llm.engine.core.model.config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(8)]} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    steps, spent = llm.engine.num_steps, state.COMM_SECONDS[0]
    t = time.perf_counter()
    llm.generate(prompts, params)
    rate = batch * args.tokens / (time.perf_counter() - t)
    comm = (state.COMM_SECONDS[0] - spent) / max(1, llm.engine.num_steps - steps)
    backend = type(llm.engine.core.model.backend).__name__
    if llm.engine.core.executor is not None:
        llm.engine.core.executor.shutdown()
    return {"tok_s": rate, "comm_ms_per_step": comm * 1e3, "backend": backend}


def confine(cpus: int) -> list[int]:
    """Confines this process (and the ranks it starts) to its first `cpus` allowed CPUs."""
    allowed = sorted(os.sched_getaffinity(0))[:cpus]
    os.sched_setaffinity(0, allowed)
    return allowed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default="bench-small")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batches", default="1,4")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "TP,BATCH,THREADS": one side, in a child
    args = p.parse_args()
    if args.one is not None:
        tp, batch, threads = (int(x) for x in args.one.split(","))
        print(json.dumps(measure(args, tp, batch, threads)), flush=True)
        return
    from musespark.bench.common import print_json

    cpus = confine(args.cpus)
    child = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    result: dict = {"benchmark": "parallel", "backend": args.backend, "cpus": cpus, "preset": args.preset}
    for batch in (int(b) for b in args.batches.split(",")):
        # (TP, threads per rank): one process on every CPU, one process on one thread per rank's
        # share (what perfect thread scaling would double), TP=2 with one share per rank.
        sides_of = {"tp1": (1, len(cpus)), "tp1_one_share": (1, max(1, len(cpus) // 2)), "tp2": (2, len(cpus) // 2)}
        runs: dict[str, list[dict]] = {name: [] for name in sides_of}
        for _ in range(args.pairs):
            for name, (tp, threads) in sides_of.items():
                cmd = [*child, "--one", f"{tp},{batch},{threads}"]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        sides = {
            name: {
                "tok_s": round(statistics.median(r["tok_s"] for r in rs), 1),
                "runs": [round(r["tok_s"], 1) for r in rs],
                "comm_ms_per_step": round(statistics.median(r["comm_ms_per_step"] for r in rs), 3),
                "backend": rs[0]["backend"],
                "threads_per_rank": sides_of[name][1],
            }
            for name, rs in runs.items()
        }
        tp2 = sides["tp2"]["tok_s"]
        result[f"batch{batch}"] = {
            **sides,
            "tp2_over_tp1": round(tp2 / sides["tp1"]["tok_s"], 3),
            # against one process if its threads scaled perfectly: a floor for tp2_over_tp1 that a
            # busy machine (which stalls a multi-threaded process more than single-threaded ranks) cannot inflate
            "tp2_over_ideal_tp1": round(tp2 / (2 * sides["tp1_one_share"]["tok_s"]), 3),
        }
    print_json(result)


if __name__ == "__main__":
    main()
