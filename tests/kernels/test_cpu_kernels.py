"""The native CPU kernels (src/musespark/kernels), each against a plain-PyTorch
reference of the same formula, on awkward shapes; and the fallback without them."""

import os
import platform
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from musespark import env
from musespark.kernels import cpu
from musespark.kernels.cpu import PANEL_PATHS

ops = cpu.native_ops()


def test_kernels_build_on_an_avx2_linux_machine():
    # CI machines are x86-64 Linux with AVX2 and gcc: the kernels must really be in use there.
    if platform.machine() == "x86_64" and platform.system() == "Linux" and {"avx2", "fma"} <= cpu.cpu_flags():
        assert ops is not None
    else:
        assert ops is None


needs_ops = pytest.mark.skipif(ops is None, reason="native kernels need x86-64 Linux with AVX2 (checked above)")


@needs_ops
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "M,N,K", [(1, 1, 8), (1, 13, 24), (2, 7, 40), (3, 64, 64), (5, 11, 48), (9, 37, 136), (64, 5, 1024)]
)
def test_linear_is_as_accurate_as_torch(wdtype, M, N, K, kernel_path):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w = torch.randn(N, K, generator=g).to(wdtype)
    x = torch.randn(M, K, generator=g).to(wdtype)
    exact = x.double() @ w.double().T
    ours = ops.linear_small_m(x, w)
    assert ours.dtype == wdtype and ours.shape == (M, N)
    theirs = F.linear(x, w)
    # Both round the fp32 sum once to the output dtype: ours may not be worse than torch's.
    err_ours = (ours.double() - exact).abs().max()
    err_torch = (theirs.double() - exact).abs().max()
    scale = exact.abs().max()
    assert err_ours <= 2 * err_torch + 1e-6 * scale, (float(err_ours), float(err_torch))


@needs_ops
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_a_row_never_depends_on_its_batch(wdtype, kernel_path):
    """Every tile shape, the remainder rows, the weight streams of products of up to three
    rows (csrc/gemm/avx2_tiles.h stream_rows; N = 9 and 70 leave 1 and 2 rows past the streams) and
    (K = 2048: 60-row chunks on the AVX-512 path, 30-row blocks of x on the fp32 tiles,
    weight_tiles) several x chunks give each row the bits it gets alone."""
    g = torch.Generator().manual_seed(7)
    for K, N in ((2048, 9), (200, 70)):
        w = torch.randn(N, K, generator=g).to(wdtype)
        x = torch.randn(130, K, generator=g).to(wdtype)
        alone = torch.cat([ops.linear_small_m(x[m : m + 1], w) for m in range(130)])
        for M in (2, 3, 4, 5, 6, 7, 13, 61, 130):
            assert torch.equal(ops.linear_small_m(x[:M], w), alone[:M]), (kernel_path, K, M)


@needs_ops
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_products_split_across_threads_give_the_one_thread_bits(wdtype, kernel_path):
    """A product's tiles start out split between the threads and the first thread done takes
    chunks from the back of the other's share (csrc/gemm/jobs.cpp TileRange), so which thread runs a
    tile changes from run to run: every run must still give every element the bits one
    thread gives, with no tile lost or run twice into the wrong place. (300 rows on the fp32
    tiles: two blocks of x, each take running its tiles over both, csrc/gemm/avx2_tiles.h weight_tiles.)"""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(3001, 264, generator=g).to(wdtype)
    packed = cpu.pack_panels(w) if wdtype == torch.bfloat16 and kernel_path in PANEL_PATHS else None
    cases = [
        (torch.randn(M, 264, generator=g).to(wdtype), rows)
        for M, rows in (
            (1, None),
            (3, None),
            (70, torch.ones(70, dtype=torch.bool)),
            (9, torch.arange(9) % 2 == 0),
            (300, None),
        )
    ]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [ops.linear_small_m(x, w, rows, packed) for x, rows in cases]
        torch.set_num_threads(2)
        for _ in range(10):
            for (x, rows), want in zip(cases, alone):
                assert torch.equal(ops.linear_small_m(x, w, rows, packed), want), (kernel_path, x.shape[0])
    finally:
        torch.set_num_threads(threads)


