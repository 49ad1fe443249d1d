"""KV block manager: allocation, prefix caching, sliding-window release, invariants (CPU only)."""

from __future__ import annotations

import math
import random

import pytest

from musespark.engine.block_manager import KVCacheManager
from musespark.engine.block_pool import NULL_BLOCK, BlockPool, hash_block, num_blocks_for_budget

BS = 4


def snapshot(m: KVCacheManager):
    """Everything observable about the manager's state, to prove an operation changed nothing."""
    pool = m.pool
    return (
        {rid: ([list(t) for t in s.tables], list(s.num_hashed)) for rid, s in m._requests.items()},
        [(b.ref_cnt, b.cache_key) for b in pool.blocks],
        list(pool._free),
        list(pool._cached_free),
        dict(pool._cached),
    )


def grow(m: KVCacheManager, rid: str, tokens: list[int], computed: int, n: int) -> bool:
    """One scheduler step: allocate, 'compute', register full blocks; invariants checked."""
    ok = m.allocate_slots(rid, tokens[: computed + n], computed, n)
    m.check_invariants()
    if ok:
        m.cache_full_blocks(rid, tokens, computed + n)
        m.check_invariants()
    return ok


def test_num_blocks_for_budget():
    # one block = 2 (K,V) * 3 layers * 4 tokens * 2 heads * 8 dim * 2 bytes = 768 bytes
    assert num_blocks_for_budget(768 * 10 + 767, 4, 3, 2, 8, 2) == 10
    assert num_blocks_for_budget(767, 4, 3, 2, 8, 2) == 0
    with pytest.raises(ValueError):
        num_blocks_for_budget(1000, 0, 3, 2, 8, 2)


def test_hash_is_chained_and_deterministic():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])


