"""Scheduler unit tests with a fake model runner: no model, no tensors, milliseconds.

The fake runner plays the model's part against the KV cache manager: every step it
writes a digest of each computed position's context into the flat slot that
`slot_mapping` names, reads back every position the step's queries attend to (the
window, for sliding groups) and checks it holds the right digest, then "samples" a
token derived from the whole context. So a block that is shared, reused or evicted
wrongly shows up as a wrong read, and a lost or duplicated token as a wrong output.

Invariants are checked after every `schedule()` and every `update()`.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import random
from collections.abc import Sequence

import pytest

from musespark.config import CacheConfig, SchedulerConfig
from musespark.engine.args import EngineArgs
from musespark.engine.block_manager import NULL_BLOCK, KVCacheManager
from musespark.engine.request import Request, RequestStatus
from musespark.engine.scheduler import ScheduledBatch, Scheduler
from musespark.sampling_params import SamplingParams

# -- construction (works with today's `Scheduler(config, kv)` and the new signature) ---------


def make_scheduler(
    *,
    num_blocks: int,
    block_size: int = 4,
    group_windows: Sequence[int | None] = (None,),
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    group_lookahead: Sequence[int | None] | None = None,
) -> tuple[Scheduler, KVCacheManager]:
    """A scheduler and its KV cache manager (the `kv` the tests inspect)."""
    config = SchedulerConfig(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    cache = CacheConfig(
        block_size=block_size,
        kv_cache_memory=None,
        kv_cache_fraction=EngineArgs.kv_cache_fraction,
        enable_prefix_caching=enable_prefix_caching,
        kv_cache_dtype=EngineArgs.kv_cache_dtype,
    )
    if "num_blocks" in inspect.signature(Scheduler).parameters:  # the scheduler owns its manager
        sched = Scheduler(config, cache, num_blocks, list(group_windows), group_lookahead)
        kv = sched.kv_cache_manager
    else:
        kv = KVCacheManager(
            num_blocks, cache.block_size, list(group_windows), enable_prefix_caching=cache.enable_prefix_caching
        )
        sched = Scheduler(config, kv)
    assert isinstance(kv, KVCacheManager)
    return sched, kv


_REQUEST_FIELDS = {f.name for f in dataclasses.fields(Request)}
_arrivals = itertools.count()


def make_request(rid: str, prompt_ids: Sequence[int], max_tokens: int, **kw) -> Request:
    kw.setdefault("params", SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
    if "arrival" in _REQUEST_FIELDS:  # being removed from Request
        kw.setdefault("arrival", next(_arrivals))
    return Request(request_id=rid, prompt_token_ids=list(prompt_ids), max_tokens=max_tokens, **kw)


# -- the fake model ------------------------------------------------------------------------

_H0 = 0x9E3779B97F4A7C15 & ((1 << 61) - 1)
_MASK = (1 << 61) - 1


def prefix_digests(token_ids: Sequence[int]) -> list[int]:
    """digest[p] stands for the K/V of position p: it depends on tokens 0..p."""
    out, h = [], _H0
    for t in token_ids:
        h = ((h * 1_000_003) ^ (t + 1)) & _MASK
        out.append(h)
    return out


def token_after(digest: int) -> int:
    return 100 + digest % 900  # prompts use ids < 100: outputs never collide with them


def expected_outputs(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What an uninterrupted run of the fake model produces (no scheduler involved)."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(token_after(prefix_digests(tokens)[-1]))
        tokens.append(out[-1])
    return out


def first_reachable(window: int | None, first_query_pos: int, block_size: int) -> int:
    return 0 if window is None else max(0, first_query_pos - window + 1) // block_size


class FakeRunner:
    """Writes and reads a fake KV cache through `slot_mapping`; samples from the context."""

    def __init__(self, kv: KVCacheManager, num_blocks: int, block_size: int, windows: Sequence[int | None]):
        self.kv, self.bs, self.windows = kv, block_size, list(windows)
        self.store = [[None] * (num_blocks * block_size) for _ in self.windows]
        self.calls = 0

    def execute(self, batch: ScheduledBatch) -> dict[str, int]:
        self.calls += 1
        sampled: dict[str, int] = {}
        for req, n in zip(batch.requests, batch.num_new):
            c, rid = req.num_computed_tokens, req.request_id
            assert n >= 1 and c + n <= req.num_tokens, (rid, c, n, req.num_tokens)
            digests = prefix_digests(req.token_ids[: c + n])
            new = range(c, c + n)
            for g, w in enumerate(self.windows):
                store = self.store[g]
                for p, s in zip(new, self.kv.slot_mapping(rid, g, new)):
                    store[s] = digests[p]
                lo = 0 if w is None else max(0, c - w + 1)  # what the step's first query reaches back to
                read = range(lo, c + n)
                for p, s in zip(read, self.kv.slot_mapping(rid, g, read)):
                    assert store[s] == digests[p], f"{rid}: group {g} position {p} (slot {s}) holds wrong K/V"
            if c + n == req.num_tokens:
                sampled[rid] = token_after(digests[-1])
        return sampled


# -- the driver with invariants ------------------------------------------------------------


class Harness:
    def __init__(self, **kw):
        self.sched, self.kv = make_scheduler(**kw)
        self.num_blocks = kw["num_blocks"]
        self.bs = kw.get("block_size", 4)
        self.windows = list(kw.get("group_windows", (None,)))
        self.max_num_seqs = kw.get("max_num_seqs", 64)
        self.budget = kw.get("max_num_batched_tokens", 64)
        self.runner = FakeRunner(self.kv, self.num_blocks, self.bs, self.windows)
        self.order: dict[str, int] = {}  # request id -> arrival index
        self.reqs: dict[str, Request] = {}
        self.done: dict[str, Request] = {}  # finished or aborted
        self.batches: list[ScheduledBatch] = []
        self.num_steps = 0
        self.check()

    # requests
    def add(self, rid: str, prompt: Sequence[int], max_tokens: int) -> Request:
        req = make_request(rid, prompt, max_tokens)
        self.order[rid] = len(self.order)
        self.reqs[rid] = req
        self.sched.add(req)
        self.check()
        return req

    def abort(self, rid: str) -> Request:
        req = self.sched.abort(rid)
        assert req is self.reqs[rid]
        assert req.is_finished and req.finish_reason == "abort"
        self.done[rid] = req
        self.check()
        return req

    # one step
    def schedule(self) -> ScheduledBatch:
        batch = self.sched.schedule()
        self.num_steps += 1
        self.batches.append(batch)
        self.check_batch(batch)
        self.check()
        return batch

    def update(self, batch: ScheduledBatch, sampled: dict[str, int]) -> list[Request]:
        finished = self.sched.update(batch, sampled)
        for req in finished:
            rid = req.request_id
            assert rid not in self.done, f"{rid} finished twice"
            assert req.is_finished and req.finish_reason == "length", req
            assert req.output_token_ids == expected_outputs(req.prompt_token_ids, req.max_tokens), rid
            self.done[rid] = req
        for req, n in zip(batch.requests, batch.num_new):
            c, nt = self.pending[req.request_id]
            if not req.is_finished:  # n more computed; one token more iff sampled
                assert req.num_computed_tokens == c + n
                assert req.num_tokens == nt + (req.request_id in sampled)
            elif req.finish_reason == "abort":  # aborted while the model ran: nothing changes
                assert (req.num_computed_tokens, req.num_tokens) == (c, nt)
        self.check()
        return finished

    def step(self) -> tuple[ScheduledBatch, list[Request]]:
        batch = self.schedule()
        return batch, self.update(batch, self.runner.execute(batch))

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError(
            f"not done after {max_steps} steps: running={self.ids(self.sched.running)} "
            f"waiting={self.ids(self.sched.waiting)}"
        )

    @staticmethod
    def ids(reqs) -> list[str]:
        return [r.request_id for r in reqs]

    # invariants
    def check_batch(self, batch: ScheduledBatch) -> None:
        assert len(batch.requests) == len(batch.num_new)
        rids = self.ids(batch.requests)
        assert len(set(rids)) == len(rids), rids
        assert 0 <= sum(batch.num_new) <= self.budget, batch.num_new
        running = {r.request_id for r in self.sched.running}
        self.pending = {r.request_id: (r.num_computed_tokens, r.num_tokens) for r in batch.requests}
        for req, n in zip(batch.requests, batch.num_new):
            c = req.num_computed_tokens
            assert 1 <= n <= req.num_tokens - c, (req.request_id, c, n, req.num_tokens)
            assert req.request_id in running and not req.is_finished
            end = -(-(c + n) // self.bs)
            for g, w in enumerate(self.windows):
                table = self.kv.block_table(req.request_id, g)
                assert len(table) >= end, (req.request_id, g, table, c, n)
                needed = table[first_reachable(w, c, self.bs) : end]
                assert NULL_BLOCK not in needed, (req.request_id, g, table, c, n)
        for req in batch.preempted:
            assert req.request_id not in rids
            assert req in self.sched.waiting and req.num_computed_tokens == 0
            assert req.status is RequestStatus.WAITING and not self.kv.has_request(req.request_id)

    def check(self) -> None:
        self.kv.check_invariants()
        sched, kv = self.sched, self.kv
        running, waiting = list(sched.running), list(sched.waiting)
        assert len(running) <= self.max_num_seqs
        live = self.ids(running) + self.ids(waiting)
        assert len(set(live)) == len(live), live
        assert sched.has_unfinished() == bool(live)
        assert set(live) | set(self.done) == set(self.reqs) and not set(live) & set(self.done)
        for req in running:
            assert req.status is RequestStatus.RUNNING and kv.has_request(req.request_id)
        for req in waiting:
            assert req.status is RequestStatus.WAITING and not kv.has_request(req.request_id)
        for req in itertools.chain(running, waiting):
            assert 0 <= req.num_computed_tokens <= req.num_tokens
            assert req.token_ids == req.prompt_token_ids + req.output_token_ids
            assert len(req.output_token_ids) < req.max_tokens
        for rid, req in self.done.items():
            assert req.is_finished and not kv.has_request(rid)
        # FIFO with preempt-newest: both queues in arrival order, every running one older.
        r_order = [self.order[r.request_id] for r in running]
        w_order = [self.order[r.request_id] for r in waiting]
        assert r_order == sorted(r_order) and w_order == sorted(w_order), (r_order, w_order)
        assert not r_order or not w_order or r_order[-1] < w_order[0], (r_order, w_order)
        # No leak: every used block is held by a running request.
        held = {
            b
            for r in running
            for g in range(len(self.windows))
            for b in kv.block_table(r.request_id, g)
            if b != NULL_BLOCK
        }
        assert self.num_blocks - kv.num_free_blocks == len(held)


def prompt(start: int, n: int) -> list[int]:
    return [(start + i) % 100 for i in range(n)]


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_newest_first_and_nothing_lost(prefix_caching):
    """4 requests of 4 prompt tokens, 8 blocks of 4: each needs its 3rd block at step 6."""
    specs = [("A", prompt(0, 4), 8), ("B", prompt(10, 4), 8), ("C", prompt(20, 4), 8), ("D", prompt(30, 4), 8)]

    ref = Harness(num_blocks=100, enable_prefix_caching=prefix_caching)
    for rid, p, m in specs:
        ref.add(rid, p, m)
    ref.run()
    assert ref.num_steps == 8 and ref.sched.num_preemptions == 0

    h = Harness(num_blocks=8, enable_prefix_caching=prefix_caching)
    A, B, C, D = (h.add(rid, p, m) for rid, p, m in specs)
    for _ in range(5):  # 1 block each at step 1, a 2nd at step 2: pool full after step 2
        batch, _ = h.step()
        assert h.ids(batch.requests) == ["A", "B", "C", "D"] and not batch.preempted
    assert h.kv.num_free_blocks == 0

    # Step 6: A (oldest) needs a block -> D (newest) is preempted, not A; then C needs one
    # and is itself the newest running -> preempted too. C goes in front of D.
    batch = h.schedule()
    assert h.ids(batch.requests) == ["A", "B"] and batch.num_new == [1, 1]
    assert h.ids(batch.preempted) == ["D", "C"]
    assert h.ids(h.sched.waiting) == ["C", "D"] and h.ids(h.sched.running) == ["A", "B"]
    for r in (C, D):
        assert r.num_computed_tokens == 0 and r.num_preemptions == 1 and len(r.output_token_ids) == 5
    assert h.sched.num_preemptions == 2 and A.num_preemptions == 0 and B.num_preemptions == 0
    h.update(batch, h.runner.execute(batch))

    # Step 7: C needs 3 blocks for its 9 tokens (or 1 new + 2 cached), only 2 are free.
    batch, _ = h.step()
    assert h.ids(batch.requests) == ["A", "B"] and h.ids(h.sched.waiting) == ["C", "D"]
    batch, finished = h.step()  # step 8: A and B finish
    assert h.ids(finished) == ["A", "B"]
    # Step 9: both recomputed. With prefix caching C's own 2 full blocks are still cached
    # (D's were evicted first by A and B at step 6: they were freed first).
    batch, _ = h.step()
    assert h.ids(batch.requests) == ["C", "D"]
    assert batch.num_new == ([1, 9] if prefix_caching else [9, 9])
    assert C.num_cached_tokens == 0  # counted at first admission only
    h.run()
    assert h.num_steps == 11 and h.sched.num_preemptions == 2
    for rid, _, m in specs:
        assert h.reqs[rid].output_token_ids == ref.reqs[rid].output_token_ids
        assert len(h.reqs[rid].output_token_ids) == m
    assert h.kv.num_free_blocks == 8


def test_draft_group_shares_the_pool_and_preempts():
    """A draft KV group (group_lookahead: a drafter's own K/V, `lookahead` positions past the
    target's) draws from the same pool: where the target alone fits, the same requests are
    preempted instead of the draft growing past the pool, and every output is unchanged."""
    specs = [(rid, prompt(10 * i, 4), 8) for i, rid in enumerate("ABCD")]
    alone = Harness(num_blocks=16, enable_prefix_caching=False)
    for rid, p, m in specs:
        alone.add(rid, p, m)
    alone.run()
    assert alone.sched.num_preemptions == 0  # 4 requests x 3 blocks
    h = Harness(num_blocks=16, enable_prefix_caching=False, group_windows=(None, None), group_lookahead=(None, 4))
    for rid, p, m in specs:
        h.add(rid, p, m)
    while h.sched.has_unfinished():
        batch = h.schedule()
        for r, n in zip(batch.requests, batch.num_new):  # the draft group reaches 4 positions further
            assert len(h.kv.block_table(r.request_id, 1)) == -(-(r.num_computed_tokens + n + 4) // 4)
        h.update(batch, h.runner.execute(batch))
    assert h.sched.num_preemptions > 0
    for rid, _, _ in specs:
        assert h.reqs[rid].output_token_ids == alone.reqs[rid].output_token_ids
    assert h.kv.num_free_blocks == 16


def test_chunked_prefill_alone_splits_into_budget_chunks():
    h = Harness(num_blocks=64, max_num_batched_tokens=8)
    L = h.add("L", prompt(0, 20), 3)
    sizes, outs = [], []
    while h.sched.has_unfinished():
        batch, _ = h.step()
        sizes.append(batch.num_new)
        outs.append(len(L.output_token_ids))
    assert sizes == [[8], [8], [4], [1], [1]]
    assert outs == [0, 0, 1, 2, 3]  # a token is sampled only when the prompt is fully computed


def test_chunked_prefill_decodes_first_budget_shared():
    h = Harness(num_blocks=64, max_num_batched_tokens=8)
    h.add("D", prompt(0, 3), 20)
    batch, _ = h.step()
    assert batch.num_new == [3]
    h.add("L", prompt(20, 20), 2)
    h.add("N", prompt(50, 5), 1)
    got = []
    for _ in range(4):
        batch, _ = h.step()
        got.append((h.ids(batch.requests), batch.num_new))
        assert sum(batch.num_new) <= 8
    assert got == [
        (["D", "L"], [1, 7]),  # the decode first; L takes the rest; N must wait (budget 0)
        (["D", "L"], [1, 7]),
        (["D", "L", "N"], [1, 6, 1]),  # L's last chunk leaves 1 token: N starts with a 1-token chunk
        (["D", "L", "N"], [1, 1, 4]),
    ]
    assert h.reqs["L"].is_finished and h.reqs["N"].is_finished
    h.run()


def test_prefix_cache_hits_at_admission():
    shared = prompt(0, 8)  # two full blocks of 4
    h = Harness(num_blocks=64)
    A = h.add("A", shared + [60, 61], 4)
    B0 = h.add("B0", shared + [70], 2)  # same step as A: nothing is computed yet, so no hit
    batch, _ = h.step()
    assert batch.num_new == [10, 9] and A.num_cached_tokens == 0 and B0.num_cached_tokens == 0

    B = h.add("B", shared + [62, 63, 64], 2)  # A is still running: its blocks are shared
    batch, _ = h.step()
    assert h.ids(batch.requests) == ["A", "B0", "B"] and batch.num_new == [1, 1, 3]
    assert B.num_cached_tokens == 8
    assert h.kv.block_table("B", 0)[:2] == h.kv.block_table("A", 0)[:2]
    h.run()
    assert h.kv.num_free_blocks == 64

    C = h.add("C", shared + [65], 1)  # A has finished: its blocks are cached-free
    batch, _ = h.step()
    assert batch.num_new == [1] and C.num_cached_tokens == 8
    Dq = h.add("Dq", shared, 1)  # the whole prompt is cached: one block is recomputed anyway
    batch, _ = h.step()
    assert batch.num_new == [4] and Dq.num_cached_tokens == 4
    Eq = h.add("Eq", shared[:4] + [99] + shared[5:] + [66], 1)  # differs inside block 1: hit is block 0 only
    batch, _ = h.step()
    assert batch.num_new == [5] and Eq.num_cached_tokens == 4


def test_prefix_cache_disabled_never_hits():
    shared = prompt(0, 8)
    h = Harness(num_blocks=64, enable_prefix_caching=False)
    h.add("A", shared + [60, 61], 1)
    h.run()
    B = h.add("B", shared + [62, 63, 64], 1)
    batch, _ = h.step()
    assert batch.num_new == [11] and B.num_cached_tokens == 0


def test_max_num_seqs_fifo():
    h = Harness(num_blocks=64, max_num_seqs=2)
    for i, m in enumerate([5, 2, 3, 1, 1]):
        h.add(f"r{i}", prompt(10 * i, 4), m)
    admitted: dict[str, int] = {}
    while h.sched.has_unfinished():
        batch, _ = h.step()
        assert len(h.sched.running) <= 2
        for r, n in zip(batch.requests, batch.num_new):
            if n == 4:
                admitted[r.request_id] = h.num_steps
        if h.num_steps == 1:
            assert h.ids(h.sched.waiting) == ["r2", "r3", "r4"]
    assert admitted == {"r0": 1, "r1": 1, "r2": 3, "r3": 6, "r4": 6}
    assert list(admitted) == ["r0", "r1", "r2", "r3", "r4"]
    assert h.num_steps == 6


def test_abort_mid_prefill_alone_frees_everything():
    h = Harness(num_blocks=16, max_num_batched_tokens=8)
    L = h.add("L", prompt(0, 16), 4)
    batch, _ = h.step()
    assert batch.num_new == [8] and L.num_computed_tokens == 8
    assert h.kv.num_free_blocks == 14
    h.abort("L")
    assert h.kv.num_free_blocks == 16 and not h.sched.has_unfinished()
    assert L.output_token_ids == [] and h.sched.abort("L") is None
    batch, _ = h.step()
    assert batch.requests == [] and batch.preempted == []


def test_abort_mid_prefill_others_continue():
    h = Harness(num_blocks=16, max_num_batched_tokens=8)
    O1 = h.add("O1", prompt(0, 4), 6)
    h.add("L", prompt(20, 16), 4)
    batch, _ = h.step()
    assert h.ids(batch.requests) == ["O1", "L"] and batch.num_new == [4, 4]
    batch, _ = h.step()
    assert batch.num_new == [1, 7] and h.reqs["L"].num_computed_tokens == 11
    h.abort("L")
    assert h.kv.num_free_blocks == 16 - h.kv.num_held_blocks("O1", 0) == 14
    h.add("O2", prompt(50, 6), 2)
    h.run()
    assert all("L" not in h.ids(b.requests) for b in h.batches[2:])
    assert O1.output_token_ids == expected_outputs(O1.prompt_token_ids, 6)
    assert len(h.reqs["O2"].output_token_ids) == 2 and h.kv.num_free_blocks == 16


def test_abort_while_the_model_runs():
    """Aborted between schedule() and update(): update skips it, its blocks are already back."""
    h = Harness(num_blocks=16, max_num_batched_tokens=8)
    h.add("O1", prompt(0, 4), 3)
    L = h.add("L", prompt(20, 12), 4)
    batch = h.schedule()
    sampled = h.runner.execute(batch)
    h.abort("L")
    assert h.kv.num_free_blocks == 15
    finished = h.update(batch, sampled)
    assert finished == [] and L.num_computed_tokens == 0 and L.output_token_ids == []
    h.run()
    assert h.kv.num_free_blocks == 16


@pytest.mark.parametrize("budget", [64, 4])
def test_sliding_window_release(budget):
    bs, W = 4, 8
    h = Harness(num_blocks=64, block_size=bs, group_windows=[None, W], max_num_batched_tokens=budget)
    R = h.add("R", prompt(0, 10), 50)
    max_full = max_slide = 0
    while h.sched.has_unfinished():
        batch = h.schedule()
        (n,) = batch.num_new
        c = R.num_computed_tokens
        end = -(-(c + n) // bs)
        full = h.kv.num_held_blocks("R", 0)
        slide = h.kv.num_held_blocks("R", 1)
        assert full == end  # the full group keeps everything
        assert slide == end - max(0, c - W + 1) // bs  # exactly the blocks the step's queries reach
        assert slide <= math.ceil((W + n - 1) / bs) + 1
        if c >= 10:  # decode
            assert slide <= math.ceil(W / bs) + 1
        assert h.kv.num_free_blocks == 64 - full - slide
        max_full, max_slide = max(max_full, full), max(max_slide, slide)
        h.update(batch, h.runner.execute(batch))
    assert max_full == math.ceil(59 / bs) == 15
    assert max_slide == 3
    assert R.output_token_ids == expected_outputs(R.prompt_token_ids, 50)
    assert h.kv.num_free_blocks == 64


@pytest.mark.parametrize(
    "windows,prefix_caching,seed",
    [
        ((None,), True, 0),
        ((None, 8), True, 1),
        ((None,), False, 2),
    ],
)
def test_randomized_stress(windows, prefix_caching, seed):
    rng = random.Random(seed)
    # Every request fits alone: <= 24 + 16 tokens = 10 full blocks (+ <= 7 sliding) <= 20.
    h = Harness(
        num_blocks=20,
        block_size=4,
        group_windows=windows,
        enable_prefix_caching=prefix_caching,
        max_num_seqs=6,
        max_num_batched_tokens=16,
    )
    bases = [[rng.randrange(100) for _ in range(16)] for _ in range(3)]
    ids = itertools.count()
    aborted_in_flight = 0
    for step in range(300):
        if step < 200:
            for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
                shared = rng.choice(bases)[: rng.choice([0, 4, 8, 12])]
                p = shared + [rng.randrange(100) for _ in range(rng.randint(1, 24 - len(shared)))]
                h.add(f"q{next(ids)}", p, rng.randint(1, 16))
        live = h.ids(h.sched.running) + h.ids(h.sched.waiting)
        if live and rng.random() < 0.04:
            h.abort(rng.choice(live))
        batch = h.schedule()
        sampled = h.runner.execute(batch)
        if batch.requests and rng.random() < 0.02:  # aborted while the model runs
            h.abort(rng.choice(batch.requests).request_id)
            aborted_in_flight += 1
        h.update(batch, sampled)
    h.run(2000)
    assert set(h.done) == set(h.reqs) and len(h.reqs) > 100
    for req in h.done.values():
        want = expected_outputs(req.prompt_token_ids, req.max_tokens)
        if req.finish_reason == "abort":
            assert req.output_token_ids == want[: len(req.output_token_ids)]
        else:
            assert req.output_token_ids == want
    assert h.sched.num_preemptions > 0  # the pool really was tight
    if prefix_caching:
        assert sum(r.num_cached_tokens for r in h.reqs.values()) > 0
    assert h.kv.num_free_blocks == 20