@needs_ops
@pytest.mark.parametrize("M,N,K", [(1, 1, 8), (3, 70, 40), (6, 64, 64), (13, 129, 1032), (70, 200, 2056)])
def test_prompt_rows_are_as_accurate_as_torch_and_never_depend_on_their_batch(M, N, K, kernel_path):
    """Prompt rows (`prompt_rows` true) take the panel kernel on the AVX-512 path
    (kernels/csrc/gemm/jobs.cpp split_prompt_runs): as accurate as torch's product, each row the bits
    it gets alone or next to other rows of either kind, whatever the run boundaries (K over
    1024: several packed chunks; N over 64: several panels, a partial last one)."""
    g = torch.Generator().manual_seed(M * 7 + N + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    exact = x.double() @ w.double().T
    prompt = torch.ones(M, dtype=torch.bool)
    ours = ops.linear_small_m(x, w, prompt)
    err_ours = (ours.double() - exact).abs().max()
    err_torch = (F.linear(x, w).double() - exact).abs().max()
    assert err_ours <= 2 * err_torch + 1e-6 * exact.abs().max(), (float(err_ours), float(err_torch))
    alone = torch.cat([ops.linear_small_m(x[m : m + 1], w, prompt[:1]) for m in range(M)])
    assert torch.equal(ours, alone), kernel_path
    decode = ops.linear_small_m(x, w)
    mixed = torch.rand(M, generator=g) < 0.5
    assert torch.equal(ops.linear_small_m(x, w, mixed), torch.where(mixed[:, None], ours, decode))
    assert torch.equal(ops.linear_small_m(x, w, torch.zeros(M, dtype=torch.uint8)), decode)


@needs_ops
def test_prompt_rows_take_their_own_kernel_on_the_avx512_path(kernel_path):
    """The flag reaches the kernel: on the AVX-512 path a prompt row sums in another order
    than a decode row (some of 4096 bf16 outputs differ); on the AVX2 path it changes nothing.
    The second half of each weight row nearly cancels the first (x repeats its first half),
    so every output is far smaller than its partial sums and the fp32 rounding of those sums,
    which depends on the order, reaches the bf16 result (with plain random data a few of the
    4096 outputs differ, or none: on AMX hardware none did for seed 11)."""
    g = torch.Generator().manual_seed(11)
    half = torch.randn(256, 1024, generator=g)
    w = torch.cat([half, -half + 1e-3 * torch.randn(256, 1024, generator=g)], 1).bfloat16()
    x = torch.randn(16, 1024, generator=g).bfloat16().repeat(1, 2)
    prompt = ops.linear_small_m(x, w, torch.ones(16, dtype=torch.bool))
    decode = ops.linear_small_m(x, w)
    if kernel_path in PANEL_PATHS:
        assert not torch.equal(prompt, decode)
    else:
        assert torch.equal(prompt, decode)


@needs_ops
def test_prompt_rows_argument_is_checked():
    x, w = torch.randn(4, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="prompt_rows must be a contiguous bool or uint8 \\[4\\]"):
        ops.linear_small_m(x, w, torch.ones(3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="prompt_rows"):
        ops.linear_small_m(x, w, torch.ones(4, dtype=torch.float32))


@pytest.mark.parametrize("K", [6, 32, 76])
def test_pack_panels_lays_out_each_weight_pair_where_the_kernel_reads_it(K):
    """Panel p holds the bf16 bits of w[64p + c, 2q] (low half) and w[64p + c, 2q + 1] (high
    half) at its word 1024 g + 16 gp b + 16 r + c % 16 (pair q = 16 g + r, block b = c // 16,
    gp the pairs of group g: 16 or the last group's rest); rows past N are zero. Checked
    element by element, against the formula written out here, for a single short group (K 6),
    whole groups (K 32) and whole groups then a short one (K 76)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, K, generator=g).bfloat16()
    panels = cpu.pack_panels(w)
    assert panels.dtype == torch.int32 and panels.shape == (2, K // 2, 64) and panels.is_contiguous()
    bits = w.view(torch.int16).to(torch.int64) & 0xFFFF
    seen = set()
    for p in range(2):
        words = panels[p].flatten()
        for q in range(K // 2):
            group, r = divmod(q, 16)
            gp = min(16, K // 2 - 16 * group)
            for c in range(64):
                n = 64 * p + c
                want = int(bits[n, 2 * q]) | int(bits[n, 2 * q + 1]) << 16 if n < 70 else 0
                at = 1024 * group + 16 * gp * (c // 16) + 16 * r + c % 16
                assert at == cpu.panel_word(q, c, K // 2)
                assert int(words[at]) & 0xFFFFFFFF == want, (p, q, c)
                seen.add((p, at))
    assert len(seen) == 2 * K // 2 * 64  # every word is some pair's
    with pytest.raises(ValueError, match="bfloat16 \\[N, K\\] weight with K even"):
        cpu.pack_panels(w.float())
    with pytest.raises(ValueError, match="K even"):
        cpu.pack_panels(torch.zeros(4, 5, dtype=torch.bfloat16))
    experts = torch.randn(3, 70, 6, generator=g).bfloat16()  # [E, N, K]: each expert's panels in turn
    packed = cpu.pack_panels(experts)
    assert packed.shape == (3, 2, 3, 64) and packed.is_contiguous()
    for e in range(3):
        assert torch.equal(packed[e], cpu.pack_panels(experts[e])), e
    with pytest.raises(ValueError, match="E, N, K"):
        cpu.pack_panels(torch.zeros(2, 3, 4, 6, dtype=torch.bfloat16))


@needs_ops
@pytest.mark.parametrize(
    "M,N,K", [(1, 1, 8), (3, 70, 40), (6, 64, 64), (13, 129, 1032), (70, 200, 2056), (533, 200, 264)]
)
def test_packed_panels_give_every_row_the_panel_kernels_bits(M, N, K, kernel_path):
    """A weight with its panels (`panels=pack_panels(w)`): on the AVX-512 path every row,
    prompt or not, takes the panel kernel on the packed copy: the bits a prompt row gets
    from the weight packed on the fly, alone or in any batch; on the AVX2 path the panels are
    ignored. Shapes: a partial last panel, several K chunks, several x tiles; 533 rows: on
    the AMX path two superblocks of 256 rows against several panels per call, then an odd
    block and a partial one (kernels/csrc/gemm/bf16_panels_amx.cpp), where the weight packed on the fly takes
    every row against one panel at a time."""
    g = torch.Generator().manual_seed(M * 5 + N + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    panels = cpu.pack_panels(w)
    got = ops.linear_small_m(x, w, None, panels)
    prompt = ops.linear_small_m(x, w, torch.ones(M, dtype=torch.bool))
    decode = ops.linear_small_m(x, w)
    if kernel_path in PANEL_PATHS:
        assert torch.equal(got, prompt)
    else:
        assert torch.equal(got, decode)
    mixed = torch.rand(M, generator=g) < 0.5  # flags change nothing on a packed weight
    assert torch.equal(ops.linear_small_m(x, w, mixed, panels), got)
    alone = torch.cat([ops.linear_small_m(x[m : m + 1], w, None, panels) for m in range(M)])
    assert torch.equal(alone, got)
    exact = x.double() @ w.double().T
    err_ours = (got.double() - exact).abs().max()
    err_torch = (F.linear(x, w).double() - exact).abs().max()
    assert err_ours <= 2 * err_torch + 1e-6 * exact.abs().max(), (float(err_ours), float(err_torch))
    head = ops.softcapped_logits(x, w, 0.7, 5.0, panels)
    assert torch.equal(head, 5.0 * torch.tanh(got.float() * 0.7 / 5.0))


@needs_ops
def test_panels_argument_is_checked():
    x, w = torch.randn(4, 16).bfloat16(), torch.randn(70, 16).bfloat16()
    good = cpu.pack_panels(w)
    for bad in (good.float(), good[:1], good.transpose(1, 2), good.view(2, 4, 128)):
        with pytest.raises(RuntimeError, match="linear_small_m: panels must be the contiguous int32 \\[2, 8, 64\\]"):
            ops.linear_small_m(x, w, None, bad)
    with pytest.raises(RuntimeError, match="panels go with a bfloat16 \\[N, K\\] weight"):
        ops.linear_small_m(x.float(), w.float(), None, good)


@needs_ops
def test_without_batch_invariance_prompt_sized_products_use_onednn(kernel_path):
    """MUSESPARK_BATCH_INVARIANT=0 (here: the op) sends bf16 products of >= 64 rows to
    oneDNN on AVX-512-BF16 CPUs: the result is then torch's own bf16 product, bit for bit;
    smaller products (and every product on the AVX2 path) keep the invariant kernels."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 256, generator=g).bfloat16()
    x = torch.randn(80, 256, generator=g).bfloat16()
    invariant = ops.linear_small_m(x, w)
    before = ops.set_batch_invariant(False)
    try:
        fast = ops.linear_small_m(x, w)
        small = ops.linear_small_m(x[:63], w)
    finally:
        ops.set_batch_invariant(before)
    assert torch.equal(small, invariant[:63])
    if kernel_path in PANEL_PATHS:
        assert torch.equal(fast, x @ w.T)
    else:
        assert torch.equal(fast, invariant)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N", [(1, 13), (3, 64), (7, 1001), (40, 3000)])
def test_softcapped_logits_are_torchs_softcap_of_the_head(dtype, M, N, kernel_path):
    """cap * tanh(y * m / cap) on linear_small_m's y (bf16-rounded for a bf16 head): the same
    bits as torch's ops on that y, tails (M * N % 8) and multi-threaded sizes included; NaN
    stays NaN."""
    g = torch.Generator().manual_seed(M * 7 + N)
    w = torch.randn(N, 64, generator=g).to(dtype)
    x = (torch.randn(M, 64, generator=g) * 3).to(dtype)
    multiplier, cap = 0.7, 5.0
    expected = cap * torch.tanh(ops.linear_small_m(x, w).float() * multiplier / cap)
    got = ops.softcapped_logits(x, w, multiplier, cap)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert torch.equal(got, expected)
    nan = ops.softcapped_logits(torch.full((1, 64), float("nan")).to(dtype), w, multiplier, cap)
    assert nan.isnan().all()


@needs_ops
def test_linear_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.linear_small_m(torch.randn(1, 12), torch.randn(4, 12))
    with pytest.raises(RuntimeError, match="K="):
        ops.linear_small_m(torch.randn(1, 16), torch.randn(4, 24))


def _attention_reference(q, k_cache, v_cache, tables, seq_lens, window, scale):
    out = []
    bs = k_cache.shape[1]
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = tables[b, pos // bs] * bs + pos % bs
        k = k_cache.flatten(0, 1)[slots].float()  # [n, nKV, D]
        v = v_cache.flatten(0, 1)[slots].float()
        first = max(0, n - window) if window else 0
        k, v = k[first:], v[first:]
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k.double()) * scale
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v.double()))
    return torch.stack(out)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
