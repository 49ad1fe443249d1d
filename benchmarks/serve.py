"""Serving benchmark: a seeded load generator against a running `musespark serve`.

    musespark serve &                                    # the bundled model on 127.0.0.1:8000
    python benchmarks/serve.py --num-prompts 32 --request-rate inf

Streams /v1/completions requests with random prompt and output lengths (ignore_eos, so each
request generates exactly its max_tokens), arriving as a Poisson process of --request-rate
requests/s (inf: all at once), at most --max-concurrency in flight. Metrics follow vLLM's
benchmark_serving: TTFT = first streamed token - send time; TPOT = (e2e - TTFT) /
(output_tokens - 1); ITL = the gaps between successive streamed chunks; E2EL = last byte -
send time. Prints a human-readable table, then ONE JSON line (last) with the figures,
the machine, versions and the git commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

WORDS = ("the a of to and in is it that for on with as was at by be this have from or one had not but what all "
         "were when we there can an your which their said if do will each about how up out them then she many "
         "some so these would other into has more her two like him see time could no make than first been its "
         "who now people my made over did down only way find use may water long little very after words called "
         "just where most know get through back much before go good new write our used me man too any day same "
         "right look think also around another came come work three word must because does part even place well").split()


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


async def one_request(http: httpx.AsyncClient, url: str, body: dict, headers: dict) -> Result:
    res = Result()
    start = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            done = False
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    res.error = f"malformed event {line[:80]!r}"
                    return res
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter()
                if chunk.get("choices"):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
            res.e2e = time.perf_counter() - start
            res.ok = done and last is not None
            if not res.ok:
                res.error = "stream ended without [DONE] or without tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:  # read .git directly (what `git rev-parse HEAD` prints) ...
        head = (root / ".git" / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        ref_file = root / ".git" / ref
        if ref_file.is_file():
            return ref_file.read_text().strip()
        for line in (root / ".git" / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    try:  # ... else ask git
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "httpx": httpx.__version__}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def make_requests(args: argparse.Namespace, model: str | None) -> list[dict]:
    rng = random.Random(args.seed)
    lo_in, hi_in = args.input_len_range
    lo_out, hi_out = args.output_len_range
    bodies = []
    for _ in range(args.num_prompts):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo_in, hi_in)))
        body = {"prompt": prompt, "max_tokens": rng.randint(lo_out, hi_out), "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if model:
            body["model"] = model
        bodies.append(body)
    return bodies


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as http:
        model = args.model
        if model is None:
            r = await http.get(f"{args.base_url}/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        bodies = make_requests(args, model)
        url = f"{args.base_url}/v1/completions"
        rng = np.random.default_rng(args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(body: dict) -> Result:
            if sem is None:
                return await one_request(http, url, body, headers)
            async with sem:
                return await one_request(http, url, body, headers)

        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "benchmark": "serve", "model": model, "base_url": args.base_url, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "seed": args.seed,
        "input_len_range_words": list(args.input_len_range), "output_len_range": list(args.output_len_range),
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput_rps": len(ok) / duration, "output_throughput_tok_s": out_tokens / duration,
        "total_token_throughput_tok_s": (in_tokens + out_tokens) / duration,
        "ttft_ms": percentiles([r.ttft for r in ok]), "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([x for r in ok for x in r.itl]), "e2el_ms": percentiles([r.e2e for r in ok]),
        "machine": machine(), "commit": git_commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("MUSESPARK_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len-range", type=_range, default=(8, 64), help="prompt length in words, LO,HI")
    p.add_argument("--output-len-range", type=_range, default=(16, 128), help="max_tokens, LO,HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    out = asyncio.run(run(args))
    print(f"completed {out['completed']}/{args.num_prompts} in {out['duration_s']:.2f} s; "
          f"{out['request_throughput_rps']:.2f} req/s, {out['output_throughput_tok_s']:.1f} output tok/s")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = out[name]
        print(f"  {name:8s} mean {s['mean']:9.2f}  p50 {s['p50']:9.2f}  p90 {s['p90']:9.2f}  p99 {s['p99']:9.2f}")
    print(json.dumps(out), flush=True)
    return 0 if out["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
