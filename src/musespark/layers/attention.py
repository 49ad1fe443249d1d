"""Attention over a flat batch of tokens from many sequences.

The model sees one flat batch: `T` tokens, sequence `b` owning rows
`query_start_loc[b] : query_start_loc[b+1]`. An `AttentionContext` says where each
sequence's keys and values live:

* without a KV cache (`kv_caches is None`) every sequence's context is exactly its
  tokens in this batch (a whole prompt, the reference path);
* with a paged KV cache, K/V of the new tokens are written at `slot_mapping` (a flat
  slot = block * block_size + offset) and every query reads its sequence's history
  through a block table. Layers may be split into KV groups (e.g. full and sliding
  layers with separate block tables, so sliding layers can release blocks that fall
  out of their window); `layer_group[i]` names layer i's group.

The cache may hold a narrower dtype than the queries (fp8, layers/kv_quant.py): new K/V are
written through `store` and every key read here goes through `from_cache` into the queries'
dtype; a backend hands its native kernels only caches they take (backends/cpu_plan.py).

Masking is by position: a query at position p sees keys at positions <= p, and on a
sliding layer only those > p - window.

`paged_attention` is the torch reference. A backend may hand it a `DecodeKernel` for the
rows that have one query each (decode rows); every such row then goes through that kernel,
in pure-decode and mixed batches alike, so a sequence's result does not depend on what
else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from .kv_quant import FP8_KV_DTYPE, from_cache, store


@dataclass
class KVGroup:
    """Where one group of layers keeps its keys/values for this step."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot for each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64: block ids per sequence (-1 = none)


@dataclass
class AttentionContext:
    query_start_loc: list[int]  # [B+1] row offsets of each sequence in the flat batch
    seq_lens: list[int]  # [B] context length of each sequence after this step (cached + new)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: K, V [num_blocks, block_size, nKV, D]
    groups: list[KVGroup] | None = None
    layer_group: list[int] | None = None  # layer index -> index into `groups`
    # Sequences whose queries are computed one row at a time as decode rows (speculative
    # verification: each row then gets exactly the numbers one-at-a-time decoding gives).
    row_wise: list[int] = field(default_factory=list)
    # [T] bool: the rows that are tokens of their request's prompt (None: none is). A backend
    # may multiply them by a prompt-sized kernel; whether a row is one depends on the row
    # alone, never on its batch (kernels/csrc/gemm/jobs.h, split_prompt_runs).
    prompt_rows: torch.Tensor | None = None
    # The largest position in the step, when the caller built the positions (None: read them).
    max_position: int | None = None
    _seq_lens_t: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def seq_lens_tensor(self, device: torch.device) -> torch.Tensor:
        """`seq_lens` as an int64 tensor [B], made once per step."""
        if self._seq_lens_t is None:
            self._seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int64, device=device)
        return self._seq_lens_t

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def for_prompts(cls, lengths: list[int]) -> AttentionContext:
        """Context for whole prompts computed from scratch, no cache."""
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        return cls(query_start_loc=starts, seq_lens=list(lengths), prompt_rows=torch.ones(starts[-1], dtype=torch.bool))


def _attend(
    q: torch.Tensor,  # [n, nH, D] queries
    k: torch.Tensor,  # [m, nKV, D] keys
    v: torch.Tensor,  # [m, nKV, D]
    q_pos: torch.Tensor,  # [n] query positions
    k_pos: torch.Tensor,  # [m] key positions
    scale: float,
    window: int | None,
    plain_causal: bool = False,
) -> torch.Tensor:
    """Softmax attention of n queries over m keys, masked by position -> [n, nH, D].

    `plain_causal` (a whole sequence from position 0, no window) takes SDPA's causal
    kernel without a mask; otherwise keys are masked explicitly.
    """
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, len, D]
    if plain_causal:
        out = F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    else:
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    return out[0].transpose(0, 1)  # [n, nH, D]