def test_paged_decode_attention_matches_dense_softmax(dtype, window, heads):
    nH, nKV = heads
    D, bs, nblocks = 16, 4, 32
    g = torch.Generator().manual_seed(nH * 10 + nKV + window)
    k_cache = torch.randn(nblocks, bs, nKV, D, generator=g).to(dtype)
    v_cache = torch.randn(nblocks, bs, nKV, D, generator=g).to(dtype)
    seq_lens = [1, 7, 13, 4]
    tables = torch.randperm(nblocks, generator=g)[:16].view(4, 4).clone()
    if window:  # blocks wholly before the window are released: never read
        for b, n in enumerate(seq_lens):
            tables[b, : max(0, n - window) // bs] = -1
    q = torch.randn(4, nH, D, generator=g)
    scale = 0.3
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens), window, scale)
    want = _attention_reference(q, k_cache, v_cache, tables, seq_lens, window, scale)
    assert (got.double() - want).abs().max() < 1e-5


@needs_ops
@pytest.mark.parametrize("D", [32, 64, 96])
@pytest.mark.parametrize("heads", [(16, 4), (6, 2), (3, 1), (8, 8), (40, 4)])
@pytest.mark.parametrize("window", [0, 37])
def test_bf16_decode_attention_on_every_path(D, heads, window, kernel_path):
    """A bf16 model's decode rows (bf16 cache, bf16-valued queries): the AVX-512 path
    (vdpbf16ps scores, 16-lane softmax) and the AVX2 one both match float64, over sequences
    long and short enough to hit every key-group, prefetch and softmax tail; each row alone
    gives the bits it gives in the batch."""
    nH, nKV = heads
    bs, B = 16, 5
    g = torch.Generator().manual_seed(D + nH + window)
    seq_lens = [1, 15, 17, 130, 300]
    per = [(n + bs - 1) // bs for n in seq_lens]
    nblocks = sum(per) + 3
    k_cache = torch.randn(nblocks, bs, nKV, D, generator=g).bfloat16()
    v_cache = torch.randn(nblocks, bs, nKV, D, generator=g).bfloat16()
    order = torch.randperm(nblocks, generator=g).tolist()
    tables = torch.zeros(B, max(per), dtype=torch.long)
    for b, n in enumerate(per):
        tables[b, :n] = torch.tensor(order[:n])
        order = order[n:]
    q = (torch.randn(B, nH, D, generator=g) * 2).bfloat16().float()
    scale = D**-0.5
    lens = torch.tensor(seq_lens)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, window, scale)
    want = _attention_reference(q, k_cache, v_cache, tables, seq_lens, window, scale)
    assert (got.double() - want).abs().max() < 2e-5, kernel_path
    for b in (0, 3):
        alone = ops.paged_decode_attention(
            q[b : b + 1].contiguous(),
            k_cache,
            v_cache,
            tables[b : b + 1].contiguous(),
            lens[b : b + 1].contiguous(),
            window,
            scale,
        )
        assert torch.equal(alone[0], got[b])


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [0, 9])
def test_paged_decode_step_is_the_write_then_the_decode_kernel(dtype, window, kernel_path):
    """The one-call decode step writes k, v at the slots and returns, in q's dtype, exactly
    what index_copy_ + paged_decode_attention (fp32 q) + rounding return: the same caches
    and the same bits."""
    nH, nKV, D, bs = 8, 2, 32, 4
    g = torch.Generator().manual_seed(window + (dtype == torch.bfloat16))
    seq_lens = [1, 6, 23, 12]
    B = len(seq_lens)
    nblocks = 40
    k_cache = torch.randn(nblocks, bs, nKV, D, generator=g).to(dtype)
    v_cache = torch.randn(nblocks, bs, nKV, D, generator=g).to(dtype)
    order = torch.randperm(nblocks, generator=g)
    tables = order[: B * 8].view(B, 8).clone()
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(seq_lens)])
    q = torch.randn(B, nH, D, generator=g).to(dtype)
    k = torch.randn(B, nKV, D, generator=g).to(dtype)
    v = torch.randn(B, nKV, D, generator=g).to(dtype)
    lens = torch.tensor(seq_lens)
    kc, vc = k_cache.clone(), v_cache.clone()
    kc.view(-1, nKV, D).index_copy_(0, slots, k)
    vc.view(-1, nKV, D).index_copy_(0, slots, v)
    want = ops.paged_decode_attention(q.float(), kc, vc, tables, lens, window, 0.2).to(dtype)
    got = ops.paged_decode_step(q, k, v, k_cache, v_cache, slots, tables, lens, window, 0.2)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)


