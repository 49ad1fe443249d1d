"""Continuous batching by counters (vLLM v1 style); no tensors here.

The scheduler owns the requests' queues and the one `KVCacheManager` (built from the block
count the model runner reports). Each step hands out a token budget
(`max_num_batched_tokens`): running requests first, in arrival order, each asking for
`num_tokens - num_computed_tokens` (1 for a decode, the rest of the prompt, chunked, for a
prefill); then waiting requests, which first reuse cached prefix blocks. When the KV pool
runs out, the newest running request is preempted by recompute: its blocks are freed and
it goes back to the front of the waiting queue with `num_computed_tokens = 0`; its tokens
so far are kept, so nothing is lost or duplicated.

Speculative decoding: a running request in decode that holds drafts asks for 1 + k
tokens (its anchor, the last token, plus the drafts), fewer drafts if the budget is short;
the step's drafts are in `ScheduledBatch.spec_token_ids`. `update` appends the verified
tokens one by one (stop tokens and length limits cut the run as if generated one at a
time) and sets `num_computed_tokens` back over the rejected drafts, so KV written for them
is overwritten later and never lies in a block registered in the prefix cache (only
blocks below `num_computed_tokens` are).

A drafter's own K/V (the DSpark draft's context) are one more KV group of the same manager
(`group_lookahead`), so they are allocated with the request's target blocks from the same
pool, freed with it, and preempted with it: a full cache preempts a request, never lets a
draft cache grow past the budget.

Invariants: `running` is in arrival order and holds at most `max_num_seqs` requests; every
running request holds blocks for its computed tokens in every group (a draft group also for
its lookahead), a waiting one holds none; a finished or aborted request is in neither queue
and holds no blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import CacheConfig, SchedulerConfig
from .block_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step's decision: compute `num_new` tokens for each request, in this order.

    `block_tables[i][g]` is request i's block table in KV group g: the manager's own list,
    read-only, valid until the scheduler next runs (the model runner reads it, never the
    manager)."""

    requests: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_tables: list[list[list[int]]] = field(default_factory=list)
    spec_token_ids: list[list[int]] = field(default_factory=list)  # per request: drafts computed this step
    spec_probs: list[Any] = field(default_factory=list)  # per request: their draft probs [k, V] or None

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int,
        group_windows: Sequence[int | None],
        group_lookahead: Sequence[int | None] | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache.block_size,
            group_windows,
            enable_prefix_caching=cache.enable_prefix_caching,
            group_lookahead=group_lookahead,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in arrival order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management -----------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish the request with reason "abort" and free its blocks at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if not request.is_finished:
            request.finish("abort")
        self._remove(request)
        return request

    def _remove(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv_cache_manager.free(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            # The victim is the newest running request: one at index >= i, so never one
            # already scheduled this step; when it is `request` itself, stop trying.
            while not kv.allocate_slots(request.request_id, request.token_ids, request.num_computed_tokens, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_new.append(n)
                # Drafts that fit in this step (all of them unless the budget ran short).
                k = max(0, request.num_computed_tokens + n - request.num_tokens)
                batch.spec_token_ids.append(request.spec_token_ids[:k])
                batch.spec_probs.append(None if request.spec_probs is None or not k else request.spec_probs[:k])
                request.spec_token_ids, request.spec_probs = [], None
                budget -= n
                i += 1
                continue
            # `request` itself was preempted: the list shifted; do not advance i.

        if not batch.preempted:  # memory is tight after a preemption: admit nobody new this step
            self._admit_waiting(batch, budget)
        batch.block_tables = [kv.block_tables(r.request_id) for r in batch.requests]
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            # A request that wants its prompt's logprobs computes the whole prompt (cached
            # blocks would skip positions it needs).
            computed = (
                0
                if request.params.prompt_logprobs is not None
                else kv.get_computed_blocks(request.request_id, request.token_ids, request.cache_salt)
            )
            n = min(request.num_tokens - computed, budget)
            if not kv.allocate_slots(request.request_id, request.token_ids, computed, n, request.cache_salt):
                break
            self.waiting.popleft()
            request.num_computed_tokens = computed
            if request.num_preemptions == 0:
                request.num_cached_tokens = computed
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:  # the first admission; a preempted request keeps it
                request.scheduled_time = time.monotonic()
            self.running.append(request)
            batch.requests.append(request)
            batch.num_new.append(n)
            batch.spec_token_ids.append([])
            batch.spec_probs.append(None)
            budget -= n

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_probs = [], None
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        batch.preempted.append(request)

    def update(
        self, batch: ScheduledBatch, sampled: dict[str, int], verified: Mapping[str, list[int]] | None = None
    ) -> list[Request]:
        """Advance counters after the model ran; append sampled tokens; return the
        requests that finished this step (their blocks are already freed).

        `sampled` maps request id -> new token, for requests whose step reached the end
        of their known tokens; `verified` maps a request that had drafts this step to its
        accepted drafts followed by one more token.
        """
        finished: list[Request] = []
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new)):
            if request.is_finished:  # aborted meanwhile
                continue
            drafts = batch.spec_token_ids[i] if batch.spec_token_ids else ()
            if drafts:
                if self._update_verified(request, n, len(drafts), verified[request.request_id]):
                    finished.append(request)
                continue
            request.num_computed_tokens += n
            self.kv_cache_manager.cache_full_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_token(token)
            if request.check_token_stop(self.config.max_model_len):
                finished.append(request)
        for request in finished:
            self._remove(request)
        return finished

    def _update_verified(self, request: Request, n: int, num_drafts: int, tokens: list[int]) -> bool:
        """Roll back the rejected drafts, append `tokens` until a stop; True if it finished."""
        request.num_computed_tokens += n - (num_drafts - (len(tokens) - 1))
        done = False
        for token in tokens:
            request.append_token(token)
            if request.check_token_stop(self.config.max_model_len):
                done = True
                break  # what follows a stop is discarded, as if never generated
        # Every position below this holds the KV of an accepted token.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        self.kv_cache_manager.cache_full_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
        return done

    def finish_request(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """Finish a request for a reason found outside the scheduler (a stop string)."""
        if not request.is_finished:
            request.finish(reason, stop_reason)
        self._remove(request)
