"""Flags shared by the offline benchmarks (latency, throughput) and building the LLM from them."""

from __future__ import annotations

import argparse
import random
from typing import Any

from .presets import PRESETS, resolve_model


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled musespark-tiny)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="a random-weight checkpoint made on the fly (cached) instead of --model")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--cache-dir", default=None, help="where preset checkpoints are kept "
                   "(default: $MUSESPARK_BENCH_CACHE or ~/.cache/musespark/bench)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="off by default: random prompts share nothing, and benchmarks should not hit it")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)


def build_llm(args: argparse.Namespace, needed_len: int):
    """The LLM for these flags; max_model_len defaults to what the workload needs."""
    import torch

    from ..engine.llm import LLM

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    path = resolve_model(args.model, args.preset, args.dtype, args.cache_dir, seed=0)
    max_len = args.max_model_len or max(needed_len + 1, 64)
    llm = LLM(model=path, dtype=args.dtype, max_model_len=max_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
              enable_prefix_caching=args.enable_prefix_caching, seed=args.seed)
    return llm, path


def model_info(llm: Any, path: Any) -> dict[str, Any]:
    from .presets import count_params

    cfg = llm.engine.config
    counts = count_params(cfg)
    return {"model": str(path) if path is not None else str(llm.engine.model_path),
            "dtype": str(llm.engine.model.dtype).removeprefix("torch."),
            "params_total": counts.total, "params_active": counts.active}


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> dict[str, list[int]]:
    """A prompt of `length` random token ids (ids 0..2 avoided: pad/bos/eos in the presets)."""
    return {"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(length)]}
