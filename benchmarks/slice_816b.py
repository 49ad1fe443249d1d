"""Load, decode and prefill a real-width slice of Muse Spark Open 816B; project the whole model.

    python benchmarks/slice_816b.py DIR                     # a slice written by tools/write_816b_slice.py
    python benchmarks/slice_816b.py --write DIR --layers 1 --vocab 16384 --experts 8 --bf16-expert-layers none
    python benchmarks/slice_816b.py DIR --check --load-pairs 3 --batches 1,8,32

With --write the slice is written first (tools/write_816b_slice.py `write_slice`; real widths
unless narrowed; DIR must not hold a checkpoint) and, with --delete, removed at the end.

Every model runs in a fresh child process (this script with --child), so that peak RSS and
page-cache state belong to one load:

1. Load: `--load-pairs` pairs, alternated: (a) drop the checkpoint's files from the page cache
   (posix_fadvise DONTNEED), then `musespark.load_model(DIR, backend="cpu")` in a child, which
   reports the load's wall time and its peak RSS (VmHWM of /proc/self/status, mapped file
   pages included); (b) drop them again and read every file fully (the time to read the files).
   Reported against the checkpoint's bytes on disk.
2. Bandwidth: best of 5 fp32 sums over a 1 GiB tensor (benchmarks/compare_hf.py's probe), in the
   child that decodes, just before decoding.
3. Decode at each batch of --batches on the paged path (the model's forward over a paged KV
   cache, as the engine runs a decode step, without the scheduler): every sequence gets a
   --prompt-len random-token prompt, then --steps greedy steps are timed; the median step is
   reported. A 512-token (--prefill-len) prompt is timed on its own, best of --prefill-repeats.
   Bytes a decode step must read: every checkpoint tensor but the embedding, with the experts
   counted per layer as (distinct experts chosen in that step) x (one expert's bytes in the
   checkpoint). The distinct experts are counted by a hook on each layer's router where the
   backend calls it; the cpu backend routes inside its native layer, and then the count is the
   expectation for uniform random routing, E * (1 - (1 - k/E)^B) (B = 1: exactly k; B = 8 at
   real width: ~57 of 256); `distinct_experts_source` says which.
   Achieved GB/s = those bytes / median step time. Packed copies the backend makes are not
   counted (they replace reading the checkpoint tensor, they do not add to it).
4. --check: the cpu (native) backend decodes --check-steps greedy steps in one child, the torch
   backend in another, fed the same tokens (teacher forcing); logits go to .npy files in a
   temporary directory (two models do not fit in memory at real width). Reported: the largest
   |difference| over the largest |logit|, and whether every greedy token matches.
5. Projection (labelled "projection": not measured): the whole 816B model's bytes per decode
   token and multiply-adds per prompt token are computed from the real config
   (`slice_config(N)` with the preset's layer count, bf16 experts in layers 0 and 61 as
   released, the writer's exact tensor list); batch-1 tokens/s = the slice's achieved batch-1
   GB/s / those bytes (and the roofline: the probed bandwidth / those bytes); prefill tokens/s =
   the slice's measured multiply-adds per second / the model's per token.

--avx2-only runs every child as on an AVX2-only x86 CPU (the JSON line's machine.isa_limits
records it). Prints a summary to stderr, then ONE JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from musespark.cpu_features import AVX2_ONLY_ENV

# --avx2-only: each library reads its instruction-set cap when it loads, so the script restarts
# itself with the caps set; the child processes inherit them.
if "--avx2-only" in sys.argv[1:] and any(os.environ.get(k) != v for k, v in AVX2_ONLY_ENV.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ONLY_ENV})

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "tools"))
KV_BLOCK = 16  # tokens per KV block
READ_CHUNK = 64 << 20
WIDTHS = ("hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "moe_hidden", "moe_intermediate")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- checkpoint bytes (read from the safetensors headers, not the loaded model) -----------


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def classify(entries: dict[str, tuple[tuple[int, ...], int]], num_experts: int) -> dict[str, Any]:
    """name -> (shape, nbytes) => bytes and multiply-adds by part. Experts: per layer, the
    bytes of one expert (all its tensors / E) and its multiply-adds per token."""
    out: dict[str, Any] = {"embed": 0, "dense": 0, "expert_bytes": {}, "expert_macs": {}, "dense_macs": 0, "head": 0}
    for name, (shape, nbytes) in entries.items():
        if "embed_tokens" in name:
            out["embed"] += nbytes
            continue
        if ".mlp.experts." in name and "post_expert_norm" not in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            out["expert_bytes"][layer] = out["expert_bytes"].get(layer, 0) + nbytes / num_experts
            if name.endswith(("gate_up_proj", "down_proj")):  # codes (uint8: 2 weights a byte) or bf16
                per = math.prod(shape[1:]) * (2 if nbytes == math.prod(shape) else 1)
                out["expert_macs"][layer] = out["expert_macs"].get(layer, 0) + per
            continue
        out["dense"] += nbytes
        if name == "lm_head.weight":
            out["head"] = nbytes
        elif len(shape) == 2:
            out["dense_macs"] += math.prod(shape)
    return out


def read_entries(path: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    from musespark.checkpoint.safetensors_file import SafetensorsFile

    out = {}
    for f in checkpoint_files(path):
        with SafetensorsFile(f) as st:
            out.update({n: (tuple(e.shape), e.end - e.start) for n, e in st.entries.items()})
    return out


# -- page cache ---------------------------------------------------------------------------


def drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_read(files: list[Path]) -> float:
    """Seconds to read every file fully after dropping it from the page cache."""
    drop_cache(files)
    buf = bytearray(READ_CHUNK)
    t = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


# -- the paged decode loop (children) -----------------------------------------------------


class Paged:
    """B sequences over one paged KV cache; `step(tokens)` appends one or more tokens per sequence."""

    def __init__(self, model, batch: int, max_len: int) -> None:
        import torch

        cfg = model.config
        self.model, self.batch = model, batch
        per = max_len // KV_BLOCK + 2
        shape = (batch * per, KV_BLOCK, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = [
            (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.table = torch.arange(batch * per).view(batch, per)
        self.lens = [0] * batch

    def step(self, tokens: list[list[int]]):
        """tokens[b]: the new tokens of sequence b -> logits of each sequence's last token [B, V]."""
        import torch

        from musespark.layers.attention import AttentionContext, KVGroup

        ids, pos, slots, starts = [], [], [], [0]
        for b, new in enumerate(tokens):
            p = torch.arange(self.lens[b], self.lens[b] + len(new))
            ids += new
            pos.append(p)
            slots.append(self.table[b, p // KV_BLOCK] * KV_BLOCK + p % KV_BLOCK)
            self.lens[b] += len(new)
            starts.append(starts[-1] + len(new))
        cfg = self.model.config
        ctx = AttentionContext(
            query_start_loc=starts,
            seq_lens=list(self.lens),
            kv_caches=self.kv,
            groups=[KVGroup(slot_mapping=torch.cat(slots), block_tables=self.table)],
            layer_group=[0] * cfg.num_hidden_layers,
        )
        hidden = self.model(torch.tensor(ids), torch.cat(pos), ctx)
        return self.model.compute_logits(hidden[[s - 1 for s in starts[1:]]])


class ExpertCounter:
    """Distinct experts the routers chose since `reset`, per layer (forward hooks on the routers)."""

    def __init__(self, model) -> None:
        from musespark.layers.moe import Router

        self.chosen: dict[int, set[int]] = {}
        for i, layer in enumerate(model.layers):
            for m in layer.modules():
                if isinstance(m, Router):
                    m.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def hook(_module, _inputs, output) -> None:
            self.chosen.setdefault(layer, set()).update(output[1].flatten().tolist())

        return hook

    def reset(self) -> None:
        self.chosen = {}


def expected_distinct(cfg, batch: int) -> float:
    """Distinct experts `batch` tokens choose when each picks top_k of E uniformly at random
    (8 random tokens choose about 57 of 256 at real width; batch 1 exactly top_k)."""
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    return E * (1 - (1 - k / E) ** batch)


def child_load(path: str, backend: str) -> dict:
    import torch

    import musespark

    t = time.perf_counter()
    model = musespark.load_model(path, backend=backend)
    elapsed = time.perf_counter() - t
    out = {"load_s": elapsed, "vm_hwm_bytes": vm_hwm(), "backend": model.backend.name}
    out["threads"] = torch.get_num_threads()
    return out


def child_bench(path: str, args: argparse.Namespace) -> dict:
    import torch

    import musespark
    from musespark.bench.common import machine

    sys.path.insert(0, str(HERE.parent))
    from compare_hf import measure_bandwidth

    torch.manual_seed(args.seed)
    model = musespark.load_model(path, backend="cpu")
    cfg = model.config
    parts = classify(read_entries(Path(path)), cfg.num_local_experts)
    counter = ExpertCounter(model)
    gen = torch.Generator().manual_seed(args.seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()

    bandwidth = measure_bandwidth(args.bandwidth_mb)
    log(f"bandwidth probe {bandwidth / 1e9:.2f} GB/s")
    decode = {}
    with torch.inference_mode():
        for batch in args.batches:
            paged = Paged(model, batch, args.prompt_len + args.steps + 2)
            logits = paged.step([rand(args.prompt_len) for _ in range(batch)])
            times, step_bytes, distinct = [], [], []
            for _ in range(args.steps + 1):  # the first step is a warmup
                nxt = logits.argmax(-1).tolist()
                counter.reset()
                t = time.perf_counter()
                logits = paged.step([[x] for x in nxt])
                times.append(time.perf_counter() - t)
                n = {layer: len(s) for layer, s in counter.chosen.items()}
                source = "router hook"
                if not n:  # the backend routes inside its native layer: no router module is called
                    source = "uniform routing model E*(1-(1-k/E)^B)"
                    n = {layer: expected_distinct(cfg, batch) for layer in parts["expert_bytes"]}
                distinct.append(statistics.mean(n.values()) if n else float("nan"))
                step_bytes.append(parts["dense"] + sum(parts["expert_bytes"][i] * c for i, c in n.items()))
            times, step_bytes, distinct = times[1:], step_bytes[1:], distinct[1:]
            med = statistics.median(times)
            nbytes = statistics.mean(step_bytes)
            decode[str(batch)] = {
                "ms_per_step": round(med * 1e3, 2),
                "tok_s": round(batch / med, 3),
                "step_bytes": int(nbytes),
                "distinct_experts_per_layer": round(statistics.mean(distinct), 2),
                "distinct_experts_source": source,
                "achieved_gb_s": round(nbytes / med / 1e9, 3),
                "pct_of_probe": round(100 * nbytes / med / bandwidth, 1),
                "steps_ms": [round(x * 1e3, 2) for x in times],
            }
            log(
                f"batch {batch}: {decode[str(batch)]['ms_per_step']} ms/step, {decode[str(batch)]['tok_s']} tok/s, "
                f"{decode[str(batch)]['achieved_gb_s']} GB/s"
            )
            del paged, logits
        prefill = None
        if args.prefill_len:
            best = math.inf
            for _ in range(args.prefill_repeats):
                paged = Paged(model, 1, args.prefill_len + 2)
                prompt = rand(args.prefill_len)
                t = time.perf_counter()
                paged.step([prompt])
                best = min(best, time.perf_counter() - t)
                del paged
            macs = args.prefill_len * (
                parts["dense_macs"] + sum(m * cfg.num_experts_per_tok for m in parts["expert_macs"].values())
            )
            prefill = {
                "tokens": args.prefill_len,
                "seconds": round(best, 3),
                "tok_s": round(args.prefill_len / best, 2),
                "gmacs_per_s": round(macs / best / 1e9, 2),
            }
            log(f"prefill {args.prefill_len}: {best:.2f} s, {prefill['tok_s']} tok/s")
    return {
        "bandwidth_bytes_per_s": bandwidth,
        "decode": decode,
        "prefill": prefill,
        "parts": {k: v for k, v in parts.items()},
        "threads": torch.get_num_threads(),
        "machine": machine(),
    }


def child_logits(path: str, backend: str, steps: int, prompt_len: int, seed: int, out: str, forced: str | None) -> dict:
    import numpy as np
    import torch

    import musespark

    model = musespark.load_model(path, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.config.vocab_size, (prompt_len,), generator=gen).tolist()
    feed = json.loads(forced) if forced else None
    paged = Paged(model, 1, prompt_len + steps + 2)
    rows, greedy = [], []
    with torch.inference_mode():
        logits = paged.step([prompt])
        for i in range(steps):
            row = logits[0].float()
            rows.append(row.numpy().copy())
            greedy.append(int(row.argmax()))
            if i + 1 < steps:
                logits = paged.step([[feed[i] if feed else greedy[-1]]])
    np.save(out, np.stack(rows))
    return {"greedy": greedy, "backend": model.backend.name}


# -- the parent -----------------------------------------------------------------------------


def run_child(argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, str(HERE), "--child", *argv], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {argv[:2]} failed with exit status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def projection(decode_b1: dict | None, prefill: dict | None, layers: int | None, bandwidth: float) -> dict:
    """Whole-model figures from the slice's measured rates (not measured)."""
    from write_816b_slice import slice_config, slice_tensors

    from musespark.bench.presets import preset_config

    n = layers or preset_config("muse-spark-open-816b").num_hidden_layers
    cfg = slice_config(n)
    bf16 = {i for i in (0, 61) if i < n}
    entries = {t.name: (t.shape, t.nbytes) for t in slice_tensors(cfg, bf16)}
    parts = classify(entries, cfg.num_local_experts)
    k = cfg.num_experts_per_tok
    token_bytes = parts["dense"] + k * sum(parts["expert_bytes"].values())
    token_macs = parts["dense_macs"] + k * sum(parts["expert_macs"].values())
    out: dict[str, Any] = {
        "projection": True,
        "layers": n,
        "bf16_expert_layers": sorted(bf16),
        "checkpoint_bytes": sum(b for _, b in entries.values()),
        "batch1_bytes_per_token": int(token_bytes),
        "prefill_macs_per_token": int(token_macs),
    }
    out["batch1_roofline_tok_s_at_probe"] = round(bandwidth / token_bytes, 3)
    if decode_b1:
        rate = decode_b1["achieved_gb_s"] * 1e9
        out["batch1_decode_tok_s"] = round(rate / token_bytes, 3)
        out["basis_decode"] = f"slice batch-1 achieved {decode_b1['achieved_gb_s']} GB/s / bytes per token"
    if prefill:
        out["prefill_tok_s"] = round(prefill["gmacs_per_s"] * 1e9 / token_macs, 3)
        out["basis_prefill"] = f"slice prefill {prefill['gmacs_per_s']} G multiply-adds/s / multiply-adds per token"
    return out


def write(args: argparse.Namespace) -> dict:
    from write_816b_slice import write_slice

    layers = None
    if args.bf16_expert_layers is not None:
        layers = [] if args.bf16_expert_layers in ("", "none") else [int(x) for x in args.bf16_expert_layers.split(",")]
    widths = {k: getattr(args, k) for k in WIDTHS if getattr(args, k)}
    return write_slice(
        args.write, layers=args.layers, vocab=args.vocab, bf16_expert_layers=layers, seed=args.seed, log=log, **widths
    )


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", help="a slice directory (or use --write DIR)")
    ap.add_argument("--write", metavar="DIR", help="write a slice to DIR first (tools/write_816b_slice.py)")
    ap.add_argument("--delete", action="store_true", help="remove the --write directory at the end")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=202048)
    ap.add_argument(
        "--bf16-expert-layers", default=None, metavar="I,J", help="as the writer's flag ('none': all NVFP4)"
    )
    for name in WIDTHS:
        ap.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help="writer width override (default: real)"
        )
    ap.add_argument("--load-pairs", type=int, default=1)
    ap.add_argument("--batches", type=ints, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per batch")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=512, help="0: no prefill")
    ap.add_argument("--prefill-repeats", type=int, default=1)
    ap.add_argument("--bandwidth-mb", type=int, default=1024)
    ap.add_argument("--check", action="store_true", help="native vs torch logits, two processes")
    ap.add_argument("--check-steps", type=int, default=4)
    ap.add_argument("--projection-layers", type=int, default=None, help="default: the 816B preset's")
    ap.add_argument(
        "--avx2-only", action="store_true", help="run as on an AVX2-only x86 CPU (musespark.cpu_features.AVX2_ONLY_ENV)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        what, path, *rest = args.child
        if what == "load":
            result = child_load(path, rest[0])
        elif what == "bench":
            result = child_bench(path, args)
        else:
            result = child_logits(
                path, rest[0], args.check_steps, args.prompt_len, args.seed, rest[1], rest[2] if len(rest) > 2 else None
            )
        print(json.dumps(result), flush=True)
        return 0

    written = None
    if args.write:
        written = write(args)
        path = Path(args.write)
    elif args.path:
        path = Path(args.path)
    else:
        ap.error("give a slice directory or --write DIR")
    try:
        files = checkpoint_files(path)
        disk = sum(f.stat().st_size for f in files)
        loads, reads = [], []
        for i in range(args.load_pairs):
            drop_cache(files)
            loads.append(run_child(["load", str(path), "cpu"]))
            reads.append(cold_read(files))
            log(
                f"pair {i + 1}: load {loads[-1]['load_s']:.2f} s, peak RSS {loads[-1]['vm_hwm_bytes'] / 1e9:.2f} GB; "
                f"cold read {reads[-1]:.2f} s"
            )
        load = None  # --load-pairs 0: decode and prefill only
        if loads:
            load_s = statistics.median(x["load_s"] for x in loads)
            read_s = statistics.median(reads)
            hwm = max(x["vm_hwm_bytes"] for x in loads)
            load = {
                "checkpoint_bytes": disk,
                "load_s": [round(x["load_s"], 3) for x in loads],
                "cold_read_s": [round(x, 3) for x in reads],
                "load_over_read": round(load_s / read_s, 2),
                "peak_rss_bytes": hwm,
                "peak_rss_over_checkpoint": round(hwm / disk, 3),
                "read_gb_s": round(disk / read_s / 1e9, 3),
            }
        bench_argv = ["bench", str(path)]
        flags = [
            f"--batches={','.join(map(str, args.batches))}",
            f"--steps={args.steps}",
            f"--prompt-len={args.prompt_len}",
            f"--prefill-len={args.prefill_len}",
            f"--prefill-repeats={args.prefill_repeats}",
            f"--bandwidth-mb={args.bandwidth_mb}",
            f"--seed={args.seed}",
        ]
        proc = subprocess.run(
            [sys.executable, str(HERE), *flags, "--child", *bench_argv], stdout=subprocess.PIPE, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"bench child failed with exit status {proc.returncode}")
        bench = json.loads(proc.stdout.strip().splitlines()[-1])
        check = None
        if args.check:
            with tempfile.TemporaryDirectory(prefix="slice816b-") as tmp:
                import numpy as np

                flags = [f"--check-steps={args.check_steps}", f"--prompt-len={args.prompt_len}", f"--seed={args.seed}"]

                def logits_child(backend: str, forced: list[int] | None) -> dict:
                    extra = [json.dumps(forced)] if forced else []
                    cmd = [
                        sys.executable,
                        str(HERE),
                        *flags,
                        "--child",
                        "logits",
                        str(path),
                        backend,
                        f"{tmp}/{backend}.npy",
                        *extra,
                    ]
                    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
                    if proc.returncode != 0:
                        raise RuntimeError(f"{backend} logits child failed with exit status {proc.returncode}")
                    return json.loads(proc.stdout.strip().splitlines()[-1])

                native = logits_child("cpu", None)
                ref = logits_child("torch", native["greedy"])
                a, b = np.load(f"{tmp}/cpu.npy"), np.load(f"{tmp}/torch.npy")
                scale = float(np.abs(b).max())
                check = {
                    "steps": args.check_steps,
                    "backends": [native["backend"], ref["backend"]],
                    "max_diff_over_max_logit": float(np.abs(a - b).max() / scale),
                    "finite": bool(np.isfinite(a).all() and np.isfinite(b).all()),
                    "greedy_native": native["greedy"],
                    "greedy_torch": ref["greedy"],
                    "greedy_match": native["greedy"] == ref["greedy"],
                }
                diff = check["max_diff_over_max_logit"]
                log(f"check: max diff / max logit {diff:.2e}, greedy match {check['greedy_match']}")
        proj = projection(
            bench["decode"].get("1"), bench["prefill"], args.projection_layers, bench["bandwidth_bytes_per_s"]
        )
        if "batch1_decode_tok_s" in proj:
            log(f"PROJECTION (not measured): whole model batch-1 decode {proj['batch1_decode_tok_s']} tok/s")
        from musespark.bench.common import print_json

        result = {
            "benchmark": "slice_816b",
            "path": path.name,
            "written": written and {k: written[k] for k in ("bytes", "bf16_expert_layers", "seconds")},
            "config": json.loads((path / "config.json").read_text())["text_config"] | {},
            "load": load,
            "bandwidth_gb_s": round(bench["bandwidth_bytes_per_s"] / 1e9, 3),
            "threads": bench["threads"],
            "decode": bench["decode"],
            "prefill": bench["prefill"],
            "check": check,
            "projection_816b": proj,
            "child_machine": bench["machine"],
            "seed": args.seed,
            "avx2_only": args.avx2_only,
        }
        cfg = result["config"]
        result["config"] = {
            k: cfg.get(k)
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "vocab_size",
                "num_local_experts",
                "num_experts_per_tok",
                "moe_hidden_size",
                "moe_intermediate_size",
            )
        }
        print_json(result)
    finally:
        if args.write and args.delete:
            shutil.rmtree(args.write, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
