"""The FastAPI app: `ServerConfig`, the route table, OpenAI-shaped errors, and `serve()` (the
request gate and the transport are in transport.py; the HTTP helpers every API module shares
in http.py; the Responses and Messages routes in responses.py and messages.py).

    app = build_app(engine, ServerConfig(model_name="musespark-tiny"))
    serve(engine, config, host="127.0.0.1", port=8000)

The routes talk to the `AsyncEngine` only (generate, abort, stats, metrics); request
building that tokenizes or renders a chat runs in a worker thread, off the event loop.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine.chat import compile_template, parse_reasoning_effort_map, parse_template_kwargs
from ..engine.llm_engine import LLMEngine
from . import endpoints, generate_api, messages, responses
from .async_engine import AsyncEngine, EngineDeadError
from .chat_output import check_parsers
from .http import APIError, Preparation, SSEResponse, error_response, parse_body, until_disconnect, validation_error
from .listen import close_uds
from .load import LoadTrackingMiddleware, ServerLoad, orca_headers_for
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .render import render_chat
from .serving import ChatSettings, Serving
from .transport import GuardMiddleware, header_timeout_protocol

logger = logging.getLogger("musespark.server")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    api_keys: tuple[str, ...] = ()  # more keys (--api-key given several times): any of them is accepted
    model_aliases: tuple[str, ...] = ()  # --served-model-name's other names (model_name is the first)
    max_logprobs: int = 20  # --max-logprobs: most logprobs/top_logprobs a request may ask (-1: protocol cap only)
    fastapi_docs: bool = True  # /docs, /redoc, /openapi.json (--disable-fastapi-docs turns them off)
    ssl_keyfile: str | None = None  # HTTPS: both files, or neither
    ssl_certfile: str | None = None
    max_request_body_bytes: int = 1 << 20
    max_sequences_per_request: int = 256  # prompts x n in one request
    log_requests: bool = True
    graceful_shutdown_s: int = 30
    # Chat templates: the template text (None: the checkpoint's), the lowest-precedence
    # template kwargs, and reasoning_effort -> template value (unlisted efforts unchanged).
    chat_template: str | None = None
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    reasoning_effort_map: Mapping[str, str] | None = None
    # Output parsers (`musespark.parsers`): --reasoning-parser, --tool-call-parser, --enable-auto-tool-choice.
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # vLLM's response options: usage.prompt_tokens_details (with cached_tokens) is sent only with
    # --enable-prompt-tokens-details; --return-tokens-as-token-ids names logprob tokens "token_id:N".
    enable_prompt_tokens_details: bool = False
    return_tokens_as_token_ids: bool = False
    # Transport: seconds a connection may take to send a request's headers; browser origins
    # allowed by CORS (none by default); proxies whose X-Forwarded-* headers are believed
    # (None: nobody's; uvicorn's syntax, e.g. "10.0.0.1,10.0.0.2" or "*").
    header_timeout_s: float = 10.0
    allowed_origins: tuple[str, ...] = ()
    forwarded_allow_ips: str | None = None
    # vLLM's frontend switches: the path prefix a proxy adds (--root-path; "" none: routes answer
    # with and without it), usage on every stream (--enable-force-include-usage), and the /load and
    # /tokenizer_info endpoints (--enable-server-load-tracking, --enable-tokenizer-info-endpoint).
    root_path: str = ""
    enable_force_include_usage: bool = False
    enable_server_load_tracking: bool = False
    enable_tokenizer_info_endpoint: bool = False

    def __post_init__(self) -> None:
        if self.max_request_body_bytes <= 0:
            raise ValueError(f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be positive, got {self.header_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if not all(isinstance(k, str) and k for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        for f in (self.ssl_keyfile, self.ssl_certfile):
            if f is not None and not Path(f).is_file():
                raise ValueError(f"no such file: {f}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or more, got {self.max_logprobs}")
        if self.chat_template is not None:
            compile_template(self.chat_template)  # a template that does not compile fails now
        parse_template_kwargs(self.default_chat_template_kwargs, "default_chat_template_kwargs")
        parse_reasoning_effort_map(self.reasoning_effort_map)
        check_parsers(self.reasoning_parser, self.tool_call_parser, self.enable_auto_tool_choice)

    @property
    def all_api_keys(self) -> tuple[str, ...]:
        """api_key and api_keys, each once (empty: no key is required)."""
        return tuple(dict.fromkeys(((self.api_key,) if self.api_key else ()) + self.api_keys))

    def chat_settings(self) -> ChatSettings:
        return ChatSettings(
            chat_template=self.chat_template,
            default_chat_template_kwargs=parse_template_kwargs(
                self.default_chat_template_kwargs, "default_chat_template_kwargs"
            ),
            reasoning_effort_map=parse_reasoning_effort_map(self.reasoning_effort_map),
            reasoning_parser=self.reasoning_parser,
            tool_call_parser=self.tool_call_parser if self.enable_auto_tool_choice else None,
            enable_prompt_tokens_details=self.enable_prompt_tokens_details,
            return_tokens_as_token_ids=self.return_tokens_as_token_ids,
        )


def add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's JSON shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc.errors())
        return error_response(400, err.message, err.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The app serving `engine`. (Over 60 lines on purpose: it is the route table, a few
    lines per route, and the server's whole surface reads best in one place.)"""
    async_engine = AsyncEngine(engine, config.model_name, log_requests=config.log_requests)
    serving = Serving(
        async_engine,
        config.model_name,
        config.max_sequences_per_request,
        config.chat_settings(),
        model_aliases=config.model_aliases,
        max_logprobs=config.max_logprobs,
        force_include_usage=config.enable_force_include_usage,
    )
    prep = Preparation()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    no_docs = {} if config.fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="musespark", version=__version__, lifespan=lifespan, root_path=config.root_path, **no_docs)
    app.state.async_engine = async_engine
    load = app.state.server_load = ServerLoad(config.enable_server_load_tracking)
    app.add_middleware(LoadTrackingMiddleware, load=load)  # inside the guard: refused requests do not count
    app.add_middleware(GuardMiddleware, config=config)
    if config.allowed_origins:  # outermost: preflights are answered before the key check
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
        )

    add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_engine.is_alive else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(async_engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "musespark",
                    "root": str(async_engine.model_path),
                    "parent": None,
                    "max_model_len": async_engine.max_model_len,
                }
                for name in (config.model_name, *config.model_aliases)
            ],
        }

    def orca(request: Request) -> dict[str, str]:
        return orca_headers_for(request.headers, async_engine.metrics.load_report)

    async def run_completion(request: Request, req: CompletionRequest) -> Response:
        base, jobs = await prep.run(serving.completion_jobs, req)
        if req.stream:
            return SSEResponse(serving.completion_stream(base, req, jobs))

        async def work() -> JSONResponse:
            finals = await serving.final_outputs(jobs)
            return JSONResponse(serving.completion_response(base, req, jobs, finals), headers=orca(request))

        return await until_disconnect(request, work())

    async def run_chat(request: Request, req: ChatCompletionRequest) -> Response:
        base, jobs = await prep.run(serving.chat_jobs, req)
        if req.stream:
            return SSEResponse(serving.chat_stream(base, req, jobs))

        async def work() -> JSONResponse:
            (final,) = await serving.final_outputs(jobs)
            return JSONResponse(serving.chat_response(base, req, final), headers=orca(request))

        return await until_disconnect(request, work())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run_completion(request, await parse_body(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await run_chat(request, await parse_body(request, ChatCompletionRequest))

    @app.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> dict[str, Any]:
        req = await parse_body(request, ChatCompletionRequest)
        return await prep.run(render_chat, serving, req)

    endpoints.add_routes(
        app,
        serving,
        prep,
        chat=run_chat,
        completion=run_completion,
        load=load,
        tokenizer_info_enabled=config.enable_tokenizer_info_endpoint,
        chat_template=config.chat_template,
    )
    generate_api.add_routes(app, serving, prep)
    responses.add_routes(app, serving, prep)
    messages.add_routes(app, serving, prep)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, TokenizeRequest)
        return await prep.run(serving.tokenize, req)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await parse_body(request, DetokenizeRequest)
        return await prep.run(serving.detokenize, req)

    return app


def serve(
    engine: LLMEngine,
    config: ServerConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    sock: socket.socket | None = None,
) -> int:
    """Run until SIGTERM/SIGINT: stop accepting, let running requests finish (at most
    config.graceful_shutdown_s), stop the engine loop, return 0. `sock`: an already bound
    socket (TCP or Unix, server/listen.py) to serve on instead of host:port."""
    import uvicorn

    app = build_app(engine, config)
    uv = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=config.log_requests,
        timeout_graceful_shutdown=config.graceful_shutdown_s,
        lifespan="on",
        http=header_timeout_protocol(config.header_timeout_s),
        proxy_headers=config.forwarded_allow_ips is not None,
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
        forwarded_allow_ips=config.forwarded_allow_ips,
    )
    server = uvicorn.Server(uv)
    # uvicorn re-raises the signal that stopped it once it has shut down; a no-op handler
    # makes that a clean exit (status 0) instead of death by SIGTERM.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if sock is not None and sock.family == socket.AF_UNIX:
            close_uds(sock.getsockname())
    return 0 if server.started else 1
