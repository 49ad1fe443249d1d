"""Prometheus series under vLLM's names (`vllm:*`, label `model_name`).

Counters and histograms are updated by the engine thread as outputs appear; gauges and the
engine's own cumulative counters (prefix cache, preemptions) are read from the immutable
`EngineStats` snapshot the engine thread publishes after every step (the `stats` callable),
so a scrape never touches the engine itself. With speculative decoding on, the
`vllm:spec_decode_*` counters (drafts, draft tokens, accepted tokens, accepted tokens per
draft position) come from the same snapshot; mean acceptance length =
1 + accepted_tokens / drafts, as vLLM's dashboards compute it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..engine.core import EngineStats

# vLLM's buckets (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _SnapshotCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator:
        s, label = self._m.stats(), [self._m.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (old name). 1 means 100 percent usage.", s.kv_usage)
        yield counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", s.prefix_queries
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_hits
        )
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions)
        if s.num_speculative_tokens:  # speculative decoding is on: vLLM's spec_decode series
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_num_draft_tokens)
            yield counter(
                "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", s.spec_num_accepted_tokens
            )
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=["model_name", "position"],
            )
            for pos in range(s.num_speculative_tokens):
                n = s.spec_accepted_per_pos[pos] if pos < len(s.spec_accepted_per_pos) else 0
                per_pos.add_metric([self._m.model_name, str(pos)], n)
            yield per_pos


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats] = EngineStats) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.stats = stats
        r, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (same as inter-token latency).",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        r.register(_SnapshotCollector(self))

    def request_finished(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
