"""The `musespark` command line.

    musespark generate [--model DIR] [--max-tokens N] [--temperature T] [--top-p P]
                       [--seed S] [--chat [--tools JSON] [--chat-template FILE] [--chat-template-kwargs JSON]]
                       PROMPT...

    musespark serve [MODEL] [--host H] [--port P] [--api-key KEY] [--served-model-name NAME]
                    [--chat-template FILE] [--default-chat-template-kwargs JSON]
                    [--reasoning-effort-map JSON] ...

    musespark bench latency|throughput [--model DIR | --preset NAME] [--dtype D] ...
    musespark bench serve [--base-url URL] [--num-prompts N] [--request-rate R] ...

`generate` prints each completion as it streams (with `--chat` on a model that speaks Muse,
its reasoning, answer and tool calls apart); `serve` runs the OpenAI-compatible HTTP
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
    p.add_argument("--chat-template", default=None, help="with --chat: a Jinja chat template file (or the "
                   "template itself) replacing the checkpoint's")
    p.add_argument("--tools", default=None, metavar="JSON|FILE",
                   help="with --chat: OpenAI tool definitions, a JSON list or a file holding one")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="with --chat: extra template kwargs, a JSON object (e.g. '{\"reasoning_strength\": \"low\"}')")


def load_chat_template(value: str | None) -> str | None:
    """vLLM's rule: a value holding any of "{}\n" is the template itself; else it names a file."""
    if value is None or any(c in value for c in "{}\n"):
        return value
    from pathlib import Path

    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--chat-template: no such file {value!r}")
    return path.read_text(encoding="utf-8")


def _load_tools(value: str | None) -> list | None:
    import json
    from pathlib import Path

    if value is None:
        return None
    if value.lstrip().startswith("["):
        text = value
    elif Path(value).is_file():
        text = Path(value).read_text(encoding="utf-8")
    else:
        raise ValueError(f"--tools: give a JSON list of tools or a file holding one, got {value!r}")
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--tools is not valid JSON: {exc}") from None
    return tools


class _ChatPrinter:
    """Prints a Muse turn as it streams: reasoning, answer and tool calls under their own
    labels (the model's channel markers are parsed, never printed)."""

    def __init__(self, tools: list | None) -> None:
        from .parsers import MuseOutputParser, tool_schemas_from_openai

        self.parser = MuseOutputParser(reasoning=True, tools=bool(tools),
                                       tool_names=tool_schemas_from_openai(tools) if tools else None)
        self.section: str | None = None

    def _label(self, section: str) -> None:
        if section != self.section:
            print(("\n" if self.section else "") + f"[{section}] ", end="", flush=True)
            self.section = section

    def show(self, delta) -> None:
        if delta.reasoning:
            self._label("reasoning")
            print(delta.reasoning, end="", flush=True)
        if delta.content:
            self._label("answer")
            print(delta.content, end="", flush=True)
        for call in delta.tool_calls:
            if call.name is not None:
                self.section = None
                self._label(f"tool call {call.name}")
            print(call.arguments, end="", flush=True)


