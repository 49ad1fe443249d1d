"""Per-step cost of streaming with logprobs: does it grow with the length so far?

    python benchmarks/stream_logprobs.py [--src OTHER_TREE/src] [--tokens 1000] [--logprobs 20]

Streams one greedy request (ignore_eos) from the bundled model through `LLM.generate_stream`
and reports the median wall time per step over the first 100 steps and over the last 100.
With incremental output processing both are about equal. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", default=None, help="import musespark from this src directory (e.g. an older worktree)")
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--logprobs", type=int, default=20)
    args = p.parse_args()
    if args.src:
        sys.path.insert(0, args.src)
    import musespark
    from musespark import LLM, SamplingParams
    from musespark.bench.common import print_json

    if args.src:
        assert os.path.realpath(musespark.__file__).startswith(os.path.realpath(args.src)), musespark.__file__
    llm = LLM(max_model_len=args.tokens + 64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=args.logprobs)
    times, last, start = [], time.perf_counter(), time.perf_counter()
    for _ in llm.generate_stream("def f():", params):
        now = time.perf_counter()
        times.append(now - last)
        last = now
    print_json(
        {
            "benchmark": "stream_logprobs",
            "src": musespark.__file__,
            "tokens": len(times),
            "logprobs": args.logprobs,
            "total_s": time.perf_counter() - start,
            "median_ms_first_100": 1000 * statistics.median(times[1:101]),
            "median_ms_last_100": 1000 * statistics.median(times[-100:]),
        }
    )


if __name__ == "__main__":
    main()
