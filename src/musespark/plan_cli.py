"""`musespark plan`: per-rank weight and KV-cache memory of a TP/EP/PP deployment, from a
config alone (no weights read; musespark.parallel.plan computes, this prints)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from .bench.presets import PRESETS

    p = sub.add_parser("plan", help="per-rank weight and KV-cache memory of a TP/EP/PP deployment (no weights read)")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a checkpoint directory (only its config.json is read; default: the bundled model)",
    )
    src.add_argument("--preset", default=None, choices=sorted(PRESETS), help="a named config (musespark.bench.presets)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    p.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="experts split over the TP ranks (contiguous blocks) instead of along their width",
    )
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N")
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["nvfp4"],
        help="nvfp4: routed experts (not those of the first and last layer) as NVFP4",
    )
    p.add_argument(
        "--dtype", default="auto", help="unquantized weights' dtype (default: the checkpoint's, else bfloat16)"
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (= --dtype), a dtype, or fp8")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GB",
        help="memory per device in GB (1e9 bytes): how many KV tokens fit beside the weights",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="sliding layers hold min(window, this) tokens; with --device-memory: sequences of this length that fit",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="with --device-memory: reserve this many sequences' sliding-window KV first",
    )
    p.add_argument("--json", action="store_true", help="also print one JSON object (the last line)")
    from .plan_cpu_cli import add_arguments

    add_arguments(p)


def plan_rows(plans: list) -> list[tuple[str, object]]:
    """Consecutive ranks with identical figures, grouped: [(label "0-7", plan), ...]."""

    def key(r):
        return (
            r.pp_rank,
            r.layers,
            r.experts[1] - r.experts[0],
            tuple(r.weights.values()),
            r.kv_bytes_per_token,
            r.kv_tokens,
        )

    rows: list[list] = []
    for r in plans:
        if rows and key(rows[-1][1]) == key(r):
            rows[-1][2] = r.rank
        else:
            rows.append([r.rank, r, r.rank])
    return [(str(a) if a == b else f"{a}-{b}", r) for a, r, b in rows]


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from . import env
    from .parallel.plan import GB, dtype_bytes, plan_memory
    from .plan_cpu_cli import check_args
    from .quant.config import checkpoint_quantization

    error = check_args(args)
    if error is not None:
        print(f"musespark plan: error: {error}", file=sys.stderr)
        return 2
    quantization, bf16_expert_layers = args.quantization, None
    if args.preset is not None:
        from .bench.presets import preset_config

        cfg, source = preset_config(args.preset), f"preset {args.preset}"
    else:
        from .checkpoint.loader import load_config
        from .engine.args import default_model_path

        path = args.model if args.model is not None else default_model_path()
        cfg, source = load_config(path), str(path)
        declared, excluded = checkpoint_quantization(path, cfg)
        if declared is not None:  # the checkpoint's own quantization config decides what is NVFP4
            quantization, bf16_expert_layers = declared, excluded
            source += f" ({declared} checkpoint)"
    args.quantization = quantization
    tp, pp, ep = args.tensor_parallel_size, args.pipeline_parallel_size, args.enable_expert_parallel
    dtype, nbytes = dtype_bytes(args.dtype, cfg)
    if args.device == "cpu":
        from .parallel.cpu_server import plan_cpu_server
        from .plan_cpu_cli import print_plan

        (rank,) = plan_memory(
            cfg,
            quantization=quantization,
            dtype=dtype,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            kv_cache_dtype=args.kv_cache_dtype,
            bf16_expert_layers=bf16_expert_layers,
        )
        layers = cfg.num_hidden_layers
        server = plan_cpu_server(
            cfg,
            rank,
            args.memory,
            bf16_expert_layers=set(bf16_expert_layers if bf16_expert_layers is not None else (0, layers - 1)),
            quantized=quantization is not None,
            dtype_bytes=nbytes,
            path=args.cpu_path,
            sockets=args.sockets,
            cores=args.cores,
            bandwidth_gbs=args.bandwidth,
            efficiency=args.efficiency,
            context=args.context,
            nvfp4_gmacs_per_core=args.nvfp4_gmacs,
            bf16_gmacs_per_core=args.bf16_gmacs,
            expert_panels=env.expert_panels(),
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
        )
        print_plan(server, source, dtype, quantization is not None, args.json)
        return 0
    plans = plan_memory(
        cfg,
        tp=tp,
        ep=ep,
        pp=pp,
        quantization=args.quantization,
        dtype=dtype,
        block_size=args.block_size,
        device_memory_gb=args.device_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
        bf16_expert_layers=bf16_expert_layers,
    )
    unit, scale = ("GB", GB) if max(r.weight_bytes for r in plans) >= GB else ("MB", 1e6)
    print(
        f"{source}: TP{tp}{'+EP' + str(tp) if ep else ''}{f' x PP{pp}' if pp > 1 else ''}, {tp * pp} ranks, "
        f"weights {dtype}{' + NVFP4 experts' if args.quantization else ''}, in {unit} (1{unit} = {scale:.0e} bytes)"
    )
    head = [
        "ranks",
        "stage",
        "layers",
        "experts",
        "attn",
        "pool+unpool",
        "router",
        "embed/head",
        "experts",
        "other",
        "total",
        "KV B/tok",
        "sliding MiB/seq",
    ]
    if args.device_memory is not None:
        head += ["KV GB", "KV tokens"] + ([f"seqs@{args.max_model_len}"] if args.max_model_len else [])
    table = [head]
    for label, r in plan_rows(plans):
        w = r.weights

        def g(*parts: str, w: dict[str, int] = w) -> str:
            return f"{sum(w[x] for x in parts) / scale:.2f}"

        row = [
            label,
            str(r.pp_rank),
            f"{r.layers[0]}-{r.layers[1] - 1}",
            f"{r.experts[0]}-{r.experts[1] - 1}"
            + ("" if r.expert_width == cfg.moe_intermediate_size else f" @{r.expert_width}"),
            g("attention"),
            g("pooler_unpooler"),
            g("router", "router_bias"),
            g("embedding", "lm_head"),
            g("experts"),
            g("dense_mlp", "norms_gates"),
            f"{r.weight_bytes / scale:.2f}",
            str(r.kv_bytes_per_token),
            f"{r.kv_bytes_per_seq_sliding / 2**20:.2f}",
        ]
        if args.device_memory is not None:
            row += [f"{r.kv_cache_bytes / GB:.2f}", "-" if r.kv_tokens is None else str(r.kv_tokens)]
            if args.max_model_len:
                row.append("-" if r.max_seqs_at_max_len is None else str(r.max_seqs_at_max_len))
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(c.rjust(wd) if i >= 4 else c.ljust(wd) for i, (c, wd) in enumerate(zip(row, widths))))
    for r in plans:
        for note in r.notes:
            print(f"rank {r.rank}: {note}")
    if args.json:
        print(
            json.dumps(
                {
                    "source": source,
                    "tensor_parallel_size": tp,
                    "pipeline_parallel_size": pp,
                    "enable_expert_parallel": ep,
                    "quantization": args.quantization,
                    "dtype": dtype,
                    "world_size": tp * pp,
                    "max_weight_bytes": max(r.weight_bytes for r in plans),
                    "ranks": [r.as_dict() for r in plans],
                }
            )
        )
    return 0
