"""`musespark plan --device cpu`: one CPU server's resident bytes (packed copies included), KV
budget and projected decode/prefill speed (musespark.parallel.cpu_server computes, this prints)."""

from __future__ import annotations

import argparse
import json
import re

from .parallel.cpu_server import (
    CPU_PATHS,
    DEFAULT_BF16_GMACS,
    DEFAULT_CORES_PER_SOCKET,
    DEFAULT_EFFICIENCY,
    DEFAULT_NVFP4_GMACS,
    CpuServerPlan,
)


def gigabytes(text: str) -> float:
    """'768', '768GB', '768 gb' -> 768.0 (GB = 1e9 bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*(?:GB|gb|G|g)?\s*", text)
    if m is None or not float(m.group(1)) > 0:
        raise argparse.ArgumentTypeError(f"expected a positive size in GB such as 768 or 768GB, got {text!r}")
    return float(m.group(1))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=["gpu", "cpu"],
        default="gpu",
        help="gpu: per-rank memory of a TP/EP/PP deployment (--device-memory); cpu: one process on a CPU "
        "server (--memory): resident bytes with the packed copies, KV tokens and projected tokens/s",
    )
    p.add_argument("--memory", type=gigabytes, default=None, metavar="GB", help="with --device cpu: the server's RAM")
    p.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="GB/s",
        help="with --device cpu: measured memory bandwidth of the whole server (default: 250 GB/s per socket, assumed)",
    )
    p.add_argument(
        "--cores", type=int, default=None, metavar="N", help=f"default {DEFAULT_CORES_PER_SOCKET} per socket"
    )
    p.add_argument("--sockets", type=int, default=1, metavar="S")
    p.add_argument(
        "--cpu-path",
        choices=CPU_PATHS,
        default="avx512_bf16",
        help="the kernel path (avx512_bf16 and amx_bf16 pack dense bf16 weights into panels: a second copy)",
    )
    p.add_argument(
        "--efficiency",
        type=float,
        default=DEFAULT_EFFICIENCY,
        help="fraction of the bandwidth a decode step achieves",
    )
    p.add_argument("--context", type=int, default=0, help="tokens of KV a decode step reads (default 0: weights only)")
    p.add_argument(
        "--nvfp4-gmacs",
        type=float,
        default=DEFAULT_NVFP4_GMACS,
        metavar="G/s",
        help="NVFP4 expert multiply-adds per second per core (prefill)",
    )
    p.add_argument(
        "--bf16-gmacs",
        type=float,
        default=DEFAULT_BF16_GMACS,
        metavar="G/s",
        help="bf16 multiply-adds per second per core (prefill)",
    )


def check_args(args: argparse.Namespace) -> str | None:
    """An error message for a CPU plan's flags, or None."""
    if args.device != "cpu":
        given = [f for f, v in (("--memory", args.memory), ("--bandwidth", args.bandwidth)) if v is not None]
        return f"{', '.join(given)} need --device cpu (GPU memory is --device-memory)" if given else None
    if args.memory is None:
        return "--device cpu needs --memory GB (the server's RAM)"
    if args.device_memory is not None:
        return "--device cpu takes --memory, not --device-memory"
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1:
        return "--device cpu plans one process (-tp 1 -pp 1); a multi-socket server is --sockets S"
    return None


def print_plan(c: CpuServerPlan, source: str, dtype: str, quantized: bool, as_json: bool) -> None:
    def gb(n: float) -> str:
        return f"{n / 1e9:.2f} GB"

    print(
        f"{source}: one CPU server, {c.sockets} socket(s), {c.cores} cores, {gb(c.memory_bytes)} RAM, "
        f"{c.path} path; weights {dtype}{' + NVFP4 experts' if quantized else ''}"
    )
    packed = c.packed_bytes
    print(f"  checkpoint weights       {gb(c.weight_bytes)}")
    print(
        f"  packed copies            {gb(sum(packed.values()))} (dense linears {gb(packed['dense_linears'])}, "
        f"LM head {gb(packed['lm_head'])}, bf16 experts {gb(packed['bf16_experts'])})"
    )
    print(f"  resident                 {gb(c.resident_bytes)}: {'fits' if c.fits else 'does NOT fit'}")
    print(f"  KV cache                 {gb(c.kv_cache_bytes)}, {c.kv_tokens} full-attention tokens")
    print("projection (not a measurement):")
    print(
        f"  decode, batch 1          {c.decode_tokens_per_s:.2f} tokens/s = {c.bandwidth_gbs:.0f} GB/s"
        f"{' (assumed)' if c.bandwidth_assumed else ''} x {c.efficiency:.2f} efficiency / "
        f"{gb(c.decode_bytes_per_token)} read per token (context {c.context})"
    )
    macs = c.prefill_macs_per_token
    print(
        f"  prefill                  {c.prefill_tokens_per_s:.1f} tokens/s = {macs['nvfp4_experts'] / 1e9:.1f} G "
        f"NVFP4 expert multiply-adds at {c.nvfp4_gmacs_per_core:g} G/s/core + {macs['bf16'] / 1e9:.1f} G bf16 at "
        f"{c.bf16_gmacs_per_core:g} G/s/core per token, {c.cores} cores (attention scores not counted)"
    )
    for note in c.notes:
        print(f"note: {note}")
    if as_json:
        print(json.dumps({"source": source, "device": "cpu", "dtype": dtype, "quantized": quantized, **c.as_dict()}))