@needs_ops
def test_paged_decode_step_names_the_bad_argument():
    k_cache = torch.zeros(4, 4, 2, 16).bfloat16()
    q, k = torch.zeros(1, 4, 16).bfloat16(), torch.zeros(1, 2, 16).bfloat16()
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="slot_mapping\\[0\\]=16 is outside the cache"):
        ops.paged_decode_step(q, k, k, k_cache, k_cache.clone(), torch.tensor([16]), tables, lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="q must be contiguous .* in the cache's dtype"):
        ops.paged_decode_step(q.float(), k, k, k_cache, k_cache.clone(), torch.tensor([2]), tables, lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="block_tables\\[0, 0\\]=7 is not a block of the cache"):
        ops.paged_decode_step(
            q, k, k, k_cache, k_cache.clone(), torch.tensor([2]), torch.tensor([[7, 1]]), lens, 0, 1.0
        )


def _chunk_attention_reference(q, k, v, q0, k0, window, scale, dtype=torch.float64):
    n, m = q.shape[0], k.shape[0]
    qp, kp = torch.arange(q0, q0 + n), torch.arange(k0, k0 + m)
    mask = kp[None, :] <= qp[:, None]
    if window:
        mask &= kp[None, :] > qp[:, None] - window
    groups = q.shape[1] // k.shape[1]
    q4, k4, v4 = (t.to(dtype).transpose(0, 1)[None] for t in (q, k, v))
    k4, v4 = k4.repeat_interleave(groups, 1), v4.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)[0].transpose(0, 1)


