"""bf16 products with weights on every kernel path this CPU runs, side by side.

    python benchmarks/isa_products.py                          # 8192 x 8192 at 1 and 8 rows
    python benchmarks/isa_products.py --n 4096 --k 2048 --rows 1,8,64 --repeats 9

Each path (`avx2`, `avx512`, `avx512_bf16`, `amx_bf16`: those the CPU runs) is timed in a child
process started with `MUSESPARK_ISA` set to it, so one process runs one dispatch row as the
engine does. A child makes the same seeded bf16 weight [N, K] and x [rows, K], and times
`linear_small_m` (the op behind the dense linears) best of --repeats after one warm-up call; on
the paths that multiply packed panels the weight is packed once first (`pack_panels`, as the
backend packs the dense weights) and the unpacked kernel (`bf16_dots`) is timed too. The weight
is larger than the caches at the default size, so the figure is the rate at which each path
streams a weight from memory: GB/s = N * K * 2 bytes / the best time. The children alternate
path by path, --rounds times, and each figure is the best over the rounds.

Prints a summary to stderr and ONE JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from musespark.bench.common import print_json  # noqa: E402
from musespark.cpu_features import ISA_LEVELS, detected_isa  # noqa: E402

PATHS = ("avx2", "avx512", "avx512_bf16", "amx_bf16")


def child(n: int, k: int, rows: list[int], repeats: int, threads: int) -> dict:
    """Times this process's kernel path (MUSESPARK_ISA) and returns its figures."""
    import time

    import torch

    from musespark.kernels import cpu

    torch.set_num_threads(threads)
    ops = cpu.native_ops()
    if ops is None:
        raise SystemExit("isa_products: the native CPU kernels are unavailable here")
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    packed = cpu.pack_panels(w) if cpu.kernel_path() in cpu.PANEL_PATHS else None
    out: dict[str, dict[str, float]] = {}
    for m in rows:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        kinds = {"plain": {}} if packed is None else {"panels": {"panels": packed}, "plain": {}}
        for kind, kwargs in kinds.items():
            ops.linear_small_m(x, w, **kwargs)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                ops.linear_small_m(x, w, **kwargs)
                best = min(best, time.perf_counter() - t)
            out.setdefault(str(m), {})[kind] = best
    return {"kernel_path": cpu.kernel_path(), "seconds": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8192, help="weight rows")
    ap.add_argument("--k", type=int, default=8192, help="weight columns (the reduction)")
    ap.add_argument("--rows", default="1,8", help="rows of x, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r]
    if args.child:
        print(json.dumps(child(args.n, args.k, rows, args.repeats, args.threads)))
        return
    top = ISA_LEVELS.index(detected_isa()) if detected_isa() in ISA_LEVELS else -1
    paths = [p for p in PATHS if p in ISA_LEVELS and ISA_LEVELS.index(p) <= top]
    if not paths:
        raise SystemExit("isa_products: this CPU runs none of the native kernel paths")
    best: dict[str, dict[str, dict[str, float]]] = {}
    for _ in range(args.rounds):
        for path in paths:
            cmd = [sys.executable, __file__, "--child", "--n", str(args.n), "--k", str(args.k)]
            cmd += ["--rows", args.rows, "--repeats", str(args.repeats), "--threads", str(args.threads)]
            proc = subprocess.run(cmd, env=dict(os.environ, MUSESPARK_ISA=path), capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"isa_products: the {path} child failed:\n{proc.stderr[-2000:]}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            for m, kinds in got["seconds"].items():
                for kind, sec in kinds.items():
                    slot = best.setdefault(path, {}).setdefault(m, {})
                    slot[kind] = min(slot.get(kind, float("inf")), sec)
    weight_bytes = args.n * args.k * 2
    gb_s = {
        p: {m: {kd: round(weight_bytes / s / 1e9, 2) for kd, s in ks.items()} for m, ks in v.items()}
        for p, v in best.items()
    }
    for p, v in gb_s.items():
        print(f"{p}: " + "; ".join(f"{m} rows {ks}" for m, ks in v.items()), file=sys.stderr)
    print_json(
        {
            "benchmark": "isa_products",
            "n": args.n,
            "k": args.k,
            "rows": rows,
            "threads": args.threads,
            "weight_gb_s": gb_s,
            "seconds": best,
        }
    )


if __name__ == "__main__":
    main()
