"""The `musespark` command line.

    musespark generate [--model DIR] [--max-tokens N] [--temperature T] [--top-p P]
                       [--seed S] [--chat [--tools JSON] [--chat-template FILE] [--chat-template-kwargs JSON]]
                       PROMPT...

    musespark serve [MODEL] [--host H] [--port P] [--api-key KEY...] [--served-model-name NAME...]
                    [--chat-template FILE] [--default-chat-template-kwargs JSON]
                    [--reasoning-effort-map JSON] [any other `vllm serve` flag] ...

    musespark bench latency|throughput [--model DIR | --preset NAME] [--dtype D] ...
    musespark bench serve [--base-url URL] [--num-prompts N] [--request-rate R] ...

    musespark plan [--model DIR | --preset NAME] [-tp N] [-ep] [-pp N] [--quantization nvfp4]
                   [--dtype D] [--device-memory GB] [--json]

`generate` prints each completion as it streams (with `--chat` on a model that speaks Muse,
its reasoning, answer and tool calls apart); `serve` runs the OpenAI-compatible HTTP
server (vLLM's flag names: a `vllm serve` command line runs as it is, each flag with no
meaning here ignored with a warning or refused; see musespark.server.vllm_flags). Without
a model both use the bundled model. `bench` runs vLLM's three benchmark modes (see
musespark.bench); its last output line is one JSON object.

The engine flags (--model, --dtype, --backend, --max-model-len, ...) of generate, serve and
bench latency/throughput come from `EngineArgs.add_cli_args`: one table of names and
defaults. `generate --seed` is the per-request sampling seed (the engine seed elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import plan_cli
from .engine.args import EngineArgs

# `generate`'s fallback when the checkpoint's generation_config.json sets no max_new_tokens.
GENERATE_MAX_TOKENS = 64


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for one or more prompts")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    EngineArgs.add_cli_args(p, skip={"seed"})
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens to generate per prompt (default: the checkpoint's generation config, else {GENERATE_MAX_TOKENS})",
    )
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", dest="request_seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument(
        "--chat-template",
        default=None,
        help="with --chat: a Jinja chat template file (or the template itself) replacing the checkpoint's",
    )
    p.add_argument(
        "--tools",
        default=None,
        metavar="JSON|FILE",
        help="with --chat: OpenAI tool definitions, a JSON list or a file holding one",
    )
    p.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help='with --chat: extra template kwargs, a JSON object (e.g. \'{"reasoning_strength": "low"}\')',
    )


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

        self.parser = MuseOutputParser(
            reasoning=True, tools=bool(tools), tool_names=tool_schemas_from_openai(tools) if tools else None
        )
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
            if call.name is not None:  # a new call: always its own labelled line
                self._label(f"tool call {call.name} #{call.index}")
            print(call.arguments, end="", flush=True)


def _run_generate(args: argparse.Namespace) -> int:
    import dataclasses

    from .engine.chat import normalize_tools, parse_template_kwargs
    from .engine.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)), show_progress=True)
    processor = llm.engine.input_processor
    params = processor.default_sampling_params(
        fallback_max_tokens=GENERATE_MAX_TOKENS,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.request_seed,
    )
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
            request = processor.render_chat(
                [{"role": "user", "content": prompt}],
                chat_template=template,
                chat_template_kwargs=template_kwargs,
                tools=tools,
            )
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
    stats = llm.engine.get_stats()
    if stats.num_speculative_tokens and stats.spec_num_drafts:
        mean = 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
        print(
            f"[speculative decoding: mean acceptance length {mean:.2f} over {stats.spec_num_drafts} drafts]",
            file=sys.stderr,
            flush=True,
        )
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from .server.vllm_flags import EnableDisable, add_vllm_compat_args

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(p, model_positional=True)
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="MODEL, as a flag (vLLM's)")
    p.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory", type=int, help="= --kv-cache-memory")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="must be MODEL (its tokenizer is used)")
    p.add_argument(
        "--trust-remote-code",
        action=EnableDisable,
        default=False,
        help="accepted (vLLM's); no checkpoint code is ever run",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        default=None,
        help="require 'Authorization: "
        "Bearer KEY' on /v1/*; several keys: any is accepted (default: $MUSESPARK_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name clients send; "
        "several: the first is reported (default: MODEL as given, or the bundled model's directory name)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most logprobs / top_logprobs a request may ask for (-1: no limit of ours)",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="sampling defaults "
        'over the checkpoint\'s generation config, e.g. \'{"temperature": 0.6, "max_new_tokens": 512}\'',
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (or the template "
        "itself) replacing the checkpoint's (chat_template.jinja, else tokenizer_config.json's)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="template kwargs for every chat request, a JSON object; a request's "
        'chat_template_kwargs and fields override them (e.g. \'{"reasoning_strength": "low"}\')',
    )
    p.add_argument(
        "--reasoning-effort-map",
        default=None,
        metavar="JSON",
        help="a JSON object mapping reasoning_effort values (none, minimal, low, medium, high, xhigh, "
        "max) to the value the template receives as reasoning_effort and reasoning_strength "
        "(default: identity)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split reasoning channels into message.reasoning: muse (alias musespark1x)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action=EnableDisable,
        default=False,
        help="turn tool calls in the output into tool_calls (needs --tool-call-parser)",
    )
    p.add_argument("--tool-call-parser", default=None, metavar="NAME", help="muse (alias musespark1x)")
    p.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action=EnableDisable,
        default=True,
        help="log each request (default: on; --disable-log-requests turns it off)",
    )
    p.add_argument(
        "--disable-fastapi-docs",
        action=EnableDisable,
        default=False,
        help="do not serve /docs, /redoc and /openapi.json",
    )
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="close a connection that has not sent a request's headers within this time",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long running requests may take to finish",
    )
    p.add_argument(
        "--allowed-origins",
        default=None,
        metavar="JSON",
        help="browser origins allowed by CORS, a JSON list (e.g. '[\"https://app.example\"]'); "
        "default: none (vLLM's default is every origin)",
    )
    p.add_argument(
        "--forwarded-allow-ips",
        default=None,
        metavar="IPS",
        help="proxies whose X-Forwarded-For/-Proto headers are trusted (comma-separated, or '*'); "
        "default: none, so a client's own X-Forwarded-For is never logged as its address",
    )
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key")
    p.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS with this certificate")
    p.add_argument(
        "--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    add_vllm_compat_args(p)  # every other `vllm serve` flag: ignored with a warning, or refused


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


def _vllm_model_flags(args: argparse.Namespace) -> None:
    """vLLM's --model and --tokenizer: MODEL as a flag; a tokenizer only from MODEL itself."""
    from pathlib import Path

    if args.model_flag is not None:
        if args.model is not None and Path(args.model) != Path(args.model_flag):
            raise ValueError(f"MODEL {args.model!r} and --model {args.model_flag!r} differ; give one of them")
        args.model = args.model_flag
    if args.tokenizer is not None:
        from .engine.args import default_model_path

        model = Path(args.model) if args.model is not None else default_model_path()
        if Path(args.tokenizer).resolve() != model.resolve():
            raise ValueError(
                f"--tokenizer {args.tokenizer!r}: only MODEL's own tokenizer is supported; "
                "drop --tokenizer or give the model directory"
            )