def _run_generate(args: argparse.Namespace) -> int:
    import dataclasses

    from .engine.chat import normalize_tools, parse_template_kwargs
    from .engine.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)), show_progress=True)
    processor = llm.engine.input_processor
    params = processor.default_sampling_params(
        fallback_max_tokens=GENERATE_MAX_TOKENS, max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.request_seed)
    template = load_chat_template(args.chat_template)
    template_kwargs = parse_template_kwargs(args.chat_template_kwargs, "--chat-template-kwargs")
    tools = normalize_tools(_load_tools(args.tools))
    muse = args.chat and processor.tokenizer is not None and processor.tokenizer.token_to_id("<|message|>") is not None
    if muse:
        params = dataclasses.replace(params, skip_special_tokens=False)  # the parser reads the markers
    for i, prompt in enumerate(args.prompts):
        if args.chat:
            if processor.tokenizer is None:
                raise ValueError("--chat needs a model with a tokenizer and a chat template")
            request = processor.render_chat([{"role": "user", "content": prompt}], chat_template=template,
                                            chat_template_kwargs=template_kwargs, tools=tools)
        else:
            request = prompt
        if len(args.prompts) > 1:
            print(f"--- [{i}] {prompt!r}", flush=True)
        final = None
        printer = _ChatPrinter(tools) if muse else None
        for out in llm.generate_stream(request, params):
            if final is None and not args.chat:
                print(prompt, end="", flush=True)  # echo the prompt once the request is accepted
            if printer is None:
                print(out.outputs[0].delta_text, end="", flush=True)
            else:
                printer.show(printer.parser.feed(out.outputs[0].delta_text))
            final = out
        if printer is not None and final is not None:
            printer.show(printer.parser.finish(final.outputs[0].finish_reason))
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
                   "itself) replacing the checkpoint's (chat_template.jinja, else tokenizer_config.json's)")
    p.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help="template kwargs for every chat request, a JSON object; a request's "
                   "chat_template_kwargs and fields override them (e.g. '{\"reasoning_strength\": \"low\"}')")
    p.add_argument("--reasoning-effort-map", default=None, metavar="JSON",
                   help="a JSON object mapping reasoning_effort values (none, minimal, low, medium, high, xhigh, "
                   "max) to the value the template receives as reasoning_effort and reasoning_strength "
                   "(default: identity)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split reasoning channels into message.reasoning: muse (alias musespark1x)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="turn tool calls in the output into tool_calls (needs --tool-call-parser)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME", help="muse (alias musespark1x)")
    p.add_argument("--disable-log-requests", action="store_true")
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="close a connection that has not sent a request's headers within this time")
    p.add_argument("--allowed-origins", default=None, metavar="JSON",
                   help="browser origins allowed by CORS, a JSON list (e.g. '[\"https://app.example\"]'); "
                   "default: none (vLLM's default is every origin)")
    p.add_argument("--forwarded-allow-ips", default=None, metavar="IPS",
                   help="proxies whose X-Forwarded-For/-Proto headers are trusted (comma-separated, or '*'); "
                   "default: none, so a client's own X-Forwarded-For is never logged as its address")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def _allowed_origins(value: str | None) -> tuple[str, ...]:
    import json

    if value is None:
        return ()
    try:
        origins = json.loads(value)
    except json.JSONDecodeError:
        origins = None
    if not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins):
        raise ValueError(f"--allowed-origins must be a JSON list of origins, got {value!r}")
    return tuple(origins)


def _run_serve(args: argparse.Namespace) -> int:
    import logging

    from .engine.chat import compile_template, parse_reasoning_effort_map, parse_template_kwargs
    from .engine.llm_engine import LLMEngine
    from .server.api import ServerConfig, serve
    from .server.chat_output import check_parsers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key if args.api_key is not None else os.environ.get("MUSESPARK_API_KEY") or None
    template = load_chat_template(args.chat_template)
    # Check the chat flags before loading weights (ServerConfig checks them again).
    default_kwargs = parse_template_kwargs(args.default_chat_template_kwargs, "--default-chat-template-kwargs")
    effort_map = parse_reasoning_effort_map(args.reasoning_effort_map)
    if template is not None:
        compile_template(template)
    check_parsers(args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice)
    origins = _allowed_origins(args.allowed_origins)
    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
    if template is not None and engine.tokenizer is None:
        raise ValueError("--chat-template needs a model with a tokenizer")
    name = args.served_model_name or args.model or engine.model_path.name
    config = ServerConfig(model_name=name, api_key=api_key, max_request_body_bytes=args.max_request_body_bytes,
                          log_requests=not args.disable_log_requests, chat_template=template,
                          default_chat_template_kwargs=default_kwargs, reasoning_effort_map=effort_map,
                          reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                          enable_auto_tool_choice=args.enable_auto_tool_choice, header_timeout_s=args.header_timeout,
                          allowed_origins=origins, forwarded_allow_ips=args.forwarded_allow_ips)
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
