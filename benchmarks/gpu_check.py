"""One prepared run on one CUDA GPU (an H200 in mind): every Triton kernel's parity at real
sizes, then the decoder's batch-1 decode and a 2048-token prefill timed through the triton
backend, the torch backend and transformers, against the HBM roofline.

    python benchmarks/gpu_check.py                 # the whole check (~4-6 min on an H200, compiles included)
    python benchmarks/gpu_check.py --skip-hf       # without transformers
    python benchmarks/gpu_check.py --dry-run-cpu   # the same code path at toy sizes on CPU under
                                                   # TRITON_INTERPRET=1 (checks the script, times nothing real)

1. Kernels (`musespark.kernels.triton`), each against its `reference_*`
   (`musespark.backends.triton_reference`) on the GPU, in fp32
   and bf16, at hidden 4096, 32 heads / 8 KV heads of head_dim 128, 64 experts top-8 at
   Hm 2048 / Im 1024, 2048 tokens (experts: 512): max relative error, pass at fp32 1e-5 and
   bf16 8e-3 (tests/kernels/test_triton_kernels.py states why); routing reports the fraction of
   tokens whose expert set equals the reference's (near-ties may flip in fp32 sums) and
   passes at >= 0.999. Attention: a 2048-token prompt, a 512-token chunk after a 1536-token
   prefix, 8 decode rows with contexts up to 4096, full and 1024-window, plus the bitwise
   check that a decode row equals the same row inside a chunk. Each kernel's time and its
   reference's (triton.testing.do_bench, ms).
2. A GPU-sized random model (--layers, default 4: layer 0 dense, then sparse; the default
   sliding/full/NoPE pattern, window 1024; vocab 32768, hidden 4096, dense intermediate
   11008, the attention and experts above), written once as a bf16 checkpoint under
   --workdir, loaded with `load_model(device="cuda")`. Parity of whole-prompt logits
   (256 tokens): fp32 triton vs fp32 torch (pass at 1e-4) and bf16 triton vs bf16 torch
   (reported with the distance of each from fp32; pass when triton's is at most 1.5x
   torch's, the CPU test's criterion), and bf16 torch vs transformers (reported).
3. Timing, bf16: a 2048-token prefill (time to the first token's logits) and --decode-steps
   batch-1 greedy decode steps after it. musespark is driven by this script's own paged-cache
   loop (one KV block table, block size 16, the model's `forward` + `compute_logits`), NOT by
   the engine: the engine's runner and KV cache have not been run on a GPU and may still
   assume the CPU. transformers==5.23.0 (if importable) runs `generate` (greedy, KV cache, its
   default experts implementation) from the same checkpoint: prefill = a 1-token generate,
   decode = (N+1-token generate - prefill) / N. Each figure is the median of --repeats.
4. Roofline: device copy bandwidth measured here (best of 10 copies of a 2 GiB buffer,
   read + write bytes); batch-1 decode cannot beat bandwidth / active weight bytes per token
   (`bench.presets.active_weight_bytes`: everything but the embedding and the unrouted
   experts, LM head included). Prefill cannot beat max(all weight bytes / bandwidth,
   FLOPs / measured bf16 GEMM FLOP/s). Each engine's figure is reported as % of it.

Prints progress, then ONE JSON line last: {"ok": all parity checks passed, "kernels": ...,
"model_parity": ..., "timing": ..., "roofline": ..., "env": ..., "errors": [...]}. A failing
section records its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

FP32_TOL, BF16_TOL, MODEL_FP32_TOL = 1e-5, 8e-3, 1e-4

REAL = dict(
    T=2048,
    H=4096,
    nH=32,
    nKV=8,
    D=128,
    E=64,
    k=8,
    Hm=2048,
    Im=1024,
    T_moe=512,
    block=16,
    window=1024,
    prefix=1536,
    chunk=512,
    decode_ctx=(4096, 3000, 2048, 1025, 1024, 777, 100, 1),
)
TOY = dict(
    T=40,
    H=48,
    nH=4,
    nKV=2,
    D=16,
    E=6,
    k=2,
    Hm=24,
    Im=32,
    T_moe=12,
    block=4,
    window=8,
    prefix=20,
    chunk=9,
    decode_ctx=(33, 20, 9, 1),
)


def model_fields(layers: int, toy: bool) -> dict[str, Any]:
    if toy:
        return dict(
            vocab_size=128,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            moe_hidden_size=24,
            moe_intermediate_size=32,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=8,
            mlp_layer_types=("dense",) + ("sparse",) * (layers - 1),
            bos_token_id=1,
            eos_token_id=2,
        )
    return dict(
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        moe_hidden_size=2048,
        moe_intermediate_size=1024,
        num_local_experts=64,
        num_experts_per_tok=8,
        sliding_window=1024,
        mlp_layer_types=("dense",) + ("sparse",) * (layers - 1),
        bos_token_id=1,
        eos_token_id=2,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the random model (default 4)")
    p.add_argument("--prefill", type=int, default=2048, help="prefill length in tokens (default 2048)")
    p.add_argument("--decode-steps", type=int, default=64, help="timed batch-1 decode steps (default 64)")
    p.add_argument("--parity-len", type=int, default=256, help="prompt length of the logit parity (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per figure, median reported (default 3)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the random checkpoint is written (default: a temporary directory, removed afterwards)",
    )
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    p.add_argument("--skip-kernels", action="store_true", help="skip section 1")
    p.add_argument("--skip-model", action="store_true", help="skip sections 2-4")
    p.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="toy sizes on CPU under TRITON_INTERPRET=1 "
        "(exercises this script without a GPU; its figures mean nothing)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# -- helpers --------------------------------------------------------------------------------


def rel(ours, ref) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def mean_rel(ours, ref) -> float:
    return float((ours.float() - ref.float()).abs().mean() / ref.float().abs().mean().clamp_min(1e-30))


class Run:
    """Collects results and errors; `section` runs a step and records a failure without stopping."""

    def __init__(self, device) -> None:
        self.device = device
        self.out: dict[str, Any] = {"ok": True, "errors": []}

    def section(self, name: str, fn: Callable[[], Any]) -> Any:
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # record and go on: one JSON line must come out
            self.out["ok"] = False
            self.out["errors"].append(f"{name}: {type(e).__name__}: {e}")
            traceback.print_exc()
            return None
        finally:
            print(f"   ({time.perf_counter() - t:.1f} s)", flush=True)

    def check(self, table: dict, key: str, err: float, tol: float, **extra: Any) -> None:
        ok = bool(err <= tol)
        table[key] = {"rel_err": err, "tol": tol, "ok": ok, **extra}
        self.out["ok"] &= ok
        print(f"   {key}: {err:.2e} (tol {tol:.0e}) {'ok' if ok else 'FAIL'} {extra or ''}", flush=True)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ms(fn: Callable[[], Any], device) -> float:
    """Median milliseconds of fn (triton.testing.do_bench on CUDA; a few wall-clock runs on CPU)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=50))
    times = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


