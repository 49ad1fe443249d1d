"""Kernel 5: the routed experts at width Hm, grouped by expert (docs/spec.md §3, compressed MoE step 3).

Three launches, no host synchronisation (tiles are laid out on the device):

1. `_gate_up_kernel`: per tile of one expert's assignments, g = u W_gate^T and v = u W_up^T
   (fp32 sums), each rounded to the model dtype as the reference linear does, then
   h = silu(g) * v with the reference's two roundings (silu, then the product).  h [N, Im]
2. `_down_kernel`: y = h W_down^T, rounded to the model dtype.                     y [N, Hm]
3. `_norm_sum_kernel`: per token, for its k experts in increasing id:
   out = sum_e w_e * rms(y_e * post_gain, eps), fp32, one add at a time from the smallest
   id (the reference's order: layers/moe.py `Experts.forward`).                out [T, Hm]

N = T * k assignments, sorted by expert id (stable); tile i covers rows
[tile_start[i], tile_end[i]) of one expert, at most BLOCK_M of them. The tile grid has a
host-known bound (cdiv(N, BLOCK_M) + min(E, N)); tiles past the real count do nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, dot_precision, dot_upcast, interpreted, is_bf16, pow2, round_to


@triton.jit
def _gate_up_kernel(
    u_ptr,
    src_ptr,
    w_ptr,
    h_ptr,
    tile_e_ptr,
    tile_s_ptr,
    tile_n_ptr,
    E,
    Hm,
    Im,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_e_ptr + tile)
    e64 = tl.minimum(e, E - 1).to(tl.int64)
    start = tl.load(tile_s_ptr + tile)
    n = tl.load(tile_n_ptr + tile)  # 0 on tiles past the real ones: every load and store masked off
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < start + n
    src = tl.load(src_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # token of each assignment
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < tl.minimum(Im, n * Im)
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e64 * 2 * Im * Hm
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, Hm, BLOCK_K):
        k_ok = (k0 + ks) < Hm
        x = tl.load(u_ptr + src[:, None] * Hm + k0 + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(
            w_base + cols[None, :].to(tl.int64) * Hm + k0 + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        wu = tl.load(
            w_base + (Im + cols[None, :]).to(tl.int64) * Hm + k0 + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(x, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(x, wu, acc_u, input_precision=PREC)
    g = round_to(acc_g, OUT_BF16)
    v = round_to(acc_u, OUT_BF16)
    h = round_to(round_to(g / (1.0 + tl.exp(-g)), OUT_BF16) * v, OUT_BF16)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * Im + cols[None, :], h, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    tile_e_ptr,
    tile_s_ptr,
    tile_n_ptr,
    E,
    Hm,
    Im,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_e_ptr + tile)
    e64 = tl.minimum(e, E - 1).to(tl.int64)
    start = tl.load(tile_s_ptr + tile)
    n = tl.load(tile_n_ptr + tile)  # 0 on tiles past the real ones: every load and store masked off
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < start + n
    rows64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < tl.minimum(Hm, n * Hm)
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e64 * Hm * Im
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, Im, BLOCK_K):
        k_ok = (k0 + ks) < Im
        x = tl.load(h_ptr + rows64[:, None] * Im + k0 + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            w_base + cols[None, :].to(tl.int64) * Im + k0 + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PREC)
    tl.store(
        y_ptr + rows64[:, None] * Hm + cols[None, :], round_to(acc, OUT_BF16), mask=row_ok[:, None] & col_ok[None, :]
    )


@triton.jit
def _norm_sum_kernel(y_ptr, pos_ptr, w_ptr, gain_ptr, out_ptr, Hm, eps, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m = cols < Hm
    gain = tl.load(gain_ptr + cols, mask=m, other=0.0)
    out = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for r in range(K):  # the token's experts in increasing id
        j = tl.load(pos_ptr + t * K + r).to(tl.int64)  # its row in the expert-sorted outputs
        y = tl.load(y_ptr + j * Hm + cols, mask=m, other=0.0).to(tl.float32) * gain
        y = y * tl.rsqrt(tl.sum(y * y, axis=0) / Hm + eps)
        out = out + y * tl.load(w_ptr + t * K + r)
    tl.store(out_ptr + t * Hm + cols, out, mask=m)


def _tiles(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """Expert-sorted assignment order [N] and the tile table (expert, first row, rows) [G],
    G = cdiv(N, block_m) + min(E, N): all on the device, no synchronisation."""
    N = flat_ids.shape[0]
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [E]
    starts = torch.cumsum(counts, 0) - counts
    per = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(per, 0)
    G = triton.cdiv(N, block_m) + min(num_experts, N)
    t = torch.arange(G, device=flat_ids.device)
    e = torch.searchsorted(tile_end, t, right=True)  # E past the last real tile
    ec = e.clamp(max=num_experts - 1)
    first = starts[ec] + (t - (tile_end[ec] - per[ec])) * block_m
    n = torch.clamp(starts[ec] + counts[ec] - first, 0, block_m)
    return order, e.to(torch.int32), first.to(torch.int32), n.to(torch.int32)


def moe_experts(
    u: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    post_gain: torch.Tensor,
    eps: float,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 32,
) -> torch.Tensor:
    """u [T, Hm] model dtype; weights [T, k] fp32; ids [T, k] int; gate_up [E, 2*Im, Hm] (gate rows,
    then up rows); down [E, Hm, Im]; post_gain [Hm] fp32 (1 + post-expert norm weight)
    -> sum over each token's experts, in increasing id, of w * rms(y * post_gain, eps): [T, Hm] fp32.
    `block_m` None: 64 rows per tile when the experts average at least 64 rows (prefill: fewer
    re-reads of each expert's weights), else 16 (decode); 16 under the interpreter."""
    check_device(u)
    T, Hm = u.shape
    E, two_im, _ = gate_up.shape
    Im = two_im // 2
    k = ids.shape[1]
    assert gate_up.shape == (E, 2 * Im, Hm) and down.shape == (E, Hm, Im) and weights.shape == ids.shape
    out = torch.empty(T, Hm, dtype=torch.float32, device=u.device)
    if T == 0:
        return out
    if block_m is None:
        block_m = 64 if not interpreted() and T * k >= 64 * E else 16
    ids, perm = ids.sort(dim=1)  # increasing id along k (the summation order)
    weights = weights.gather(1, perm).float().contiguous()
    flat = ids.reshape(-1)
    order, tile_e, tile_s, tile_n = _tiles(flat, E, block_m)
    N = flat.shape[0]
    src = (order // k).to(torch.int32)  # token of each sorted assignment
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(N, device=u.device))  # assignment -> sorted row
    u, gate_up, down = u.contiguous(), gate_up.contiguous(), down.contiguous()
    dt = u.dtype
    h = torch.empty(N, Im, dtype=dt, device=u.device)
    y = torch.empty(N, Hm, dtype=dt, device=u.device)
    upcast = dot_upcast(dt)
    prec = dot_precision(torch.float32 if upcast else dt)
    G = tile_e.shape[0]
    bk = min(block_k, pow2(Hm)), min(block_k, pow2(Im))
    _gate_up_kernel[(G, triton.cdiv(Im, block_n))](
        u,
        src,
        gate_up,
        h,
        tile_e,
        tile_s,
        tile_n,
        E,
        Hm,
        Im,
        UPCAST=upcast,
        PREC=prec,
        OUT_BF16=is_bf16(dt),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk[0],
        num_warps=4,
    )
    _down_kernel[(G, triton.cdiv(Hm, block_n))](
        h,
        down,
        y,
        tile_e,
        tile_s,
        tile_n,
        E,
        Hm,
        Im,
        UPCAST=upcast,
        PREC=prec,
        OUT_BF16=is_bf16(dt),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk[1],
        num_warps=4,
    )
    _norm_sum_kernel[(T,)](
        y,
        pos,
        weights,
        post_gain.float().contiguous(),
        out,
        Hm,
        float(eps),
        K=k,
        BLOCK_H=pow2(Hm),
        num_warps=max(1, min(16, pow2(Hm) // 512)),
    )
    return out