class DecodeKernel(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """One query per sequence: q [B, nH, D] fp32, caches [num_blocks, block_size, nKV, D],
        block_tables [B, max_blocks] int64, seq_lens [B] int64 (keys per sequence, the query's
        own included), window 0 = none -> [B, nH, D] fp32."""


class PrefillKernel(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int, window: int, scale: float
    ) -> torch.Tensor:
        """One sequence's chunk: q [n, nH, D] at positions q_start.., k, v [m, nKV, D] at
        positions k_start.. (every key the chunk reaches, in order), window 0 = none ->
        [n, nH, D] in q's dtype, causal."""


def paged_attention(
    q: torch.Tensor,  # [T, nH, D]
    k: torch.Tensor,  # [T, nKV, D]
    v: torch.Tensor,  # [T, nKV, D]
    positions: torch.Tensor,  # [T]
    ctx: AttentionContext,
    layer: int,
    scale: float,
    window: int | None,
    decode: DecodeKernel | None = None,
    prefill: PrefillKernel | None = None,
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention for every sequence of the batch -> [T, nH, D].
    With a paged cache, the new K/V are written first; `decode` (if given) computes the
    single-query rows, `prefill` (if given) the bf16 chunks of several rows (from a bf16 or an
    fp8 cache, whose keys it gets widened to bf16)."""
    out = torch.empty_like(q)
    qsl = ctx.query_start_loc
    if ctx.kv_caches is None:
        for b in range(ctx.num_seqs):
            s, e = qsl[b], qsl[b + 1]
            if e > s:
                pos = positions[s:e]
                plain = window is None or (e - s) <= window
                out[s:e] = _attend(
                    q[s:e], k[s:e], v[s:e], pos, pos, scale, window, plain_causal=plain and int(pos[0]) == 0
                )
        return out

    assert ctx.groups is not None and ctx.layer_group is not None
    group = ctx.groups[ctx.layer_group[layer]]
    k_cache, v_cache = ctx.kv_caches[layer]
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    store(k_flat, group.slot_mapping, k)
    store(v_flat, group.slot_mapping, v)
    if q.shape[0] == ctx.num_seqs:  # pure decode: one query per sequence, one batched call
        if decode is not None:
            out = decode(
                q.float().contiguous(),
                k_cache,
                v_cache,
                group.block_tables,
                ctx.seq_lens_tensor(q.device),
                window or 0,
                scale,
            )
            return out.to(q.dtype)
        return _decode_attention(
            q, k_flat, v_flat, positions, ctx.seq_lens, group.block_tables, block_size, scale, window
        )
    single = [b for b in range(ctx.num_seqs) if qsl[b + 1] - qsl[b] == 1] if decode is not None else []
    if single:
        rows = torch.tensor([qsl[b] for b in single], device=q.device)
        seqs = torch.tensor(single, device=q.device)
        got = decode(
            q[rows].float().contiguous(),
            k_cache,
            v_cache,
            group.block_tables.index_select(0, seqs).contiguous(),
            ctx.seq_lens_tensor(q.device).index_select(0, seqs),
            window or 0,
            scale,
        )
        out[rows] = got.to(q.dtype)
    if ctx.row_wise:
        _row_wise_attention(out, q, k_cache, v_cache, k_flat, v_flat, positions, ctx, group, scale, window, decode)
    skip = set(ctx.row_wise)
    for b in range(ctx.num_seqs):
        s, e = qsl[b], qsl[b + 1]
        if e == s or (single and e - s == 1) or b in skip:
            continue
        if prefill is not None and q.dtype == torch.bfloat16 and k_flat.dtype in (torch.bfloat16, FP8_KV_DTYPE):
            # an fp8 cache's keys and values widen to bf16 exactly (e4m3 is a subset of bf16)
            slots, k_pos = _reachable_slots(group.block_tables[b], ctx.seq_lens[b], e - s, block_size, window)
            keys, values = from_cache(k_flat[slots], q.dtype), from_cache(v_flat[slots], q.dtype)
            out[s:e] = prefill(q[s:e], keys, values, ctx.seq_lens[b] - (e - s), int(k_pos[0]), window or 0, scale)
            continue
        out[s:e] = _attend_chunk(
            q[s:e], k_flat, v_flat, positions[s:e], group.block_tables[b], ctx.seq_lens[b], block_size, scale, window
        )
    return out


# Queries per SDPA call in a prefill chunk: each block reads only the keys its rows can reach
# (with a sliding window, a band instead of the whole prefix) and its mask stays small.
PREFILL_QUERY_BLOCK = 256


def _attend_chunk(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    block_size: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """A sequence's n new queries (the last n of its seq_len positions) over the paged cache,
    PREFILL_QUERY_BLOCK rows at a time -> [n, nH, D]. A block at the start of a sequence with
    every key in reach (no prefix, no window cutting in) takes SDPA's causal kernel."""
    n = q.shape[0]
    if n <= PREFILL_QUERY_BLOCK:
        slots, k_pos = _reachable_slots(table, seq_len, n, block_size, window)
        plain = seq_len == n and (window is None or n <= window)
        keys, values = from_cache(k_flat[slots], q.dtype), from_cache(v_flat[slots], q.dtype)
        return _attend(q, keys, values, positions, k_pos, scale, window, plain_causal=plain)
    out = torch.empty_like(q)
    for s in range(0, n, PREFILL_QUERY_BLOCK):
        e = min(n, s + PREFILL_QUERY_BLOCK)
        end = seq_len - n + e  # the block's rows are the last e - s of the first `end` positions
        slots, k_pos = _reachable_slots(table, end, e - s, block_size, window)
        plain = end == e - s and (window is None or e - s <= window)
        keys, values = from_cache(k_flat[slots], q.dtype), from_cache(v_flat[slots], q.dtype)
        out[s:e] = _attend(q[s:e], keys, values, positions[s:e], k_pos, scale, window, plain_causal=plain)
    return out


def _row_wise_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    positions: torch.Tensor,
    ctx: AttentionContext,
    group: KVGroup,
    scale: float,
    window: int | None,
    decode: DecodeKernel | None,
) -> None:
    """Rows of the `ctx.row_wise` sequences as single-query decode rows (row i of a sequence's
    n sees seq_len - (n - 1 - i) keys), written into `out` in place."""
    qsl = ctx.query_start_loc
    rows, seqs, lens = [], [], []
    for b in ctx.row_wise:
        s, e = qsl[b], qsl[b + 1]
        for r in range(s, e):
            rows.append(r)
            seqs.append(b)
            lens.append(ctx.seq_lens[b] - (e - 1 - r))
    rows_t = torch.tensor(rows, device=q.device)
    tables = group.block_tables.index_select(0, torch.tensor(seqs, device=q.device)).contiguous()
    if decode is not None:
        got = decode(
            q[rows_t].float().contiguous(),
            k_cache,
            v_cache,
            tables,
            torch.tensor(lens, dtype=torch.int64, device=q.device),
            window or 0,
            scale,
        )
    else:
        got = _decode_attention(
            q[rows_t], k_flat, v_flat, positions[rows_t], lens, tables, k_cache.shape[1], scale, window
        )
    out[rows_t] = got.to(q.dtype)


def _reachable_slots(
    table: torch.Tensor, seq_len: int, num_queries: int, block_size: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slots [m] and positions [m] of every key the last `num_queries` positions of
    a sequence of `seq_len` can see; blocks before the oldest reachable key are never read."""
    first_query = seq_len - num_queries
    first_key = 0 if window is None else max(0, first_query - window + 1)
    first_block = first_key // block_size
    blocks = table[first_block : (seq_len - 1) // block_size + 1]
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)[None, :]).reshape(-1)
    start = first_block * block_size
    return slots[: seq_len - start], torch.arange(start, seq_len, device=table.device)


def _decode_attention(
    q: torch.Tensor,  # [B, nH, D], one query per sequence
    k_flat: torch.Tensor,  # [num_slots, nKV, D]
    v_flat: torch.Tensor,
    positions: torch.Tensor,  # [B]
    seq_lens: list[int],
    block_tables: torch.Tensor,  # [B, max_blocks]
    block_size: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """All decode queries at once: gather each sequence's reachable blocks into a padded
    [B, L] key set (padding masked out) and run one SDPA call."""
    B = q.shape[0]
    first = [0 if window is None else max(0, n - window) // block_size for n in seq_lens]  # query at n-1
    count = [(n - 1) // block_size - f + 1 for n, f in zip(seq_lens, first)]
    nb = max(count)
    device = q.device
    j = torch.arange(nb, device=device)
    first_t = torch.tensor(first, device=device)
    cols = (first_t[:, None] + j[None, :]).clamp(max=block_tables.shape[1] - 1)  # [B, nb]
    blocks = block_tables.gather(1, cols)
    valid_block = (j[None, :] < torch.tensor(count, device=device)[:, None]) & (blocks >= 0)
    blocks = torch.where(valid_block, blocks, torch.zeros_like(blocks))
    offs = torch.arange(block_size, device=device)
    slots = (blocks[:, :, None] * block_size + offs).reshape(B, nb * block_size)  # [B, L]
    k_pos = first_t[:, None] * block_size + torch.arange(nb * block_size, device=device)[None, :]
    q_pos = positions[:, None]
    mask = (k_pos <= q_pos) & valid_block.repeat_interleave(block_size, dim=1)
    if window is not None:
        mask &= k_pos > q_pos - window
    keys = from_cache(k_flat[slots], q.dtype).transpose(1, 2)  # [B, nKV, L, D]
    values = from_cache(v_flat[slots], q.dtype).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],
        keys,
        values,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out[:, :, 0, :]  # [B, nH, D]