# -- 1. kernels -----------------------------------------------------------------------------


def kernel_checks(run: Run, s: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    from musespark.backends import triton_reference as refs
    from musespark.backends.triton_backend import attention_args
    from musespark.kernels.triton import attention, experts, norm_residual, o_norm_gate, qk_norm_rope, routing
    from musespark.layers.attention import AttentionContext, KVGroup
    from musespark.layers.moe import ROUTER_EPS
    from musespark.layers.rotary import cos_sin, inv_frequencies

    dev = run.device
    g = torch.Generator(device=dev).manual_seed(seed)
    res: dict[str, Any] = {}
    times: dict[str, Any] = {}

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    T, H, nH, nKV, D = s["T"], s["H"], s["nH"], s["nKV"], s["D"]
    for dt in (torch.float32, torch.bfloat16):
        tol, tag = (FP32_TOL, "fp32") if dt == torch.float32 else (BF16_TOL, "bf16")
        # 1. norm -> gated residual -> next norm
        st, br = randn(T, H, scale=3), randn(T, H, scale=7, dtype=dt)
        w = randn(H) / 0.3
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1 + beta), min=1e-3))
        pg, ng = 1 + randn(H, scale=0.2), 1 + randn(H, scale=0.2)
        args = (st, br, alpha, beta, 1e-8, pg, ng, 1e-5, dt)
        (s1, h1), (s2, h2) = norm_residual.norm_residual(*args), refs.reference_norm_residual(*args)
        run.check(res, f"norm_residual.stream.{tag}", rel(s1, s2), FP32_TOL)
        run.check(res, f"norm_residual.next_norm.{tag}", rel(h1, h2), tol)
        times[f"norm_residual.{tag}"] = [
            bench_ms(lambda: norm_residual.norm_residual(*args), dev),
            bench_ms(lambda: refs.reference_norm_residual(*args), dev),
        ]
        # 2. QK-norm + RoPE + paged KV write
        x, v = randn(T, nKV, D, scale=4, dtype=dt), randn(T, nKV, D, dtype=dt)
        pos = torch.arange(T, device=dev) + 5
        rot = cos_sin(pos, inv_frequencies(500000.0, D).to(dev))
        nb = T // s["block"] + 4
        slots = torch.randperm(nb * s["block"], generator=g, device=dev)[:T]
        caches = [torch.zeros(nb, s["block"], nKV, D, dtype=dt, device=dev) for _ in range(4)]
        ours = qk_norm_rope.qk_norm_rope(x, 1e-5, 5.47, rot, dt, v, slots, caches[0], caches[1])
        ref = refs.reference_qk_norm_rope(x, 1e-5, 5.47, rot, dt, v, slots, caches[2], caches[3])
        run.check(res, f"qk_norm_rope.{tag}", rel(ours, ref), tol)
        run.check(res, f"qk_norm_rope.k_cache.{tag}", rel(caches[0], caches[2]), tol)
        run.check(res, f"qk_norm_rope.v_cache.{tag}", rel(caches[1], caches[3]), 0.0)
        xq = randn(T, nH, D, scale=4, dtype=dt)
        times[f"qk_norm_rope.q.{tag}"] = [
            bench_ms(lambda: qk_norm_rope.qk_norm_rope(xq, 1e-5, 5.47, rot, dt), dev),
            bench_ms(lambda: refs.reference_qk_norm_rope(xq, 1e-5, 5.47, rot, dt), dev),
        ]
        # 3. O-norm x sigmoid gate
        o, gate = randn(T, nH, D, scale=3, dtype=dt), randn(T, nH, D, scale=2, dtype=dt)
        run.check(
            res,
            f"o_norm_gate.{tag}",
            rel(o_norm_gate.o_norm_gate(o, gate, 1e-5), refs.reference_o_norm_gate(o, gate, 1e-5)),
            tol,
        )
        times[f"o_norm_gate.{tag}"] = [
            bench_ms(lambda: o_norm_gate.o_norm_gate(o, gate, 1e-5), dev),
            bench_ms(lambda: refs.reference_o_norm_gate(o, gate, 1e-5), dev),
        ]
        # 4. routing
        E, k = s["E"], s["k"]
        f = randn(T, H, dtype=dt)
        wr, bias = randn(E, H, scale=2 / H**0.5), randn(E, scale=0.1)
        w1, i1 = routing.route_topk(f, wr, bias, k, 0.1767766952966369, 1.0, ROUTER_EPS)
        w2, i2 = refs.reference_route(f, wr, bias, k, 0.1767766952966369, 1.0)
        same = (i1 == i2).all(dim=1)
        frac = float(same.float().mean())
        run.check(
            res,
            f"routing.weights.{tag}",
            rel(w1[same], w2[same]) if bool(same.any()) else math.inf,
            FP32_TOL,
            same_experts=frac,
        )
        res[f"routing.same_experts.{tag}"] = {"fraction": frac, "ok": frac >= 0.999}
        run.out["ok"] &= frac >= 0.999
        times[f"routing.{tag}"] = [
            bench_ms(lambda: routing.route_topk(f, wr, bias, k, 0.17, 1.0, ROUTER_EPS), dev),
            bench_ms(lambda: refs.reference_route(f, wr, bias, k, 0.17, 1.0), dev),
        ]
        # 5. experts
        Tm, Hm, Im = s["T_moe"], s["Hm"], s["Im"]
        u = randn(Tm, Hm, scale=2, dtype=dt)
        gu, dn = randn(E, 2 * Im, Hm, scale=Hm**-0.5, dtype=dt), randn(E, Hm, Im, scale=Im**-0.5, dtype=dt)
        ids = torch.argsort(torch.rand(Tm, E, generator=g, device=dev), dim=1)[:, :k]
        wts = torch.rand(Tm, k, generator=g, device=dev)
        pgn = 1 + randn(Hm, scale=0.2)
        run.check(
            res,
            f"experts.{tag}",
            rel(
                experts.moe_experts(u, wts, ids, gu, dn, pgn, 1e-8),
                refs.reference_moe_experts(u, wts, ids, gu, dn, pgn, 1e-8),
            ),
            tol,
        )
        times[f"experts.{tag}"] = [
            bench_ms(lambda: experts.moe_experts(u, wts, ids, gu, dn, pgn, 1e-8), dev),
            bench_ms(lambda: refs.reference_moe_experts(u, wts, ids, gu, dn, pgn, 1e-8), dev),
        ]
        # 6. attention: prompt, chunk after a prefix, decode rows; full and windowed
        bs = s["block"]
        cases = {
            "prompt": ([0], [T]),
            "chunk": ([s["prefix"]], [s["chunk"]]),
            "decode": ([n - 1 for n in s["decode_ctx"]], [1] * len(s["decode_ctx"])),
        }
        for name, (done, new) in cases.items():
            B = len(done)
            lens = [d + n for d, n in zip(done, new)]
            mb = max(lens) // bs + 1
            nb = B * mb + 1
            tables = torch.randperm(nb, generator=g, device=dev)[: B * mb].view(B, mb)
            posn = torch.cat([torch.arange(d, d + n, device=dev) for d, n in zip(done, new)])
            rows = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(new, device=dev))
            slots = tables[rows, posn // bs] * bs + posn % bs
            qsl = [0]
            for n in new:
                qsl.append(qsl[-1] + n)
            Tq = qsl[-1]
            q, kk, vv = randn(Tq, nH, D, dtype=dt), randn(Tq, nKV, D, dtype=dt), randn(Tq, nKV, D, dtype=dt)
            kc, vc = randn(nb, bs, nKV, D, dtype=dt), randn(nb, bs, nKV, D, dtype=dt)
            for window in (None, s["window"]):

                def ctx():
                    return AttentionContext(
                        query_start_loc=qsl,
                        seq_lens=lens,
                        kv_caches=[(kc.clone(), vc.clone())],
                        groups=[KVGroup(slot_mapping=slots, block_tables=tables)],
                        layer_group=[0],
                    )

                scale = D**-0.5
                c1, c2 = ctx(), ctx()
                ours = attention.paged_attention(q, kk, vv, posn, *attention_args(c1, 0), scale, window)
                ref = refs.reference_paged_attention(q, kk, vv, posn, c2, 0, scale, window)
                key = f"attention.{name}.{'w' + str(window) if window else 'full'}.{tag}"
                run.check(res, key, rel(ours, ref), tol)
                c3 = ctx()
                a3 = attention_args(c3, 0)
                times[key] = [
                    bench_ms(lambda: attention.paged_attention(q, kk, vv, posn, *a3, scale, window), dev),
                    bench_ms(lambda: refs.reference_paged_attention(q, kk, vv, posn, c3, 0, scale, window), dev),
                ]
                if name == "chunk":  # the chunk's last row, alone as a decode row: bitwise equal
                    alone = AttentionContext(
                        query_start_loc=[0, 1],
                        seq_lens=lens,
                        kv_caches=c1.kv_caches,
                        groups=[KVGroup(slot_mapping=slots[-1:], block_tables=tables)],
                        layer_group=[0],
                    )
                    row = attention.paged_attention(
                        q[-1:], kk[-1:], vv[-1:], posn[-1:], *attention_args(alone, 0), scale, window
                    )
                    res[key + ".decode_row_bitwise"] = {
                        "ok": bool(torch.equal(row[0], ours[-1])),
                        "rel_err": rel(row[0], ours[-1]),
                    }
                    print(f"   {key}.decode_row_bitwise: {res[key + '.decode_row_bitwise']}", flush=True)
    run.out["kernel_times_ms"] = {k: {"triton": v[0], "reference": v[1]} for k, v in times.items()}
    return res


# -- 2. the model ---------------------------------------------------------------------------


def randomize_on_device(model, seed: int) -> None:
    """`model.init_random_weights`' scales, drawn on the model's device (fast for billions)."""
    import torch

    gen = torch.Generator(device=model.device).manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t is None or name.endswith(("inv_freq", "alpha", "beta")) or not t.dtype.is_floating_point:
                continue
            noise = torch.randn(t.shape, generator=gen, device=t.device)
            if name.endswith("residual_gate.gate"):
                val = noise
            elif name.endswith("e_score_correction_bias"):
                val = noise * 0.1
            elif name == "norm.weight":
                val = 1.0 + noise * 0.2
            elif t.ndim == 1:
                val = noise * 0.2
            elif name == "lm_head.weight":
                val = noise * 3.0 / hidden**0.5
            elif name.endswith("mlp.gate.weight"):
                val = noise * 2.0 / hidden**0.5
            else:
                val = noise / t.shape[-1] ** 0.5
            t.copy_(val.to(t.dtype))
            del noise, val


def write_checkpoint(cfg, path: Path, device, seed: int) -> Path:
    import torch

    from musespark.checkpoint.writer import save_checkpoint
    from musespark.model import MuseSparkForCausalLM

    with torch.device(device):
        model = MuseSparkForCausalLM(cfg)
    randomize_on_device(model, seed)
    save_checkpoint(model.state_dict(), cfg, path, dtype=torch.bfloat16)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return path


def paged_generate(model, prompt, n_decode: int, block_size: int = 16):
    """Prefill `prompt` [P] in one step, then n_decode greedy steps, through a paged cache
    (this script's own loop, not the engine's) -> (prefill s, decode s, tokens [n_decode + 1])."""
    import torch

    from musespark.layers.attention import AttentionContext, KVGroup

    cfg, dev = model.config, model.device
    P = prompt.shape[0]
    nb = (P + n_decode) // block_size + 2
    kv = [
        tuple(
            torch.zeros(nb, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=model.dtype, device=dev)
            for _ in range(2)
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    table = torch.arange(nb, device=dev)[None, :]  # identity: slot = position

    def step(ids, start: int):
        pos = torch.arange(start, start + ids.shape[0], device=dev)
        ctx = AttentionContext(
            query_start_loc=[0, ids.shape[0]],
            seq_lens=[start + ids.shape[0]],
            kv_caches=kv,
            groups=[KVGroup(slot_mapping=pos, block_tables=table)],
            layer_group=[0] * cfg.num_hidden_layers,
        )
        hidden = model(ids, pos, ctx)
        return model.compute_logits(hidden[-1:]).argmax(-1)  # [1], stays on the device

    out = []
    with torch.inference_mode():
        sync(dev)
        t0 = time.perf_counter()
        tok = step(prompt, 0)
        sync(dev)
        t1 = time.perf_counter()
        out.append(tok)
        for i in range(n_decode):
            tok = step(tok, P + i)
            out.append(tok)
        sync(dev)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.cat(out).tolist()


def model_section(run: Run, args: argparse.Namespace, toy: bool) -> None:
    import torch

    from musespark.backends import select_backend
    from musespark.bench.presets import active_weight_bytes, count_params
    from musespark.config import ModelConfig
    from musespark.model import load_model

    dev = run.device
    cfg = ModelConfig(**model_fields(args.layers, toy))
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    ckpt = work / f"random-{args.layers}l"
    if not (ckpt / "config.json").is_file():
        run.section("write the random checkpoint", lambda: write_checkpoint(cfg, ckpt, dev, args.seed))
    counts = count_params(cfg)
    run.out["model"] = {"config": model_fields(args.layers, toy), "params": counts.as_dict(), "checkpoint": str(ckpt)}
    gen = torch.Generator().manual_seed(args.seed + 1)
    parity_ids = torch.randint(3, cfg.vocab_size, (args.parity_len,), generator=gen).tolist()
    parity: dict[str, Any] = {}
    run.out["model_parity"] = parity

    def fp32_parity():
        m = load_model(ckpt, dtype="float32", device=dev, backend="torch")
        ref = m.prompt_logits(parity_ids)
        m.backend = select_backend("triton", m)
        ours = m.prompt_logits(parity_ids)
        run.check(
            parity,
            "fp32.triton_vs_torch",
            rel(ours, ref),
            MODEL_FP32_TOL,
            argmax_agree=float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
        )
        del m
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        return ref.cpu()

    exact = run.section("model parity fp32", fp32_parity)
    state: dict[str, Any] = {}

    def bf16_parity():
        m = load_model(ckpt, dtype="bfloat16", device=dev, backend="torch")
        ref = m.prompt_logits(parity_ids).cpu()
        m.backend = select_backend("triton", m)
        ours = m.prompt_logits(parity_ids).cpu()
        entry = {
            "triton_vs_torch": rel(ours, ref),
            "triton_vs_torch_mean": mean_rel(ours, ref),
            "argmax_agree": float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
        }
        if exact is not None:
            entry.update(
                triton_vs_fp32=rel(ours, exact),
                torch_vs_fp32=rel(ref, exact),
                triton_vs_fp32_mean=mean_rel(ours, exact),
                torch_vs_fp32_mean=mean_rel(ref, exact),
            )
            entry["ok"] = bool(
                entry["triton_vs_fp32"] <= 1.5 * entry["torch_vs_fp32"] + 1e-3
                and entry["triton_vs_fp32_mean"] <= 1.25 * entry["torch_vs_fp32_mean"] + 1e-3
            )
            run.out["ok"] &= entry["ok"]
        parity["bf16"] = entry
        print(f"   bf16: {entry}", flush=True)
        state["model"], state["ref"] = m, ref

    run.section("model parity bf16", bf16_parity)
    model = state.get("model")
    if model is None:
        return

    timing: dict[str, Any] = {}
    run.out["timing"] = timing
    prompt = torch.randint(3, cfg.vocab_size, (args.prefill,), generator=gen).to(dev)

    def time_ours(backend: str):
        model.backend = select_backend(backend, model)
        paged_generate(model, prompt[:64], 2)  # warm-up: compiles the kernels for these shapes
        paged_generate(model, prompt, 2)
        pre, dec, toks = [], [], None
        for _ in range(args.repeats):
            p, d, toks = paged_generate(model, prompt, args.decode_steps)
            pre.append(p)
            dec.append(d)
        timing[backend] = {
            "prefill_s": statistics.median(pre),
            "prefill_tok_s": args.prefill / statistics.median(pre),
            "decode_tok_s": args.decode_steps / statistics.median(dec),
            "tokens": toks[:8],
        }
        print(f"   {backend}: {timing[backend]}", flush=True)

    run.section("time musespark (triton backend)", lambda: time_ours("triton"))
    run.section("time musespark (torch backend)", lambda: time_ours("torch"))
    if "triton" in timing and "torch" in timing:
        timing["same_greedy_tokens"] = timing["triton"]["tokens"] == timing["torch"]["tokens"]
    model = state["model"] = None  # free it before transformers loads (the closures above are done)
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    if not args.skip_hf:
        run.section(
            "time transformers", lambda: time_hf(run, args, ckpt, prompt.cpu(), parity_ids, state["ref"], timing)
        )

    def roofline():
        bw = copy_bandwidth(dev, toy)
        flops_s = gemm_flops(dev, toy)
        active = active_weight_bytes(cfg, torch.bfloat16)
        decode_roof = bw / active
        total_bytes = (counts.total - counts.embedding) * 2
        flops = prefill_flops(cfg, args.prefill)
        prefill_roof_s = max(total_bytes / bw, flops / flops_s)
        roof = {
            "copy_bandwidth_bytes_per_s": bw,
            "bf16_gemm_flop_per_s": flops_s,
            "active_weight_bytes": active,
            "decode_tok_s": decode_roof,
            "prefill_s": prefill_roof_s,
            "prefill_flops": flops,
        }
        for t in timing.values():
            if isinstance(t, dict) and "decode_tok_s" in t:
                t["decode_pct_of_roofline"] = 100 * t["decode_tok_s"] / decode_roof
                t["prefill_pct_of_roofline"] = 100 * prefill_roof_s / t["prefill_s"]
        run.out["roofline"] = roof
        print(f"   {roof}", flush=True)

    run.section("roofline", roofline)


def time_hf(run: Run, args: argparse.Namespace, ckpt: Path, prompt, parity_ids, ours_ref, timing: dict) -> None:
    import torch

    try:
        import transformers
        from transformers import MuseSparkForConditionalGeneration
    except ImportError as e:
        timing["transformers"] = {"skipped": f"not importable: {e}"}
        return
    dev = run.device
    transformers.utils.logging.set_verbosity_error()
    hf = MuseSparkForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.bfloat16).to(dev).eval()
    with torch.inference_mode():
        hf_logits = hf(input_ids=torch.tensor([parity_ids], device=dev)).logits[0].float().cpu()
    run.out["model_parity"]["bf16_torch_vs_transformers"] = {
        "rel": rel(ours_ref, hf_logits),
        "mean_rel": mean_rel(ours_ref, hf_logits),
        "argmax_agree": float((ours_ref.argmax(-1) == hf_logits.argmax(-1)).float().mean()),
    }
    ids = prompt[None, :].to(dev)

    def gen(n: int) -> float:
        sync(dev)
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                use_cache=True,
                pad_token_id=0,
            )
        sync(dev)
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t

    gen(2)  # warm-up
    pre = [gen(1) for _ in range(args.repeats)]
    full = [gen(args.decode_steps + 1) for _ in range(args.repeats)]
    p = statistics.median(pre)
    timing["transformers"] = {
        "version": transformers.__version__,
        "prefill_s": p,
        "prefill_tok_s": args.prefill / p,
        "decode_tok_s": args.decode_steps / max(1e-9, statistics.median(full) - p),
        "experts_implementation": getattr(hf.config.get_text_config(), "_experts_implementation", None),
    }
    print(f"   transformers: {timing['transformers']}", flush=True)
    hf = None  # free it (gen above is done)
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(dev, toy: bool) -> float:
    """Device copy bandwidth, bytes/s (read + write), best of 10 copies."""
    import torch

    n = 1 << 20 if toy else 1 << 29  # fp32 elements: 4 MiB / 2 GiB
    x = torch.ones(n, dtype=torch.float32, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    best = math.inf
    for _ in range(10):
        sync(dev)
        t = time.perf_counter()
        y.copy_(x)
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best


def gemm_flops(dev, toy: bool) -> float:
    """Measured bf16 GEMM FLOP/s (best of 5 square products), the prefill's compute roof."""
    import torch

    n = 256 if toy else 8192
    a = torch.randn(n, n, device=dev).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev).to(torch.bfloat16)
    a @ b
    best = math.inf
    for _ in range(5):
        sync(dev)
        t = time.perf_counter()
        a @ b
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def prefill_flops(cfg, T: int) -> float:
    """Matmul FLOPs of a T-token prefill: 2 x active parameters (embedding excluded) per token,
    plus QK^T and PV over the keys each query sees (causal; windows on sliding layers)."""
    from musespark.bench.presets import count_params

    c = count_params(cfg)
    flops = 2.0 * T * (c.active)
    for i in range(cfg.num_hidden_layers):
        w = cfg.sliding_window if cfg.is_sliding(i) else None
        keys = sum(min(p + 1, w) if w else p + 1 for p in range(T))
        flops += 4.0 * cfg.num_attention_heads * cfg.head_dim * keys
    return flops


# -- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        args.layers, args.prefill, args.decode_steps, args.parity_len, args.repeats = 2, 24, 3, 12, 1
    import platform

    import torch

    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("gpu_check needs a CUDA device (or --dry-run-cpu)", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.dry_run_cpu else "cuda")
    run = Run(dev)
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError as e:
        env["triton"] = None
        run.out["ok"] = False
        run.out["errors"].append(f"triton: {e}")
    try:
        from musespark.bench.common import git_commit

        env["commit"] = git_commit()
    except Exception:  # noqa: BLE001 - informational only
        env["commit"] = None
    run.out["env"] = env
    if env["triton"] is not None:
        if not args.skip_kernels:
            run.out["kernels"] = run.section(
                "kernel parity", lambda: kernel_checks(run, TOY if args.dry_run_cpu else REAL, args.seed)
            )
        if not args.skip_model:
            run.section("model", lambda: model_section(run, args, args.dry_run_cpu))
            if args.workdir is None and run.out.get("model"):
                import shutil

                shutil.rmtree(Path(run.out["model"]["checkpoint"]).parent, ignore_errors=True)
    print(json.dumps(run.out, default=str))
    return 0 if run.out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
