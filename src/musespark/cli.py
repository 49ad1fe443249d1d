"""The `musespark` command line.

    musespark generate [--model DIR] [--max-tokens N] [--temperature T] [--top-p P]
                       [--seed S] [--chat] PROMPT...

    musespark serve [MODEL] [--host H] [--port P] [--api-key KEY] [--served-model-name NAME] ...

    musespark bench latency|throughput [--model DIR | --preset NAME] [--dtype D] ...
    musespark bench serve [--base-url URL] [--num-prompts N] [--request-rate R] ...

`generate` prints each completion as it streams; `serve` runs the OpenAI-compatible HTTP
server (vLLM's flag names). Without a model both use the bundled model. `bench` runs
vLLM's three benchmark modes (see musespark.bench); its last output line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .engine.llm import LLM
from .sampling_params import SamplingParams


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for one or more prompts")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled musespark-tiny)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate per prompt (default: "
                   "the checkpoint's generation config, else 64)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-model-len", type=int, default=None)


def _run_generate(args: argparse.Namespace) -> int:
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, show_progress=True)
    engine = llm.engine
    fields = dict(engine.generation_defaults)
    fields.setdefault("max_tokens", 64)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    params = SamplingParams(**fields)
    for i, prompt in enumerate(args.prompts):
        if args.chat:
            tokenizer = llm.get_tokenizer()
            if tokenizer is None:
                raise ValueError("--chat needs a model with a tokenizer and a chat template")
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            request = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        else:
            request = prompt
        if len(args.prompts) > 1:
            print(f"--- [{i}] {prompt!r}", flush=True)
        final = None
        for out in llm.generate_stream(request, params):
            if final is None and not args.chat:
                print(prompt, end="", flush=True)  # echo the prompt once the request is accepted
            print(out.outputs[0].delta_text, end="", flush=True)
            final = out
        print(flush=True)
        if final is not None:
            c = final.outputs[0]
            print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]", file=sys.stderr, flush=True)
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory (default: the bundled musespark-tiny)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                   "(default: $MUSESPARK_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send "
                   "(default: MODEL as given, or the bundled model's directory name)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes "
                   "(default: a fraction of available memory)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (or the template "
                   "itself) replacing the checkpoint's")
    p.add_argument("--disable-log-requests", action="store_true")
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def _run_serve(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from .config import CacheConfig
    from .engine.llm_engine import LLMEngine
    from .server.api import ServerConfig, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key if args.api_key is not None else os.environ.get("MUSESPARK_API_KEY") or None
    cache = CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        enable_prefix_caching=args.enable_prefix_caching)
    engine = LLMEngine(args.model, dtype=args.dtype, cache=cache, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       seed=args.seed)
    if args.chat_template is not None:
        if engine.tokenizer is None:
            raise ValueError("--chat-template needs a model with a tokenizer")
        path = Path(args.chat_template)
        engine.tokenizer.chat_template = path.read_text(encoding="utf-8") if path.is_file() else args.chat_template
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])  # fail now, not per request
    name = args.served_model_name or args.model or engine.model_path.name
    config = ServerConfig(model_name=name, api_key=api_key, max_request_body_bytes=args.max_request_body_bytes,
                          log_requests=not args.disable_log_requests)
    return serve(engine, config, host=args.host, port=args.port, log_level=args.uvicorn_log_level)


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from .bench import latency, serve, throughput

    p = sub.add_parser("bench", help="benchmark: latency | throughput (offline engine) | serve (a running server)")
    modes = p.add_subparsers(dest="bench_mode", required=True)
    latency.add_args(modes.add_parser("latency", help="one batch: prefill and per-token decode times"))
    throughput.add_args(modes.add_parser("throughput", help="N seeded random requests through the offline engine"))
    serve.add_args(modes.add_parser("serve", help="drive a running `musespark serve` (TTFT, TPOT, ITL, E2EL)"))


def _run_bench(args: argparse.Namespace) -> int:
    from .bench import latency, serve, throughput

    return {"latency": latency.main, "throughput": throughput.main, "serve": serve.main}[args.bench_mode](args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="musespark", description="Serve and run Muse Spark 1x models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "bench":
            return _run_bench(args)
    except ValueError as exc:
        print(f"musespark {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
