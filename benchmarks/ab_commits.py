"""musespark against musespark: two source trees side by side in one run (A B A B ...).

    python benchmarks/ab_commits.py --old OLD/src                 # this checkout (B) vs another tree (A)
    python benchmarks/ab_commits.py --old OLD/src --preset bench-small --pairs 3 --cases b1,b8

OLD is another checkout of the repository, e.g. made by `git worktree add OLD <commit>`.

Each run is a fresh subprocess that imports musespark from the given `src` directory, loads
the preset's random-weight checkpoint (made once and cached, `musespark.bench.presets`) in
bf16, warms up, then times `LLM.generate` (greedy, ignore_eos, prefix caching off) for:
  b1        one request, 128-token prompt, 128 new tokens
  b8        8 requests of 128 + 128 at once
  p2048     one 2048-token prompt, 1 new token (the prompt's time: tok/s = 1 / seconds)
  mixed64   64 requests at once, seeded lengths 16..512 in and 16..512 out (compare_hf's mix)
The two trees alternate (old new, new old, old new, ...); each case's figure is output tokens per
second over the whole generate call, and the ratio new/old is computed pair by pair and
summarised by the median (> 1: the new tree is faster). --avx2-only runs both trees as on an
AVX2-only CPU (every library capped at AVX2, as compare_hf.py's flag). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

NEW_SRC = Path(__file__).resolve().parents[1] / "src"
# requests, prompt tokens, new tokens: a number, or a seeded (lo, hi) range per request
CASES = {"b1": (1, 128, 128), "b8": (8, 128, 128), "p2048": (1, 2048, 1), "mixed64": (64, (16, 512), (16, 512))}

CHILD = r"""
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
import os
import musespark
assert os.path.realpath(musespark.__file__).startswith(os.path.realpath(sys.argv[1])), musespark.__file__
from musespark import LLM, SamplingParams
from musespark.bench.presets import resolve_model
path = resolve_model(None, sys.argv[2], "bfloat16", None, seed=0)
llm = LLM(model=path, dtype="bfloat16", max_model_len=2560, max_num_seqs=64, enable_prefix_caching=False)
vocab = llm.engine.config.vocab_size
out = {"musespark": __import__("musespark").__file__}
for name, (n, inp, new) in json.loads(sys.argv[3]).items():
    rng = random.Random(0)
    length = lambda v: rng.randint(*v) if isinstance(v, list) else v
    prompts, params = [], []
    for _ in range(n):
        prompts.append({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length(inp))]})
        params.append(SamplingParams(temperature=0.0, max_tokens=length(new), ignore_eos=True))
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    out[name] = sum(len(r.outputs[0].token_ids) for r in results) / seconds
print(json.dumps(out))
"""


def run(src: str, preset: str, cases: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, src, preset, json.dumps(cases)], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="the other tree's src directory (e.g. a git worktree's src)")
    p.add_argument("--new", default=str(NEW_SRC), help="default: this checkout's src")
    p.add_argument("--preset", default="bench-small")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--cases", default="b1,b8")
    p.add_argument(
        "--avx2-only",
        action="store_true",
        help="both trees as on an AVX2-only CPU (every library capped at AVX2: musespark.cpu_features.AVX2_ONLY_ENV)",
    )
    args = p.parse_args()
    if args.avx2_only:  # the runs are child processes: they load every library with the caps set
        sys.path.insert(0, str(NEW_SRC))
        from musespark.cpu_features import AVX2_ONLY_ENV

        os.environ.update(AVX2_ONLY_ENV)
    cases = {c: CASES[c] for c in args.cases.split(",")}
    pairs = []
    for i in range(args.pairs):
        if i % 2 == 0:  # alternate which tree goes first, so neither always gets the warmer machine
            old, new = run(args.old, args.preset, cases), run(args.new, args.preset, cases)
        else:
            new, old = run(args.new, args.preset, cases), run(args.old, args.preset, cases)
        pairs.append({"old": old, "new": new})
        print(
            f"pair {i}: "
            + "  ".join(f"{c} old {old[c]:.1f} new {new[c]:.1f} tok/s ({new[c] / old[c]:.3f}x)" for c in cases),
            flush=True,
        )
    summary = {
        c: {
            "median_ratio_new_over_old": statistics.median(q["new"][c] / q["old"][c] for q in pairs),
            "old_tok_s": [q["old"][c] for q in pairs],
            "new_tok_s": [q["new"][c] for q in pairs],
        }
        for c in cases
    }
    sys.path.insert(0, args.new)
    from musespark.bench.common import print_json

    print_json(
        {"benchmark": "ab_commits", "preset": args.preset, "dtype": "bfloat16", "old_src": args.old, "cases": summary}
    )


if __name__ == "__main__":
    main()
