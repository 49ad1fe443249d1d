"""The offline API's sampling features, end to end through the engine (random model,
token-id prompts)."""

import pytest
import torch
from conftest import save_random_checkpoint
from test_engine import CFG

from musespark import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_random_checkpoint(tmp_path_factory.mktemp("api_ckpt"), CFG, seed=8)
    return LLM(model=path, dtype="float32", max_model_len=96, block_size=4)


def ids(*tokens):
    return {"prompt_token_ids": list(tokens)}


def test_seeded_request_same_alone_and_in_a_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(ids(5, 6, 7), p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=10, ignore_eos=True)
    batch = llm.generate([ids(9, 9, 9, 9), ids(5, 6, 7), ids(11, 12)], [others, p, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = (
        llm.generate(ids(5, 6, 7), SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=10, ignore_eos=True))[
            0
        ]
        .outputs[0]
        .token_ids
    )
    assert other_seed != alone


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate(ids(3, 4, 5), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    toks = greedy.outputs[0].token_ids
    stop_at = toks[3]
    first = toks.index(stop_at)
    out = llm.generate(
        ids(3, 4, 5), SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True)
    )[0].outputs[0]
    assert out.token_ids == toks[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens forbids the stop token until enough tokens exist
    out = llm.generate(
        ids(3, 4, 5),
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[toks[0]], min_tokens=3, ignore_eos=True),
    )[0].outputs[0]
    assert len(out.token_ids) >= 3 and toks[0] not in out.token_ids[:3]


def test_eos_and_ignore_eos(llm):
    eos = CFG.eos_token_id[0]
    # Make EOS the greedy choice by checking where it would be chosen: use a stop-free run,
    # then a run where EOS is one of the stop ids is covered above; here: ignore_eos keeps going.
    out = llm.generate(ids(3, 4, 5), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    seeded = [
        llm.generate(ids(3, 4, 5), SamplingParams(temperature=5.0, seed=s, max_tokens=40))[0].outputs[0]
        for s in range(12)
    ]
    stopped = [o for o in seeded if o.finish_reason == "stop"]
    assert stopped, "with high temperature some run should hit EOS within 40 tokens"
    for o in stopped:
        assert o.token_ids[-1] == eos and eos not in o.token_ids[:-1]


def test_n_samples_and_logprobs(llm):
    out = llm.generate(
        ids(7, 8), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=2, ignore_eos=True)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) > 1, "n samples should differ"
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 6
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry
            ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
            assert [lp.rank for lp in ranked] == [1, 2]
            assert ranked[0].logprob >= ranked[1].logprob
            assert all(lp.logprob <= 0 for lp in entry.values())
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_logprobs_match_the_model(llm):
    prompt = [3, 4, 5, 6]
    out = llm.generate(ids(*prompt), SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0]
    ref = torch.log_softmax(llm.engine.model.prompt_logits(prompt)[-1], -1)
    vals, top = ref.topk(3)
    entry = out.logprobs[0]
    for v, t in zip(vals.tolist(), top.tolist()):
        assert entry[t].logprob == pytest.approx(v, abs=1e-4)
    assert out.token_ids[0] == top[0].item()


def test_streaming_deltas_add_up(llm):
    p = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    full = llm.generate(ids(4, 4, 4), p)[0].outputs[0].token_ids
    chunks = [o.outputs[0].delta_token_ids for o in llm.generate_stream(ids(4, 4, 4), p)]
    assert sum(chunks, []) == full and all(len(c) == 1 for c in chunks)


def test_abort_frees_blocks(llm):
    stream = llm.generate_stream(ids(*range(3, 40)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    assert llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks > 0
    stream.close()
    assert llm.engine.core.scheduler.kv_cache_manager.pool.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


def test_the_engine_answers_to_vllms_name(llm):
    """vLLM users drive the engine as `llm.llm_engine`: a request added there runs to the end."""
    engine = llm.llm_engine
    engine.add_request("vllm-name", ids(5, 6, 7), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "vllm-name"]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.5), "temperature"),
        (dict(n=0), "n"),
    ],
)
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_requests_fail_before_any_work(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(ids(*([3] * 200)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="bogus"):
        llm.generate(ids(3), {"max_tokens": 3, "bogus": 1})
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([ids(3), 42], SamplingParams())
    with pytest.raises(ValueError, match="Token id 10000 is out of vocabulary") as exc:  # vLLM's wording
        llm.generate(ids(3, 10_000), SamplingParams())
    assert exc.value.param == "prompt_token_ids"
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    with pytest.raises(ValueError, match="unknown argument"):
        LLM(model="unused", gpu_memory_utilisation=0.5)


def test_unknown_sampling_keyword_is_a_value_error():
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams(max_tokens=3, bogus=1)
