"""KV cache blocks: allocation, prefix reuse, sliding-window release, ref counts.

Pure Python, no tensors. The scheduler owns the one `KVCacheManager`; the model runner only
reads the block tables the scheduler hands it for a step. A block id indexes the K/V
tensors `[num_blocks, block_size, nKV, D]` of its group's layers (see
`model_runner.kv_layout`); token position p lives in logical block p // block_size at
offset p % block_size, so its flat cache slot is
`block_table[p // block_size] * block_size + p % block_size`.

Layers are split into KV groups (`group_windows[g]` is None for full attention, W for
a sliding window of W keys). Every request has one block table per group; all groups
draw from ONE `BlockPool`, so they share the memory budget.

Draft groups (`group_lookahead[g]` = L, not None): a speculative drafter's own layers
(the DSpark draft's context K/V). They hold positions [0, end + L) where the target
groups hold [0, end): the L extra positions are the draft's block rows, scratch it
writes and reads within one proposal. A draft group is never prefix-cached: its blocks
are never hashed, and on a prefix hit its table starts with NULL_BLOCK entries for the
hit blocks (the drafter was given no rows there and masks them out).

Block states and eviction live in `block_pool.py`.

Design choices:

* No block is reserved: -1 is the null entry of a block table (a sliding block that
  fell out of the window). Attention never reads entries before
  `(first_query_pos - W + 1) // block_size`, which is exactly what is released here.
* Block hash = sha256(parent_digest || int64 token ids of the block) — chained, so the
  same block content after a different prefix gets a different hash; stable across
  processes. The cache key is `(group, hash)` because each group's layers hold
  different K/V for the same tokens.
* A block is hashed once all its tokens are computed (`cache_full_blocks`, also done
  by `allocate_slots` for the tokens it is told are computed). Sliding groups are hashed
  too; a sliding-group prefix hit only needs the blocks the window can still reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .block_pool import NULL_BLOCK, BlockHash, BlockPool, hash_block, salt_root


@dataclass
class _RequestState:
    tables: list[list[int]]  # per group, indexed by logical block; NULL_BLOCK = released
    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of full blocks
    root: BlockHash | None = None  # the chain's root: the request's cache salt, hashed (None: unsalted)
    num_hashed: list[int] = field(default_factory=list)  # per group: leading blocks already registered


class KVCacheManager:
    """Block tables of every request in every KV group, over one shared `BlockPool`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        group_windows: Sequence[int | None],
        enable_prefix_caching: bool = True,
        group_lookahead: Sequence[int | None] | None = None,
    ) -> None:
        if not group_windows:
            raise ValueError("need at least one KV group")
        for w in group_windows:
            if w is not None and w <= 0:
                raise ValueError(f"sliding window must be positive, got {w}")
        lookahead = [None] * len(group_windows) if group_lookahead is None else list(group_lookahead)
        if len(lookahead) != len(group_windows) or any(n is not None and n < 0 for n in lookahead):
            raise ValueError(
                f"group_lookahead must give None or a count >= 0 per group ({len(group_windows)}), got {lookahead}"
            )
        if all(n is not None for n in lookahead):
            raise ValueError("group_lookahead: at least one group must be an ordinary (target) group")
        self.block_size = block_size
        self.group_windows: list[int | None] = list(group_windows)
        self.group_lookahead: list[int | None] = lookahead
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._requests: dict[str, _RequestState] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    # -- small helpers ----------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-free blocks count as free)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def _cached_group(self, group: int) -> bool:
        """Whether `group` takes part in prefix caching (every group but the draft groups)."""
        return self.group_lookahead[group] is None

    def _first_reachable_block(self, group: int, first_query_pos: int) -> int:
        """Lowest logical block a query at >= first_query_pos can read in `group`."""
        w = self.group_windows[group]
        return 0 if w is None else max(0, first_query_pos - w + 1) // self.block_size

    def _hashes(
        self, token_ids: Sequence[int], n_blocks: int, known: list[BlockHash], root: BlockHash | None = None
    ) -> list[BlockHash]:
        """Extend `known` (in place) to the chained hashes of the first n_blocks full blocks;
        the chain starts from `root` (a cache salt's hash), so salted blocks match only
        blocks of the same salt."""
        bs = self.block_size
        while len(known) < n_blocks:
            i = len(known)
            known.append(hash_block(known[-1] if known else root, token_ids[i * bs : (i + 1) * bs]))
        return known

    def _cached_prefix(self, token_ids: Sequence[int], root: BlockHash | None) -> tuple[int, list[BlockHash]]:
        """Longest number of leading blocks usable from the cache in every group."""
        bs = self.block_size
        max_blocks = max(0, len(token_ids) - 1) // bs  # at least one token must be computed
        if not self.enable_prefix_caching or max_blocks == 0:
            return 0, []
        hashes = self._hashes(token_ids, max_blocks, [], root)
        present = [[self.pool.lookup((g, h)) is not None for h in hashes] for g in range(self.num_groups)]
        # Full groups need every block of the prefix (draft groups need none).
        k = max_blocks
        for g, w in enumerate(self.group_windows):
            if w is None and self._cached_group(g):
                n = 0
                while n < k and present[g][n]:
                    n += 1
                k = n
        # Sliding groups need only the blocks the next query (at k * bs) can reach.
        while k > 0 and not all(
            all(present[g][self._first_reachable_block(g, k * bs) : k])
            for g, w in enumerate(self.group_windows)
            if w is not None and self._cached_group(g)
        ):
            k -= 1
        return k, hashes[:k]

    # -- public API -------------------------------------------------------------
    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Prompt tokens whose KV is already cached (a multiple of block_size, < len(token_ids))
        under `cache_salt` (requests with different salts never share blocks).

        A pure lookup: nothing is claimed until `allocate_slots`, which must follow
        before any other allocation could evict the hit blocks.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        k, _ = self._cached_prefix(token_ids, salt_root(cache_salt))
        self.prefix_queries += len(token_ids)
        self.prefix_hits += k * self.block_size
        return k * self.block_size

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        cache_salt: str | None = None,
    ) -> bool:
        """Make positions [0, num_computed_tokens + num_new_tokens) writable/readable in every group.

        For a request without blocks, `num_computed_tokens` must be 0 or the value
        `get_computed_blocks` just returned: those blocks are shared from the cache.
        Full blocks below `num_computed_tokens` get hashed; sliding-group blocks the
        queries at >= num_computed_tokens cannot reach are released (-1). A draft group
        holds [0, total + its lookahead).
        Returns False and changes nothing when the pool cannot supply the blocks.
        `cache_salt` applies to a request without blocks (it is kept for the request's life).

        (Over 60 lines on purpose: lookup, plan and commit stay in one function so that the
        all-or-nothing rule is visible in one place; nothing is changed before the commit.)
        """
        bs = self.block_size
        c, total = num_computed_tokens, num_computed_tokens + num_new_tokens
        if c < 0 or num_new_tokens < 0 or c > len(token_ids):
            raise ValueError(f"bad token counts: computed={c}, new={num_new_tokens}, len={len(token_ids)}")
        state = self._requests.get(request_id)
        hit_blocks: list[list[int]] = [[] for _ in range(self.num_groups)]
        if state is None:
            if c % bs:
                raise ValueError(f"a new request's computed tokens must be whole cached blocks, got {c}")
            k = c // bs
            root = salt_root(cache_salt)
            hashes = self._hashes(token_ids, k, [], root)
            for g in range(self.num_groups):
                first = self._first_reachable_block(g, c) if self._cached_group(g) else len(hashes)
                for i, h in enumerate(hashes):
                    bid = self.pool.lookup((g, h)) if i >= first else NULL_BLOCK
                    if bid is None:
                        raise ValueError(f"block {i} of {request_id!r} is not cached (any more)")
                    hit_blocks[g].append(bid)
            tables = [list(t) for t in hit_blocks]
        else:
            tables = state.tables  # only read until the commit below

        # Plan: what to release and how many blocks to add per group.
        to_release: list[list[int]] = []
        to_add: list[tuple[int, int]] = []  # (first new logical index, n new blocks) per group
        for g, table in enumerate(tables):
            first = self._first_reachable_block(g, c)
            to_release.append([i for i in range(min(first, len(table))) if table[i] != NULL_BLOCK])
            start = max(len(table), first)
            end = -(-(total + (self.group_lookahead[g] or 0)) // bs)
            to_add.append((start, max(0, end - start)))
        need = sum(n for _, n in to_add)
        revived = {b for hb in hit_blocks for b in hb if b != NULL_BLOCK and self.pool.blocks[b].ref_cnt == 0}
        # Blocks only this request holds become allocatable once released.
        freed = sum(1 for g, idx in enumerate(to_release) for i in idx if self.pool.blocks[tables[g][i]].ref_cnt == 1)
        if need + len(revived) > self.pool.num_free_blocks + freed:
            return False

        # Commit.
        if state is None:
            for hb in hit_blocks:
                for b in hb:
                    if b != NULL_BLOCK:
                        self.pool.touch(b)
            state = _RequestState(tables=tables, hashes=hashes, root=root, num_hashed=[len(t) for t in tables])
            self._requests[request_id] = state
        self._register_full_blocks(state, token_ids, c)
        for g, idx in enumerate(to_release):
            for i in reversed(idx):
                self.pool.release(tables[g][i])
                tables[g][i] = NULL_BLOCK
        for g, (start, n) in enumerate(to_add):
            table = tables[g]
            table.extend([NULL_BLOCK] * (start - len(table)))
            table.extend(self.pool.allocate(n))
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the hashes of blocks that are full and computed (call after each step)."""
        self._register_full_blocks(self._requests[request_id], token_ids, num_computed_tokens)

    def _register_full_blocks(self, state: _RequestState, token_ids: Sequence[int], num_computed: int) -> None:
        if not self.enable_prefix_caching:
            return
        n_full = min(num_computed, len(token_ids)) // self.block_size
        if all(n >= n_full for n in state.num_hashed):
            return
        self._hashes(token_ids, n_full, state.hashes, state.root)
        for g, table in enumerate(state.tables):
            if not self._cached_group(g):  # never hashed: counted as done
                state.num_hashed[g] = max(state.num_hashed[g], n_full)
                continue
            for i in range(state.num_hashed[g], min(n_full, len(table))):
                bid = table[i]
                if bid != NULL_BLOCK and self.pool.blocks[bid].cache_key is None:
                    self.pool.register(bid, (g, state.hashes[i]))  # duplicate content: stays unhashed
            state.num_hashed[g] = max(state.num_hashed[g], min(n_full, len(table)))

    def free(self, request_id: str) -> None:
        """Release every block of the request (finish, abort or preemption). Unknown ids are ignored."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        # Tail blocks first, so a chain's tail is evicted before its head.
        for table in state.tables:
            for bid in reversed(table):
                if bid != NULL_BLOCK:
                    self.pool.release(bid)

    def block_table(self, request_id: str, group: int) -> list[int]:
        """Logical block index -> block id (NULL_BLOCK = released); a copy."""
        return list(self._requests[request_id].tables[group])

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Every group's block table of the request: the manager's own lists, not copies.
        Read-only for the caller, and valid only until the next allocate/free call."""
        return self._requests[request_id].tables

    def num_held_blocks(self, request_id: str, group: int) -> int:
        return sum(1 for b in self._requests[request_id].tables[group] if b != NULL_BLOCK)

    def slot_mapping(self, request_id: str, group: int, positions: Sequence[int]) -> list[int]:
        """Flat cache slot of each position: block_id * block_size + offset."""
        table = self._requests[request_id].tables[group]
        bs = self.block_size
        out = []
        for p in positions:
            i = p // bs
            if p < 0 or i >= len(table) or table[i] == NULL_BLOCK:
                raise IndexError(f"position {p} of {request_id!r} has no block in group {group}")
            out.append(table[i] * bs + p % bs)
        return out

    def check_invariants(self) -> None:
        """Pool partition is exact and every ref count equals the table entries pointing at it."""
        self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        for rid, state in self._requests.items():
            seen: set[int] = set()
            for table in state.tables:
                for bid in table:
                    if bid != NULL_BLOCK:
                        assert bid not in seen, f"block {bid} twice in {rid!r}"
                        seen.add(bid)
                        refs[bid] += 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs[b.block_id], (b, refs[b.block_id])
