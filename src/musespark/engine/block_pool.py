"""The block pool: every KV block's ref count, hash and free/cached-free state.

Pure Python, no tensors. See `block_manager.py` for how requests use it.

Every block is in exactly one of three states:

* used        ref_cnt > 0, referenced by >= 1 request tables (shared prefix blocks);
* cached-free ref_cnt == 0 but still holds a hashed full block: reusable by a prefix
              hit until evicted, least recently freed first;
* free        ref_cnt == 0 and holds nothing worth keeping.

New blocks come from `free` first and only then evict `cached-free` blocks (LRU), so
a cached prefix is never thrown away while a worthless block is available.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = -1  # block-table entry for a released (or never needed) sliding block

BlockHash = bytes  # 32-byte sha256 digest
CacheKey = tuple[int, BlockHash]  # (group, block hash)


def salt_root(cache_salt: str | None) -> BlockHash | None:
    """The hash chain's root for a cache salt (None: the unsalted chain)."""
    if cache_salt is None:
        return None
    return hashlib.sha256(b"musespark-cache-salt\x00" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: depends on the block's tokens and its whole prefix."""
    h = hashlib.sha256(parent if parent is not None else b"\x00" * 32)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def num_blocks_for_budget(
    kv_cache_memory_bytes: int,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    extra_bytes_per_block: int = 0,
) -> int:
    """How many blocks fit: one block holds K and V of `block_size` tokens for every layer,
    plus `extra_bytes_per_block` (a drafter's own K/V tensors, allocated for every block id)."""
    for name, v in (
        ("block_size", block_size),
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if extra_bytes_per_block < 0:
        raise ValueError(f"extra_bytes_per_block must be >= 0, got {extra_bytes_per_block}")
    per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes + extra_bytes_per_block
    return max(0, kv_cache_memory_bytes) // per_block


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    cache_key: CacheKey | None = None  # set while the block holds a registered full block


class BlockPool:
    """Fixed set of blocks with ref counts, a plain free list and an LRU of cached-free blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest first = next evicted
        self._cached: dict[CacheKey, int] = {}  # (group, hash) -> block id

    # -- counts ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + cached-free)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # -- prefix cache ---------------------------------------------------------
    def lookup(self, key: CacheKey) -> int | None:
        return self._cached.get(key) if self.enable_prefix_caching else None

    def register(self, block_id: int, key: CacheKey) -> bool:
        """Mark a used, now full block as cached under `key`; False if the key is taken."""
        if not self.enable_prefix_caching or key in self._cached:
            return False
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and block.cache_key is None, block
        block.cache_key = key
        self._cached[key] = block_id
        return True

    # -- ref counting ---------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take n blocks (ref_cnt 1): plain free ones first, then evict cached-free LRU."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"need {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                bid, _ = self._free.popitem(last=False)
            else:
                bid, _ = self._cached_free.popitem(last=False)
                block = self.blocks[bid]
                assert block.cache_key is not None
                del self._cached[block.cache_key]
                block.cache_key = None
            self.blocks[bid].ref_cnt = 1
            out.append(bid)
        return out

    def touch(self, block_id: int) -> None:
        """Add a reference to an existing (cached) block, reviving it if it was cached-free."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self._cached_free[block_id]
        block.ref_cnt += 1

    def release(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes cached-free (if hashed) or free."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"double free of block {block_id}"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.cache_key is not None:
                self._cached_free[block_id] = None  # most recently freed -> evicted last
            else:
                self._free[block_id] = None

    def check_invariants(self) -> None:
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert len(self._free) + len(self._cached_free) + len(used) == self.num_blocks
        assert not (self._free.keys() & self._cached_free.keys())
        for b in self.blocks:
            assert b.ref_cnt >= 0, b
            if b.ref_cnt == 0:
                assert (b.block_id in self._cached_free) == (b.cache_key is not None), b
                assert (b.block_id in self._free) == (b.cache_key is None), b
            else:
                assert b.block_id not in self._free and b.block_id not in self._cached_free, b
            if b.cache_key is not None:
                assert self._cached.get(b.cache_key) == b.block_id, b
        for key, bid in self._cached.items():
            assert self.blocks[bid].cache_key == key
        if not self.enable_prefix_caching:
            assert not self._cached
