"""What batch invariance costs: prompt-sized bf16 products by our kernels vs by oneDNN.

    python benchmarks/batch_invariance.py                    # bench-small, 5 rounds, ~2 min
    python benchmarks/batch_invariance.py --rounds 3 --cases long2048

With batch invariance on (the default), every product runs the native kernels, whose sums do
not depend on how many rows share them; `MUSESPARK_BATCH_INVARIANT=0` hands bf16 products of
64 rows or more to oneDNN's GEMM (`at::mm`, AMX tiles where the CPU has them). Decode-sized
steps run the same kernels either way, so only prompt processing can differ. One process,
one model; the two settings alternate round by round (`set_batch_invariant`), and each case's
ratio (time invariant / time oneDNN, > 1: invariance costs) is the median over the rounds.

Cases (`LLM.generate`, greedy, one new token, prefix caching off):
  long2048  one 2048-token prompt
  b8        8 prompts of 128 tokens (one 1024-row step)

Prints a table, then ONE JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from musespark import LLM, SamplingParams
from musespark.bench.common import print_json
from musespark.bench.presets import make_checkpoint, preset_config
from musespark.kernels.cpu import native_ops

CASES = {"long2048": (1, 2048), "b8": (8, 128)}  # prompts, tokens each


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench-small")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default="long2048,b8")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    ops = native_ops()
    if ops is None:
        raise SystemExit("batch_invariance.py: the native CPU kernels are unavailable here")
    llm = LLM(
        model=str(make_checkpoint(args.preset, "bfloat16")),
        dtype="bfloat16",
        enable_prefix_caching=False,
        max_model_len=4096,
        seed=args.seed,
    )
    vocab = preset_config(args.preset).vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    before = ops.set_batch_invariant(True)
    results = {}
    try:
        for case in args.cases.split(","):
            n, length = CASES[case]
            prompts = [
                {"prompt_token_ids": torch.randint(3, vocab, (length,), generator=gen).tolist()} for _ in range(n)
            ]
            times: dict[bool, list[float]] = {True: [], False: []}
            llm.generate(prompts, params, use_tqdm=False)  # warm-up
            for _ in range(args.rounds):
                for invariant in (True, False):
                    ops.set_batch_invariant(invariant)
                    t0 = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)
                    times[invariant].append(time.perf_counter() - t0)
            ratios = [a / b for a, b in zip(times[True], times[False])]
            results[case] = {
                "invariant_s": [round(t, 4) for t in times[True]],
                "onednn_s": [round(t, 4) for t in times[False]],
                "cost_ratio_median": round(statistics.median(ratios), 3),
            }
            print(
                f"{case:<10} invariant {statistics.median(times[True]):.3f} s  oneDNN "
                f"{statistics.median(times[False]):.3f} s  cost x{statistics.median(ratios):.3f}"
            )
    finally:
        ops.set_batch_invariant(before)
    print_json(
        {
            "benchmark": "batch_invariance",
            "preset": args.preset,
            "rounds": args.rounds,
            "ratio_definition": "time with invariance / time with oneDNN for >= 64-row products, per round, median",
            "results": results,
        }
    )


if __name__ == "__main__":
    main()