@needs_ops
@pytest.mark.parametrize(
    "n,m,q0,k0,heads,D,window",
    [
        (37, 37, 0, 0, (4, 2), 64, 0),  # a fresh prompt
        (50, 80, 30, 0, (8, 2), 32, 0),  # a chunk after a cached prefix
        (100, 100, 0, 0, (4, 4), 128, 17),  # sliding window
        (9, 40, 31, 0, (2, 1), 16, 8),  # window, prefix, one KV head
        (33, 26, 50, 57, (4, 2), 48, 20),  # keys starting past 0 (a window's band)
        (5, 5, 0, 0, (2, 2), 256, 0),
        # long enough for pairs of key blocks that every row of a tile reaches (no masks)
        (200, 260, 60, 0, (4, 1), 64, 0),
        (300, 300, 0, 0, (8, 2), 64, 100),
    ],
)
def test_prefill_attention_matches_sdpa(n, m, q0, k0, heads, D, window, kernel_path):
    """bf16 in, bf16 out: no further from a float64 evaluation than PyTorch's own bf16 SDPA
    (x1.25 + 1 bf16 ulp of the output scale); both round P to bf16 before P V."""
    if kernel_path not in PANEL_PATHS:
        pytest.skip("prefill_attention runs on the avx512_bf16 path only (SDPA elsewhere)")
    g = torch.Generator().manual_seed(n + m + D)
    nH, nKV = heads
    q, k, v = (torch.randn(r, h, D, generator=g).bfloat16() for r, h in ((n, nH), (m, nKV), (m, nKV)))
    ours = ops.prefill_attention(q, k, v, q0, k0, window, D**-0.5)
    exact = _chunk_attention_reference(q, k, v, q0, k0, window, D**-0.5)
    sdpa = _chunk_attention_reference(q, k, v, q0, k0, window, D**-0.5, torch.bfloat16)
    err, err_sdpa = (ours.double() - exact).abs().max(), (sdpa.double() - exact).abs().max()
    assert ours.shape == q.shape and ours.dtype == torch.bfloat16
    assert err <= 1.25 * err_sdpa + exact.abs().max() / 128, (float(err), float(err_sdpa))
    # Each row alone: a shorter chunk gives the same rows (batch invariance within a sequence).
    assert torch.equal(ops.prefill_attention(q[: n // 2], k, v, q0, k0, window, D**-0.5), ours[: n // 2])


@needs_ops
@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
@pytest.mark.parametrize("input_scaled", [False, True])
def test_rms_norm_matches_the_formula(in_dtype, out_dtype, input_scaled):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 40, generator=g) * 3).to(in_dtype)
    gain = 1 + 0.2 * torch.randn(40, generator=g)
    eps, scale = 1e-5, 1.0 if input_scaled else 0.7
    xf = x.float()
    if input_scaled:
        v = xf * gain
        want = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    else:
        want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gain * scale
    got = ops.rms_norm(x, gain, eps, input_scaled, scale, out_dtype)
    assert got.dtype == out_dtype
    tol = 1e-6 if out_dtype == torch.float32 else 1e-2
    assert (got.float() - want).abs().max() <= tol * want.abs().max()
    plain = ops.rms_norm(x, None, eps, False, 1.0, torch.float32)
    assert torch.allclose(plain, xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), rtol=1e-6, atol=1e-6)


