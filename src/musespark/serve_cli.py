"""`musespark serve`: the OpenAI-compatible HTTP server, with vLLM's flag names (a `vllm serve`
command line runs as it is; each flag with no meaning here is ignored with a warning or
refused, see musespark.server.vllm_flags). Every flag is checked before weights load."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from .engine.args import EngineArgs


def add_parser(sub: argparse._SubParsersAction) -> None:
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
        "--enable-prompt-tokens-details",
        action=EnableDisable,
        default=False,
        help="send usage.prompt_tokens_details.cached_tokens (prefix-cache hits); default: null, as vLLM",
    )
    p.add_argument(
        "--return-tokens-as-token-ids",
        action=EnableDisable,
        default=False,
        help="name logprob tokens 'token_id:N' (a request's return_tokens_as_token_ids overrides it)",
    )
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


def allowed_origins(value: str | None) -> tuple[str, ...]:
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


def vllm_model_flags(args: argparse.Namespace) -> None:
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


@dataclass(frozen=True)
class ServeSettings:
    """What `serve` runs with, resolved from its command line before any weights load.
    `server.model_name` is "" when neither --served-model-name nor MODEL names the model
    (then the checkpoint directory's name is used)."""

    engine_args: EngineArgs
    server: Any  # server.api.ServerConfig (imported lazily: the parser stays light)
    host: str
    port: int
    log_level: str
    generation_overrides: dict[str, Any]  # --override-generation-config, as SamplingParams fields


def resolve(args: argparse.Namespace, log: logging.Logger) -> ServeSettings:
    """Check every flag (a refused vLLM flag or a bad value raises ValueError naming it; each
    ignored vLLM flag logs one warning) and resolve the settings; reads no weights."""
    from .engine.chat import load_chat_template, parse_reasoning_effort_map, parse_template_kwargs
    from .server.api import ServerConfig
    from .server.protocol import MAX_LOGPROBS
    from .server.vllm_flags import check_vllm_compat, parse_override_generation_config

    check_vllm_compat(args, log)
    vllm_model_flags(args)
    api_keys = tuple(args.api_key) if args.api_key else tuple(filter(None, [os.environ.get("MUSESPARK_API_KEY")]))
    overrides = parse_override_generation_config(args.override_generation_config, log)
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        log.warning(f"--max-logprobs {args.max_logprobs}: requests are still limited to {MAX_LOGPROBS} logprobs")
    names = tuple(args.served_model_name or ())
    server = ServerConfig(  # checks its own values (the template compiles, the parsers exist, ...)
        model_name=names[0] if names else (args.model or ""),
        api_keys=api_keys,
        max_request_body_bytes=args.max_request_body_bytes,
        log_requests=args.log_requests,
        graceful_shutdown_s=args.shutdown_timeout,
        chat_template=load_chat_template(args.chat_template),
        default_chat_template_kwargs=parse_template_kwargs(
            args.default_chat_template_kwargs, "--default-chat-template-kwargs"
        ),
        reasoning_effort_map=parse_reasoning_effort_map(args.reasoning_effort_map),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        header_timeout_s=args.header_timeout,
        allowed_origins=allowed_origins(args.allowed_origins),
        forwarded_allow_ips=args.forwarded_allow_ips,
        max_logprobs=args.max_logprobs,
        fastapi_docs=not args.disable_fastapi_docs,
        model_aliases=names[1:],
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    return ServeSettings(
        engine_args=EngineArgs.from_cli_args(args),
        server=server,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        generation_overrides=overrides,
    )


def log_kv_cache(engine: Any, log: logging.Logger) -> None:
    """One start-up line: the KV cache's blocks, their dtype (--kv-cache-dtype) and bytes."""
    runner = engine.core.runner
    held = [t for pair in runner.kv_caches if pair is not None for t in pair]
    unique = {id(t): t for t in held}.values()  # layers of a group share one pair
    dtype = str(held[0].dtype).removeprefix("torch.") if held else "none"
    nbytes = sum(t.numel() * t.element_size() for t in unique)
    log.info(f"KV cache: {runner.num_blocks} blocks of {runner.block_size} tokens, {dtype}, {nbytes} bytes")


def run(args: argparse.Namespace) -> int:
    from .engine.llm_engine import LLMEngine
    from .server.api import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = resolve(args, logging.getLogger("musespark.server"))
    engine = LLMEngine(settings.engine_args.create_engine_config())
    log_kv_cache(engine, logging.getLogger("musespark.server"))
    server = settings.server
    if server.chat_template is not None and engine.tokenizer is None:
        raise ValueError("--chat-template needs a model with a tokenizer")
    if settings.generation_overrides:
        engine.input_processor.generation_defaults.update(settings.generation_overrides)
        cap = settings.generation_overrides.get("max_tokens")
        if cap is not None:  # vLLM: --override-generation-config's max_new_tokens caps every request
            engine.input_processor.override_max_tokens = cap
        engine.input_processor.default_sampling_params()  # a bad value fails now, not per request
    if not server.model_name:
        server = dataclasses.replace(server, model_name=engine.model_path.name)
    return serve(engine, server, host=settings.host, port=settings.port, log_level=settings.log_level)