def _run_serve(args: argparse.Namespace) -> int:
    import logging

    from .engine.chat import compile_template, parse_reasoning_effort_map, parse_template_kwargs
    from .engine.llm_engine import LLMEngine
    from .server.api import ServerConfig, serve
    from .server.chat_output import check_parsers
    from .server.protocol import MAX_LOGPROBS
    from .server.vllm_flags import check_vllm_compat, parse_override_generation_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("musespark.server")
    # Check every flag before loading weights (ServerConfig checks its own again).
    check_vllm_compat(args, log)
    _vllm_model_flags(args)
    api_keys = tuple(args.api_key) if args.api_key else tuple(filter(None, [os.environ.get("MUSESPARK_API_KEY")]))
    template = load_chat_template(args.chat_template)
    default_kwargs = parse_template_kwargs(args.default_chat_template_kwargs, "--default-chat-template-kwargs")
    effort_map = parse_reasoning_effort_map(args.reasoning_effort_map)
    if template is not None:
        compile_template(template)
    check_parsers(args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice)
    origins = _allowed_origins(args.allowed_origins)
    overrides = parse_override_generation_config(args.override_generation_config, log)
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        log.warning(f"--max-logprobs {args.max_logprobs}: requests are still limited to {MAX_LOGPROBS} logprobs")
    names = tuple(args.served_model_name or ())
    config_kwargs = dict(
        api_keys=api_keys,
        max_request_body_bytes=args.max_request_body_bytes,
        log_requests=args.log_requests,
        graceful_shutdown_s=args.shutdown_timeout,
        chat_template=template,
        default_chat_template_kwargs=default_kwargs,
        reasoning_effort_map=effort_map,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        header_timeout_s=args.header_timeout,
        allowed_origins=origins,
        forwarded_allow_ips=args.forwarded_allow_ips,
        max_logprobs=args.max_logprobs,
        fastapi_docs=not args.disable_fastapi_docs,
        model_aliases=names[1:],
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    ServerConfig(model_name=names[0] if names else "model", **config_kwargs)  # refuse bad values before loading
    engine = LLMEngine(EngineArgs.from_cli_args(args).create_engine_config())
    if template is not None and engine.tokenizer is None:
        raise ValueError("--chat-template needs a model with a tokenizer")
    if overrides:
        engine.input_processor.generation_defaults.update(overrides)
        engine.input_processor.default_sampling_params()  # a bad value fails now, not per request
    name = names[0] if names else args.model or engine.model_path.name
    return serve(
        engine,
        ServerConfig(model_name=name, **config_kwargs),
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
    )


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


def _quantize_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write an NVFP4 (ModelOpt-format) copy of a bf16 checkpoint")
    p.add_argument(
        "--format",
        required=True,
        choices=["nvfp4"],
        help="the quantized format (NVFP4: E2M1 codes, "
        "fp8-e4m3 block scales per 16, fp32 global and calibrated input scales)",
    )
    p.add_argument("src", metavar="SRC", help="the unquantized checkpoint directory")
    p.add_argument("dst", metavar="DST", help="the new checkpoint directory (must not exist or be empty)")
    p.add_argument(
        "--scope",
        default="experts",
        choices=["experts", "linear"],
        help="experts (default): routed experts of every layer but the first and last; "
        "linear: every linear layer and all experts, not the LM head",
    )
    p.add_argument(
        "--calibration-prompts",
        type=int,
        default=16,
        metavar="N",
        help="prompts the bf16 model runs to calibrate the activation input scales (default 16)",
    )
    p.add_argument(
        "--calibration-file",
        default=None,
        metavar="F",
        help="a text file whose blank-line-separated paragraphs are the calibration prompts "
        "(default: modules of the Python standard library, the bundled model's corpus)",
    )


def _run_quantize(args: argparse.Namespace) -> int:
    from .apps.quantize import quantize_checkpoint

    quantize_checkpoint(
        args.src,
        args.dst,
        scope=args.scope,
        calibration_prompts=args.calibration_prompts,
        calibration_file=args.calibration_file,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="musespark", description="Serve and run Muse Spark 1x models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    plan_cli.add_parser(sub)
    _quantize_parser(sub)
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
        if args.command == "plan":
            return plan_cli.run(args)
        if args.command == "quantize":
            return _run_quantize(args)
    except ValueError as exc:
        print(f"musespark {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
