"""The HTTP transport under the app: what a request must be to reach a route
(`GuardMiddleware`: API key, JSON bodies, the size limit) and uvicorn's h11 protocol with a
header-read timeout (`header_timeout_protocol`).

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but waits forever for the
headers of a request that has started: a client that opens a socket and trickles bytes (or
none) holds it indefinitely. `HeaderTimeoutProtocol` arms a timer when a connection opens
and after each response; it is disarmed when a request's headers are complete. A timer
that fires closes the connection (no response: the request never started).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http import anthropic_error_response, error_response

if TYPE_CHECKING:
    from .api import ServerConfig


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """An h11 protocol class whose connections must send complete headers within `seconds`."""

    class HeaderTimeoutProtocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None

        def _arm(self) -> None:
            self._disarm()
            self._armed_cycle = self.cycle
            self._timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._timer is not None and self.cycle is not self._armed_cycle:
                self._disarm()  # a new request's headers are complete

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def route_path(scope: Scope) -> str:
    """The path the routes see: without the --root-path prefix when the request carries it
    (`/llm/v1/models` and `/v1/models` are both /v1/models), as Starlette's router matches."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


def _is_json(content_type: bytes | None) -> bool:
    """application/json or application/*+json, parameters (charset=...) allowed."""
    if content_type is None:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


# Paths that need the API key: vLLM's /v1 and /inference, and /invocations, which vLLM leaves
# open although it runs the same requests as /v1 (a key that a route ignores protects nothing).
_GUARDED = ("/v1", "/inference", "/invocations")


class GuardMiddleware:
    """API key on /v1/*, /inference/* and /invocations (`_GUARDED`; constant-time compare with
    each key; the `Bearer` scheme in any case), JSON-only POST bodies (415 otherwise: a web
    page cannot make a browser send JSON cross-origin without a CORS preflight), and the
    request body limit (from Content-Length, then while reading). The body is buffered and
    replayed to the app; later receive() calls (disconnect detection) go to the server."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app, self.config = app, config
        self._keys = tuple(k.encode() for k in config.all_api_keys)
        self._want = self._keys or None  # None: no key required

    def _matches(self, token: bytes) -> bool:
        """Compares with every key (no early exit), so timing tells nothing of which matched."""
        return sum(hmac.compare_digest(token, key) for key in self._keys) > 0

    def _authorized(self, header: bytes, x_api_key: bytes | None = None) -> bool:
        """`Authorization: Bearer KEY`, or Anthropic clients' `x-api-key: KEY`."""
        scheme, _, token = header.strip().partition(b" ")
        ok = self._matches(token.strip()) and scheme.lower() == b"bearer"
        if x_api_key is not None:
            ok = self._matches(x_api_key.strip()) or ok
        return ok

    @staticmethod
    def _refuse(scope: Scope, status: int, message: str) -> JSONResponse:
        """The error in the route's shape: Anthropic's on /v1/messages, else OpenAI's."""
        if route_path(scope).startswith("/v1/messages"):
            return anthropic_error_response(status, message)
        return error_response(status, message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self._want is not None and route_path(scope).startswith(_GUARDED):
            if not self._authorized(headers.get(b"authorization", b""), headers.get(b"x-api-key")):
                return await self._refuse(scope, 401, "Unauthorized: missing or wrong API key")(scope, receive, send)
        if scope["method"] == "POST" and not _is_json(headers.get(b"content-type")):
            return await self._refuse(scope, 415, "request bodies must be JSON (Content-Type: application/json)")(
                scope, receive, send
            )
        limit = self.config.max_request_body_bytes
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > limit
            except ValueError:
                return await self._refuse(scope, 400, "invalid Content-Length header")(scope, receive, send)
            if too_big:
                return await self._refuse(scope, 413, f"request body exceeds {limit} bytes")(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            size += len(message.get("body", b""))
            if size > limit:
                return await self._refuse(scope, 413, f"request body exceeds {limit} bytes")(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def receive_replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, receive_replayed, send)
