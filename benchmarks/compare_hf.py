"""musespark vs transformers, side by side in one process, plus the decode roofline.

    python benchmarks/compare_hf.py                                   # the full matrix on bench-small (slow)
    python benchmarks/compare_hf.py --dtypes bfloat16 --cases b1,b8 --repeats 2
    python benchmarks/compare_hf.py --quick                           # smoke: bench-tiny, small sizes

Both engines load the same random-weight checkpoint of a preset (`musespark.bench.presets`,
made once and cached) at each dtype and run the same seeded token-id workloads, alternating
musespark (A) and transformers (B) as A B A B ... for --repeats pairs after one untimed warmup
of each. Every ratio is computed pair by pair (musespark's figure over transformers', so > 1
means musespark is faster; for times, transformers' time over musespark's) and summarised by
the median of the pairs: the two engines share the machine's noise within a pair.

transformers (==5.23.0) runs `MuseSparkForConditionalGeneration.generate(do_sample=False,
max_new_tokens=N, min_new_tokens=N, use_cache=True)` (greedy, KV cache on, EOS cannot end it
early, pad_token_id set) with its default experts implementation; musespark runs `LLM.generate`
(greedy, ignore_eos, prefix caching off so that repeats do not hit the cache).

Cases (--cases; sizes in --quick mode in brackets):
  b1        batch 1, 128-token prompt, 128 new tokens           [16 + 8]
  b8        8 requests of 128 + 128                             [8 x (16 + 8)]
  mixed64   64 requests, seeded lengths 16..512 in and 16..512 out [8 requests, 4..32]; musespark gets
            all at once, transformers runs them as left-padded batches of 8 sorted by output then input
            length (its best case); only the requested tokens count
  long2048  one 2048-token prompt, 128 new tokens               [128 + 8]
For b1/b8/long2048, TTFT is the time of a separate 1-token generate and decode tokens/s is
batch * (N - 1) / (time for N tokens - TTFT); for mixed64 the figure is output tokens/s.

Roofline: memory-read bandwidth is measured in the same run (best of 5 `.sum()` over a
--bandwidth-mb fp32 tensor); batch-1 decode cannot beat bandwidth / (active weight bytes per
token), active = every weight but the embedding table and the unrouted experts (LM head fully),
at the dtype's width. musespark's (and transformers') batch-1 decode tok/s are reported as % of it:
the bandwidth is probed again right after each timed batch-1 run (a VM's bandwidth can move by
half within minutes), each run is held to its own probe, and the median over runs is reported
(`roofline.tok_s` stays the roofline at the start-of-run probe). musespark keeps its weights in
huge pages (`musespark.hugepages`), where one core streams faster than in the probe tensor's
4 KiB pages: each probe is also taken in huge-page memory, and musespark's fraction against
those is reported beside it (`musespark_pct_vs_hugepage_probes`).

Expected runtime on a 2-core CPU VM (AMD EPYC): --quick ~10-20 s; bench-small with
`--dtypes bfloat16 --cases b1,b8 --repeats 2` ~8.5 min, `--dtypes float32 --cases b1 --repeats 2`
~3.5 min (see benchmarks/RESULTS.md; the first run also writes the ~0.8/1.6 GB checkpoint); the full
matrix (both dtypes, all four cases, 3 repeats) takes hours there (mixed64 alone is ~20k output
tokens per engine per run) and is meant for a bigger machine.

--avx2-only runs both engines as on an AVX2-only x86 CPU (`musespark.cpu_features.AVX2_ONLY_ENV`):
on an AVX-512 or AMX machine, transformers' bf16 matmuls then leave oneDNN for PyTorch's own loops
and our kernels take their AVX2 path; the JSON line records the caps (`machine.isa_limits`) and
what PyTorch ran (`torch_isa`, `torch_onednn_bf16`).

Prints a table per case, then ONE JSON line last (figures, machine, versions, commit).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from musespark.cpu_features import AVX2_ONLY_ENV

# --avx2-only: every library reads its instruction-set cap when it loads, so the script starts
# again with the caps set, before torch is imported.
if "--avx2-only" in sys.argv[1:] and any(os.environ.get(k) != v for k, v in AVX2_ONLY_ENV.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ONLY_ENV})

import torch  # noqa: E402

from musespark import LLM, SamplingParams, hugepages
from musespark.bench.common import print_json
from musespark.bench.presets import (
    PRESETS,
    active_weight_bytes,
    count_params,
    dtype_name,
    make_checkpoint,
    preset_config,
)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "decode": equal-length batch; "mixed": seeded lengths
    batch: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]


FULL = {
    "b1": Case("b1", "decode", 1, (128, 128), (128, 128)),
    "b8": Case("b8", "decode", 8, (128, 128), (128, 128)),
    "mixed64": Case("mixed64", "mixed", 64, (16, 512), (16, 512)),
    "long2048": Case("long2048", "decode", 1, (2048, 2048), (128, 128)),
}
QUICK = {
    "b1": Case("b1", "decode", 1, (16, 16), (8, 8)),
    "b8": Case("b8", "decode", 8, (16, 16), (8, 8)),
    "mixed64": Case("mixed64", "mixed", 8, (4, 32), (4, 32)),
    "long2048": Case("long2048", "decode", 1, (128, 128), (8, 8)),
}
HF_BATCH = 8  # transformers' batch size for the mixed case
PAD_ID = 0


def workload(case: Case, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """[(prompt ids, output length)], seeded; ids 0..2 (pad/bos/eos in the presets) avoided."""
    rng = random.Random(f"{seed}-{case.name}")
    out = []
    for _ in range(case.batch):
        n_in, n_out = rng.randint(*case.input_len), rng.randint(*case.output_len)
        out.append(([rng.randrange(3, vocab) for _ in range(n_in)], n_out))
    return out


def measure_bandwidth(mb: int, tries: int = 5, huge: bool = False) -> float:
    """Memory-read bandwidth in bytes/s: best of `tries` fp32 .sum() over `mb` MiB, in torch's
    own memory (4 KiB pages here), or with `huge` in memory advised for huge pages as
    musespark's weights are (`musespark.hugepages`)."""
    n = mb * (1 << 20) // 4
    x = hugepages.empty((n,), torch.float32).fill_(1.0) if huge else torch.ones(n, dtype=torch.float32)
    x.sum()  # first touch
    best = math.inf
    for _ in range(tries):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    nbytes = x.numel() * 4
    del x
    return nbytes / best


