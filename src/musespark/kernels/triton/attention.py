"""Kernel 6: causal (optionally sliding-window) attention over a paged KV cache, for chunked
prefill (queries after a cached prefix) and decode (one query per sequence) alike.

Program (tile, kv head): a tile holds up to BLOCK_M (query row, head-of-the-group) pairs of
one sequence, so the G = nH / nKV query heads that share a kv head read its keys once. Keys
stream in BLOCK_N blocks through the block table (flat slot = block * block_size + offset)
with an fp32 online softmax. Masking is by position, as in the reference: a query at
position p sees keys at positions <= p, and on a sliding layer only those > p - window. Key
blocks start at a multiple of BLOCK_N whatever the tile, and fully masked keys change
nothing exactly, so a row's result does not depend on which tile (batch) it is in.

bf16 caches: probabilities are rounded to bf16 before the P·V product (the tensor-core
form; done explicitly, so the interpreter computes the same numbers as a GPU).
Without a cache (`cache is None`) the keys are the batch's own k/v rows.

The launchers take tensors and plain lists only; the triton backend unpacks the model's
`AttentionContext` into them (`backends/triton_backend.py`, `attention_args`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check_device, dot_precision, dot_upcast, is_bf16, pow2, round_to


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    pos_ptr,
    qsl_ptr,
    len_ptr,
    bt_ptr,
    bt_stride,
    tile_seq_ptr,
    tile_pair_ptr,
    nH,
    nKV,
    D,
    block_size,
    scale,
    window,
    PAGED: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    KV_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(tile_seq_ptr + tile)
    G = nH // nKV
    qs = tl.load(qsl_ptr + b)
    nq = tl.load(qsl_ptr + b + 1) - qs
    L = tl.load(len_ptr + b)  # keys of the sequence after this step
    pairs = tl.load(tile_pair_ptr + tile) + tl.arange(0, BLOCK_M)
    row_ok = pairs < nq * G
    qi = pairs // G
    head = kvh * G + pairs % G
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D
    q_rows = (qs + qi).to(tl.int64)
    q = tl.load(
        q_ptr + (q_rows[:, None] * nH + head[:, None]) * D + ds[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = tl.load(pos_ptr + q_rows, mask=row_ok, other=0)
    # Key index range this tile can see (index = position in the paged case).
    first = L - nq  # index of the sequence's first query
    last_q = tl.minimum(nq, (tl.load(tile_pair_ptr + tile) + BLOCK_M - 1) // G + 1) - 1
    hi = first + last_q + 1
    lo = first * 0
    if window > 0:
        lo = tl.maximum(0, first + tl.load(tile_pair_ptr + tile) // G - window + 1)
    start = (lo // BLOCK_N) * BLOCK_N
    m_i = tl.full((BLOCK_M,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for j0 in range(start, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        if PAGED:
            blk = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + j // block_size, mask=j < hi, other=-1)
            key_ok = (j < hi) & (j >= lo) & (blk >= 0)
            slot = blk.to(tl.int64) * block_size + j % block_size
            k_pos = j
        else:
            key_ok = (j < hi) & (j >= lo)
            slot = (qs + j).to(tl.int64)
            k_pos = tl.load(pos_ptr + slot, mask=key_ok, other=0)
        kv_off = (slot[None, :] * nKV + kvh) * D + ds[:, None]  # [BLOCK_D, BLOCK_N]
        kt = tl.load(k_ptr + kv_off, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PREC) * scale
        see = key_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if window > 0:
            see = see & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + tl.trans(kv_off), mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if KV_BF16:
            p = round_to(p, True)
        if UPCAST:
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_rows[:, None] * nH + head[:, None]) * D + ds[None, :],
        round_to(out, OUT_BF16),
        mask=row_ok[:, None] & d_ok[None, :],
    )


PagedKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # k_cache, v_cache, slot_mapping, block_tables


@dataclass(frozen=True)
class AttentionMeta:
    """A step's per-sequence tables on the device, shared by every layer of the step (one
    host-to-device copy): query_start_loc [B+1], key counts [B] (seq_lens with a cache, the
    query counts without), and the tile table: sequence and first (query, head) pair [tiles]."""

    qsl: torch.Tensor
    lens: torch.Tensor
    tile_seq: torch.Tensor
    tile_pair: torch.Tensor
    group: int  # query heads per kv head the tiles were laid out for
    block_m: int


def attention_meta(
    query_start_loc: Sequence[int], key_lens: Sequence[int], group: int, device: torch.device, block_m: int = 16
) -> AttentionMeta:
    """The tables of a step, for `group` query heads per kv head, in one int32 copy to `device`.
    query_start_loc [B+1]: row offsets of each sequence in the flat batch; key_lens [B]: the
    keys each sequence attends over (its seq_len with a paged cache, its query count without)."""
    qsl = list(query_start_loc)
    B = len(qsl) - 1
    lens = list(key_lens)
    if len(lens) != B:
        raise ValueError(f"key_lens has {len(lens)} entries; query_start_loc describes {B} sequences")
    seqs, firsts = [], []
    for b in range(B):
        for p0 in range(0, (qsl[b + 1] - qsl[b]) * group, block_m):
            seqs.append(b)
            firsts.append(p0)
    flat = torch.tensor(qsl + lens + seqs + firsts, dtype=torch.int32).to(device, non_blocking=True)
    n = len(seqs)
    return AttentionMeta(
        flat[: B + 1], flat[B + 1 : 2 * B + 1], flat[2 * B + 1 : 2 * B + 1 + n], flat[2 * B + 1 + n :], group, block_m
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: Sequence[int],
    key_lens: Sequence[int],
    cache: PagedKV | None,
    scale: float,
    window: int | None,
    block_m: int = 16,
    block_n: int = 32,
    write_cache: bool = True,
    meta: AttentionMeta | None = None,
) -> torch.Tensor:
    """The contract of `layers.attention.paged_attention` (q [T, nH, D], k/v [T, nKV, D],
    positions [T]) -> o [T, nH, D] in q's dtype. `cache`: this layer's (k_cache, v_cache
    [num_blocks, block_size, nKV, D], slot_mapping [T], block_tables [B, max_blocks]), or None.
    With a cache the new k/v are written at slot_mapping first (skip with `write_cache=False`
    when already done), and each sequence's keys are 0 .. key_lens[b]-1 (position = index);
    without one, each sequence attends over its own rows of k/v. `meta`:
    `attention_meta(query_start_loc, key_lens, ...)` made once per step (made here when None)."""
    from .qk_norm_rope import write_kv

    check_device(q)
    T, nH, D = q.shape
    nKV = k.shape[1]
    assert nH % nKV == 0
    out = torch.empty_like(q)
    if T == 0:
        return out
    q, positions = q.contiguous(), positions.to(torch.int64).contiguous()
    paged = cache is not None
    if paged:
        k_cache, v_cache, slot_mapping, block_tables = cache
        if write_cache:
            write_kv(k, v, slot_mapping, k_cache, v_cache)
        keys, values = k_cache, v_cache
        tables = block_tables.contiguous()
        block_size, stride = k_cache.shape[1], tables.shape[1]
    else:
        keys, values = k.contiguous(), v.contiguous()
        tables, block_size, stride = positions, 1, 0
    if meta is None:
        meta = attention_meta(query_start_loc, key_lens, nH // nKV, q.device, block_m)
    assert meta.group == nH // nKV and meta.block_m == block_m
    if meta.tile_seq.numel() == 0:
        return out
    upcast = dot_upcast(keys.dtype) or keys.dtype != q.dtype
    prec = dot_precision(torch.float32 if upcast else keys.dtype)
    _attention_kernel[(meta.tile_seq.numel(), nKV)](
        q,
        keys,
        values,
        out,
        positions,
        meta.qsl,
        meta.lens,
        tables,
        stride,
        meta.tile_seq,
        meta.tile_pair,
        nH,
        nKV,
        D,
        block_size,
        float(scale),
        int(window or 0),
        PAGED=paged,
        UPCAST=upcast,
        PREC=prec,
        KV_BF16=is_bf16(keys.dtype),
        OUT_BF16=is_bf16(q.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=pow2(D),
        num_warps=4,
    )
    return out