@needs_ops
def test_prompt_sized_outputs_reuse_freed_blocks_and_never_live_ones():
    """The ops' outputs of 1 MiB and more come from blocks kept across calls (kernels/csrc/common/pool.h):
    one freed is handed to the next output of its size; one alive never is."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 1024, generator=g)  # a 2 MiB fp32 output
    first = ops.rms_norm(x, None, 1e-6, False, 1.0, torch.float32)
    kept, where = first.clone(), first.data_ptr()
    second = ops.rms_norm(x * 2, None, 1e-6, False, 1.0, torch.float32)
    assert second.data_ptr() != where and torch.equal(first, kept)  # the live one is untouched
    del first
    third = ops.rms_norm(x, None, 1e-6, False, 1.0, torch.float32)
    assert third.data_ptr() == where and torch.equal(third, kept)
    small = ops.rms_norm(x[:8], None, 1e-6, False, 1.0, torch.float32)  # below 1 MiB: at::empty's
    assert torch.equal(small, kept[:8])


def _random_model(seed: int, **overrides):
    from musespark.config import ModelConfig
    from musespark.model import MuseSparkForCausalLM, init_random_weights

    fields = dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_hidden_size=24,
        moe_intermediate_size=40,
        num_local_experts=6,
        num_experts_per_tok=3,
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        sliding_window=4,
    )
    fields.update(overrides)
    model = MuseSparkForCausalLM(ModelConfig(**fields))
    init_random_weights(model, seed=seed)
    return model.to(torch.bfloat16).eval()


def _backends(model):
    from musespark.backends import select_backend

    return select_backend("torch", model), select_backend("cpu", model)


@needs_ops
@pytest.mark.parametrize("T", [1, 7])
def test_fused_layers_match_the_module_path(T, kernel_path):
    """Every fused decoder layer (bf16: attn_in, attention, attn_out, ffn_dense/ffn_moe)
    against the same layer through the PyTorch modules, from the same fp32 stream. Both
    round to bf16 at the same places; the router's fp32 GEMV (MKL vs the kernel) and
    sigmoid differ at rounding level, which can move one bf16 rounding by an ulp."""
    from musespark.layers.attention import AttentionContext

    model = _random_model(seed=T, moe_hidden_size=256, moe_intermediate_size=1024)
    reference, native = _backends(model)
    g = torch.Generator().manual_seed(T)
    s = torch.randn(T, model.config.hidden_size, generator=g) * 3
    positions = torch.arange(T)
    kinds, moved = set(), False
    with torch.inference_mode():
        for layer in model.layers:
            ctx = AttentionContext.for_prompts([T])
            want = layer(s, positions, ctx, {}, reference, torch.bfloat16)
            # Called on its own the layer's rows are decode rows; inside the model's step
            # (`Backend.step`) the context's prompt rows reach the products.
            decode = layer(s, positions, AttentionContext.for_prompts([T]), {}, native, torch.bfloat16)
            with native.step(ctx):
                prompt = layer(s, positions, ctx, {}, native, torch.bfloat16)
            for got in (decode, prompt):
                assert got.dtype == torch.float32 and got.shape == want.shape
                err = (got - want).abs()
                assert err.max() <= 2e-2 * want.abs().max(), f"layer {layer.self_attn.layer}"
                assert err.mean() <= 1e-3 * want.abs().mean(), f"layer {layer.self_attn.layer}"
            moved |= not torch.equal(prompt, decode)
            kinds.add((type(layer.mlp).__name__, layer.self_attn.window, layer.self_attn.rope_theta is None))
    assert len(kinds) >= 3  # dense and sparse; sliding and full; with and without rotary
    # On the AVX-512 path unpacked experts' prompt rows take the panel kernel, which sums in
    # another order than their decode rows' (packed weights: every row takes it): some bf16
    # value moves; with the experts packed too (cpu.expert_panels), nothing does.
    if T > 1:
        assert moved == (kernel_path in PANEL_PATHS and not native.weights.pack_experts), (moved, kernel_path)


@needs_ops
@pytest.mark.parametrize("T", [1, 4, 600])
def test_moe_results_do_not_depend_on_the_thread_count(T, kernel_path):
    """With several threads, bf16 experts on the AVX-512 path may run whole on one thread each
    (gather, gate/up, SwiGLU, down: csrc/blocks/ffn_block.cpp whole_expert_tasks; an expert of over
    256 rows as several tasks, which 600 tokens x 4 of 8 experts make); with one thread,
    their tiles run in turn. Each row meets the same kernel and tiles either way, so every
    bit agrees, for decode rows and for prompt rows (which take the panel kernel)."""
    from musespark.layers.attention import AttentionContext

    model = _random_model(
        seed=T, moe_hidden_size=64, moe_intermediate_size=96, num_local_experts=8, num_experts_per_tok=4
    )
    _, native = _backends(model)
    g = torch.Generator().manual_seed(T)
    s = torch.randn(T, model.config.hidden_size, generator=g) * 3
    sparse = [layer for layer in model.layers if type(layer.mlp).__name__ == "SparseMoeBlock"]
    threads = torch.get_num_threads()
    results = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.inference_mode():
                for layer in sparse:
                    results[n, layer, "decode"] = native.moe_ffn(layer, s, torch.bfloat16)
                    with native.step(AttentionContext.for_prompts([T])):
                        results[n, layer, "prompt"] = native.moe_ffn(layer, s, torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    for (n, layer, rows), got in results.items():
        if n == 2:
            assert torch.equal(got, results[1, layer, rows]), (layer.self_attn.layer, rows)
    assert not torch.equal(results[1, sparse[0], "decode"], results[1, sparse[1], "decode"])


@needs_ops
def test_the_cpu_backend_packs_dense_bf16_weights_for_the_avx512_path_only(kernel_path):
    """Dense bf16 linears and the head get their panels on the AVX-512 path (as many bytes
    again); expert weights only as MUSESPARK_EXPERT_PANELS says (tested below); fp32
    weights and the AVX2 path keep [weight] alone."""
    model = _random_model(seed=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(env.EXPERT_PANELS, "0")
        _, native = _backends(model)
    attn, moe = model.layers[0].self_attn, model.layers[1].mlp
    for linear in (attn.q_proj, attn.o_proj, moe.pre_expert_proj, model.lm_head):
        args = native.weights.linear(linear)
        assert args[0] is linear.weight
        if kernel_path in PANEL_PATHS:
            assert len(args) == 2 and torch.equal(args[1], cpu.pack_panels(linear.weight))
        else:
            assert len(args) == 1
    assert all(len(part) == 1 for part in native.weights.experts(moe.experts))
    _, native = _backends(model.float())
    assert len(native.weights.linear(attn.q_proj)) == 1


def test_expert_panels_policy(monkeypatch):
    """MUSESPARK_EXPERT_PANELS: 1 and 0 decide; auto packs while the copy fits in a quarter of
    the available memory; anything else is refused by name."""
    from musespark.bench.common import machine

    monkeypatch.setattr(cpu, "expert_panels_chosen", None)
    monkeypatch.setenv(env.EXPERT_PANELS, "1")
    assert cpu.expert_panels(1 << 60) and cpu.expert_panels_chosen is True
    assert machine()["expert_panels"] == "1: packed"  # what the benchmarks' JSON lines record
    monkeypatch.setenv(env.EXPERT_PANELS, "0")
    assert not cpu.expert_panels(1) and cpu.expert_panels_chosen is False
    assert machine()["expert_panels"] == "0: not packed"
    monkeypatch.delenv(env.EXPERT_PANELS)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert cpu.expert_panels(1 << 20) and not cpu.expert_panels(available)
    assert machine()["expert_panels"] == "auto: not packed"
    monkeypatch.setenv(env.EXPERT_PANELS, "yes")
    with pytest.raises(ValueError, match="MUSESPARK_EXPERT_PANELS='yes': expected 0, 1 or auto"):
        cpu.expert_panels(1)


@needs_ops
@pytest.mark.parametrize("T", [1, 5, 40])
def test_packed_experts_give_every_row_the_prompt_rows_bits(T, kernel_path, monkeypatch):
    """Experts packed into panels (MUSESPARK_EXPERT_PANELS=1): on the AVX-512 path every
    row, decode or prompt, takes the panel kernel on the packed copy, so it gets the bits a
    prompt row gets from the unpacked experts (panels packed on the fly), alone or in any
    batch, with one thread or two; on the AVX2 path nothing is packed and nothing changes."""
    from musespark.layers.attention import AttentionContext

    model = _random_model(
        seed=T + 11, moe_hidden_size=64, moe_intermediate_size=96, num_local_experts=8, num_experts_per_tok=4
    )
    monkeypatch.setenv(env.EXPERT_PANELS, "1")
    _, packed = _backends(model)
    monkeypatch.setenv(env.EXPERT_PANELS, "0")
    _, plain = _backends(model)
    sparse = [layer for layer in model.layers if type(layer.mlp).__name__ == "SparseMoeBlock"]
    gu, down = packed.weights.experts(sparse[0].mlp.experts)
    assert (len(gu), len(down)) == ((2, 2) if kernel_path in PANEL_PATHS else (1, 1))
    g = torch.Generator().manual_seed(T)
    s = torch.randn(T, model.config.hidden_size, generator=g) * 3
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for layer in sparse:
                with plain.step(AttentionContext.for_prompts([T])):
                    prompt = plain.moe_ffn(layer, s, torch.bfloat16)
                decode = plain.moe_ffn(layer, s, torch.bfloat16)
                want = prompt if kernel_path in PANEL_PATHS else decode
                for n in (1, 2):
                    torch.set_num_threads(n)
                    assert torch.equal(packed.moe_ffn(layer, s, torch.bfloat16), want), (n, layer.self_attn.layer)
                    with packed.step(AttentionContext.for_prompts([T])):
                        assert torch.equal(packed.moe_ffn(layer, s, torch.bfloat16), want)
                alone = torch.cat([packed.moe_ffn(layer, s[t : t + 1], torch.bfloat16) for t in range(T)])
                assert torch.equal(alone, want)
    finally:
        torch.set_num_threads(threads)


@needs_ops
def test_expert_panels_argument_is_checked(kernel_path, monkeypatch):
    """Expert panels that are not the packing of the experts (wrong shape, dtype or layout)
    are refused with the argument's name and the expected shape."""
    if kernel_path not in PANEL_PATHS:
        pytest.skip("expert panels exist on the avx512_bf16 path only; this CPU runs " + kernel_path)
    model = _random_model(seed=2)
    monkeypatch.setenv(env.EXPERT_PANELS, "1")
    _, native = _backends(model)
    layer = model.layers[1]
    args = list(native.args.ffn(layer))
    at = next(i for i, a in enumerate(args) if isinstance(a, list) and len(a) == 2 and a[0].dim() == 3)
    gu, panels = args[at]
    s = torch.randn(2, model.config.hidden_size)
    for bad in (panels[:1], panels.float(), panels.transpose(2, 3)):
        args[at] = [gu, bad]
        with pytest.raises(RuntimeError, match="gate_up.*panels must be the contiguous int32 \\[6, 2, 12, 64\\]"):
            native.ops.ffn_moe(s, *args, True, None)
    args[at] = [gu.float(), panels]
    with pytest.raises(RuntimeError, match="panels go with a bfloat16"):
        native.ops.ffn_moe(s, *args, True, None)


