"""The torch backend's NVFP4 experts against the native cpu backend, per decode step, on one
narrow slice of Muse Spark Open 816B in the released NVFP4 layout.

    python benchmarks/nvfp4_fallback.py                                   # the default slice (~0.2 GB)
    python benchmarks/nvfp4_fallback.py --hidden 2048 --experts 64 --moe-hidden 1024 --moe-intermediate 1024
    python benchmarks/nvfp4_fallback.py --previous                        # also the formula before blocked decoding

The slice (tools/write_816b_slice.py `write_slice`: random E2M1 codes and e4m3 scales written
straight to disk, every layer's experts NVFP4) goes to a temporary directory, removed at the
end. It is loaded twice in this process, once with `--backend cpu` (the native kernels) and
once with `--backend torch` (the reference, what `auto` picks without the native kernels).

For each batch of --batches, each model gets the same random --prompt-len-token prompts, then
--steps decode steps on the paged path (benchmarks/slice_816b.py `Paged`), all fed the native
model's greedy tokens; the two backends' steps alternate, the first going first on even steps
and second on odd ones, after one untimed warm-up step each. Reported per batch: the median
step of each (wall time, and this process's CPU time: with --threads 1 on a machine shared with
other work, the CPU time is the steadier measure of the work each backend does), the ratio
torch / cpu of each (the target: within 4x), the milliseconds of the torch
step spent in the experts (a hook on each `Experts` module), the largest |logit difference|
over the largest |logit|, and whether the greedy tokens agree. `--previous` adds a third
variant, the torch backend with the formula it used before (each chosen expert decoded whole to
fp32, then rounded to the activation dtype), alternated with the other two, and whether its
logits equal the torch backend's bit for bit at every step.

Prints a summary to stderr, then ONE JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1] / "tools"))
TARGET_RATIO = 4.0  # the torch fallback's goal: within 4x of the native path per decode step
WIDTHS = {  # the slice's widths: narrow enough to load twice in a few GB, wide enough to be real
    "hidden": 2048,
    "heads": 32,
    "kv_heads": 4,
    "head_dim": 64,
    "experts": 64,
    "top_k": 8,
    "moe_hidden": 1024,
    "moe_intermediate": 1024,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


@contextlib.contextmanager
def previous_formula() -> Iterator[None]:
    """The torch backend as it decoded NVFP4 before: the whole weight to fp32, then rounded."""
    from musespark.quant import nvfp4
    from musespark.quant.nvfp4_math import dequantize

    saved = nvfp4.dequantize_to

    def whole(packed, block_scale, global_scale, dtype, out=None, block_elements=None):
        return dequantize(packed, block_scale, global_scale).to(dtype)

    nvfp4.dequantize_to = whole
    try:
        yield
    finally:
        nvfp4.dequantize_to = saved


class ExpertsClock:
    """Seconds spent in the `Experts` modules of `model` since `reset` (forward hooks)."""

    def __init__(self, model) -> None:
        from musespark.layers.moe import Experts

        self.seconds, self._start = 0.0, 0.0
        for m in model.modules():
            if isinstance(m, Experts):
                m.register_forward_pre_hook(self._pre)
                m.register_forward_hook(self._post)

    def _pre(self, *_args) -> None:
        self._start = time.perf_counter()

    def _post(self, *_args) -> None:
        self.seconds += time.perf_counter() - self._start


def bench_batch(models: dict, batch: int, args: argparse.Namespace, clocks: dict) -> dict[str, Any]:
    import torch
    from slice_816b import Paged

    cfg = models["cpu"].config
    gen = torch.Generator().manual_seed(args.seed + batch)
    prompts = [torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
    names = list(models)
    paged = {n: Paged(models[n], batch, args.prompt_len + args.steps + 4) for n in names}

    def step(name: str, tokens: list[list[int]]):
        ctx = previous_formula() if name == "torch_previous" else contextlib.nullcontext()
        with ctx:
            return paged[name].step(tokens)

    times: dict[str, list[float]] = {n: [] for n in names}
    cpu_times: dict[str, list[float]] = {n: [] for n in names}  # this process's CPU seconds
    experts_ms: dict[str, list[float]] = {n: [] for n in names if n != "cpu"}
    worst, agree, identical = 0.0, True, True
    with torch.inference_mode():
        logits = {n: step(n, prompts) for n in names}
        for i in range(args.steps + 1):  # step 0: warm-up, untimed
            feed = [[t] for t in logits["cpu"].float().argmax(-1).tolist()]
            order = names if i % 2 == 0 else names[::-1]
            for n in order:
                if n in clocks:
                    clocks[n].seconds = 0.0
                t, c = time.perf_counter(), time.process_time()
                logits[n] = step(n, feed)
                dt, dc = time.perf_counter() - t, time.process_time() - c
                if i:
                    times[n].append(dt)
                    cpu_times[n].append(dc)
                    if n in experts_ms:
                        experts_ms[n].append(clocks[n].seconds)
            if "torch_previous" in logits:  # the new decoding must not change a bit
                identical = identical and torch.equal(logits["torch"], logits["torch_previous"])
            ref = logits["cpu"].float()
            for n in names[1:]:
                other = logits[n].float()
                worst = max(worst, float((other - ref).abs().max() / ref.abs().max()))
                agree = agree and bool(torch.equal(other.argmax(-1), ref.argmax(-1)))
    med = {n: statistics.median(v) for n, v in times.items()}
    used = {n: statistics.median(v) for n, v in cpu_times.items()}
    out: dict[str, Any] = {f"{n}_ms_per_step": round(med[n] * 1e3, 3) for n in names}
    out.update({f"{n}_process_ms_per_step": round(used[n] * 1e3, 3) for n in names})
    for n in names[1:]:
        out[f"{n}_over_cpu"] = round(med[n] / med["cpu"], 3)
        out[f"{n}_over_cpu_process_time"] = round(used[n] / used["cpu"], 3)
        out[f"{n}_experts_ms_per_step"] = round(statistics.median(experts_ms[n]) * 1e3, 3)
    out["within_target"] = out["torch_over_cpu"] <= TARGET_RATIO
    out["max_logit_diff_over_max_logit"] = round(worst, 6)
    out["greedy_agree"] = agree
    if "torch_previous" in names:
        out["torch_logits_identical_to_previous"] = identical
    out["steps_ms"] = {n: [round(x * 1e3, 3) for x in v] for n, v in times.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=4096, help="a reduced vocabulary: the head is not what is measured")
    for name, default in WIDTHS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    ap.add_argument("--batches", default="1,8", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per batch (one more warms up)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--previous", action="store_true", help="also time the formula before blocked decoding")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (the native kernels' too; 0: default)")
    ap.add_argument("--dir", help="write the slice here instead of a temporary directory (kept)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]

    import torch
    from write_816b_slice import write_slice

    import musespark
    from musespark.bench.common import machine

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    widths = {k: getattr(args, k) for k in WIDTHS}
    tmp = None if args.dir else tempfile.mkdtemp(prefix="nvfp4_fallback_")
    path = Path(args.dir or tmp) / "slice"
    try:
        written = write_slice(
            path, layers=args.layers, vocab=args.vocab, bf16_expert_layers=[], seed=args.seed, **widths
        )
        log(f"slice: {written['bytes'] / 1e9:.3f} GB, {args.layers} NVFP4 layer(s), widths {widths}")
        models = {"cpu": musespark.load_model(str(path), backend="cpu")}
        if models["cpu"].backend.name != "cpu":
            raise SystemExit("the native cpu backend is not available here (no C++ compiler?): nothing to compare")
        models["torch"] = musespark.load_model(str(path), backend="torch")
        if args.previous:
            models["torch_previous"] = models["torch"]
        clocks = {"torch": ExpertsClock(models["torch"])}
        if args.previous:
            clocks["torch_previous"] = clocks["torch"]
        decode = {}
        for b in batches:
            decode[str(b)] = r = bench_batch(models, b, args, clocks)
            extra = f", previous {r['torch_previous_over_cpu']}x" if args.previous else ""
            log(
                f"batch {b}: cpu {r['cpu_ms_per_step']} ms, torch {r['torch_ms_per_step']} ms "
                f"(experts {r['torch_experts_ms_per_step']} ms): {r['torch_over_cpu']}x{extra}; "
                f"process time {r['torch_over_cpu_process_time']}x"
            )
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "benchmark": "nvfp4_fallback",
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "slice": {"layers": args.layers, "vocab": args.vocab, "bytes": written["bytes"], **widths},
        "target_ratio": TARGET_RATIO,
        "decode": decode,
        "threads": torch.get_num_threads(),
        "machine": machine(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
