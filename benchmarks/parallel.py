"""Tensor parallel against one process, side by side in one run, with the time rank 0 spends
in collectives per step.

    python benchmarks/parallel.py [--model DIR] [--tokens 64] [--batches 1,4] [--pairs 2]

For each batch size, `LLM(tensor_parallel_size=1)` and `LLM(tensor_parallel_size=2)` decode
the same greedy requests (ignore_eos, `--tokens` each) `--pairs` times, alternately; the
figure is the median output tokens/s of each, their ratio, and rank 0's seconds inside
all-reduce/all-gather per engine step at TP=2 (gloo, one machine). On a 2-core CPU a
slowdown is expected: each rank gets one core, and every layer adds two all-reduces.
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import time


def measure(tp: int, model: str | None, batch: int, tokens: int, pairs: int) -> dict:
    from musespark import LLM, SamplingParams
    from musespark.parallel import state

    llm = LLM(
        model=model, tensor_parallel_size=tp, max_model_len=tokens + 64, enable_prefix_caching=False, backend="torch"
    )  # the same backend on both sides (sharded ranks run torch)
    prompts = [f"def f{i}(x):" for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    rates, comm = [], []
    for _ in range(pairs):
        steps, spent = llm.engine.num_steps, state.COMM_SECONDS[0]
        t = time.perf_counter()
        llm.generate(prompts, params)
        rates.append(batch * tokens / (time.perf_counter() - t))
        comm.append((state.COMM_SECONDS[0] - spent) / max(1, llm.engine.num_steps - steps))
    if llm.engine.core.executor is not None:
        llm.engine.core.executor.shutdown()
    return {"tok_s": round(statistics.median(rates), 1), "comm_ms_per_step": round(statistics.median(comm) * 1e3, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batches", default="1,4")
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args()
    from musespark.bench.common import print_json

    result: dict = {"benchmark": "parallel", "backend": "torch"}
    for batch in (int(b) for b in args.batches.split(",")):
        one = measure(1, args.model, batch, args.tokens, args.pairs)
        two = measure(2, args.model, batch, args.tokens, args.pairs)
        result[f"batch{batch}"] = {"tp1": one, "tp2": two, "tp2_over_tp1": round(two["tok_s"] / one["tok_s"], 3)}
    print_json(result)


if __name__ == "__main__":
    main()
