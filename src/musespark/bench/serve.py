"""`musespark bench serve`: a seeded load generator against a running `musespark serve`.

    musespark serve &                                   # the bundled model on 127.0.0.1:8000
    musespark bench serve --num-prompts 32 --request-rate inf

Streams /v1/completions requests with random prompt and output lengths (ignore_eos, so each
request generates exactly its max_tokens), arriving as a Poisson process of --request-rate
requests/s (inf: all at once), at most --max-concurrency in flight. Metrics follow vLLM's
benchmark_serving: TTFT = first streamed token - send time; TPOT = (e2e - TTFT) /
(output_tokens - 1); ITL = the gaps between successive streamed chunks; E2EL = last byte -
send time; each as mean/p50/p90/p99 in ms; request and token throughput over the whole run.
Prints a human-readable table, then ONE JSON line (last). (`benchmarks/serve.py` is a thin
wrapper over this module.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from .common import parse_range, percentiles, print_json

WORDS = (
    "the a of to and in is it that for on with as was at by be this have from or one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many "
    "some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called "
    "just where most know get through back much before go good new write our used me man too any day same "
    "right look think also around another came come work three word must because does part even place well"
).split()


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


def make_requests(args: argparse.Namespace, model: str | None) -> list[dict]:
    rng = random.Random(args.seed)
    lo_in, hi_in = args.input_len_range
    lo_out, hi_out = args.output_len_range
    bodies = []
    for _ in range(args.num_prompts):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo_in, hi_in)))
        body = {
            "prompt": prompt,
            "max_tokens": rng.randint(lo_out, hi_out),
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            body["model"] = model
        bodies.append(body)
    return bodies


async def run_async(args: argparse.Namespace) -> dict[str, Any]:
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
        "benchmark": "serve",
        "model": model,
        "base_url": args.base_url,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "input_len_range_words": list(args.input_len_range),
        "output_len_range": list(args.output_len_range),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput_rps": len(ok) / duration,
        "output_throughput_tok_s": out_tokens / duration,
        "total_token_throughput_tok_s": (in_tokens + out_tokens) / duration,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2el_ms": percentiles([r.e2e for r in ok]),
    }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("MUSESPARK_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len-range", type=parse_range, default=(8, 64), help="prompt length in words, N or LO,HI")
    p.add_argument("--output-len-range", type=parse_range, default=(16, 128), help="max_tokens, N or LO,HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)


def main(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf: all at once)")
    out = asyncio.run(run_async(args))
    print(
        f"completed {out['completed']}/{args.num_prompts} in {out['duration_s']:.2f} s; "
        f"{out['request_throughput_rps']:.2f} req/s, {out['output_throughput_tok_s']:.1f} output tok/s"
    )
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = out[name]
        print(f"  {name:8s} mean {s['mean']:9.2f}  p50 {s['p50']:9.2f}  p90 {s['p90']:9.2f}  p99 {s['p99']:9.2f}")
    print_json(out)
    return 0 if out["failed"] == 0 else 1
