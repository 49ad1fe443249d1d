"""Batch-1 decode of bf16 vs NVFP4 weight-only on the cpu backend, against the NVFP4 roofline.

    python benchmarks/nvfp4.py                          # bench-small, both scopes, 3 rounds: ~5 min
    python benchmarks/nvfp4.py --threads 1 --tokens 32

The seeded random `bench-small` checkpoint (bench/presets.py) is written once in bf16, then
quantized with `quantize_checkpoint(..., scope="linear")` and `scope="experts"` (cached next
to it). Each model is loaded with backend "cpu" (NVFP4 products: the native kernel
`nvfp4_linear`, kernels/csrc/nvfp4/nvfp4_linear.cpp), prefilled with a short prompt and timed over
`--tokens` single-token decode steps through a paged KV cache (the engine's decode shape;
no sampling, scheduler or HTTP).

The models are loaded together and timed in rounds (bf16, linear, experts; --repeats rounds),
so each ratio to bf16 is taken within a round, side by side, and summarised by the median of
the rounds (the machines are shared and drift).

Reported per model: decode tokens/s (median step; the median over rounds), resident weight bytes (every parameter
and buffer of the model), active weight bytes per token (everything but the embedding
table; routed experts at top_k / num_experts of their bytes), and the roofline = measured
memory bandwidth (a `sum` over a buffer far larger than the caches, same thread count) /
active bytes, with the measured rate as a % of it. Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import musespark
from musespark.bench.common import print_json
from musespark.bench.presets import CACHE_ENV, make_checkpoint, nvfp4_checkpoint
from musespark.layers.attention import AttentionContext, KVGroup
from musespark.layers.moe import Experts

BLOCK = 16


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(resident bytes of every parameter and buffer, bytes one decode token reads)."""
    cfg = model.config
    resident = active = 0
    for _name, module in model.named_modules():
        own = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)) if t is not None]
        nbytes = sum(t.numel() * t.element_size() for t in own)
        resident += nbytes
        if module is model.embed_tokens:
            continue  # one row per token
        if isinstance(module, Experts):  # its own tensors only: the post-norm is a child module
            active += nbytes * cfg.num_experts_per_tok // cfg.num_local_experts
        else:
            active += nbytes
    return resident, active


def memory_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of `reps` sums over a `gib` GiB fp32 buffer."""
    buf = torch.ones(int(gib * 2**30) // 4)
    buf.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def decode_rate(model, prompt_len: int, tokens: int, seed: int) -> float:
    """Median seconds per single-token decode step after a `prompt_len` prefill -> tokens/s."""
    cfg = model.config
    blocks = (prompt_len + tokens) // BLOCK + 2
    shape = (blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    kv = [
        (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
        for _ in range(cfg.num_hidden_layers)
    ]
    table = torch.arange(blocks)[None, :]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
    done, steps = 0, []
    with torch.inference_mode():
        for step in range(tokens + 1):
            t0 = time.perf_counter()
            pos = torch.arange(done, len(ids))
            group = KVGroup(slot_mapping=table[0, pos // BLOCK] * BLOCK + pos % BLOCK, block_tables=table)
            ctx = AttentionContext(
                query_start_loc=[0, len(ids) - done],
                seq_lens=[len(ids)],
                kv_caches=kv,
                groups=[group],
                layer_group=[0] * cfg.num_hidden_layers,
            )
            hidden = model(torch.tensor(ids[done:]), pos, ctx)
            ids.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
            done = len(ids) - 1
            if step > 0:  # step 0 is the prefill
                steps.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(steps)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench-small")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per model")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the three models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None, help=f"checkpoint cache (default ${CACHE_ENV} or a temp dir)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import os

    cache = Path(args.cache_dir or os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "musespark-bench")
    src = make_checkpoint(args.preset, "bfloat16", cache, seed=args.seed)
    paths = {"bf16": src}
    for scope in ("linear", "experts"):
        paths[f"nvfp4-{scope}"] = nvfp4_checkpoint(src, scope, cache)

    bandwidth = memory_bandwidth()
    models = {name: musespark.load_model(path, backend="cpu") for name, path in paths.items()}
    rates: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            rates[name].append(decode_rate(model, args.prompt_len, args.tokens, args.seed))
    rows = {}
    for name, model in models.items():
        resident, active = weight_bytes(model)
        rate = statistics.median(rates[name])
        roofline = bandwidth / active
        ratios = [r / b for r, b in zip(rates[name], rates["bf16"])]
        rows[name] = {
            "decode_tok_s": round(rate, 2),
            "rounds_tok_s": [round(r, 2) for r in rates[name]],
            "resident_weight_bytes": resident,
            "active_weight_bytes_per_token": active,
            "roofline_tok_s": round(roofline, 2),
            "pct_of_roofline": round(100 * rate / roofline, 1),
            "backend": model.backend.name,
            "speedup_vs_bf16": round(statistics.median(ratios), 2),
            "speedup_per_round": [round(r, 2) for r in ratios],
        }

    print(
        f"{args.preset}, batch-1 decode, cpu backend, {torch.get_num_threads()} thread(s), "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'weights':<16}{'tok/s':>8}{'x bf16':>8}{'resident MB':>13}"
        f"{'active MB/tok':>15}{'roofline tok/s':>16}{'% roof':>8}"
    )
    for name, r in rows.items():
        print(
            f"{name:<16}{r['decode_tok_s']:>8.1f}{r['speedup_vs_bf16']:>8.2f}{r['resident_weight_bytes'] / 1e6:>13.1f}"
            f"{r['active_weight_bytes_per_token'] / 1e6:>15.1f}{r['roofline_tok_s']:>16.1f}{r['pct_of_roofline']:>8.1f}"
        )
    print_json(
        {
            "benchmark": "nvfp4",
            "preset": args.preset,
            "tokens": args.tokens,
            "prompt_len": args.prompt_len,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "seed": args.seed,
            "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
            "results": rows,
        }
    )


if __name__ == "__main__":
    main()
