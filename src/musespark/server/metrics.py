"""Prometheus series under vLLM's names, types, labels and buckets (`vllm:*`; labels
`model_name` and `engine`, which is "0": one engine per server).

Counters and histograms are updated by the engine thread as outputs appear (`observe_step`
once per engine step, `request_finished` once per finished sequence); gauges and the
engine's own cumulative counters (prefix cache, preemptions) are read from the immutable
`EngineStats` snapshot the engine thread publishes after every step (the `stats` callable),
so a scrape never touches the engine itself. With speculative decoding on, the
`vllm:spec_decode_*` counters (drafts, draft tokens, accepted tokens, accepted tokens per
draft position) come from the same snapshot; mean acceptance length =
1 + accepted_tokens / drafts, as vLLM's dashboards compute it.

Per-request phases follow vLLM: queue = first scheduled - queued; prefill = first token -
first scheduled; decode = last token - first token; inference = last token - first
scheduled (preemptions stay inside the phase they happened in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..engine.core import EngineStats
from . import metrics_buckets as buckets

ENGINE = "0"  # the `engine` label: a server runs one engine
LABELS = ["model_name", "engine"]


@dataclass(frozen=True)
class FinishedSequence:
    """What the engine thread knows of one finished sequence (times: time.monotonic())."""

    finished_reason: str
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int | None
    arrival: float
    queued: float | None = None  # when the engine took the request
    scheduled: float | None = None  # first scheduled
    first_token: float | None = None
    last_token: float | None = None


class _SnapshotCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator:
        s, label = self._m.stats(), [self._m.model_name, ENGINE]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(label, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason: 'capacity' waits for scheduling capacity, 'deferred' "
            "for a transient constraint. The reasons sum to vllm:num_requests_waiting.",
            labels=[*LABELS, "reason"],
        )
        by_reason.add_metric([*label, "capacity"], s.num_waiting)  # nothing defers a request here
        by_reason.add_metric([*label, "deferred"], 0)
        yield by_reason
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (old name). 1 means 100 percent usage.", s.kv_usage)
        yield counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", s.prefix_queries
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_hits
        )
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions)
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=[*self._m.cache_info, "engine"]
        )
        info.add_metric([*self._m.cache_info.values(), ENGINE], 1)
        yield info
        if s.num_speculative_tokens:  # speculative decoding is on: vLLM's spec_decode series
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_num_draft_tokens)
            yield counter(
                "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", s.spec_num_accepted_tokens
            )
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=[*LABELS, "position"],
            )
            for pos in range(s.num_speculative_tokens):
                n = s.spec_accepted_per_pos[pos] if pos < len(s.spec_accepted_per_pos) else 0
                per_pos.add_metric([*label, str(pos)], n)
            yield per_pos


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats] = EngineStats,
        *,
        max_model_len: int = 4096,
        cache_info: Mapping[str, str] | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.stats = stats
        # vllm:cache_config_info's labels (vLLM's CacheConfig field names), values as strings.
        self.cache_info = dict(cache_info or {})
        r, lv = self.registry, (model_name, ENGINE)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(*lv)

        def histogram(name: str, doc: str, bounds: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=bounds, registry=r).labels(*lv)

        tokens = buckets.request_tokens(max_model_len)
        latency = buckets.REQUEST_LATENCY
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=r,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", buckets.ITERATION_TOKENS
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", buckets.REQUEST_PARAMS_N
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            buckets.INTER_TOKEN_LATENCY,
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets.TIME_TO_FIRST_TOKEN,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets.INTER_TOKEN_LATENCY,
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (same as inter-token latency).",
            buckets.INTER_TOKEN_LATENCY,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latency
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", latency
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", latency
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", latency
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", latency
        )
        r.register(_SnapshotCollector(self))

    def observe_step(self, tokens: int) -> None:
        """One engine step computed `tokens` tokens (prompt tokens prefilled + tokens generated)."""
        self.iteration_tokens.observe(tokens)

    def request_params(self, n: int, max_generation_tokens: int) -> None:
        """A request (all its n sequences) finished; its longest sequence generated
        `max_generation_tokens` tokens."""
        self.params_n.observe(n)
        self.max_generation_tokens.observe(max_generation_tokens)

    def request_finished(self, seq: FinishedSequence, now: float) -> None:
        """One sequence finished (vLLM counts each of a request's n sequences)."""
        self._success.labels(self.model_name, ENGINE, seq.finished_reason).inc()
        self.e2e.observe(now - seq.arrival)
        self.request_prompt_tokens.observe(seq.prompt_tokens)
        self.request_generation_tokens.observe(seq.generation_tokens)
        if seq.max_tokens:
            self.params_max_tokens.observe(seq.max_tokens)
        if seq.scheduled is not None:
            if seq.queued is not None:
                self.queue_time.observe(max(0.0, seq.scheduled - seq.queued))
            if seq.first_token is not None and seq.last_token is not None:
                self.prefill_time.observe(max(0.0, seq.first_token - seq.scheduled))
                self.decode_time.observe(max(0.0, seq.last_token - seq.first_token))
                self.inference_time.observe(max(0.0, seq.last_token - seq.scheduled))
        if seq.first_token is not None and seq.last_token is not None:  # mean decode gap, 0 for one token
            gaps = seq.generation_tokens - 1
            self.request_tpot.observe((seq.last_token - seq.first_token) / gaps if gaps > 0 else 0.0)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def load_report(self) -> list[tuple[str, float]]:
        """ORCA named metrics (vLLM's choice and order): waiting requests, KV-cache usage."""
        s = self.stats()
        return [("num_requests_waiting", float(s.num_waiting)), ("kv_cache_usage_perc", float(s.kv_usage))]
