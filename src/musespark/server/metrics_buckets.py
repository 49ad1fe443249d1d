"""vLLM's Prometheus histogram bucket families (upper bounds), so dashboards built for vLLM
read our histograms unchanged. Seconds for the latency families, counts for the others."""

from __future__ import annotations

# End-to-end and per-phase request times (e2e, queue, inference, prefill, decode).
REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
REQUEST_LATENCY += (240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5)
TIME_TO_FIRST_TOKEN += (10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
INTER_TOKEN_LATENCY += (20.0, 40.0, 80.0)
# Tokens computed per engine step.
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# The `n` request parameter.
REQUEST_PARAMS_N = (1, 2, 5, 10, 20)


def request_tokens(max_model_len: int) -> tuple[int, ...]:
    """Token-count histograms (prompt, generation, max_tokens): 1, 2, 5, 10, 20, 50, ... up to
    max_model_len (vLLM's 1-2-5 series)."""
    bounds: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(bounds)
            bounds.append(m * scale)
        scale *= 10