def test_allocate_and_grow_block_by_block():
    m = KVCacheManager(num_blocks=10, block_size=BS, group_windows=[None, None])
    tokens = list(range(100, 130))
    assert grow(m, "a", tokens, 0, 1)
    for g in range(2):
        assert len(m.block_table("a", g)) == 1
    for c in range(1, 17):
        assert grow(m, "a", tokens, c, 1)
        for g in range(2):
            table = m.block_table("a", g)
            assert len(table) == math.ceil((c + 1) / BS)
            assert len(set(table)) == len(table) and NULL_BLOCK not in table
            assert m.slot_mapping("a", g, [c]) == [table[c // BS] * BS + c % BS]
    assert m.pool.num_used_blocks == 2 * 5
    assert m.usage() == 1.0
    assert m.num_free_blocks == 0
    # groups never share a block
    assert not set(m.block_table("a", 0)) & set(m.block_table("a", 1))
    # full pool: the next block cannot be had
    assert not grow(m, "a", tokens, 20, 1)
    m.free("a")
    m.check_invariants()
    assert m.num_free_blocks == 10 and m.usage() == 0.0
    assert not m.has_request("a")


def test_out_of_blocks_returns_false_without_partial_changes():
    m = KVCacheManager(num_blocks=5, block_size=BS, group_windows=[None, None])
    tokens = list(range(40))
    assert grow(m, "a", tokens, 0, 8)  # 2 blocks per group = 4 blocks
    before = snapshot(m)
    # new request needs 2 blocks (one per group), only 1 free
    assert not m.allocate_slots("b", tokens[:3], 0, 3)
    m.check_invariants()
    assert snapshot(m) == before and not m.has_request("b")
    # growing "a" would fit in group 0 but not in group 1: nothing may change
    assert not m.allocate_slots("a", tokens[:9], 8, 1)
    m.check_invariants()
    assert snapshot(m) == before
    # a request with cached prefix blocks that cannot get its new blocks claims nothing
    m.free("a")
    m.check_invariants()
    assert grow(m, "c", [7] * 40, 0, 8)  # 4 blocks used, 1 free; "a"'s blocks evicted
    hit = m.get_computed_blocks("d", [7] * 17)
    assert hit == 8
    before = snapshot(m)
    assert not m.allocate_slots("d", [7] * 17, hit, 9)  # needs 3 blocks per group
    m.check_invariants()
    assert snapshot(m) == before


def test_free_returns_everything():
    m = KVCacheManager(num_blocks=32, block_size=BS, group_windows=[None, 6])
    for i, rid in enumerate(["a", "b", "c"]):
        tokens = [i * 1000 + t for t in range(30)]
        assert grow(m, rid, tokens, 0, 13)
        assert grow(m, rid, tokens, 13, 7)
    assert m.pool.num_used_blocks > 0
    for rid in ["b", "a", "c"]:
        m.free(rid)
        m.check_invariants()
    assert m.num_free_blocks == 32 and m.pool.num_used_blocks == 0
    assert all(b.ref_cnt == 0 for b in m.pool.blocks)
    m.free("never-seen")  # harmless
    m.check_invariants()


def test_prefix_hit_shares_blocks_and_ref_counts():
    m = KVCacheManager(num_blocks=20, block_size=BS, group_windows=[None])
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2 tokens
    assert m.get_computed_blocks("a", prompt) == 0
    assert grow(m, "a", prompt, 0, 10)
    a_table = m.block_table("a", 0)

    hit = m.get_computed_blocks("b", prompt)
    assert hit == 8 and hit % BS == 0 and hit < len(prompt)
    assert m.prefix_queries == 20 and m.prefix_hits == 8
    assert grow(m, "b", prompt, hit, len(prompt) - hit)
    b_table = m.block_table("b", 0)
    assert b_table[:2] == a_table[:2] and b_table[2] != a_table[2]
    assert [m.pool.blocks[b].ref_cnt for b in b_table] == [2, 2, 1]
    assert m.pool.num_used_blocks == 4

    # a prompt that is exactly the cached blocks still computes its last token
    assert m.get_computed_blocks("c", prompt[:8]) == 4

    m.free("a")
    m.check_invariants()
    assert [m.pool.blocks[b].ref_cnt for b in b_table] == [1, 1, 1]
    m.free("b")
    m.check_invariants()
    assert m.pool.num_used_blocks == 0
    assert m.pool.num_cached_free_blocks == 2  # the two hashed full blocks stay cached
    # and are still hit after both owners left
    assert m.get_computed_blocks("d", prompt + [99]) == 8
    assert grow(m, "d", prompt + [99], 8, 3)
    assert m.block_table("d", 0)[:2] == a_table[:2]
    assert m.pool.num_cached_free_blocks == 0


def test_same_block_after_different_prefix_does_not_hit():
    m = KVCacheManager(num_blocks=20, block_size=BS, group_windows=[None])
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert grow(m, "a", a, 0, len(a))
    # second block identical but preceded by a different first block: no hit at all
    assert m.get_computed_blocks("b", [9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0
    # same first block, different second block: only the first block hits
    assert m.get_computed_blocks("c", [1, 2, 3, 4, 0, 0, 0, 0, 9]) == 4
    m.check_invariants()


def test_duplicate_content_computed_twice_is_cached_once():
    m = KVCacheManager(num_blocks=20, block_size=BS, group_windows=[None])
    p = list(range(9))
    assert grow(m, "a", p, 0, 9)
    assert grow(m, "b", p, 0, 9)  # computed without a lookup: same content, new blocks
    assert len(m.pool._cached) == 2
    m.free("a")
    m.free("b")
    m.check_invariants()
    assert m.pool.num_cached_free_blocks == 2


def test_lru_eviction_order():
    m = KVCacheManager(num_blocks=6, block_size=BS, group_windows=[None])
    a, b = [1] * 8 + [0], [2] * 8 + [0]
    assert grow(m, "a", a, 0, 9)  # 3 blocks, 2 hashed
    assert grow(m, "b", b, 0, 9)
    a_blocks, b_blocks = m.block_table("a", 0), m.block_table("b", 0)
    m.free("a")  # freed first -> evicted first
    m.check_invariants()
    m.free("b")
    m.check_invariants()
    assert m.pool.num_cached_free_blocks == 4 and m.num_free_blocks == 6

    # two plain free blocks (the partial tails) are used before any cached block
    assert grow(m, "x", [3] * 7, 0, 7)
    assert set(m.block_table("x", 0)) == {a_blocks[2], b_blocks[2]}
    assert m.get_computed_blocks("qa", a) == 8 and m.get_computed_blocks("qb", b) == 8

    # the next block evicts "a"'s tail block (least recently freed, tail first)
    assert grow(m, "x", [3] * 9, 7, 2)
    assert m.block_table("x", 0)[2] == a_blocks[1]
    assert m.get_computed_blocks("qa", a) == 4 and m.get_computed_blocks("qb", b) == 8
    assert grow(m, "x", [3] * 13, 9, 4)
    assert m.block_table("x", 0)[3] == a_blocks[0]
    assert m.get_computed_blocks("qa", a) == 0 and m.get_computed_blocks("qb", b) == 8

    # a hit revives "b"'s blocks; once freed again they are the most recent
    m.free("x")
    m.check_invariants()
    assert grow(m, "y", b, 8, 1)
    m.free("y")
    m.check_invariants()
    assert list(m.pool._cached_free)[-2:] == [b_blocks[1], b_blocks[0]]


def check_sliding_table(m: KVCacheManager, rid: str, g: int, first_query: int, seq_len: int) -> None:
    """Entries the window can reach are real blocks; everything before is released."""
    w = m.group_windows[g]
    first = max(0, first_query - w + 1) // BS
    last = (seq_len - 1) // BS
    table = m.block_table(rid, g)
    assert len(table) == last + 1
    assert all(b == NULL_BLOCK for b in table[:first]), table
    assert all(b != NULL_BLOCK for b in table[first:]), table
    assert m.num_held_blocks(rid, g) == last - first + 1


@pytest.mark.parametrize("window", [8, 6, 1])
def test_sliding_window_memory_bounded_while_full_group_grows(window):
    m = KVCacheManager(num_blocks=300, block_size=BS, group_windows=[None, window])
    n_total = 50 * max(window, 8)
    tokens = [random.Random(0).randrange(50) for _ in range(n_total)]
    assert grow(m, "a", tokens, 0, 5)
    check_sliding_table(m, "a", 1, 0, 5)
    bound = math.ceil(window / BS) + 1
    for c in range(5, n_total):
        assert grow(m, "a", tokens, c, 1)
        check_sliding_table(m, "a", 1, c, c + 1)
        assert m.num_held_blocks("a", 1) <= bound
        assert len(m.block_table("a", 0)) == math.ceil((c + 1) / BS)
        assert m.slot_mapping("a", 1, [c])[0] // BS == m.block_table("a", 1)[c // BS]
    assert m.num_held_blocks("a", 0) == n_total // BS
    with pytest.raises(IndexError):
        m.slot_mapping("a", 1, [0])
    m.free("a")
    m.check_invariants()
    assert m.pool.num_used_blocks == 0


def test_sliding_window_chunked_prefill_releases_between_chunks():
    w, chunk = 8, 12
    m = KVCacheManager(num_blocks=100, block_size=BS, group_windows=[w])
    tokens = list(range(120))
    for c in range(0, 120, chunk):
        assert grow(m, "a", tokens, c, chunk)
        check_sliding_table(m, "a", 0, c, c + chunk)
        assert m.num_held_blocks("a", 0) <= math.ceil(w / BS) + 1 + math.ceil(chunk / BS)


def test_sliding_group_prefix_hit_needs_only_window_blocks():
    w = 8
    m = KVCacheManager(num_blocks=40, block_size=BS, group_windows=[None, w])
    prompt = list(range(1, 22))  # 21 tokens, 5 full blocks
    assert grow(m, "a", prompt, 0, 21)
    assert grow(m, "a", prompt + [0], 21, 1)  # releases sliding blocks 0..2 (cached-free)
    hit = m.get_computed_blocks("b", prompt)
    assert hit == 20
    assert grow(m, "b", prompt, hit, 1)
    sliding = m.block_table("b", 1)
    first = (20 - w + 1) // BS  # = 3
    assert sliding[:first] == [NULL_BLOCK] * first
    assert sliding[first:5] == m.block_table("a", 1)[first:5]
    assert m.block_table("b", 0)[:5] == m.block_table("a", 0)[:5]
    m.free("a")
    m.free("b")
    m.check_invariants()
    # evict the sliding group's early blocks: the full-length hit survives because the
    # window of a query at position 20 never reads them
    early = [m.pool.lookup((1, _hash_prefix(prompt, i + 1))) for i in range(3)]
    assert None not in early
    for bid in reversed(early):
        m.pool._cached_free.move_to_end(bid, last=False)  # make them the next to evict
    taken = m.pool.allocate(m.pool.num_free_blocks - m.pool.num_cached_free_blocks + 3)
    m.pool.check_invariants()
    assert all(m.pool.blocks[b].cache_key is None for b in early)
    assert m.get_computed_blocks("c", prompt) == 20
    # a shorter hit would need exactly those sliding blocks: the window at 12 reads
    # blocks 1..2, at 8 and 4 block 0, so nothing can be reused
    assert m.get_computed_blocks("d", prompt[:12] + [0] * 9) == 0
    for bid in taken:
        m.pool.release(bid)
    m.check_invariants()


def _hash_prefix(tokens: list[int], n_blocks: int) -> bytes:
    h = None
    for i in range(n_blocks):
        h = hash_block(h, tokens[i * BS : (i + 1) * BS])
    return h


def test_abort_in_the_middle_of_prefill():
    m = KVCacheManager(num_blocks=30, block_size=BS, group_windows=[None, 6])
    prompt = list(range(40))
    assert grow(m, "a", prompt, 0, 8)
    assert grow(m, "a", prompt, 8, 8)
    assert grow(m, "b", [5] * 10, 0, 10)
    m.free("a")  # abort: prefill stopped at 16 of 40 tokens
    m.check_invariants()
    assert not m.has_request("a")
    assert m.pool.num_used_blocks == 2 * 3  # only "b"
    # the chunks computed before the abort stay reusable
    assert m.get_computed_blocks("a2", prompt) == 16
    assert grow(m, "a2", prompt, 16, 24)
    m.free("a2")
    m.free("b")
    m.check_invariants()
    assert m.pool.num_used_blocks == 0


def test_prefix_caching_disabled():
    m = KVCacheManager(num_blocks=20, block_size=BS, group_windows=[None], enable_prefix_caching=False)
    p = list(range(13))
    assert grow(m, "a", p, 0, 13)
    m.free("a")
    m.check_invariants()
    assert m.get_computed_blocks("b", p) == 0
    assert m.pool.num_cached_free_blocks == 0


def test_bad_arguments():
    m = KVCacheManager(num_blocks=8, block_size=BS, group_windows=[None])
    with pytest.raises(ValueError):
        m.allocate_slots("a", list(range(8)), 3, 1)  # new request, not whole cached blocks
    with pytest.raises(ValueError):
        m.allocate_slots("a", list(range(8)), 4, 1)  # claims a prefix that is not cached
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=8, block_size=BS, group_windows=[0])
    with pytest.raises(ValueError):
        BlockPool(0, BS)
    m.check_invariants()


def test_check_invariants_catches_corruption():
    m = KVCacheManager(num_blocks=8, block_size=BS, group_windows=[None])
    assert grow(m, "a", list(range(9)), 0, 9)
    m.pool.blocks[m.block_table("a", 0)[0]].ref_cnt += 1
    with pytest.raises(AssertionError):
        m.check_invariants()


# -- randomized stress: a fake KV cache proves every read sees the right token --------


class FakeEngine:
    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.cache = [dict() for _ in m.group_windows]  # per group: slot -> (position, token)
        self.reqs: dict[str, dict] = {}  # rid -> {tokens, prompt_len, computed, started}

    def step(self, rid: str, n: int) -> bool:
        m, r = self.m, self.reqs[rid]
        tokens, c = r["tokens"], r["computed"]
        if not r["started"]:
            c = m.get_computed_blocks(rid, tokens[: r["prompt_len"]])
            assert c % BS == 0 and c < r["prompt_len"]
            n = min(n, len(tokens) - c)
        ok = m.allocate_slots(rid, tokens[: c + n], c, n)
        m.check_invariants()
        if not ok:
            return False
        r["started"] = True
        for g, w in enumerate(m.group_windows):
            slots = m.slot_mapping(rid, g, range(c, c + n))
            assert len(set(slots)) == n
            for p, s in zip(range(c, c + n), slots):
                # never write into a block another request can read
                assert m.pool.blocks[s // BS].ref_cnt == 1
                self.cache[g][s] = (p, tokens[p])
            first = 0 if w is None else max(0, c - w + 1)
            for p, s in zip(range(first, c + n), m.slot_mapping(rid, g, range(first, c + n))):
                assert self.cache[g].get(s) == (p, tokens[p]), (rid, g, p)
            if w is not None:
                assert m.num_held_blocks(rid, g) <= math.ceil((w - 1 + n) / BS) + 1
        r["computed"] = c + n
        m.cache_full_blocks(rid, tokens, c + n)
        m.check_invariants()
        return True

    def free(self, rid: str) -> None:
        self.m.free(rid)
        self.m.check_invariants()
        del self.reqs[rid]


@pytest.mark.parametrize(
    "windows,num_blocks,seed", [([None], 48, 0), ([None, 6], 48, 1), ([9, None, 4], 60, 2), ([5], 10, 3)]
)
def test_randomized_stress(windows, num_blocks, seed):
    rng = random.Random(seed)
    m = KVCacheManager(num_blocks=num_blocks, block_size=BS, group_windows=windows)
    eng = FakeEngine(m)
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    next_id, finished, failures = 0, 0, 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.2 and len(eng.reqs) < 8:
            prompt = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(1, 10))]
            total = len(prompt) + rng.randrange(1, 30)
            tokens = prompt + [rng.randrange(6) for _ in range(total - len(prompt))]
            eng.reqs[f"r{next_id}"] = dict(tokens=tokens, prompt_len=len(prompt), computed=0, started=False)
            next_id += 1
        elif op < 0.9 and eng.reqs:
            rid = rng.choice(sorted(eng.reqs))
            r = eng.reqs[rid]
            left = len(r["tokens"]) - r["computed"]
            if left == 0:
                eng.free(rid)  # finished
                finished += 1
                continue
            n = 1 if r["computed"] >= r["prompt_len"] else rng.randrange(1, left + 1)
            if not eng.step(rid, n):
                failures += 1
                # preempt by recompute: drop a running request and start it over later
                victims = sorted(k for k, v in eng.reqs.items() if v["started"])
                if victims:
                    victim = rng.choice(victims)
                    tokens, plen = eng.reqs[victim]["tokens"], eng.reqs[victim]["prompt_len"]
                    eng.free(victim)
                    eng.reqs[victim] = dict(tokens=tokens, prompt_len=plen, computed=0, started=False)
        elif eng.reqs:
            eng.free(rng.choice(sorted(eng.reqs)))  # abort at any point
    for rid in sorted(eng.reqs):
        eng.free(rid)
    assert m.pool.num_used_blocks == 0 and m.num_free_blocks == num_blocks
    assert finished > 10 and failures > 0  # the run really exercised completion and pressure
    assert m.prefix_hits > 0


# -- the tables drive the real paged attention: same result as attention without a cache --


def test_block_tables_drive_paged_attention():
    torch = pytest.importorskip("torch")
    from musespark.layers.attention import AttentionContext, KVGroup, paged_attention

    window, n_heads, n_kv, dim, vocab = 6, 2, 1, 8, 11
    gen = torch.Generator().manual_seed(0)
    tq, tk, tv = (torch.randn(vocab, h, dim, generator=gen) for h in (n_heads, n_kv, n_kv))
    tpos = torch.randn(128, 1, dim, generator=gen)
    windows = [None, window]  # layer 0: full attention (group 0), layer 1: sliding (group 1)

    def qkv(tokens, positions):
        ids, pos = torch.tensor([tokens[p] for p in positions]), torch.tensor(positions)
        return tq[ids] + tpos[pos], tk[ids] + tpos[pos], tv[ids] - tpos[pos], pos

    m = KVCacheManager(num_blocks=40, block_size=BS, group_windows=windows)
    caches = [(torch.zeros(40, BS, n_kv, dim), torch.zeros(40, BS, n_kv, dim)) for _ in windows]

    outputs = {rid: [[] for _ in windows] for rid in "ab"}

    def check_against_uncached(rid, tokens, start):
        """Rows computed step by step through the cache == one uncached pass over the sequence."""
        length = start + sum(t.shape[0] for t in outputs[rid][0])
        q, k, v, pos = qkv(tokens, list(range(length)))
        for layer, w in enumerate(windows):
            ref = paged_attention(q, k, v, pos, AttentionContext.for_prompts([length]), layer, 0.5, w)
            torch.testing.assert_close(torch.cat(outputs[rid][layer]), ref[start:], rtol=1e-5, atol=1e-5)

    def step(rid, tokens, c, n):
        assert m.allocate_slots(rid, tokens[: c + n], c, n)
        m.check_invariants()
        positions = list(range(c, c + n))
        groups = [
            KVGroup(
                slot_mapping=torch.tensor(m.slot_mapping(rid, g, positions)),
                block_tables=torch.tensor([m.block_table(rid, g)]),
            )
            for g in range(len(windows))
        ]
        ctx = AttentionContext([0, n], [c + n], kv_caches=caches, groups=groups, layer_group=[0, 1])
        q, k, v, pos = qkv(tokens, positions)
        for layer, w in enumerate(windows):
            outputs[rid][layer].append(paged_attention(q, k, v, pos, ctx, layer, 0.5, w))
        m.cache_full_blocks(rid, tokens, c + n)
        m.check_invariants()

    rng = random.Random(5)
    a = [rng.randrange(vocab) for _ in range(60)]
    b = a[:17] + [rng.randrange(vocab) for _ in range(40)]
    for c, n in [(0, 8), (8, 8), (16, 3)]:  # chunked prefill of "a"
        step("a", a, c, n)
    hit = m.get_computed_blocks("b", b[:20])
    assert hit == 16
    step("b", b, hit, 20 - hit)  # "b" reuses "a"'s blocks in both groups
    assert m.block_table("b", 0)[:4] == m.block_table("a", 0)[:4]
    for i in range(10):  # interleaved decode; sliding blocks get released as both grow
        step("a", a, 19 + i, 1)
        step("b", b, 20 + i, 1)
    assert m.block_table("a", 1)[:4] == [NULL_BLOCK] * 4
    check_against_uncached("a", a, 0)
    check_against_uncached("b", b, hit)  # "b" computed only from its first uncached token
    m.free("a")
    m.free("b")
    m.check_invariants()
    assert m.pool.num_used_blocks == 0


def test_draft_group_holds_lookahead_and_is_never_prefix_cached():
    """A draft group (group_lookahead not None) holds `lookahead` positions past the target's,
    is never hashed, starts with NULL entries on a prefix hit, and is freed with the request."""
    m = KVCacheManager(num_blocks=40, block_size=BS, group_windows=[None, None], group_lookahead=[None, 5])
    tokens = list(range(200, 230))
    assert grow(m, "a", tokens, 0, 9)
    assert len(m.block_table("a", 0)) == 3 and len(m.block_table("a", 1)) == math.ceil((9 + 5) / BS)
    assert all(key[0] == 0 for key in m.pool._cached)  # only the target group registers blocks
    m.free("a")
    m.check_invariants()
    hit = m.get_computed_blocks("b", tokens[:13])
    assert hit == 8  # the target's two full blocks; the draft group is not asked for any
    assert m.allocate_slots("b", tokens[:13], hit, 5)
    m.check_invariants()
    draft = m.block_table("b", 1)
    assert draft[:2] == [NULL_BLOCK, NULL_BLOCK] and len(draft) == math.ceil((13 + 5) / BS)
    assert all(b != NULL_BLOCK for b in draft[2:])
    m.free("b")
    assert m.pool.num_used_blocks == 0


def test_draft_group_runs_out_with_the_target():
    """All-or-nothing over the draft group too: a request whose draft lookahead does not fit
    gets no blocks at all."""
    m = KVCacheManager(num_blocks=5, block_size=BS, group_windows=[None, None], group_lookahead=[None, 8])
    before = snapshot(m)
    assert not m.allocate_slots("a", list(range(12)), 0, 12)  # 3 target + 5 draft blocks > 5
    assert snapshot(m) == before
    assert m.allocate_slots("a", list(range(4)), 0, 4)  # 1 + 3
    assert m.num_free_blocks == 1
    with pytest.raises(ValueError, match="group_lookahead"):
        KVCacheManager(num_blocks=5, block_size=BS, group_windows=[None], group_lookahead=[3])
    with pytest.raises(ValueError, match="group_lookahead"):
        KVCacheManager(num_blocks=5, block_size=BS, group_windows=[None, None], group_lookahead=[None])


def test_num_blocks_for_budget_counts_extra_bytes():
    assert num_blocks_for_budget(768 * 10, 4, 3, 2, 8, 2, extra_bytes_per_block=256) == 7
    with pytest.raises(ValueError, match="extra_bytes_per_block"):
        num_blocks_for_budget(768, 4, 3, 2, 8, 2, extra_bytes_per_block=-1)
