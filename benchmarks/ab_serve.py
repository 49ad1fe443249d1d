"""`musespark serve` against `musespark serve`: two source trees side by side in one run.

    python benchmarks/ab_serve.py --old OLD/src [--pairs 5] [--flags "--reasoning-parser muse ..."]

OLD is another checkout of the repository (`git worktree add OLD <commit>`). Each run starts a
server from one tree (the bundled model, 127.0.0.1, a free port, the same `--flags` for both),
waits until it answers, runs the serving benchmark (`musespark.bench.serve` of this checkout:
32 prompts at once, seeded) against it, and stops it. The trees alternate (old new, new old,
...); the ratio new/old of output tokens/s is taken pair by pair and summarised by the median
(> 1: the new tree is faster). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

NEW_SRC = Path(__file__).resolve().parents[1] / "src"
DEFAULT_FLAGS = "--reasoning-parser muse --enable-auto-tool-choice --tool-call-parser muse"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(src: Path, flags: list[str], bench_args: list[str]) -> float:
    """Output tokens/s of the serving benchmark against a server started from `src`."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(src))
    server = subprocess.Popen(
        [sys.executable, "-m", "musespark", "serve", "--port", str(port), *flags],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server from {src} exited with {server.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server from {src} did not start within 600 s")
            time.sleep(0.5)
        out = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("serve.py")), "--base-url", url, *bench_args],
            env=dict(os.environ, PYTHONPATH=str(NEW_SRC)),
            capture_output=True,
            text=True,
            check=True,
        )
        return float(json.loads(out.stdout.strip().splitlines()[-1])["output_throughput_tok_s"])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, type=Path, help="the other tree's src directory")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--flags", default=DEFAULT_FLAGS, help="serve flags for both trees")
    p.add_argument("--bench-args", default="--num-prompts 32 --seed 0", help="musespark.bench.serve arguments")
    args = p.parse_args()
    flags, bench_args = shlex.split(args.flags), shlex.split(args.bench_args)
    old, new = [], []
    for i in range(args.pairs):
        order = [("old", args.old), ("new", NEW_SRC)]
        for name, src in order if i % 2 == 0 else order[::-1]:
            (old if name == "old" else new).append(one_run(src.resolve(), flags, bench_args))
    from musespark.bench.common import print_json

    ratios = [n / o for n, o in zip(new, old)]
    print_json(
        {
            "benchmark": "ab_serve",
            "old_src": str(args.old),
            "flags": args.flags,
            "bench_args": args.bench_args,
            "old_output_tok_s": old,
            "new_output_tok_s": new,
            "median_ratio_new_over_old": statistics.median(ratios),
            "command": "ab_serve.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        }
    )


if __name__ == "__main__":
    main()
