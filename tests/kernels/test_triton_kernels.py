"""The Triton kernels (`musespark.kernels.triton`) against their torch references
(`musespark.backends.triton_reference`), on CPU
under Triton's interpreter (TRITON_INTERPRET=1, set below before the kernels are imported),
at small sizes with random inputs (norm weights, gates and biases randomized too).

Tolerances (relative: max |ours - ref| / max |ref|):
* fp32: 1e-5 for every kernel (measured: at most 3.1e-7; only fp32 summation order differs).
* bf16: every kernel rounds to bf16 where the reference does, so a result may differ from the
  reference by one bf16 rounding (an fp32 sum in another order falls on the other side of a
  rounding boundary): 8e-3 (2 ulp of bf16, relative to the largest |value|). Measured: 0 for
  the QK-norm/RoPE, O-gate and attention outputs except one decode case at 2.5e-3 (1 ulp);
  <= 2.4e-7 for outputs kept in fp32 (stream, norms to fp32, routing weights, and the experts'
  fp32 sum, whose bf16 intermediates round as the reference's on these inputs).
* The whole model (4 layers: dense and sparse, sliding and full, RoPE and NoPE; whole prompts
  and chunked prefill + decode through a paged cache): fp32 1e-4 (measured 4.8e-6: per-step
  ulp differences grow through the random layers). bf16 is judged against the fp32 model,
  since one bf16 ulp anywhere moves random-weight logits far (the torch backend's bf16
  logits are 0.6-0.7 max / 0.12-0.25 mean relative away from fp32): the triton backend's
  bf16 logits must be no further from fp32 than 1.5x (max) and 1.25x (mean) the torch
  backend's (measured 1.00-1.01x max, 0.95x mean), and within 0.3 max / 0.1 mean of the torch
  backend's bf16 logits (measured 0.09-0.13 max, 0.04-0.06 mean).

Without triton installed the module is skipped with a message naming it. On a GPU the same
checks at real sizes are `benchmarks/gpu_check.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined (decoration time)

import pytest  # noqa: E402
import torch  # noqa: E402

from musespark.kernels.triton import available  # noqa: E402

if not available():
    pytest.skip(
        "triton is not installed (pip install triton; the kernels are tested under TRITON_INTERPRET=1)",
        allow_module_level=True,
    )

from musespark.kernels.triton import attention, experts, norm_residual, o_norm_gate, qk_norm_rope, routing  # noqa: E402
from musespark.kernels.triton._common import interpreted  # noqa: E402

if not interpreted():
    pytest.skip(
        "the triton kernels were imported without TRITON_INTERPRET=1: they cannot run on CPU tensors",
        allow_module_level=True,
    )

from musespark.backends import select_backend  # noqa: E402
from musespark.backends.triton_backend import attention_args  # noqa: E402
from musespark.backends.triton_reference import (  # noqa: E402
    reference_moe_experts,
    reference_norm_residual,
    reference_o_norm_gate,
    reference_paged_attention,
    reference_qk_norm_rope,
    reference_rms_norm,
    reference_route,
)
from musespark.config import ModelConfig  # noqa: E402
from musespark.layers.attention import AttentionContext, KVGroup  # noqa: E402
from musespark.layers.moe import ROUTER_EPS  # noqa: E402
from musespark.layers.rotary import cos_sin, inv_frequencies  # noqa: E402
from musespark.model import MuseSparkForCausalLM, init_random_weights  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def mean_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().mean() / ref.float().abs().mean())


def close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    err = rel(ours, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]}"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- 1. norm -> gated residual -> next norm ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("post_gain,next_norm", [(False, True), (True, True), (True, False)])
def test_norm_residual(dtype, post_gain, next_norm):
    g = gen(1)
    T, H = 5, 40  # H not a power of two: masked lanes
    s = torch.randn(T, H, generator=g) * 3
    b = (torch.randn(T, H, generator=g) * 7).to(dtype)
    w = torch.randn(H, generator=g) / 0.3  # residual gate -> alpha, beta as layers/norm.ResidualGate
    beta, alpha = torch.sigmoid(w), torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1 + torch.sigmoid(w)), min=1e-3))
    pg = 1 + 0.2 * torch.randn(H, generator=g) if post_gain else None
    ng = 1 + 0.2 * torch.randn(H, generator=g)
    args = (s, b, alpha, beta, 1e-8, pg, ng, 1e-5, dtype, next_norm)
    (s1, h1), (s2, h2) = norm_residual.norm_residual(*args), reference_norm_residual(*args)
    close(s1, s2, torch.float32, "stream")  # the stream is fp32 in any model dtype
    if next_norm:
        close(h1, h2, dtype, "next norm")
    else:
        assert h1 is None and h2 is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(dtype, weighted):
    g = gen(2)
    x = (torch.randn(6, 24, generator=g) * 5).to(dtype)
    gain = 1 + 0.2 * torch.randn(24, generator=g) if weighted else None
    for out_dtype in (dtype, torch.float32):
        close(
            norm_residual.rms_norm(x, 1e-5, gain, out_dtype),
            reference_rms_norm(x, 1e-5, gain, out_dtype),
            out_dtype,
            f"rms_norm -> {out_dtype}",
        )


# -- 2. QK-norm + RoPE + paged KV write ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "nope"])
def test_qk_norm_rope_and_kv_write(dtype, rope):
    g = gen(3)
    T, heads, D, blocks, bs = 6, 3, 12, 5, 4
    x = (torch.randn(T, heads, D, generator=g) * 4).to(dtype)
    v = torch.randn(T, heads, D, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 7, 8, 30, 2047])
    rotary = cos_sin(positions, inv_frequencies(10000.0, D)) if rope else None
    close(
        qk_norm_rope.qk_norm_rope(x, 1e-5, 5.47, rotary, dtype),
        reference_qk_norm_rope(x, 1e-5, 5.47, rotary, dtype),
        dtype,
        "q",
    )
    slots = torch.tensor([17, 3, -1, 9, 0, 12])  # scattered; -1 is padding and writes nothing
    for cache_dtype in {dtype, torch.float32}:
        caches = [torch.randn(blocks, bs, heads, D, generator=g).to(cache_dtype) for _ in range(2)]
        ours_kc, ours_vc = (c.clone() for c in caches)
        ref_kc, ref_vc = (c.clone() for c in caches)
        ours = qk_norm_rope.qk_norm_rope(x, 1e-5, 1.0, rotary, dtype, v, slots, ours_kc, ours_vc)
        ref = reference_qk_norm_rope(x, 1e-5, 1.0, rotary, dtype, v, slots, ref_kc, ref_vc)
        close(ours, ref, dtype, "k")
        close(ours_kc, ref_kc, dtype, "k cache")
        assert torch.equal(ours_vc, ref_vc), "v cache: a copy, exactly"
        assert torch.equal(ours_kc[0, 2], caches[0][0, 2]), "an unmapped slot was written"


# -- 3. O-norm x sigmoid gate -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_o_norm_gate(dtype):
    g = gen(4)
    o = (torch.randn(7, 4, 12, generator=g) * 3).to(dtype)
    gate = (torch.randn(7, 4, 12, generator=g) * 2).to(dtype)
    close(o_norm_gate.o_norm_gate(o, gate, 1e-5), reference_o_norm_gate(o, gate, 1e-5), dtype, "o")


# -- 4. routing -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_routing(dtype):
    g = gen(5)
    T, H, E, k = 37, 40, 10, 3  # several programs of BLOCK_T rows; E not a power of two
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.randn(E, H, generator=g) * 2 / H**0.5
    bias = torch.randn(E, generator=g) * 0.1
    (wo, io), (wr, ir) = (
        routing.route_topk(x, w, bias, k, 0.177, 2.5, ROUTER_EPS),
        reference_route(x, w, bias, k, 0.177, 2.5),
    )
    assert torch.equal(io, ir), "the same experts, in increasing id"
    close(wo, wr, torch.float32, "routing weights")  # the router is fp32 in any model dtype


def test_routing_ties_go_to_the_lower_expert_id():
    """Exact ties in p + bias choose the lower id (as the native CPU kernel does; torch.topk
    leaves ties unspecified, so the reference is checked on the chosen scores only)."""
    g = gen(6)
    H, E = 16, 8
    w = torch.randn(E, H, generator=g)
    w[5] = w[2]
    w[6] = w[2]
    w[7] = w[1]  # experts 2, 5, 6 tie; 1 and 7 tie
    bias = torch.zeros(E)
    x = torch.randn(12, H, generator=g)
    for k in (1, 2, 3, 4):
        wo, io = routing.route_topk(x, w, bias, k, 0.5, 1.0, ROUTER_EPS)
        wr, ir = reference_route(x, w, bias, k, 0.5, 1.0)
        p = torch.sigmoid(x @ w.T * 0.5)
        for t in range(x.shape[0]):
            chosen = set(io[t].tolist())
            # lower id on ties: an unchosen expert never ties a chosen one of higher id
            for e in set(range(E)) - chosen:
                assert not any(c > e and bool(p[t, c] == p[t, e]) for c in chosen), (t, io[t])
        # equal scores, equal weights, whichever of the tied ids
        close(wo.sort(1).values, wr.sort(1).values, torch.float32, f"weights k={k}")
        assert torch.equal(p.gather(1, io).sort(1).values, p.gather(1, ir).sort(1).values)


# -- 5. grouped experts, per-expert post-norm, ordered weighted sum ---------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts(dtype):
    g = gen(7)
    T, Hm, Im, E, k = 23, 24, 40, 7, 3
    u = (torch.randn(T, Hm, generator=g) * 2).to(dtype)
    gate_up = (torch.randn(E, 2 * Im, Hm, generator=g) / Hm**0.5).to(dtype)
    down = (torch.randn(E, Hm, Im, generator=g) / Im**0.5).to(dtype)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert E-1 gets no token
    ids[0] = torch.tensor([5, 0, 3])  # unsorted rows are allowed
    weights = torch.rand(T, k, generator=g)
    gain = 1 + 0.2 * torch.randn(Hm, generator=g)
    ref = reference_moe_experts(u, weights, ids, gate_up, down, gain, 1e-8)
    for block_m, block_n in ((16, 64), (4, 16)):  # one tile per expert; several tiles and column blocks
        ours = experts.moe_experts(u, weights, ids, gate_up, down, gain, 1e-8, block_m=block_m, block_n=block_n)
        # fp32 output, but in bf16 its intermediates are rounded to bf16 (gate, up, h, y): bf16 tolerance
        err = rel(ours, ref)
        assert err <= TOL[dtype], f"experts (block_m={block_m}): relative error {err:.2e}"


# -- 6. paged attention -----------------------------------------------------------------------


def _paged_case(dtype: torch.dtype, window: int | None, done: list[int], new: list[int], seed: int):
    """A flat batch: sequence b has done[b] cached tokens and new[b] queries (chunked prefill,
    decode, a fresh prompt); scattered block tables, out-of-window blocks poisoned (-1)."""
    g = gen(seed)
    nH, nKV, D, bs, nb = 4, 2, 12, 4, 48
    B = len(done)
    tables = torch.randperm(nb, generator=g)[: B * 10].view(B, 10).clone()
    pos = torch.cat([torch.arange(d, d + n) for d, n in zip(done, new)])
    seq = torch.repeat_interleave(torch.arange(B), torch.tensor(new))
    slots = tables[seq, pos // bs] * bs + pos % bs
    if window:
        for b in range(B):
            tables[b, : max(0, done[b] - window + 1) // bs] = -1
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    T = len(pos)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (nH, nKV, nKV))
    caches = (torch.randn(nb, bs, nKV, D, generator=g).to(dtype), torch.randn(nb, bs, nKV, D, generator=g).to(dtype))

    def ctx() -> AttentionContext:
        return AttentionContext(
            query_start_loc=qsl,
            seq_lens=[d + n for d, n in zip(done, new)],
            kv_caches=[(caches[0].clone(), caches[1].clone())],
            groups=[KVGroup(slot_mapping=slots, block_tables=tables)],
            layer_group=[0],
        )

    return q, k, v, pos, ctx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding"])
@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_paged_attention(dtype, window, batch):
    done, new = ([9, 13, 0, 21], [6, 1, 7, 1]) if batch == "mixed" else ([3, 17, 30], [1, 1, 1])
    q, k, v, pos, ctx = _paged_case(dtype, window, done, new, seed=8)
    c_ours, c_ref = ctx(), ctx()
    ours = attention.paged_attention(q, k, v, pos, *attention_args(c_ours, 0), 0.29, window)
    ref = reference_paged_attention(q, k, v, pos, c_ref, 0, 0.29, window)
    close(ours, ref, dtype, "attention")
    assert torch.equal(c_ours.kv_caches[0][0], c_ref.kv_caches[0][0]) and torch.equal(
        c_ours.kv_caches[0][1], c_ref.kv_caches[0][1]
    ), "the paged K/V write"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 4], ids=["full", "sliding"])
def test_attention_without_cache(dtype, window):
    g = gen(9)
    ctx = AttentionContext.for_prompts([5, 11])
    pos = torch.cat([torch.arange(5), torch.arange(11)])
    q, k, v = (torch.randn(16, h, 12, generator=g).to(dtype) for h in (4, 1, 1))  # GQA 4:1
    close(
        attention.paged_attention(q, k, v, pos, *attention_args(ctx, 0), 0.29, window),
        reference_paged_attention(q, k, v, pos, ctx, 0, 0.29, window),
        dtype,
        "attention",
    )


def test_attention_rows_do_not_depend_on_the_batch():
    """A chunk's last query gives the same output computed alone, as a decode row: the same key
    blocks in the same order (fully masked blocks change nothing). Within 1e-6 here, not
    bitwise: the interpreter's dot is numpy's matmul, whose BLAS rounds a row differently by
    its position in the tile (benchmarks/gpu_check.py checks it bitwise on a GPU)."""
    q, k, v, pos, ctx = _paged_case(torch.float32, 5, [9], [6], seed=10)
    c = ctx()
    chunk = attention.paged_attention(q, k, v, pos, *attention_args(c, 0), 0.29, 5)
    alone = AttentionContext(
        query_start_loc=[0, 1],
        seq_lens=c.seq_lens,
        kv_caches=c.kv_caches,
        groups=[KVGroup(slot_mapping=c.groups[0].slot_mapping[-1:], block_tables=c.groups[0].block_tables)],
        layer_group=[0],
    )
    row = attention.paged_attention(q[-1:], k[-1:], v[-1:], pos[-1:], *attention_args(alone, 0), 0.29, 5)
    assert rel(row[0], chunk[-1]) <= 1e-6


# -- the whole model through the triton backend -----------------------------------------------

CFG = ModelConfig(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    moe_hidden_size=24,
    moe_intermediate_size=32,
    num_local_experts=6,
    num_experts_per_tok=2,
    sliding_window=7,
    bos_token_id=1,
    eos_token_id=2,
    mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
    rope_theta=10000.0,
)  # layers 0-2 sliding with RoPE, layer 3 full attention and NoPE


def _model(dtype: torch.dtype, seed: int) -> MuseSparkForCausalLM:
    model = MuseSparkForCausalLM(CFG)
    init_random_weights(model, seed=seed)  # every parameter and persistent buffer randomized
    model = model.to(dtype).eval()
    model.materialize_constants()
    return model


def _paged_logits(model: MuseSparkForCausalLM, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits, the sequences computed together in chunks then decode steps
    through a paged cache with two KV groups (full and sliding layers)."""
    bs, nb = 4, 40
    kv = [
        tuple(torch.zeros(nb, bs, CFG.num_key_value_heads, CFG.head_dim, dtype=model.dtype) for _ in range(2))
        for _ in range(CFG.num_hidden_layers)
    ]
    perm = torch.randperm(nb, generator=gen(11))
    tables = [perm[:18].view(3, 6).clone(), perm[18:36].view(3, 6).clone()]
    layer_group = [0 if t == "full_attention" else 1 for t in CFG.layer_types]
    lengths = [len(s) for s in seqs]
    done, got = [0] * len(seqs), [[] for _ in seqs]
    for plan in [[5, 3, 9], [8, 12, 0]] + [[1, 1, 1]] * 8:
        plan = [min(p, n - d) for p, n, d in zip(plan, lengths, done)]
        if sum(plan) == 0:
            continue
        ids, pos, qsl = [], [], [0]
        for b, n in enumerate(plan):
            ids += seqs[b][done[b] : done[b] + n]
            pos += list(range(done[b], done[b] + n))
            qsl.append(qsl[-1] + n)
        positions = torch.tensor(pos)
        rows = torch.repeat_interleave(torch.arange(len(plan)), torch.tensor(plan))
        groups = [KVGroup(slot_mapping=t[rows, positions // bs] * bs + positions % bs, block_tables=t) for t in tables]
        ctx = AttentionContext(
            query_start_loc=qsl,
            seq_lens=[d + n for d, n in zip(done, plan)],
            kv_caches=kv,
            groups=groups,
            layer_group=layer_group,
        )
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(ids), positions, ctx))
        for b, n in enumerate(plan):
            got[b] += list(logits[qsl[b] : qsl[b] + n])
            done[b] += n
    return [torch.stack(g) for g in got]


@pytest.mark.slow
def test_model_forward_fp32_matches_the_torch_backend():
    model = _model(torch.float32, seed=3)
    seqs = [torch.randint(3, CFG.vocab_size, (n,), generator=gen(12)).tolist() for n in (19, 13, 11)]
    results = {}
    for name in ("torch", "triton"):
        model.backend = select_backend(name, model)
        results[name] = ([model.prompt_logits(s) for s in seqs], _paged_logits(model, seqs))
    assert type(model.backend).__name__ == "TritonBackend"
    for ours, ref in zip(results["triton"][0] + results["triton"][1], results["torch"][0] + results["torch"][1]):
        err = rel(ours, ref)
        assert err <= 1e-4, f"relative logit error {err:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("seed", [3, 4])
def test_model_forward_bf16_is_as_close_to_fp32_as_the_torch_backend(seed):
    ids = torch.randint(3, CFG.vocab_size, (19,), generator=gen(13)).tolist()
    exact = _model(torch.float32, seed).prompt_logits(ids)
    model = _model(torch.bfloat16, seed)
    ref = model.prompt_logits(ids)
    model.backend = select_backend("triton", model)
    ours = model.prompt_logits(ids)
    ours_err, ref_err = rel(ours, exact), rel(ref, exact)
    assert ours_err <= 1.5 * ref_err + 1e-3, f"bf16 triton {ours_err:.3f} vs torch {ref_err:.3f} from fp32"
    ours_mean, ref_mean = mean_rel(ours, exact), mean_rel(ref, exact)
    assert ours_mean <= 1.25 * ref_mean + 1e-3, f"mean: bf16 triton {ours_mean:.3f} vs torch {ref_mean:.3f}"
    assert rel(ours, ref) <= 0.3 and mean_rel(ours, ref) <= 0.1


def test_backend_selection():
    model = _model(torch.float32, seed=3)
    assert type(select_backend("auto", model)).__name__ != "TritonBackend"  # auto on CPU: unchanged
    code = (
        "import torch; from musespark.backends import select_backend; from musespark.config import ModelConfig;"
        "from musespark.model import MuseSparkForCausalLM;"
        "m = MuseSparkForCausalLM(ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, "
        "num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8, moe_hidden_size=8, "
        "moe_intermediate_size=8, num_local_experts=2, num_experts_per_tok=1, bos_token_id=1, eos_token_id=2))\n"
        "try:\n    select_backend('triton', m)\nexcept ValueError as e:\n    print('REFUSED', e)"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr
