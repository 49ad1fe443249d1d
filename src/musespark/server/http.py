"""What every API module shares over HTTP: the request error (`APIError`), error bodies in
OpenAI's and Anthropic's shapes, request-body parsing, server-sent-event framing and the
streaming response, client-disconnect handling, and the request-preparation thread pool.

Invariants:
* `parse_body` accepts only a JSON object in strict UTF-8 with no lone surrogate, validated
  by a pydantic model; every refusal is an `APIError(400)` naming the field when one is to
  blame.
* An `SSEResponse` closes its generator as soon as the client goes away (the generator's
  `finally` aborts the engine requests).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send


class APIError(Exception):
    """A request refused with HTTP `status`; `param` names the request field to blame."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def bad_request(exc: ValueError) -> APIError:
    """A 400 for a refused argument, naming it when the error does."""
    return APIError(400, str(exc), getattr(exc, "param", None))


# -- error bodies -------------------------------------------------------------------------------

_OPENAI_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    503: "ServiceUnavailableError",
}

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """An error in OpenAI's JSON shape."""
    kind = _OPENAI_ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error response in OpenAI's JSON shape."""
    return JSONResponse(error_body(message, status, param), status_code=status)


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(status: int, message: str) -> JSONResponse:
    """An error response in Anthropic's shape (the /v1/messages routes)."""
    return JSONResponse(anthropic_error_body(status, message), status_code=status)


# -- request bodies -----------------------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string or key holding a lone surrogate."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return where
        elif isinstance(item, dict):
            for k, v in item.items():
                child = f"{where}.{k}" if where else str(k)
                if _SURROGATE.search(k):
                    return child
                stack.append((v, child))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
    return None


# pydantic's names for union branches and wrappers in an error's `loc` (not request fields).
_LOC_MARKERS = frozenset(
    "function-wrap function-after function-before function-plain json-or-python lax-or-strict chain default "
    "nullable tagged-union union call arguments is-instance is-subclass callable str int float bool bytes "
    "bytearray list tuple dict set frozenset complex none nonetype".split()
)
_MAX_REPORTED_ERRORS, _MAX_INPUT_CHARS, _MAX_ERROR_CHARS = 10, 200, 1000


def _loc_fields(loc: Any) -> list[str]:
    """The request-field parts of a pydantic `loc` (union branches and wrappers dropped)."""
    parts = [str(x) for x in loc or ()]
    kept = [p for p in parts if not re.search(r"[\[\]{}()]", p) and p.lower() not in _LOC_MARKERS]
    return kept or parts


def _short_input(value: Any) -> Any:
    """A size-bounded stand-in for an error's `input` (containers are described, not shown)."""
    if isinstance(value, str):
        return value if len(value) <= _MAX_INPUT_CHARS else value[:_MAX_INPUT_CHARS] + "...[truncated]"
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except Exception:  # e.g. an int too long to print
        return f"<{type(value).__name__}>"
    return text if len(text) <= _MAX_INPUT_CHARS else text[:_MAX_INPUT_CHARS] + "...[truncated]"


def validation_error(errors: Any) -> APIError:
    """pydantic's errors as one 400 worded as vLLM words them ("N validation error(s):" and
    one line per error, at most 10: type, loc as `body.FIELD`, msg, input, ctx); `param` is
    the first error's field."""
    errors = list(errors)
    if not errors:
        return APIError(400, "Validation error")
    lines = []
    for err in errors[:_MAX_REPORTED_ERRORS]:
        entry = {k: v for k, v in dict(err).items() if k != "url"}
        fields = _loc_fields(entry.get("loc"))
        entry["loc"] = ".".join(fields if fields[:1] in (["body"], ["query"], ["path"]) else ["body", *fields])
        if "input" in entry:
            entry["input"] = _short_input(entry["input"])
        text = str(entry)
        lines.append(f"  {text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + '...[truncated]'}")
    label = "error" if len(errors) == 1 else "errors"
    if len(errors) > _MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}")
    first = [f for f in _loc_fields(errors[0].get("loc")) if f != "body"]
    return APIError(400, f"{len(errors)} validation {label}:\n" + "\n".join(lines), first[0] if first else None)


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The request body validated as `model` (see the module invariants)."""
    body = await request.body()
    try:
        # Strict UTF-8 (json.loads on bytes would let encoded surrogates through).
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if "\\u" in text:  # now only \uXXXX escapes can smuggle in a lone surrogate
        where = _lone_surrogate(data)
        if where is not None:
            raise APIError(
                400,
                f"{where or 'body'}: a string holds a lone surrogate (\\ud800-\\udfff escape), "
                "which is not valid Unicode",
                where.split(".", 1)[0].split("[", 1)[0] or None,
            )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


# -- streaming and disconnects ------------------------------------------------------------------


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event: `data: JSON` (non-ASCII kept), after an `event:` line if named."""
    data = f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
    return data if event is None else f"event: {event}\n{data}"


SSE_DONE = "data: [DONE]\n\n"  # the OpenAI streams' last event


class SSEResponse(StreamingResponse):
    """Streams while listening for the client going away; on disconnect the stream is
    cancelled and its generator closed at once, which aborts the request in the engine."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client disconnects first, cancel it (which aborts its requests)
    and answer 499."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


class Preparation:
    """Runs CPU-heavy request preparation (tokenizing, chat rendering, grammar compiling) in
    worker threads, at most `threads` at once and `queue` more waiting: beyond that a request
    is refused with 503 at once instead of piling up behind the others."""

    def __init__(self, threads: int = 4, queue: int = 1024) -> None:
        self._slots = asyncio.Semaphore(threads)
        self._queue, self._pending = queue, 0

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._pending >= self._queue:
            raise APIError(503, "the server is busy preparing other requests; retry shortly")
        self._pending += 1
        try:
            async with self._slots:
                return await asyncio.to_thread(fn, *args)
        finally:
            self._pending -= 1