# -- the two engines -------------------------------------------------------------------


class Musespark:
    name = "musespark"

    def __init__(self, path: Any, dtype: str, max_len: int, kv_bytes: int | None, max_seqs: int) -> None:
        self.llm = LLM(
            model=path,
            dtype=dtype,
            max_model_len=max_len,
            max_num_seqs=max_seqs,
            kv_cache_memory=kv_bytes,
            enable_prefix_caching=False,
            seed=0,
        )

    def run(self, work: list[tuple[list[int], int]], cap: int | None = None) -> tuple[float, list[list[int]]]:
        prompts = [{"prompt_token_ids": ids} for ids, _ in work]
        params = [
            SamplingParams(temperature=0.0, max_tokens=min(n, cap) if cap else n, ignore_eos=True) for _, n in work
        ]
        t = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        return elapsed, [list(o.outputs[0].token_ids) for o in outs]


class Transformers:
    name = "transformers"

    def __init__(self, path: Any, dtype: str) -> None:
        import transformers
        from transformers import MuseSparkForConditionalGeneration

        transformers.utils.logging.set_verbosity_error()  # the checkpoint has no vision/audio towers
        self.model = MuseSparkForConditionalGeneration.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
        self.experts_implementation = getattr(self.model.config.get_text_config(), "_experts_implementation", None)

    @torch.inference_mode()
    def _generate(self, batch: list[list[int]], n: int) -> torch.Tensor:
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ids in enumerate(batch):  # left padding
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            mask[i, width - len(ids) :] = 1
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            use_cache=True,
            pad_token_id=PAD_ID,
        )
        new = out[:, width:]
        if new.shape[1] != n:
            raise RuntimeError(f"transformers generated {new.shape[1]} tokens, asked for {n}")
        return new

    def run(self, work: list[tuple[list[int], int]], cap: int | None = None) -> tuple[float, list[list[int]]]:
        outs: list[list[int]] = [[] for _ in work]
        order = sorted(range(len(work)), key=lambda i: (work[i][1], len(work[i][0])))
        t = time.perf_counter()
        for start in range(0, len(order), HF_BATCH):
            idx = order[start : start + HF_BATCH]
            n = max(work[i][1] for i in idx)
            n = min(n, cap) if cap else n
            new = self._generate([work[i][0] for i in idx], n)
            for row, i in enumerate(idx):
                outs[i] = new[row, : min(work[i][1], n)].tolist()
        return time.perf_counter() - t, outs


