"""The `musespark` command line.

    musespark generate [--model DIR] [--max-tokens N] [--temperature T] [--top-p P]
                       [--seed S] [--chat] PROMPT...

    musespark serve [MODEL] [--host H] [--port P] [--api-key KEY] [--served-model-name NAME] ...

    musespark bench latency|throughput [--model DIR | --preset NAME] [--dtype D] ...
    musespark bench serve [--base-url URL] [--num-prompts N] [--request-rate R] ...

`generate` prints each completion as it streams; `serve` runs the OpenAI-compatible HTTP
server (vLLM's flag names). Without a model both use the bundled model. `bench` runs
vLLM's three benchmark modes (see musespark.bench); its last output line is one JSON object.

The engine flags (--model, --dtype, --backend, --max-model-len, ...) of generate, serve and
bench latency/throughput come from `EngineArgs.add_cli_args`: one table of names and
defaults. `generate --seed` is the per-request sampling seed (the engine seed elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .engine.args import EngineArgs

# `generate`'s fallback when the checkpoint's generation_config.json sets no max_new_tokens.
GENERATE_MAX_TOKENS = 64


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for one or more prompts")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    EngineArgs.add_cli_args(p, skip={"seed"})
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate per prompt (default: "
                   f"the checkpoint's generation config, else {GENERATE_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", dest="request_seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")


def _run_generate(args: argparse.Namespace) -> int:
    from .engine.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)), show_progress=True)
    processor = llm.engine.input_processor
    params = processor.default_sampling_params(
        fallback_max_tokens=GENERATE_MAX_TOKENS, max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.request_seed)
    for i, prompt in enumerate(args.prompts):
        if args.chat:
            if processor.tokenizer is None:
                raise ValueError("--chat needs a model with a tokenizer and a chat template")
            request = processor.render_chat([{"role": "user", "content": prompt}])
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
    EngineArgs.add_cli_args(p, model_positional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                   "(default: $MUSESPARK_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send "
                   "(default: MODEL as given, or the bundled model's directory name)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (or the template "
                   "itself) replacing the checkpoint's")
    p.add_argument("--disable-log-requests", action="store_true")
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def _run_serve(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from .engine.llm_engine import LLMEngine
    from .server.api import ServerConfig, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key if args.api_key is not None else os.environ.get("MUSESPARK_API_KEY") or None
    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
    if args.chat_template is not None:
        if engine.tokenizer is None:
            raise ValueError("--chat-template needs a model with a tokenizer")
        path = Path(args.chat_template)
        engine.tokenizer.set_chat_template(path.read_text(encoding="utf-8") if path.is_file()
                                           else args.chat_template)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="musespark", description="Serve and run Muse Spark 1x models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
