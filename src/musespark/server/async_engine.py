"""`AsyncEngine`: one engine thread serving every connection with continuous batching.

What the server may use: `generate()` (submit a processed prompt, then the request's output
stream), `abort()`, `stats()` (the latest `EngineStats` snapshot), `metrics`, and the
read-only facts copied at construction (`input_processor`, `tokenizer`, `model_path`,
`max_model_len`, `vocab_size`). Nothing else reaches into the engine.

Invariants:
* Exactly one thread, the engine loop, touches the `LLMEngine` (add, abort, step, stats):
  no lock is needed. Coroutines hand it new requests and aborts through a thread-safe
  inbox; outputs come back to each request's asyncio.Queue via `loop.call_soon_threadsafe`.
* `stats()` returns an immutable snapshot the engine thread replaces after every step, so a
  scrape never touches the engine.
* A request whose consumer goes away (client disconnect, cancellation) is aborted at the
  next loop turn, which frees its KV blocks at once.
* The input processor is thread-safe: routes tokenize and render chats in worker threads.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..engine.core import EngineStats
from ..engine.input_processor import ProcessedPrompt
from ..engine.llm_engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..parsers import MuseOutputParser
from ..sampling_params import SamplingParams
from .metrics import FinishedSequence, ServerMetrics

logger = logging.getLogger("musespark.server")

# How long the idle engine thread sleeps between checks for stop (new work wakes it at once).
_IDLE_WAIT_S = 0.5


class EngineDeadError(RuntimeError):
    pass


def _cache_info(engine: LLMEngine, stats: EngineStats) -> dict[str, str]:
    """vllm:cache_config_info's labels: the KV cache settings, under vLLM's CacheConfig names."""
    cache = engine.engine_config.cache
    return {
        "block_size": str(cache.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "kv_cache_memory_bytes": str(cache.kv_cache_memory),
        "num_gpu_blocks": str(stats.num_kv_blocks),
        "num_cpu_blocks": "None",
    }


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    # Set by the engine thread when it takes the request (for the metrics).
    queued: float | None = None
    prompt_tokens: int = 0
    n: int = 1
    max_tokens: int | None = None
    scheduled: float | None = None


def _send(stream: _Stream, item: Any) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
        pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str, log_requests: bool = True) -> None:
        self._engine = engine  # the engine thread's alone
        self.input_processor = engine.input_processor
        self.tokenizer = engine.tokenizer
        self.model_path = engine.model_path
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.config.vocab_size
        self.log_requests = log_requests
        self._stats: EngineStats = engine.get_stats()
        self.metrics = ServerMetrics(
            model_name, self.stats, max_model_len=self.max_model_len, cache_info=_cache_info(engine, self._stats)
        )
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

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (an immutable snapshot)."""
        return self._stats

    # -- the coroutine side --------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        output_parser: Callable[[], MuseOutputParser] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as the engine produces them; leaving early
        aborts it. The prompt should be validated already (`input_processor.validate`);
        an engine refusal is raised from the first iteration."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        self._post(("add", (request_id, prompt, params, output_parser, stream)))
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
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; takes effect at the engine loop's next turn)."""
        self._post(("abort", request_id))

    def _post(self, item: tuple[str, Any]) -> None:
        self._inbox.append(item)  # deque.append is atomic
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        engine = self._engine
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not engine.has_unfinished_requests():
                    self._stats = engine.get_stats()
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                try:
                    outputs = engine.step()
                except Exception as exc:  # a failed step fails the requests in it, not the server
                    logger.exception("engine step failed; aborting all requests")
                    self._fail_all(exc)
                    continue
                now = time.monotonic()
                for out in outputs:
                    self._deliver(out, now)
                before, self._stats = self._stats, engine.get_stats()
                if self._stats.num_steps != before.num_steps:
                    self.metrics.observe_step(self._stats.last_step_tokens)
        except BaseException as exc:  # pragma: no cover - a bug in this loop
            logger.exception("engine loop died")
            self.error = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc}"))

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                self._add(*payload)
            else:
                self._abort(payload)

    def _add(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        output_parser: Callable[[], MuseOutputParser] | None,
        stream: _Stream,
    ) -> None:
        try:
            self._engine.add_request(request_id, prompt, params, output_parser)
        except Exception as exc:
            _send(stream, exc)
            return
        self._streams[request_id] = stream
        stream.queued, stream.prompt_tokens = time.monotonic(), len(prompt.token_ids)
        stream.n, stream.max_tokens = params.n, params.max_tokens
        self.metrics.prompt_tokens.inc(len(prompt.token_ids))
        if self.log_requests:
            logger.info("added request %s: %d prompt tokens, %s", request_id, len(prompt.token_ids), params)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        aborted = self._engine.abort_request(request_id)
        if aborted is not None and stream is not None:
            stream.scheduled = stream.scheduled or aborted.scheduled_time
            self._observe_end(stream, aborted)
            _send(stream, aborted)  # a consumer still listening (a server-side abort) gets the end
            if self.log_requests:
                logger.info("aborted request %s", request_id)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if stream.scheduled is None:
            stream.scheduled = out.scheduled_time
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
            self._observe_end(stream, out)
        _send(stream, out)

    def _observe_end(self, stream: _Stream, out: RequestOutput) -> None:
        """A request finished (or was aborted): one observation per sequence, then its n."""
        now = time.monotonic()
        for c in out.outputs:
            seq = FinishedSequence(
                finished_reason=c.finish_reason or "abort",
                prompt_tokens=stream.prompt_tokens,
                generation_tokens=len(c.token_ids),
                max_tokens=stream.max_tokens,
                arrival=stream.arrival,
                queued=stream.queued,
                scheduled=stream.scheduled,
                first_token=stream.first_token,
                last_token=stream.last_token,
            )
            self.metrics.request_finished(seq, now)
        self.metrics.request_params(stream.n, max((len(c.token_ids) for c in out.outputs), default=0))

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self._engine.abort_request(request_id)
            except Exception:  # pragma: no cover
                logger.exception("abort of %s failed", request_id)
            _send(stream, exc)
        self._streams.clear()
        self._stats = self._engine.get_stats()
