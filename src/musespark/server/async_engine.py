"""`AsyncEngine`: one engine thread serving every connection with continuous batching.

The engine is not thread-safe, so exactly one thread (the engine loop) calls `add_request`,
`abort_request` and `step()`, always under `self._lock`. Coroutines hand it new requests and
aborts through a thread-safe inbox; outputs come back to each request's asyncio.Queue via
`loop.call_soon_threadsafe`. A request whose consumer goes away (client disconnect,
cancellation) is aborted at the next loop turn, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.llm_engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics

logger = logging.getLogger("musespark.server")

# How long the idle engine thread sleeps between checks for stop (new work wakes it at once).
_IDLE_WAIT_S = 0.5


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    last_counts: dict[int, int] = field(default_factory=dict)


def _send(stream: _Stream, item: Any) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
        pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, log_requests: bool = True) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_requests = log_requests
        self._lock = threading.Lock()
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._thread = threading.Thread(target=self._run, name="musespark-engine", daemon=True)
        self.error: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- the coroutine side --------------------------------------------------------
    async def generate(self, request_id: str, prompt: dict[str, Any], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them; leaving early aborts it.
        The prompt must already be validated (engine.validate), so adding cannot fail."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        self._post(("add", (request_id, prompt, params, stream)))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._post(("abort", request_id))

    def _post(self, item: tuple[str, Any]) -> None:
        self._inbox.append(item)  # deque.append is atomic
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._snapshot()
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                try:
                    with self._lock:
                        outputs = self.engine.step()
                except Exception as exc:  # a failed step fails the requests in it, not the server
                    logger.exception("engine step failed; aborting all requests")
                    self._fail_all(exc)
                    continue
                now = time.monotonic()
                for out in outputs:
                    self._deliver(out, now)
                self._snapshot()
        except BaseException as exc:  # pragma: no cover - a bug in this loop
            logger.exception("engine loop died")
            self.error = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc}"))

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                request_id, prompt, params, stream = payload
                try:
                    with self._lock:
                        self.engine.add_request(request_id, prompt, params)
                except Exception as exc:
                    _send(stream, exc)
                    continue
                self._streams[request_id] = stream
                self.metrics.prompt_tokens.inc(len(prompt["prompt_token_ids"]))
                if self.log_requests:
                    logger.info("added request %s: %d prompt tokens, %s", request_id,
                                len(prompt["prompt_token_ids"]), params)
            else:
                stream = self._streams.pop(payload, None)
                with self._lock:
                    aborted = self.engine.abort_request(payload)
                if aborted is not None:
                    for c in aborted.outputs:
                        self.metrics.request_finished(c.finish_reason or "abort")
                    self._observe_end(stream)
                    if self.log_requests:
                        logger.info("aborted request %s", payload)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        new_tokens = 0
        for c in out.outputs:
            new_tokens += len(c.delta_token_ids)
        if new_tokens:
            self.metrics.generation_tokens.inc(new_tokens)
            if stream.first_token is None:
                stream.first_token = now
                self.metrics.ttft.observe(now - stream.arrival)
            elif stream.last_token is not None:
                self.metrics.token_gap(now - stream.last_token)
            stream.last_token = now
        if out.finished:
            del self._streams[out.request_id]
            for c in out.outputs:
                self.metrics.request_finished(c.finish_reason or "abort")
            self._observe_end(stream)
        _send(stream, out)

    def _observe_end(self, stream: _Stream | None) -> None:
        if stream is not None:
            self.metrics.e2e.observe(time.monotonic() - stream.arrival)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                with self._lock:
                    self.engine.abort_request(request_id)
            except Exception:  # pragma: no cover
                logger.exception("abort of %s failed", request_id)
            _send(stream, exc)
        self._streams.clear()
        self._snapshot()

    def _snapshot(self) -> None:
        e, s = self.engine, self.metrics.snapshot
        kv = e.runner.kv
        s.num_running, s.num_waiting = e.scheduler.num_running, e.scheduler.num_waiting
        s.kv_usage = kv.usage()
        s.prefix_queries, s.prefix_hits = kv.prefix_queries, kv.prefix_hits
        s.num_preemptions = e.scheduler.num_preemptions

    # -- read-only helpers for the routes ----------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self._streams) + len(self._inbox)
