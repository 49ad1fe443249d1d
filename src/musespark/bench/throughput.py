"""`musespark bench throughput`: N seeded random requests through the offline engine
(vLLM's benchmark_throughput, random dataset).

Each prompt's length is drawn (seeded) from --input-len LO,HI and its output length from
--output-len LO,HI (a single N means exactly N); every request generates exactly its output
length (greedy, ignore_eos). All requests are submitted at once to `LLM.generate`.
Reported: elapsed s, requests/s, output tokens/s, total (prompt + output) tokens/s.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from ..sampling_params import SamplingParams
from ..startup import iterations, progress_enabled
from .common import parse_range, print_json
from .engine_args import add_model_args, build_llm, model_info, random_prompt, spec_decode_summary


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(16, 512), help="prompt tokens: N or LO,HI")
    p.add_argument("--output-len", type=parse_range, default=(16, 512), help="output tokens: N or LO,HI")
    p.add_argument(
        "--num-iters-warmup",
        type=int,
        default=1,
        help="untimed runs of the same workload first (bf16 on CPU pays a large one-time cost per new shape)",
    )


def make_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int
) -> list[tuple[dict, int]]:
    """[(prompt, output_len)] seeded; lengths uniform in the inclusive ranges."""
    rng = random.Random(seed)
    lens = [(rng.randint(*input_len), rng.randint(*output_len)) for _ in range(num_prompts)]
    return [(random_prompt(rng, n_in, vocab_size), n_out) for n_in, n_out in lens]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    llm, path = build_llm(args, args.input_len[1] + args.output_len[1])
    work = make_workload(args.num_prompts, args.input_len, args.output_len, llm.engine.config.vocab_size, args.seed)
    prompts = [p for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    for _ in iterations(args.num_iters_warmup, "Warmup iterations"):
        llm.generate(prompts, params)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress_enabled())
    elapsed = time.perf_counter() - start
    in_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "benchmark": "throughput",
        **model_info(llm, path),
        "num_prompts": args.num_prompts,
        "input_len": list(args.input_len),
        "output_len": list(args.output_len),
        "seed": args.seed,
        "elapsed_s": elapsed,
        "total_prompt_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "requests_per_s": len(outs) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "speculative": spec_decode_summary(llm),
    }


def main(args: argparse.Namespace) -> int:
    out = run(args)
    print(
        f"{out['num_prompts']} requests ({out['total_prompt_tokens']} prompt + {out['total_output_tokens']} "
        f"output tokens) in {out['elapsed_s']:.2f} s"
    )
    print(
        f"  {out['requests_per_s']:.2f} requests/s, {out['output_tokens_per_s']:.1f} output tokens/s, "
        f"{out['total_tokens_per_s']:.1f} total tokens/s"
    )
    print_json(out)
    return 0
