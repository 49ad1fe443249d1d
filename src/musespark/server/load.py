"""Server load reporting: vLLM's request-count load (`--enable-server-load-tracking`, read
at GET /load) and the ORCA `endpoint-load-metrics` response header.

Invariants:
* `ServerLoad.value` is the number of requests to the tracked routes (the ones that run
  the engine) that have arrived and whose response has not been sent to the end (a
  stream counts until its last event); it is 0 whenever tracking is off.
* The ORCA header is built only from the engine's stats snapshot (no engine access).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

# Routes that count toward the load (vLLM's load-aware routes that exist here).
TRACKED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/inference/v1/generate",
        "/invocations",
    }
)
TRACKED_PREFIXES = ("/v1/responses",)

# The request header naming the ORCA format wanted (TEXT or JSON), and the response header.
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_HEADER = "endpoint-load-metrics"


class ServerLoad:
    """The in-flight request count behind GET /load (touched on the event loop only)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.value = 0


def tracked(path: str) -> bool:
    return path in TRACKED_PATHS or path.startswith(TRACKED_PREFIXES)


class LoadTrackingMiddleware:
    """Counts each tracked request from its arrival until its response is complete."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.load.enabled or not tracked(scope["path"]):
            return await self.app(scope, receive, send)
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1


def orca_header(fmt: str, named_metrics: list[tuple[str, float]]) -> dict[str, str]:
    """vLLM's `endpoint-load-metrics` header for the format a request asked for: `TEXT
    named_metrics.NAME=VALUE, ...` or `JSON {"named_metrics": {...}}`; no header for an empty
    or unknown format."""
    kind = fmt.strip().lower()
    if kind == "text":
        return {ORCA_HEADER: "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named_metrics)}
    if kind == "json":
        return {ORCA_HEADER: "JSON " + json.dumps({"named_metrics": dict(named_metrics)})}
    return {}


def orca_headers_for(
    request_headers: Mapping[str, str], named_metrics: Callable[[], list[tuple[str, float]]]
) -> dict[str, str]:
    """The ORCA header when the request asks for one (`endpoint-load-metrics-format`); the
    metrics are read only then."""
    fmt = request_headers.get(ORCA_FORMAT_HEADER, "")
    return orca_header(fmt, named_metrics()) if fmt else {}
