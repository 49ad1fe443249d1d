"""`musespark serve`: the OpenAI-compatible HTTP server, with vLLM's flag names (a `vllm serve`
command line runs as it is; each flag with no meaning here is ignored with a warning or
refused, see musespark.server.vllm_flags). Every flag is checked before weights load."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from .engine.args import EngineArgs


def add_parser(sub: argparse._SubParsersAction) -> None:
    from .cli_parsing import human_readable_int
    from .server.vllm_flags import VLLM_GROUP, EnableDisable, add_vllm_compat_args

    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        usage="musespark serve [MODEL] [--host H] [--port P] [flags; --help lists them]",
        hidden_groups=(VLLM_GROUP,),
    )
    # Groups `--help=engine` / `--help=frontend` show (vLLM's `--help=<group>`); the vLLM ones are `vllm`.
    EngineArgs.add_cli_args(p.add_argument_group("engine", "the model and the engine"), model_positional=True)
    front = p.add_argument_group("frontend", "the HTTP server")
    front.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="MODEL, as a flag (vLLM's)")
    front.add_argument(
        "--kv-cache-memory-bytes", dest="kv_cache_memory", type=human_readable_int, help="= --kv-cache-memory"
    )
    front.add_argument("--tokenizer", default=None, metavar="DIR", help="must be MODEL (its tokenizer is used)")
    front.add_argument(
        "--trust-remote-code",
        action=EnableDisable,
        default=False,
        help="accepted (vLLM's); no checkpoint code is ever run",
    )
    front.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    front.add_argument("--port", type=int, default=8000, help="TCP port (0-65535; default 8000)")
    front.add_argument(
        "--uds", default=None, metavar="PATH", help="serve on this Unix domain socket instead of --host/--port"
    )
    front.add_argument(
        "--root-path",
        default=None,
        metavar="PATH",
        help="the path prefix a proxy adds (e.g. /llm): routes answer with and without it",
    )
    front.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        default=None,
        help="require 'Authorization: "
        "Bearer KEY' on /v1/*; several keys: any is accepted (default: $VLLM_API_KEY, else $MUSESPARK_API_KEY)",
    )
    front.add_argument(
        "--enable-force-include-usage",
        action=EnableDisable,
        default=False,
        help="every streamed response ends with usage, as if stream_options.include_usage were set",
    )
    front.add_argument(
        "--enable-server-load-tracking",
        action=EnableDisable,
        default=False,
        help="count requests in flight and report them at /load",
    )
    front.add_argument(
        "--enable-tokenizer-info-endpoint",
        action=EnableDisable,
        default=False,
        help="serve /tokenizer_info (the tokenizer's configuration and chat template)",
    )
    front.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name clients send; "
        "several: the first is reported (default: MODEL as given, or the bundled model's directory name)",
    )
    front.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most logprobs / top_logprobs a request may ask for (-1: no limit of ours)",
    )
    front.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="sampling defaults "
        'over the checkpoint\'s generation config, e.g. \'{"temperature": 0.6, "max_new_tokens": 512}\'',
    )
    front.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (or the template "
        "itself) replacing the checkpoint's (chat_template.jinja, else tokenizer_config.json's)",
    )
    front.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="template kwargs for every chat request, a JSON object; a request's "
        'chat_template_kwargs and fields override them (e.g. \'{"reasoning_strength": "low"}\')',
    )
    front.add_argument(
        "--reasoning-effort-map",
        default=None,
        metavar="JSON",
        help="a JSON object mapping reasoning_effort values (none, minimal, low, medium, high, xhigh, "
        "max) to the value the template receives as reasoning_effort and reasoning_strength "
        "(default: identity)",
    )
    front.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split reasoning channels into message.reasoning: muse (alias musespark1x), or none "
        "(default: muse when the chat template is the Muse template, else none)",
    )
    front.add_argument(
        "--enable-auto-tool-choice",
        action=EnableDisable,
        default=None,
        help="turn tool calls in the output into tool_calls (needs --tool-call-parser; default: on with "
        "the Muse template, else off)",
    )
    front.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="muse (alias musespark1x), or none (default: muse when the chat template is the Muse template)",
    )
    front.add_argument(
        "--enable-prompt-tokens-details",
        action=EnableDisable,
        default=False,
        help="send usage.prompt_tokens_details.cached_tokens (prefix-cache hits); default: null, as vLLM",
    )
    front.add_argument(
        "--return-tokens-as-token-ids",
        action=EnableDisable,
        default=False,
        help="name logprob tokens 'token_id:N' (a request's return_tokens_as_token_ids overrides it)",
    )
    front.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action=EnableDisable,
        default=True,
        help="log each request (default: on; --disable-log-requests turns it off)",
    )
    front.add_argument(
        "--disable-fastapi-docs",
        action=EnableDisable,
        default=False,
        help="do not serve /docs, /redoc and /openapi.json",
    )
    front.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    front.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="close a connection that has not sent a request's headers within this time",
    )
    front.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long running requests may take to finish",
    )
    front.add_argument(
        "--allowed-origins",
        default=None,
        metavar="JSON",
        help="browser origins allowed by CORS, a JSON list (e.g. '[\"https://app.example\"]'); "
        "default: none (vLLM's default is every origin)",
    )
    front.add_argument(
        "--forwarded-allow-ips",
        default=None,
        metavar="IPS",
        help="proxies whose X-Forwarded-For/-Proto headers are trusted (comma-separated, or '*'); "
        "default: none, so a client's own X-Forwarded-For is never logged as its address",
    )
    front.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key")
    front.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS with this certificate")
    front.add_argument(
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
    uds: str | None = None  # --uds: a Unix socket instead of host:port
    parsers: Any = None  # parsers.defaults.ParserChoice: what runs, and whether Muse defaults were taken


API_KEY_ENVS = ("VLLM_API_KEY", "MUSESPARK_API_KEY")  # read in this order when --api-key is not given


def api_keys_of(flag: list[str] | None) -> tuple[str, ...]:
    """--api-key's keys; without it, the first of API_KEY_ENVS that is set (vLLM reads
    VLLM_API_KEY); empty: no key required."""
    if flag:
        return tuple(flag)
    return next(((os.environ[name],) for name in API_KEY_ENVS if os.environ.get(name)), ())


def resolve_parser_flags(args: argparse.Namespace, template: str | None) -> Any:
    """The parsers `serve` runs with (parsers.defaults): the flags, or the Muse defaults when
    the effective chat template (--chat-template, else the checkpoint's) is the Muse one."""
    from pathlib import Path

    from .engine.args import default_model_path
    from .parsers.defaults import checkpoint_chat_template, resolve_parsers

    if template is None:
        try:
            model = Path(args.model) if args.model is not None else default_model_path()
        except ValueError:
            model = None
        template = checkpoint_chat_template(model) if model is not None else None
    return resolve_parsers(template, args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice)


def resolve(args: argparse.Namespace, log: logging.Logger) -> ServeSettings:
    """Check every flag (a refused vLLM flag or a bad value raises ValueError naming it; each
    ignored vLLM flag logs one warning) and resolve the settings; reads no weights."""
    from .engine.chat import load_chat_template, parse_reasoning_effort_map, parse_template_kwargs
    from .server.api import ServerConfig
    from .server.protocol import MAX_LOGPROBS
    from .server.vllm_flags import check_vllm_compat, parse_override_generation_config

    check_vllm_compat(args, log)
    vllm_model_flags(args)
    api_keys = api_keys_of(args.api_key)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: a port is between 0 and 65535")
    if args.uds is not None and not args.uds:
        raise ValueError("--uds needs a socket path")
    if args.root_path is not None and args.root_path and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
    chat_template = load_chat_template(args.chat_template)
    parsers = resolve_parser_flags(args, chat_template)
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
        chat_template=chat_template,
        default_chat_template_kwargs=parse_template_kwargs(
            args.default_chat_template_kwargs, "--default-chat-template-kwargs"
        ),
        reasoning_effort_map=parse_reasoning_effort_map(args.reasoning_effort_map),
        reasoning_parser=parsers.reasoning_parser,
        tool_call_parser=parsers.tool_call_parser,
        enable_auto_tool_choice=parsers.enable_auto_tool_choice,
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
        root_path=(args.root_path or "").rstrip("/"),
        enable_force_include_usage=args.enable_force_include_usage,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
    )
    return ServeSettings(
        engine_args=EngineArgs.from_cli_args(args),
        server=server,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        generation_overrides=overrides,
        uds=args.uds,
        parsers=parsers,
    )


def run(args: argparse.Namespace) -> int:
    from .engine.llm_engine import LLMEngine
    from .server.api import serve
    from .server.listen import bind, close_uds, listen_url
    from .startup import serve_summary, weights_bar

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = resolve(args, logging.getLogger("musespark.server"))
    # The address is taken before any weights load: a port in use fails in a second, not after the model.
    sock = bind(settings.host, settings.port, settings.uds)
    bar = weights_bar()
    try:
        engine = LLMEngine(settings.engine_args.create_engine_config(), progress=bar)
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
        url = listen_url(sock, settings.uds, https=server.ssl_certfile is not None) + server.root_path
        print(serve_summary(engine, settings.parsers.describe(), url), file=sys.stderr, flush=True)
    except BaseException:
        if bar is not None:
            bar.close()  # the error starts on a line of its own
        sock.close()
        close_uds(settings.uds)
        raise
    return serve(engine, server, log_level=settings.log_level, sock=sock)