@needs_ops
def test_fused_model_matches_the_module_path(kernel_path):
    """bf16: on random weights, where two experts' scores nearly tie, a different fp32
    summation order can flip an expert choice and move that position's logits (and, through
    attention, later ones) by O(1) (test_parity's bf16 note); so the typical position is
    held to 1% and the greedy choices to 90% agreement. fp32 (the fused blocks on every row,
    as decode runs them): no bf16 rounding amplifies a difference, so every position is
    held to 1e-4 of the logit scale: the blocks' formulas are the reference's."""
    model = _random_model(
        seed=11, num_hidden_layers=5, mlp_layer_types=("dense", "sparse", "sparse", "sparse", "sparse")
    )
    reference, native = _backends(model)
    ids = list(range(3, 60))
    with torch.inference_mode():
        model.backend = native
        fused = model.prompt_logits(ids)
        model.backend = reference
        plain = model.prompt_logits(ids)
    per_position = (fused - plain).abs().amax(-1) / plain.abs().max()
    assert per_position.median() <= 1e-2, per_position
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9

    model = model.float()
    reference, native = _backends(model)
    native.plan = replace(native.plan, fp32_fused_max_rows=1 << 30)
    with torch.inference_mode():
        model.backend = native
        fused = model.prompt_logits(ids)
    with torch.inference_mode():
        model.backend = reference
        plain = model.prompt_logits(ids)
    assert (fused - plain).abs().max() <= 1e-4 * plain.abs().max()


