"""The model driven like the engine will drive it: a flat batch of chunks from many
sequences, keys/values in a paged cache reached through block tables. Every logit must
equal the whole-prompt reference path."""

import pytest
import torch

from musespark.config import ModelConfig
from musespark.layers import attention
from musespark.layers.attention import AttentionContext, KVGroup
from musespark.model import MuseSparkForCausalLM, init_random_weights

CFG = ModelConfig(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    moe_hidden_size=24,
    moe_intermediate_size=32,
    num_local_experts=6,
    num_experts_per_tok=2,
    sliding_window=7,
    bos_token_id=1,
    eos_token_id=2,
    mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
    rope_theta=10000.0,
)
BLOCK = 4
NUM_BLOCKS = 64


def make_model() -> MuseSparkForCausalLM:
    model = MuseSparkForCausalLM(CFG)
    init_random_weights(model, seed=3)
    return model.eval()


@pytest.mark.parametrize("query_block", [attention.PREFILL_QUERY_BLOCK, 2, 3])
def test_chunked_paged_batches_equal_whole_prompt(query_block, monkeypatch):
    """Also with prefill chunks attended a few query rows at a time (each block reading
    only the keys in its reach, the first block of a fresh sequence through the causal
    kernel)."""
    monkeypatch.setattr(attention, "PREFILL_QUERY_BLOCK", query_block)
    torch.manual_seed(0)
    model = make_model()
    lengths = [37, 22, 9]
    seqs = [torch.randint(3, CFG.vocab_size, (n,)).tolist() for n in lengths]
    want = [model.prompt_logits(s) for s in seqs]

    kv = [
        (
            torch.zeros(NUM_BLOCKS, BLOCK, CFG.num_key_value_heads, CFG.head_dim),
            torch.zeros(NUM_BLOCKS, BLOCK, CFG.num_key_value_heads, CFG.head_dim),
        )
        for _ in range(CFG.num_hidden_layers)
    ]
    # Two KV groups (full and sliding layers) with scattered, disjoint block ids.
    perm = torch.randperm(NUM_BLOCKS)
    tables = [perm[:30].view(len(lengths), 10).clone(), perm[30:60].view(len(lengths), 10).clone()]
    layer_group = [0 if t == "full_attention" else 1 for t in CFG.layer_types]
    assert set(layer_group) == {0, 1}

    done = [0] * len(lengths)
    got = [[None] * n for n in lengths]
    chunk_plan = [[5, 3, 9], [11, 19, 0], [1, 0, 0]] + [[1, 0, 0]] * 40  # prefill chunks, then decodes
    for plan in chunk_plan:
        plan = [min(p, n - d) for p, n, d in zip(plan, lengths, done)]
        if sum(plan) == 0:
            continue
        ids, pos, qsl, seq_lens = [], [], [0], []
        for b, n in enumerate(plan):
            ids += seqs[b][done[b] : done[b] + n]
            pos += list(range(done[b], done[b] + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(done[b] + n)
        positions = torch.tensor(pos)
        seq_of_row = torch.repeat_interleave(torch.arange(len(plan)), torch.tensor(plan))
        groups = []
        for table in tables:
            block_ids = table[seq_of_row, positions // BLOCK]
            groups.append(KVGroup(slot_mapping=block_ids * BLOCK + positions % BLOCK, block_tables=table.clone()))
        # Sliding layers never read blocks that fell out of the window: poison them.
        for b in range(len(plan)):
            first_needed = max(0, done[b] - CFG.sliding_window + 1) // BLOCK
            groups[1].block_tables[b, :first_needed] = -1
        ctx = AttentionContext(
            query_start_loc=qsl, seq_lens=seq_lens, kv_caches=kv, groups=groups, layer_group=layer_group
        )
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(ids), positions, ctx))
        for b, n in enumerate(plan):
            for j in range(n):
                got[b][done[b] + j] = logits[qsl[b] + j]
            done[b] += n
    assert done == lengths
    for b in range(len(lengths)):
        g = torch.stack(got[b])
        err = float((g - want[b]).abs().max() / want[b].abs().max())
        # Same function, different kernel shapes (a chunk's queries against gathered keys):
        # fp32 rounding differs at the ulp level and grows through the layers.
        assert err <= 1e-4, f"sequence {b}: relative error {err:.2e}"
        assert torch.equal(g.argmax(-1), want[b].argmax(-1))


def test_flat_batch_of_prompts_equals_one_by_one():
    model = make_model()
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22], [40] * 17]
    ctx = AttentionContext.for_prompts([len(s) for s in seqs])
    ids = torch.tensor(sum(seqs, []))
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, ctx))
    start = 0
    for s in seqs:
        want = model.prompt_logits(s)
        assert torch.allclose(logits[start : start + len(s)], want, atol=1e-5, rtol=0)
        start += len(s)