# -- measuring ----------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def _series(a: list[float], b: list[float], higher_is_better: bool) -> dict[str, Any]:
    ratios = [x / y if higher_is_better else y / x for x, y in zip(a, b)]
    return {"musespark": a, "transformers": b, "ratios": ratios, "median_ratio": _median(ratios)}


def run_case(
    case: Case, engines: list[Any], work: list[tuple[list[int], int]], repeats: int, probe: Any = None
) -> dict[str, Any]:
    """A B A B: each repeat runs every engine once (per measurement) in turn. `probe` (bytes/s),
    if given, is called right after each engine's timed runs: `probes[engine]` in the result."""
    figures: dict[str, dict[str, list[float]]] = {e.name: {} for e in engines}
    probes: dict[str, list[float]] = {e.name: [] for e in engines}
    tokens: dict[str, list[list[int]]] = {}
    for e in engines:  # untimed warmup: first-shape costs (bf16 on CPU pays a lot) stay out of the pairs
        e.run(work, cap=1)
        e.run(work, cap=4)
    for _ in range(repeats):
        for e in engines:
            f = figures[e.name]
            if case.kind == "decode":
                ttft, _ = e.run(work, cap=1)
                total, toks = e.run(work)
                n = work[0][1]
                f.setdefault("ttft_s", []).append(ttft)
                f.setdefault("e2e_s", []).append(total)
                # A noisy 1-token run can outlast the N-token one on tiny sizes: no figure then.
                decode = total - ttft
                f.setdefault("decode_tok_s", []).append(len(work) * (n - 1) / decode if decode > 0 else math.nan)
                f.setdefault("output_tok_s", []).append(len(work) * n / total)
            else:
                total, toks = e.run(work)
                f.setdefault("e2e_s", []).append(total)
                f.setdefault("output_tok_s", []).append(sum(n for _, n in work) / total)
            if probe is not None:
                probes[e.name].append(probe())
            tokens[e.name] = toks
    a, b = figures["musespark"], figures["transformers"]
    metrics = {k: _series(a[k], b[k], higher_is_better=k.endswith("tok_s")) for k in a}
    # Sanity, not a test: how many leading greedy tokens agree (bf16 drifts; fp32 should mostly agree).
    agree = []
    for x, y in zip(tokens["musespark"], tokens["transformers"]):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        agree.append(k)
    out = {
        "metrics": metrics,
        "greedy_prefix_agreement": {
            "mean_tokens": statistics.mean(agree),
            "of_tokens": statistics.mean(n for _, n in work),
        },
    }
    if probe is not None:
        out["probes"] = probes
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="model preset (default: bench-small; bench-tiny with --quick)",
    )
    p.add_argument("--dtypes", default=None, help="comma-separated (default: bfloat16,float32; bfloat16 with --quick)")
    p.add_argument("--cases", default=",".join(FULL), help=f"comma-separated subset of {','.join(FULL)}")
    p.add_argument("--repeats", type=int, default=None, help="A B pairs per case (default 3; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="small sizes (see the module doc), for smoke tests")
    p.add_argument(
        "--bandwidth-mb",
        type=int,
        default=None,
        help="MiB read by the bandwidth probe (default 1024; 512 with --quick)",
    )
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for both engines (default: torch's)")
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="musespark's KV cache in bytes (default: the engine's share of available memory)",
    )
    p.add_argument("--cache-dir", default=None, help="preset checkpoint cache (default ~/.cache/musespark/bench)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--avx2-only",
        action="store_true",
        help="both engines as on an AVX2-only CPU: our kernels, "
        "ATen, oneDNN and MKL capped at AVX2 (the caches and memory stay this machine's)",
    )
    args = p.parse_args(argv)

    preset = args.preset or ("bench-tiny" if args.quick else "bench-small")
    dtypes = [dtype_name(d) for d in (args.dtypes or ("bfloat16" if args.quick else "bfloat16,float32")).split(",")]
    table = QUICK if args.quick else FULL
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in table]
    if unknown or not names:
        p.error(f"--cases must name some of {','.join(table)}, got {args.cases!r}")
    cases = [table[c] for c in names]
    repeats = args.repeats or (2 if args.quick else 3)
    if repeats < 1:
        p.error("--repeats must be >= 1")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    cfg = preset_config(preset)
    counts = count_params(cfg)
    print(f"preset {preset}: {counts}; cases {names}; dtypes {dtypes}; {repeats} A/B pairs", flush=True)

    bandwidth = measure_bandwidth(args.bandwidth_mb or (512 if args.quick else 1024))
    print(f"memory-read bandwidth {bandwidth / 1e9:.2f} GB/s", flush=True)
    results, summary, experts_impl = [], {}, None
    max_len = max(c.input_len[1] + c.output_len[1] for c in cases) + 16
    for dtype in dtypes:
        path = make_checkpoint(preset, dtype, args.cache_dir)
        # max_num_seqs >= 64: ModelRunner caps the block count at max_num_seqs * max_model_len's blocks,
        # which is below one sequence's need when a sliding window exceeds max_model_len (a limit of the engine).
        ms = Musespark(path, dtype, max_len, args.kv_cache_memory, max(64, *(c.batch for c in cases)))
        hf = Transformers(path, dtype)
        experts_impl = hf.experts_implementation
        roofline = bandwidth / active_weight_bytes(cfg, dtype)
        for case in cases:
            t = time.perf_counter()
            work = workload(case, cfg.vocab_size, args.seed)
            probe_mb = args.bandwidth_mb or (512 if args.quick else 1024)
            res = run_case(
                case,
                [ms, hf],
                work,
                repeats,
                probe=(lambda: (measure_bandwidth(probe_mb), measure_bandwidth(probe_mb, huge=True)))
                if case.batch == 1
                else None,
            )
            both = res.pop("probes", None) or {}
            probes = {name: [p[0] for p in got] for name, got in both.items()}
            huge_probes = {name: [p[1] for p in got] for name, got in both.items()}
            entry = {
                "case": case.name,
                "dtype": dtype,
                "kind": case.kind,
                "requests": case.batch,
                "input_len": list(case.input_len),
                "output_len": list(case.output_len),
                "prompt_tokens": sum(len(i) for i, _ in work),
                "output_tokens": sum(n for _, n in work),
                **res,
                "wall_s": time.perf_counter() - t,
            }
            if case.batch == 1:
                dec = res["metrics"]["decode_tok_s"]
                active = active_weight_bytes(cfg, dtype)

                def pct(name: str, against: dict[str, list[float]]) -> float:  # each run against its own probe
                    return _median([100 * r * active / bw for r, bw in zip(dec[name], against[name])])

                entry["roofline"] = {
                    "tok_s": roofline,
                    "musespark_pct": pct("musespark", probes),
                    "transformers_pct": pct("transformers", probes),
                    "adjacent_probes_bytes_per_s": probes,
                    "musespark_pct_vs_hugepage_probes": pct("musespark", huge_probes),
                    "adjacent_hugepage_probes_bytes_per_s": huge_probes,
                }
            results.append(entry)
            head = "decode_tok_s" if case.kind == "decode" else "output_tok_s"
            summary[f"{dtype}/{case.name}/{head}"] = res["metrics"][head]["median_ratio"]
            print(f"[{dtype} {case.name}] {entry['wall_s']:.1f} s", flush=True)
            for k, s in res["metrics"].items():
                pairs = " ".join(f"{r:.2f}" for r in s["ratios"])
                print(
                    f"  {k:13s} musespark {_median(s['musespark']):10.3f}  transformers "
                    f"{_median(s['transformers']):10.3f}  ratio median {s['median_ratio']:.2f} "
                    f"(pairs {pairs})",
                    flush=True,
                )
            if "roofline" in entry:
                r = entry["roofline"]
                gbs = " ".join(f"{bw / 1e9:.1f}" for bw in r["adjacent_probes_bytes_per_s"]["musespark"])
                print(
                    f"  roofline {r['tok_s']:.1f} tok/s at the first probe; each run against its own probe "
                    f"(musespark's: {gbs} GB/s): musespark {r['musespark_pct']:.1f} %, "
                    f"transformers {r['transformers_pct']:.1f} %; musespark against huge-page probes "
                    f"{r['musespark_pct_vs_hugepage_probes']:.1f} %",
                    flush=True,
                )
        del ms, hf
        gc.collect()
    print_json(
        {
            "benchmark": "compare_hf",
            "preset": preset,
            "quick": args.quick,
            "repeats": repeats,
            "seed": args.seed,
            "params": counts.as_dict(),
            "bandwidth_bytes_per_s": bandwidth,
            "active_weight_bytes": {d: active_weight_bytes(cfg, d) for d in dtypes},
            "transformers_experts_implementation": experts_impl,
            "hf_batch_for_mixed": HF_BATCH,
            "ratio_definition": "musespark / transformers for tok/s, transformers / musespark for times; "
            "per A/B pair, median over pairs",
            "summary_median_ratios": summary,
            "results": results,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