@needs_ops
def test_fused_blocks_name_the_bad_argument():
    model = _random_model(seed=1)
    layer = model.layers[0]
    attn, norm = layer.self_attn, layer.input_layernorm
    s = torch.randn(2, model.config.hidden_size)
    q, v, g = [attn.q_proj.weight], [attn.v_proj.weight], [attn.gate_proj.weight]
    rows = attn.k_proj.weight.shape[0]
    cases = {  # a bad k_proj argument -> what the message must say
        "k_proj must be \\[": [torch.zeros(rows, 8, dtype=torch.bfloat16)],
        "k_proj must be bfloat16 or float32": [attn.k_proj.weight.half()],
        "k_proj: expected \\[bf16 weight\\]": [attn.k_proj.weight] * 4,
        "k_proj: panels must be the contiguous int32 \\[1, 24, 64\\]": [attn.k_proj.weight, attn.k_proj.weight],
        "k_proj: NVFP4 codes must be uint8": [
            attn.k_proj.weight,
            torch.zeros(rows, 16, dtype=torch.uint8),
            torch.ones(1),
        ],
        "k_proj: NVFP4 block scales": [
            torch.zeros(rows, 128, dtype=torch.uint8),
            torch.zeros(rows, 3, dtype=torch.uint8),
            torch.ones(1),
        ],
        "k_proj: NVFP4 global scales": [
            torch.zeros(rows, 128, dtype=torch.uint8),
            torch.zeros(rows, 16, dtype=torch.uint8),
            torch.ones(1, dtype=torch.float64),
        ],
    }
    for message, k in cases.items():
        with pytest.raises(RuntimeError, match=message):
            ops.attn_in(s, norm.gain(), 1e-6, q, k, v, g, attn.num_heads, attn.num_kv_heads, 1.0, None, None)
    with pytest.raises(RuntimeError, match="stream"):
        ops.attn_in(
            s.bfloat16(),
            norm.gain(),
            1e-6,
            q,
            [attn.k_proj.weight],
            v,
            g,
            attn.num_heads,
            attn.num_kv_heads,
            1.0,
            None,
            None,
        )


def test_model_runs_without_the_kernels(tmp_path):
    code = (
        "import torch\n"
        "from musespark.kernels import cpu\n"
        "assert cpu.native_ops() is None\n"
        "from musespark.model import MuseSparkForCausalLM, init_random_weights\n"
        "from musespark.config import ModelConfig\n"
        "cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
        "    num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_hidden_size=16,\n"
        "    moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,\n"
        "    mlp_layer_types=('dense', 'sparse'))\n"
        "m = MuseSparkForCausalLM(cfg); init_random_weights(m); m = m.to(torch.bfloat16).eval()\n"
        "from musespark.backends import TorchBackend, select_backend\n"
        "assert isinstance(select_backend('auto', m), TorchBackend)\n"
        "try:\n"
        "    select_backend('cpu', m)\n"
        "    raise SystemExit('backend=cpu must fail without the kernels')\n"
        "except ValueError as exc:\n"
        "    assert 'MUSESPARK_CPU_KERNELS=0' in str(exc), exc\n"
        "print(m.greedy_continuation([3, 4, 5], 4))\n"
    )
    env = dict(os.environ, MUSESPARK_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len(eval(out.stdout.strip().splitlines()[-1])) == 4


def test_kernel_cache_key_covers_the_toolchain(monkeypatch):
    key = cpu.build_key()
    assert cpu.build_key() == key  # stable (torch's builder must not change it by side effect)
    monkeypatch.setattr(cpu.sys, "version", cpu.sys.version + " (another build)")
    assert cpu.build_key() != key
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "/no/such/compiler")
    assert cpu.build_key() != key


@needs_ops
def test_two_processes_building_at_once_share_one_complete_cache(tmp_path):
    code = (
        "from musespark.kernels import cpu\nassert cpu.native_ops() is not None, cpu.unavailable_reason()\n"
        "print(cpu.cache_dir())\n"
    )
    env = dict(os.environ, MUSESPARK_CACHE=str(tmp_path), OMP_NUM_THREADS="1", MAX_JOBS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    dirs = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(dirs) == 1
    entries = list((tmp_path / "kernels").iterdir())
    assert [e.name for e in entries] == [os.path.basename(dirs.pop())]  # no staging directory left behind
    assert (entries[0] / "musespark_cpu.so").is_file()
    # A third process loads the cached library as it is (nothing rebuilt or rewritten).
    library = entries[0] / "musespark_cpu.so"
    stamp = library.stat().st_mtime_ns
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert library.stat().st_mtime_ns == stamp and len(list((tmp_path / "kernels").iterdir())) == 1


@needs_ops
def test_amx_check_runs_the_tiles_in_a_child_and_keeps_its_verdict(tmp_path, monkeypatch):
    """Before a process runs AMX tiles, a child process runs them against float64 and the
    software model (a fault costs the child); the verdict is kept per CPU model. Without AMX
    the child cannot select the path, and the reason says so."""
    from musespark.cpu_features import detected_isa

    monkeypatch.setattr(cpu, "cache_dir", lambda: tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        reason = cpu.amx_check()
    if detected_isa() == "amx_bf16":
        assert reason == "", reason
    else:
        assert "the AMX check failed" in reason and "cannot run the amx_bf16 kernels" in reason, reason
    assert (tmp_path / "amx_check.txt").read_text().split("\n", 1) == [cpu.cpu_model(), reason]

    def no_child(*args, **kwargs):
        raise AssertionError("the kept verdict should have been used")

    monkeypatch.setattr(cpu.subprocess, "run", no_child)
    assert cpu.amx_check() == reason
