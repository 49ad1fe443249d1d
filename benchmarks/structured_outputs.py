"""Per-token cost of constrained decoding against free decoding, batch 1 and 16.

    python benchmarks/structured_outputs.py [--pairs 3] [--batches 1,16] [--backend auto]

Constrained: a JSON schema (an array of exactly 48 small integers, ~100 tokens) with the
bundled model, greedy. Free: the same prompts with `max_tokens` set to the constrained
run's token count and ignore_eos, so both decode the same number of tokens. The two run
alternately, `--pairs` times per batch size, in one process; the figure is the median
ms per generated token of each and their ratio. Grammar compilation is cached after the
warm-up, as it is in a server. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import time

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 48, "maxItems": 48}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--backend", default="auto")
    args = p.parse_args()
    import torch

    from musespark import LLM, SamplingParams
    from musespark.bench.common import print_json

    torch.manual_seed(0)
    llm = LLM(max_model_len=512, enable_prefix_caching=False, backend=args.backend)
    result: dict = {"benchmark": "structured_outputs", "backend": type(llm.engine.model.backend).__name__}
    for B in (int(b) for b in args.batches.split(",")):
        prompts = [f"Numbers {i}:" for i in range(B)]
        constrained = [SamplingParams(temperature=0, max_tokens=200, structured_outputs={"json": SCHEMA})] * B
        llm.generate(prompts, constrained)  # warm-up: compiles the grammar once
        cms, fms = [], []
        for _ in range(args.pairs):
            t = time.perf_counter()
            outs = llm.generate(prompts, constrained)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            cms.append((time.perf_counter() - t) * 1e3 / n)
            free = [
                SamplingParams(temperature=0, ignore_eos=True, max_tokens=len(o.outputs[0].token_ids)) for o in outs
            ]
            t = time.perf_counter()
            outs = llm.generate(prompts, free)
            fms.append((time.perf_counter() - t) * 1e3 / sum(len(o.outputs[0].token_ids) for o in outs))
        c, f = statistics.median(cms), statistics.median(fms)
        result[f"batch{B}"] = {
            "constrained_ms_per_token": round(c, 3),
            "free_ms_per_token": round(f, 3),
            "ratio": round(c / f, 3),
            "tokens_per_seq": n // B,
        }
    print_json(result)


if __name__ == "__main__":
    main()
