"""Serving benchmark (thin wrapper): the load generator lives in `musespark.bench.serve`.

    musespark serve &                                    # the bundled model on 127.0.0.1:8000
    python benchmarks/serve.py --num-prompts 32 --request-rate inf

is the same as `musespark bench serve --num-prompts 32 --request-rate inf`; see that module
for the workload and the metric definitions (vLLM's benchmark_serving). Prints ONE JSON line last.
"""

from __future__ import annotations

import argparse
import sys

from musespark.bench import serve as bench_serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_serve.add_args(p)
    return bench_serve.main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
