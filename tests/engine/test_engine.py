"""Engine vs reference: greedy engine output equals full-recompute greedy decoding, token
for token, in float32 — with prefix caching on and off, chunked prefill, and a KV pool
small enough to force preemption."""

import pytest
import torch
from conftest import save_random_checkpoint

from musespark import LLM, SamplingParams
from musespark.config import ModelConfig

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_hidden_size=32,
    moe_intermediate_size=48,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=12,
    bos_token_id=1,
    eos_token_id=2,
    mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
    rope_theta=10000.0,
    max_position_embeddings=256,
)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("engine_ckpt"), CFG, seed=21)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, CFG.vocab_size, (40,), generator=g).tolist()
    out = []
    for i in range(16):
        n = [3, 9, 17, 30, 45, 60][i % 6]  # some longer than the window (12)
        if i % 3 == 0:  # shares a 40-token prefix with other prompts
            out.append(shared + torch.randint(3, CFG.vocab_size, (i + 1,), generator=g).tolist())
        else:
            out.append(torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist())
    return out


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    import musespark

    model = musespark.load_model(checkpoint, dtype="float32")
    return [model.greedy_continuation(p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=24),  # forces chunked prefill
        dict(kv_cache_memory=2 * 4 * 40 * 4 * 2 * 16 * 4, max_num_batched_tokens=64),  # ~40 blocks: preemption
    ],
    ids=["default", "no_prefix_cache", "chunked", "preempt"],
)
def test_greedy_engine_equals_reference(checkpoint, prompts, reference, options):
    llm = LLM(model=checkpoint, dtype="float32", max_model_len=128, block_size=4, **options)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, want) in enumerate(zip(got, reference)):
        assert g == want, f"prompt {i} (len {len(prompts[i])}): {g} != {want}"
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    kv = llm.engine.core.scheduler.kv_cache_manager
    kv.check_invariants()
    assert kv.pool.num_used_blocks == 0
    if "kv_cache_memory" in options:
        assert llm.engine.core.scheduler.num_preemptions > 0
    if "max_num_batched_tokens" in options and "kv_cache_memory" not in options:
        assert llm.engine.num_steps > NEW_TOKENS + 1


def test_second_request_with_same_prefix_skips_its_prefill(checkpoint, prompts, reference):
    llm = LLM(model=checkpoint, dtype="float32", max_model_len=128, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompts[0]}, params)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate({"prompt_token_ids": prompts[3]}, params)[0]  # shares 40 tokens with prompts[0]
    assert second.num_cached_tokens == 40
    assert llm.engine.core.scheduler.kv_cache_manager.prefix_hits == 40
    assert second.outputs[0].token_ids == reference[3]


def test_sliding_layers_hold_only_the_window(checkpoint):
    """A sequence far longer than the window keeps no more sliding-layer blocks than the
    window needs (ceil(W / block) + 1 while decoding; a prefill chunk may briefly need its
    own blocks), while full-attention layers grow with the sequence."""
    llm = LLM(model=checkpoint, dtype="float32", max_model_len=256, block_size=4)
    engine = llm.engine
    engine.add_request(
        "long", {"prompt_token_ids": [5] * 20}, SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
    )
    layout = engine.core.runner.layout
    sliding = [g for g, w in enumerate(layout.group_windows) if w is not None]
    full = [g for g, w in enumerate(layout.group_windows) if w is None]
    bound = -(-CFG.sliding_window // 4) + 1
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        kv = engine.core.scheduler.kv_cache_manager
        if kv.has_request("long") and engine.num_steps > 1:  # past the 20-token prefill chunk
            peak = max(peak, max(kv.num_held_blocks("long", g) for g in sliding))
            n_full = kv.num_held_blocks("long", full[0])
    assert peak <= bound
    assert n_full >= (20 + 190) // 4


def test_bf16_tokens_do_not_depend_on_the_batch(checkpoint, prompts):
    """bf16 on the CPU computes every row the same way whatever else is in the batch
    (README, "CPU kernels"): a request's greedy tokens and logprobs are identical alone and
    batched with prompts of other lengths (prefill rows next to decode rows)."""
    from musespark.kernels import cpu

    if cpu.native_ops() is None:
        pytest.skip("batch invariance in bf16 is a property of the native kernels (test_cpu_kernels checks they build)")
    llm = LLM(model=checkpoint, dtype="bfloat16", max_model_len=128, block_size=4, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    chosen = prompts[:6]
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0] for p in chosen]
    # Staggered arrivals: later requests prefill while earlier ones decode.
    engine = llm.engine
    together = {}
    pending = list(enumerate(chosen))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        for out in engine.step():
            if out.finished:
                together[out.request_id] = out.outputs[0]
    assert len(together) == len(chosen)
    for i, a in enumerate(alone):
        b = together[f"r{i}"]
        assert b.token_ids == a.token_ids, f"prompt {i}"
        assert [{t: lp.logprob for t, lp in d.items()} for d in b.logprobs] == [
            {t: lp.logprob for t, lp in d.items()} for d in a.logprobs
        ], f"prompt {i}"


def test_prompt_rows_are_exactly_the_prompt_tokens_of_each_step(checkpoint, prompts):
    """ctx.prompt_rows (the rows a backend may multiply by its prompt kernel) flags a row iff
    its position is inside its request's prompt: through chunked prefill (a prompt split
    over steps, next to decode rows) and preemption (a recomputed request's generated
    tokens are not prompt rows), so a row's kind never depends on the batch."""
    from musespark.engine import model_runner

    llm = LLM(
        model=checkpoint,
        dtype="bfloat16",
        max_model_len=128,
        block_size=4,
        enable_prefix_caching=False,
        kv_cache_memory=2 * 4 * 40 * 4 * 2 * 16 * 2,
        max_num_batched_tokens=24,
    )
    runner = llm.engine.core.runner
    original = runner._inputs
    checked = {"prompt": 0, "generated": 0}

    def spy(batch):
        inputs, *rest = original(batch)
        mask = model_runner._prompt_mask(inputs, torch.device("cpu"))
        qsl = inputs.query_start_loc
        if mask is None:  # None: no row of the step is a prompt token
            mask = torch.zeros(qsl[-1], dtype=torch.bool)
        for i, request in enumerate(batch.requests):
            rows = range(qsl[i], qsl[i + 1])
            want = [inputs.positions[r] < len(request.prompt_token_ids) for r in rows]
            assert mask[qsl[i] : qsl[i + 1]].tolist() == want, (
                request.request_id,
                inputs.positions[qsl[i] : qsl[i + 1]],
            )
            checked["prompt"] += sum(want)
            checked["generated"] += len(want) - sum(want)
        return (inputs, *rest)

    runner._inputs = spy
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    assert checked["prompt"] >= sum(len(p) for p in prompts[:8]) and checked["generated"] > 0
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_greedy_rows_take_torchs_argmax():
    """The plain-greedy fast path's argmax (numpy on CPU) picks what torch.argmax picks: the
    first of tied maxima, the first NaN, +inf over finite values, index 0 of an all -inf row,
    on strided rows too."""
    from musespark.engine.model_runner import _greedy

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4096, generator=g)
    x[1, 7] = x[1, 900] = 1e9
    x[2, 3] = x[2, 50] = float("nan")
    x[3] = float("-inf")
    x[4, 10] = float("inf")
    x[5, 4000] = x[5, 10] = x[5].max() + 1
    for rows in (x, x[:, ::2], x.flip(0), x[:1], x.T.contiguous().T):
        assert _greedy(rows) == rows.argmax(dim=-1).tolist()
