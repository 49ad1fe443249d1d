"""The KV cache's layout and size: which layers share block tables, how many blocks the
budget buys, and where a speculative drafter's own K/V go.

KV layout (hybrid allocation): layers are split into KV groups of equal size S, full-
attention layers apart from sliding-window ones (S = the smaller of the two counts). The
cache holds S K/V tensor pairs `[num_blocks, block_size, nKV, D]`; the j-th layer of
every group uses pair j. A block id belongs to one group at a time, so groups never
write into each other's blocks, and a sliding group that releases blocks outside its
window really gives memory back to the pool.

A drafter with K/V of its own (`DraftKVSpec`, the DSpark draft) adds one more group after
the target's: a full-attention draft group that holds `lookahead` positions past the
target's (block_manager.py). Its layer j uses pair j when its geometry equals the
target's and it has at most S layers (a block of the draft group is then a block like any
other, at no extra bytes); otherwise it gets its own tensors `[num_blocks, ...]` and every
block's bytes count them. Either way `kv_cache_memory` bounds the target's and the draft's
K/V together.

The K/V tensors hold `cache.kv_cache_dtype` (the model's dtype, or fp8 e4m3 at one byte a
value: the same budget buys twice the blocks of bf16; layers/kv_quant.py). A draft shares the
target's pairs only when its dtype is theirs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..config import CacheConfig, ModelConfig
from ..layers.kv_quant import kv_cache_torch_dtype
from .block_pool import num_blocks_for_budget
from .spec_decode.proposer import DraftKVSpec


@dataclass(frozen=True)
class KVLayout:
    layer_group: list[int]  # layer -> KV group
    layer_slot: list[int]  # layer -> index of its K/V tensor pair
    group_windows: list[int | None]  # per group: sliding window or None
    num_slots: int  # K/V tensor pairs


def kv_layout(cfg: ModelConfig) -> KVLayout:
    full = [i for i in range(cfg.num_hidden_layers) if not cfg.is_sliding(i)]
    sliding = [i for i in range(cfg.num_hidden_layers) if cfg.is_sliding(i)]
    size = min(len(full), len(sliding)) or cfg.num_hidden_layers
    layer_group = [0] * cfg.num_hidden_layers
    layer_slot = [0] * cfg.num_hidden_layers
    windows: list[int | None] = []
    for layers, window in ((full, None), (sliding, cfg.sliding_window)):
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), j
            windows.append(window)
    return KVLayout(layer_group, layer_slot, windows, size)


def available_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 << 30


@dataclass(frozen=True)
class KVPlan:
    """What the runner allocates and the scheduler's block manager manages."""

    num_blocks: int
    slots: list[int]  # the K/V tensor pairs this pipeline stage holds
    kv_heads: int  # per rank
    group_windows: list[int | None]  # the target's groups, then the draft's (if any)
    group_lookahead: list[int | None]  # None for the target's groups, the draft's lookahead for its group
    draft_shares_slots: bool  # the draft's layer j uses pair j (else tensors of its own)
    dtype: torch.dtype  # what the target's K/V tensors hold (cache.kv_cache_dtype resolved)


def plan_kv_cache(
    model: torch.nn.Module,
    layout: KVLayout,
    cache: CacheConfig,
    max_model_len: int,
    max_num_seqs: int,
    draft: DraftKVSpec | None = None,
) -> KVPlan:
    """Blocks that fit `kv_cache_memory` (or `kv_cache_fraction` of free memory) with every
    held layer's K/V, the draft's included, capped at what `max_num_seqs` sequences can hold."""
    cfg, bs = model.config, cache.block_size
    kv_heads = cfg.num_key_value_heads // model.parallel.tp_size
    kv_dtype = kv_cache_torch_dtype(cache.kv_cache_dtype, model.dtype)
    dtype_bytes = torch.empty((), dtype=kv_dtype).element_size()  # fp8: 1, half of bf16's
    budget = cache.kv_cache_memory or int(available_memory() * cache.kv_cache_fraction)
    start, end = model.layer_range  # a pipeline stage caches only its own layers' slots
    slots = sorted({layout.layer_slot[i] for i in range(start, end)})
    share = (
        draft is not None
        and (draft.num_kv_heads, draft.head_dim, draft.dtype) == (kv_heads, cfg.head_dim, kv_dtype)
        and draft.num_layers <= len(slots)
    )
    extra = 0 if draft is None or share else draft.bytes_per_block(bs)
    num_blocks = num_blocks_for_budget(
        budget, bs, len(slots), kv_heads, cfg.head_dim, dtype_bytes, extra_bytes_per_block=extra
    )
    windows = list(layout.group_windows) + ([None] if draft is not None else [])
    lookahead = [None] * len(layout.group_windows) + ([draft.lookahead] if draft is not None else [])
    # Blocks one sequence can hold at most: full groups its whole length (the draft's plus its
    # lookahead), sliding groups their window (+2: a block boundary and the block being filled).
    per_seq = 0
    for w, extra_positions in zip(windows, lookahead):
        seq_blocks = -(-(max_model_len + (extra_positions or 0)) // bs) + 1
        per_seq += seq_blocks if w is None else min(seq_blocks, -(-w // bs) + 2)
    num_blocks = min(num_blocks, max_num_seqs * per_seq)  # no point holding more
    if num_blocks < per_seq:
        raise ValueError(
            f"kv_cache_memory={budget} bytes gives {num_blocks} KV blocks, but one sequence of "
            f"max_model_len={max_model_len} needs {per_seq}; lower max_model_len (--max-model-len) or raise "
            "the KV cache size (--kv-cache-memory, --kv-cache-fraction)"
        )
    return KVPlan(num_blocks, slots, kv_heads, windows, lookahead, share, kv_dtype)
