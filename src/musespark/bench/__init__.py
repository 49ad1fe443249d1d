"""Benchmarks: `musespark bench latency | throughput | serve` (vLLM's three modes).

Each mode prints a human-readable summary, then ONE JSON line last with the figures,
the machine, the versions and the git commit (see `common.result_json`).
"""
