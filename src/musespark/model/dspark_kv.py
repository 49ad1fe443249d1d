"""The DSpark draft's context K/V in a paged cache, reached through block tables like the
target's: per draft layer K, V [num_blocks, block_size, nkv, hd] in D; position p of a
request lives at slot table[p // block_size] * block_size + p % block_size. In the engine
the tensors are the runner's and the tables are the draft's KV group of the block manager
(one budget with the target's K/V, freed and preempted with the request).

Invariants of one request (`DraftSeq`): positions [0, length) hold target-derived context
K/V, except its gaps (positions it was never given rows for: a prefix-cache hit of the target,
the steps a request spent between probes of its speculation back-off), which attention never
reads. A block pass of Q queries at positions [P0, P0 + Q) (P0 = length) writes their K/V
there as scratch, so the table must reach P0 + Q (the engine's draft group holds that
lookahead); queries see [0, P0) and their block causally.
Requests without gaps attend through the target's backend (`Backend.attention`, the paged
attention path its own layers take; the torch reference `layers.attention.paged_attention`
without one), the others through an explicit key list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..backends.base import Backend
from ..layers.attention import AttentionContext, KVGroup, paged_attention
from .dspark import Attend, DSparkDraft


@dataclass
class DraftSeq:
    """One request's context extent: [0, length) minus `gaps` ([lo, hi) ranges, below length)."""

    length: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)

    def advance(self, start: int, n: int) -> None:
        """Forget positions >= start, then hold [start, start + n); [length, start) becomes a gap
        (joined to a gap ending at length: many steps without rows in a row make one range)."""
        self.gaps = [(lo, min(hi, start)) for lo, hi in self.gaps if lo < start]
        if start > self.length:
            if self.gaps and self.gaps[-1][1] == self.length:
                self.gaps[-1] = (self.gaps[-1][0], start)
            else:
                self.gaps.append((self.length, start))
        self.length = start + n

    def known(self, end: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Positions in [0, end) that hold K/V, ascending (int64)."""
        keep = torch.ones(end, dtype=torch.bool, device=device)
        for lo, hi in self.gaps:
            keep[lo:hi] = False
        return torch.arange(end, device=device)[keep]


class PagedDraftKV:
    """The draft layers' K/V tensors, `caches[layer] = (K, V)` [num_blocks, block_size, nkv, hd]."""

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        for k, v in caches:
            if k.shape != v.shape or k.dim() != 4 or k.shape[1] != block_size:
                raise ValueError(f"caches: K/V must be [num_blocks, {block_size}, nkv, hd], got {k.shape}, {v.shape}")
        self.caches, self.block_size = caches, block_size

    @classmethod
    def allocate(cls, draft: DSparkDraft, num_blocks: int, block_size: int, device: torch.device | str) -> PagedDraftKV:
        cfg = draft.config
        shape = (num_blocks, block_size, cfg.kv_heads, cfg.head_dim)
        caches = [
            (torch.zeros(shape, dtype=draft.dtype, device=device), torch.zeros(shape, dtype=draft.dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]
        return cls(caches, block_size)

    def slots(self, table: list[int], positions: range | list[int]) -> list[int]:
        """Flat cache slot of each position (it must have a block in `table`)."""
        bs, out = self.block_size, []
        for p in positions:
            i = p // bs
            if i >= len(table) or table[i] < 0:
                raise IndexError(f"draft KV: position {p} has no block (table of {len(table)} blocks)")
            out.append(table[i] * bs + p % bs)
        return out

    def _flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.caches[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [n, nkv, hd] of `layer` at slots [n]."""
        k_flat, v_flat = self._flat(layer)
        k_flat.index_copy_(0, slots, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slots, v.to(v_flat.dtype))

    def attend(
        self,
        draft: DSparkDraft,
        tables: list[list[int]],
        seqs: list[DraftSeq],
        positions: torch.Tensor,
        backend: Backend | None = None,
    ) -> Attend:
        """Attention for a batch of blocks at positions [B, Q] (row b starts at seqs[b].length),
        through `backend` (None: the torch reference)."""
        B, Q = positions.shape
        device, scale = positions.device, draft.attention_scale()
        p0 = positions[:, 0].tolist()
        if any(p != s.length for p, s in zip(p0, seqs)):
            raise ValueError(f"block starts {p0} must equal the context lengths {[s.length for s in seqs]}")
        scratch = [self.slots(t, range(p, p + Q)) for t, p in zip(tables, p0)]
        plain = [b for b in range(B) if not seqs[b].gaps]
        gapped = [b for b in range(B) if seqs[b].gaps]
        ctx = None
        if plain:
            width = max(len(tables[b]) for b in plain)
            block_tables = [tables[b] + [-1] * (width - len(tables[b])) for b in plain]
            group = KVGroup(
                slot_mapping=torch.tensor([s for b in plain for s in scratch[b]], device=device),
                block_tables=torch.tensor(block_tables, dtype=torch.int64, device=device),
            )
            ctx = AttentionContext(
                query_start_loc=[Q * i for i in range(len(plain) + 1)],
                seq_lens=[p0[b] + Q for b in plain],
                kv_caches=self.caches,
                groups=[group],
                layer_group=[0] * len(self.caches),
            )
        plain_t = torch.tensor(plain, device=device)
        # requests with gaps: the known context's slots and positions, then the block's
        keys = {}
        bs = self.block_size
        for b in gapped:
            known = seqs[b].known(p0[b], device)  # their blocks exist: they were written
            table = torch.tensor(tables[b], dtype=torch.int64, device=device)
            own = torch.tensor(scratch[b], device=device)
            slots = table[known // bs] * bs + known % bs
            keys[b] = (torch.cat((slots, own)), torch.cat((known, positions[b])), own)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            window = draft.layers[layer].window
            out = torch.empty_like(q)
            if ctx is not None:
                flat = [t.index_select(0, plain_t).flatten(0, 1) for t in (q, k, v)]
                pos = positions.index_select(0, plain_t).flatten()
                if backend is not None:
                    o = backend.attention(draft.layers[layer].self_attn, *flat, pos, ctx)
                else:
                    o = paged_attention(*flat, pos, ctx, layer, scale, window)
                out[plain_t] = o.view(len(plain), Q, *o.shape[1:])
            for b in gapped:
                slots, k_pos, own = keys[b]
                self.store(layer, own, k[b], v[b])
                k_flat, v_flat = self._flat(layer)
                mask = k_pos[None, :] <= positions[b][:, None]
                if window is not None:
                    mask &= k_pos[None, :] > positions[b][:, None] - window
                q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q[b], k_flat[slots], v_flat[slots]))
                o = F.scaled_dot_product_attention(
                    q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=q4.shape[1] != k4.shape[1]
                )
                out[b] = o[0].transpose(0, 1)
            return out

        return attend
