"""`musespark bench latency`: one batch, timed step by step (vLLM's benchmark_latency).

A batch of --batch-size random prompts of --input-len tokens each generates exactly
--output-len tokens (greedy, ignore_eos), --num-iters times after --num-iters-warmup.
Reported, over iterations: end-to-end latency of the batch (mean, p10..p99); prefill time
(from submit until every request has its first token, i.e. the batch's TTFT); per-output-token
decode time (each later engine step, one token for every request) p50/p90/p99; and decode
tokens/s for the batch. With --speculative-config a step may yield several tokens per
request: decode_ms_per_token is then per step, decode_tokens_per_s stays per token, and
"speculative" holds the mean acceptance length.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from ..sampling_params import SamplingParams
from ..startup import iterations
from .common import percentiles, print_json
from .engine_args import add_model_args, build_llm, model_info, random_prompt, spec_decode_summary


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--num-iters-warmup", type=int, default=2)


def _one_batch(engine: Any, prompts: list[dict], params: SamplingParams, tag: str) -> tuple[float, float, list[float]]:
    """(end-to-end s, prefill s, [decode step s]) for one batch run to completion."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    have_first: set[str] = set()
    prefill = None
    steps: list[float] = []
    last = start
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        if prefill is None:
            have_first.update(o.request_id for o in outs if o.outputs and o.outputs[0].token_ids)
            if len(have_first) == len(ids):
                prefill = now - start
        else:
            steps.append(now - last)
        last = now
    return last - start, prefill if prefill is not None else last - start, steps


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    llm, path = build_llm(args, args.input_len + args.output_len)
    engine = llm.engine
    rng = random.Random(args.seed)
    prompts = [random_prompt(rng, args.input_len, engine.config.vocab_size) for _ in range(args.batch_size)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in iterations(args.num_iters_warmup, "Warmup iterations"):
        _one_batch(engine, prompts, params, f"warmup{i}")
    latencies, prefills, decode_steps = [], [], []
    for i in iterations(args.num_iters, "Profiling iterations"):
        total, prefill, steps = _one_batch(engine, prompts, params, f"iter{i}")
        latencies.append(total)
        prefills.append(prefill)
        decode_steps.extend(steps)
    decode_time = sum(decode_steps)
    decode_tokens = args.batch_size * (args.output_len - 1) * args.num_iters
    return {
        "benchmark": "latency",
        **model_info(llm, path),
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
        "seed": args.seed,
        "avg_latency_s": sum(latencies) / len(latencies),
        "latency_ms": percentiles(latencies, ps=(10, 25, 50, 75, 90, 99)),
        "prefill_ms": percentiles(prefills),
        "decode_ms_per_token": percentiles(decode_steps),
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else None,
        "latencies_s": latencies,
        "speculative": spec_decode_summary(llm),
    }


def main(args: argparse.Namespace) -> int:
    out = run(args)
    lat, pre, dec = out["latency_ms"], out["prefill_ms"], out["decode_ms_per_token"]
    print(f"batch {args.batch_size} x ({args.input_len} in, {args.output_len} out), {args.num_iters} iters")
    print(f"  latency  mean {lat['mean']:9.2f} ms  p50 {lat['p50']:9.2f}  p90 {lat['p90']:9.2f}  p99 {lat['p99']:9.2f}")
    print(f"  prefill  mean {pre['mean']:9.2f} ms  p50 {pre['p50']:9.2f}  p90 {pre['p90']:9.2f}  p99 {pre['p99']:9.2f}")
    print(f"  decode/token  {dec['mean']:9.2f} ms  p50 {dec['p50']:9.2f}  p90 {dec['p90']:9.2f}  p99 {dec['p99']:9.2f}")
    if out["decode_tokens_per_s"]:
        print(f"  decode   {out['decode_tokens_per_s']:.1f} tokens/s (batch)")
    if out["speculative"] and out["speculative"]["mean_acceptance_length"] is not None:
        print(f"  speculative: mean acceptance length {out['speculative']['mean_acceptance_length']:.2f}")
    print_json(out)
    return 0
