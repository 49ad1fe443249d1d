"""The DSpark draft's K/V as a KV group of the block manager: sized from the same budget,
allocated in blocks, freed and preempted with the request; a full cache preempts instead of
letting the draft's cache grow, and greedy outputs stay those of plain decoding."""

import pytest
import torch
from test_spec_decode import dspark_config

from musespark import LLM, SamplingParams
from musespark.engine.kv_cache import plan_kv_cache
from musespark.engine.spec_decode.proposer import DraftKVSpec

BLOCK = 16
# one block of the bundled float32 target: K and V x 2 tensor pairs x 16 tokens x 2 heads x 64 x 4 bytes
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 4
OPTIONS = dict(
    dtype="float32",
    max_model_len=256,
    block_size=BLOCK,
    max_num_batched_tokens=64,
    max_num_seqs=8,
    kv_cache_memory=60 * BLOCK_BYTES,  # one 256-token sequence with the draft needs 55 blocks
    enable_prefix_caching=True,
)


def prompts(tokenizer) -> list[dict]:
    phrases = ["the quick brown fox", "def main(args):", "one two three four", "import os\nimport sys"]
    return [{"prompt_token_ids": tokenizer.encode((phrases[i % 4] + f" {i}. ") * (2 + i % 3))} for i in range(8)]


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among (K, V) pairs."""
    seen = {}
    for pair in tensors:
        for t in pair or ():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.fixture(scope="module")
def spec():
    s = dspark_config()
    if s is None:
        pytest.skip("the dspark proposer or the bundled draft is not in this checkout")
    return s


def test_draft_kv_preempts_within_the_budget_and_stays_lossless(spec):
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    base_llm = LLM(**OPTIONS)
    base = base_llm.generate(prompts(base_llm.get_tokenizer()), params)
    llm = LLM(speculative_config=spec, **OPTIONS)
    core = llm.engine.core
    runner, sched, proposer = core.runner, core.scheduler, core.speculator.proposer
    kv = sched.kv_cache_manager
    draft_group = core.speculator.draft_group
    assert draft_group == kv.num_groups - 1 and kv.group_lookahead[draft_group] == proposer.kv_spec.lookahead
    # every K/V byte (the target's and the draft's) is inside kv_cache_memory
    assert tensor_bytes(runner.kv_caches + runner.draft_kv_caches) <= OPTIONS["kv_cache_memory"]
    assert proposer.kv is not None and proposer.kv.caches is runner.draft_kv_caches
    seen = {"steps": 0, "draft_blocks": 0}
    schedule = sched.schedule

    def checked_schedule():
        batch = schedule()
        kv.check_invariants()
        assert kv.pool.num_used_blocks <= kv.pool.num_blocks == runner.num_blocks
        lookahead = kv.group_lookahead[draft_group]
        for r, n in zip(batch.requests, batch.num_new):
            # the draft's group holds the step's positions and its lookahead (NULL entries only
            # for a prefix-cache hit, which the draft was never given rows for)
            table = kv.block_table(r.request_id, draft_group)
            assert len(table) * BLOCK >= r.num_computed_tokens + n + lookahead
            assert all(b >= 0 for b in table[r.num_computed_tokens // BLOCK :])
            seen["draft_blocks"] = max(seen["draft_blocks"], len(table))
        for r in batch.preempted:
            assert not kv.has_request(r.request_id)
        seen["steps"] += 1
        return batch

    sched.schedule = checked_schedule
    outs = llm.generate(prompts(llm.get_tokenizer()), params)
    for i, (a, b) in enumerate(zip(base, outs)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"prompt {i}"
    stats = llm.engine.get_stats()
    assert sched.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0
    assert seen["draft_blocks"] > 1
    # everything freed: no request left in the manager or the proposer, and no tensor of its own
    assert kv.pool.num_used_blocks == 0 and not proposer._seqs and proposer._own is None
    assert tensor_bytes(runner.kv_caches + runner.draft_kv_caches) <= OPTIONS["kv_cache_memory"]


def test_budget_counts_the_draft_layers(spec):
    """A draft whose K/V geometry differs from the target's gets tensors of its own, and each
    block's bytes count them: fewer blocks from the same budget."""
    llm = LLM(speculative_config=spec, **OPTIONS)
    core = llm.engine.core
    model, layout, cache = core.model, core.runner.layout, core.config.cache
    shared = plan_kv_cache(model, layout, cache, 256, 8, core.speculator.proposer.kv_spec)
    assert shared.draft_shares_slots and shared.num_blocks == 60
    own = DraftKVSpec(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float32, lookahead=7)
    plan = plan_kv_cache(model, layout, cache, 128, 8, own)
    # 32768 bytes of target K/V plus 8192 of the draft's per block
    assert not plan.draft_shares_slots and plan.num_blocks == OPTIONS["kv_cache_memory"] // (BLOCK_BYTES + 8192)
    assert plan.group_lookahead == [None] * len(layout.group_windows) + [7]
    with pytest.raises(ValueError, match="kv_cache_memory"):
        plan_kv_cache(model, layout, cache, 256, 8, own)  # 48 blocks: one 256-token sequence needs 55
