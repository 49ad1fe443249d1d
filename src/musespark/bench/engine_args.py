"""Flags shared by the offline benchmarks (latency, throughput) and building the LLM from them.

The engine flags are `EngineArgs`' (engine/args.py) with two bench defaults: 256 sequences,
and prefix caching off (random prompts share nothing, and benchmarks should not hit it).
`--speculative-config` (an EngineArgs flag) turns speculative decoding on; latency and
throughput then report its acceptance (`spec_decode_summary`) under "speculative".
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from ..engine.args import EngineArgs, default_model_path
from .presets import PRESETS, nvfp4_checkpoint, resolve_model

BENCH_DEFAULTS = {"max_num_seqs": 256, "enable_prefix_caching": False}


def add_model_args(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p, defaults=BENCH_DEFAULTS)
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="a random-weight checkpoint made on the fly (cached) instead of --model",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where preset checkpoints are kept (default: $MUSESPARK_BENCH_CACHE or ~/.cache/musespark/bench)",
    )
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["nvfp4"],
        help="quantize the model (a preset or --model) on the fly, cached: NVFP4 (musespark quantize)",
    )
    p.add_argument(
        "--nvfp4-scope",
        default="linear",
        choices=["linear", "experts"],
        help="with --quantization nvfp4: every linear but the head, or the experts (Muse's choice)",
    )


def build_llm(args: argparse.Namespace, needed_len: int):
    """The LLM for these flags; max_model_len defaults to what the workload needs."""
    import dataclasses

    import torch

    from ..engine.llm import LLM
    from ..startup import progress_enabled

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    path = resolve_model(args.model, args.preset, args.dtype, args.cache_dir, seed=0)
    if getattr(args, "quantization", None) == "nvfp4":
        path = nvfp4_checkpoint(path if path is not None else default_model_path(), args.nvfp4_scope, args.cache_dir)
    engine_args = dataclasses.replace(
        EngineArgs.from_cli_args(args), model=path, max_model_len=args.max_model_len or max(needed_len + 1, 64)
    )
    llm = LLM(**vars(engine_args), show_progress=progress_enabled())
    return llm, path


def model_info(llm: Any, path: Any) -> dict[str, Any]:
    from .presets import count_params

    cfg = llm.engine.config
    counts = count_params(cfg)
    return {
        "model": str(path) if path is not None else str(llm.engine.model_path),
        "dtype": str(llm.engine.model.dtype).removeprefix("torch."),
        "params_total": counts.total,
        "params_active": counts.active,
    }


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> dict[str, list[int]]:
    """A prompt of `length` random token ids (ids 0..2 avoided: pad/bos/eos in the presets)."""
    return {"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(length)]}


def spec_decode_summary(llm: Any) -> dict[str, Any] | None:
    """Speculative decoding's counters over the LLM's life (warm-up included), or None when
    it is off: vLLM's mean acceptance length is 1 + accepted / drafts (tokens per verifying
    step of a request), acceptance rate accepted / draft tokens."""
    spec = llm.engine.engine_config.speculative
    if spec is None:
        return None
    s = llm.engine.get_stats()
    drafts, draft_tokens = s.spec_num_drafts, s.spec_num_draft_tokens
    return {
        "config": spec.to_dict(),
        "num_drafts": drafts,
        "num_draft_tokens": s.spec_num_draft_tokens,
        "num_accepted_tokens": s.spec_num_accepted_tokens,
        "mean_acceptance_length": 1 + s.spec_num_accepted_tokens / drafts if drafts else None,
        "acceptance_rate": s.spec_num_accepted_tokens / draft_tokens if draft_tokens else None,
        "accepted_per_position": list(s.spec_accepted_per_pos),
    }
