"""Speculative decoding: config parsing, the ngram proposer, the rejection sampler against
exact enumeration, the engine's distribution under seeded sampling (chi-square), and
lossless greedy decoding with prefix caching, chunked prefill and preemption."""

import itertools
import json
import random
import zlib
from collections import Counter

import pytest
import torch
from conftest import save_random_checkpoint

from musespark import LLM, SamplingParams
from musespark.config import ModelConfig
from musespark.engine.spec_decode.backoff import Backoff
from musespark.engine.spec_decode.config import SpeculativeConfig
from musespark.engine.spec_decode.ngram import NgramProposer
from musespark.engine.spec_decode.proposer import ProposalRequest
from musespark.engine.spec_decode.rejection import acceptance_probs, residual, verify_greedy, verify_sampled

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


# -- config ---------------------------------------------------------------------------------
def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.parse({"model": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 3)
    c = SpeculativeConfig.parse(
        {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 2,
            "enforce_eager": True,
            "rejection_sample_method": "standard",
        }
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse(json.dumps(c.to_dict())) == c
    d = SpeculativeConfig.parse(
        {"method": "dspark", "model": "DIR", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}
    )
    assert (d.model, d.draft_sample_method) == ("DIR", "probabilistic")
    assert SpeculativeConfig.parse(d.to_dict()) == d


@pytest.mark.parametrize(
    "value, names",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus_key": 1}, "'bogus_key'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"}, "'quantization'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"},
            "'rejection_sample_method'",
        ),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min=4",
        ),
        ({"num_speculative_tokens": 2}, "'method'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
            "draft_sample_method",
        ),
        ({"method": "dspark", "num_speculative_tokens": 2, "draft_sample_method": "beam"}, "draft_sample_method"),
        ({"method": "dspark", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ("{not json", "JSON"),
        ([1, 2], "JSON object"),
    ],
)
def test_config_errors_name_the_key(value, names):
    with pytest.raises(ValueError, match=names) as exc:
        SpeculativeConfig.parse(value)
    assert exc.value.param == "speculative_config"


def test_llm_refuses_a_bad_config_before_loading():
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        LLM(speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(speculative_config=NGRAM, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(speculative_config={"method": "dspark", "num_speculative_tokens": 2}, tensor_parallel_size=2)


# -- ngram ----------------------------------------------------------------------------------
def brute_force_lookup(tokens, k, lo, hi):
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]  # earlier occurrences
        if starts:
            i = starts[-1]  # the most recent, unless it cannot supply k tokens: then the earliest
            if len(tokens) - (i + n) < k:
                i = starts[0]
            return tokens[i + n : i + n + k]
    return []


def test_ngram_matches_brute_force_incrementally():
    rng = random.Random(3)
    for lo, hi, k in [(1, 4, 3), (2, 2, 5), (1, 1, 1), (3, 5, 4)]:
        proposer = NgramProposer(k, lo, hi)
        tokens = [rng.randrange(4) for _ in range(5)]
        while len(tokens) < 120:
            want = brute_force_lookup(tokens, k, lo, hi)
            (got,) = proposer.propose([ProposalRequest("r", tokens, 0, None, k)])
            assert got.token_ids == want, (lo, hi, k, tokens)
            assert got.probs is None
            tokens = tokens + [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        proposer.drop("r")
        assert not proposer._index


def test_ngram_examples():
    p = NgramProposer(3, 1, 3)
    assert p.lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert p.lookup([1, 2, 3, 9, 2, 3, 7, 2, 3], 3) == [7, 2, 3]  # most recent occurrence
    assert p.lookup([5, 6, 7], 3) == []
    assert p.lookup([4, 4], 3) == [4]  # may run into the suffix; never past the end
    # A periodic tail: the most recent [1, 2] leaves only 2 tokens to copy, the earliest 4.
    assert NgramProposer(4, 1, 2).lookup([7, 1, 2, 1, 2, 1, 2], 4) == [1, 2, 1, 2]


# -- rejection sampler vs exact enumeration -------------------------------------------------
V = 3


def toy_dist(prefix, salt, zeros=False):
    """A fixed distribution over V tokens for each prefix (optionally with zero entries)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((list(prefix), salt)).encode()))
    p = torch.rand(V, generator=g, dtype=torch.float64) + 0.05
    if zeros and sum(prefix) % 2:
        p[sum(prefix) % V] = 0.0
    return p / p.sum()


def step_distribution(prefix, k, mode):
    """Exact distribution of one verification step's emitted tokens, built from the
    module's acceptance_probs and residual (the functions verify_sampled uses)."""
    out = Counter()

    def walk(j, drafted, prob_so_far):
        ctx = prefix + drafted
        p = toy_dist(ctx, "target", zeros=True)
        if j == k:  # all accepted: the bonus token from p_k
            for t in range(V):
                out[tuple(drafted) + (t,)] += prob_so_far * float(p[t])
            return
        if mode == "onehot":
            q = None
            choices = [(int(toy_dist(ctx, "draft").argmax()), 1.0)]
        else:
            q = toy_dist(ctx, "draft")
            choices = [(d, float(q[d])) for d in range(V)]
        for d, pq in choices:
            a = float(acceptance_probs(p[None], [d], None if q is None else q[None])[0])
            walk(j + 1, drafted + [d], prob_so_far * pq * a)
            r = residual(p, d, q)
            for t in range(V):
                out[tuple(drafted) + (t,)] += prob_so_far * pq * (1 - a) * float(r[t])

    walk(0, [], 1.0)
    return out


@pytest.mark.parametrize("mode", ["onehot", "probs"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_rejection_sampling_is_exact_by_enumeration(mode, k):
    """The first L tokens generated by repeated verification steps have exactly the
    target's joint distribution (float64, every path enumerated)."""
    L = 4

    def generated(prefix, n):
        if n <= 0:
            return Counter({(): 1.0})
        dist = Counter()
        for emitted, pr in step_distribution(prefix, k, mode).items():
            if len(emitted) >= n:
                dist[emitted[:n]] += pr
            else:
                for rest, pr2 in generated(prefix + list(emitted), n - len(emitted)).items():
                    dist[emitted + rest] += pr * pr2
        return dist

    got = generated([1], L)
    for seq in itertools.product(range(V), repeat=L):
        want = 1.0
        for i, t in enumerate(seq):
            want *= float(toy_dist([1] + list(seq[:i]), "target", zeros=True)[t])
        assert got.get(seq, 0.0) == pytest.approx(want, abs=1e-12), seq


def chi_square_p(observed: Counter, expected: dict, n: int) -> float:
    """Pearson chi-square p-value; cells expected below 5 draws are pooled into one."""
    from scipy.stats import chi2

    stat, df, pool_o, pool_e = 0.0, -1, 0, 0.0
    for cell, pr in expected.items():
        e = pr * n
        if e < 5:
            pool_o, pool_e = pool_o + observed.get(cell, 0), pool_e + e
            continue
        stat += (observed.get(cell, 0) - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    return float(chi2.sf(stat, df))


@pytest.mark.parametrize("mode", ["onehot", "probs"])
def test_verify_sampled_draws_match_enumeration(mode):
    """The sampling code itself: 6000 seeded draws of one step vs its exact distribution,
    chi-square p > 0.001 (fixed seeds: the test is deterministic)."""
    k, prefix, n = 2, [2, 1], 6000
    gen = torch.Generator().manual_seed(7)
    expected = step_distribution(prefix, k, mode)
    seen = Counter()
    for _ in range(n):
        drafted, qs = [], []
        for _ in range(k):
            ctx = prefix + drafted
            if mode == "onehot":
                drafted.append(int(toy_dist(ctx, "draft").argmax()))
            else:
                q = toy_dist(ctx, "draft")
                qs.append(q)
                drafted.append(int(torch.multinomial(q, 1, generator=gen)))
        p = torch.stack([toy_dist(prefix + drafted[:j], "target", zeros=True) for j in range(k + 1)])
        res = verify_sampled(drafted, p, torch.stack(qs) if qs else None, gen)
        assert res.token_ids[: res.num_accepted] == drafted[: res.num_accepted]
        seen[tuple(res.token_ids)] += 1
    assert chi_square_p(seen, expected, n) > 1e-3


def test_verify_greedy():
    assert verify_greedy([4, 5, 6], [4, 5, 7, 9]).token_ids == [4, 5, 7]
    assert verify_greedy([4, 5], [4, 5, 8]).token_ids == [4, 5, 8]
    assert verify_greedy([1], [2, 3]).num_accepted == 0


# -- the engine: distribution under seeded sampling ----------------------------------------
SMALL = ModelConfig(
    vocab_size=8,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    moe_hidden_size=16,
    moe_intermediate_size=24,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    bos_token_id=1,
    eos_token_id=2,
    mlp_layer_types=("dense", "sparse"),
    rope_theta=10000.0,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("spec_small"), SMALL, seed=5)


def test_seeded_sampling_with_speculation_matches_the_target(small_checkpoint):
    """3000 seeded requests, temperature 0.8, 4 tokens each, ngram drafting on every step
    (the prompt holds every token, lookup down to 1-grams). The pair (token 2, token 3) —
    both produced by verification steps — is compared with the exact pair distribution
    from the model's own logits: Pearson chi-square over the 64 cells (cells expected
    below 5 draws pooled), required p > 0.001. Seeds are fixed, so the test is deterministic."""
    import musespark

    prompt = [3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5]
    temperature, n = 0.8, 3000
    llm = LLM(
        model=small_checkpoint,
        dtype="float32",
        max_model_len=64,
        block_size=4,
        max_num_seqs=256,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_max": 2,
            "prompt_lookup_min": 1,
        },
    )
    # every request's first draft has both tokens (a new request would start with one)
    llm.engine.core.speculator.backoff = Backoff(start=2)
    params = [SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, seed=1000 + i) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
    seen = Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs)
    stats = llm.engine.get_stats()
    assert stats.spec_num_draft_tokens > n and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens

    model = musespark.load_model(small_checkpoint, dtype="float32")

    def probs(seq):
        return torch.softmax(model.prompt_logits(seq)[-1].double() / temperature, -1)

    p1 = probs(prompt)
    expected = Counter()
    for t1 in range(SMALL.vocab_size):
        p2 = probs(prompt + [t1])
        for t2 in range(SMALL.vocab_size):
            p3 = probs(prompt + [t1, t2])
            for t3 in range(SMALL.vocab_size):
                expected[(t2, t3)] += float(p1[t1] * p2[t2] * p3[t3])
    assert chi_square_p(seen, expected, n) > 1e-3

    again = llm.generate([{"prompt_token_ids": prompt}] * 20, params[:20])  # seeded: reproducible
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:20]]


# -- the engine: lossless greedy ------------------------------------------------------------
def mixed_prompts(tokenizer):
    """32 prompts of 3..~400 tokens: text that repeats itself (ngram finds drafts), plain
    text, and prompts sharing long prefixes (prefix-cache hits)."""
    rng = random.Random(11)
    words = (
        "the quick brown fox jumps over a lazy dog while seven small cats watch from "
        "an old red barn near the river bank"
    ).split()
    code = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    shared = "Copy the following text exactly.\n" + code * 3
    out = []
    for i in range(32):
        kind = i % 4
        if kind == 0:
            text = shared + f"# variant {i}\n" + code
        elif kind == 1:
            text = " ".join(rng.choice(words) for _ in range(rng.randrange(2, 120)))
        elif kind == 2:
            phrase = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 9)))
            text = (phrase + ". ") * rng.randrange(2, 12)
        else:
            text = rng.choice(words)
        out.append({"prompt_token_ids": tokenizer.encode(text)})
    return out


def mixed_params():
    rng = random.Random(5)
    out = []
    for i in range(32):
        kw = dict(temperature=0.0, max_tokens=rng.randrange(8, 48))
        if i % 5 == 1:
            kw.update(logprobs=2)
        if i % 7 == 2:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.2)
        if i % 9 == 3:
            kw.update(min_tokens=6, logit_bias={11: 2.5})
        if i % 6 == 4:
            kw.update(stop=["the", "\n\n"])
        out.append(SamplingParams(**kw))
    return out


LOSSLESS_OPTIONS = dict(
    dtype="float32",
    max_model_len=512,
    block_size=16,
    max_num_batched_tokens=64,
    max_num_seqs=16,
    kv_cache_memory=80 * 2 * 2 * 16 * 2 * 64 * 4,
    enable_prefix_caching=True,
)


def dspark_config():
    """The bundled DSpark draft, when this checkout has it (the dspark method's own work)."""
    from musespark.engine.args import bundled_model_path

    path = bundled_model_path().parent / "musespark-tiny-dspark"
    import importlib.util

    if importlib.util.find_spec("musespark.engine.spec_decode.dspark") is None or not (path / "config.json").is_file():
        return None
    return {"method": "dspark", "model": str(path), "num_speculative_tokens": 7}


def run_mixed(spec):
    options = dict(LOSSLESS_OPTIONS)
    if spec is not None and spec["method"] == "dspark":
        # the draft's context K/V are a KV group of the same pool: one 512-token sequence
        # needs 87 blocks then (53 without); 100 still preempt
        options["kv_cache_memory"] = 100 * 2 * 2 * 16 * 2 * 64 * 4
    llm = LLM(speculative_config=spec, **options)
    return llm, llm.generate(mixed_prompts(llm.get_tokenizer()), mixed_params())


@pytest.fixture(scope="module")
def base_run():
    """The bundled model without speculation; prefix caching on, 64-token steps (chunked
    prefill) and a KV pool small enough to force preemption.

    In float32: the runs with and without speculation schedule differently (verification
    rows use the step budget, so prompts are chunked and preempted at other points), and in
    bf16 the engine's greedy tokens depend on the schedule even without speculation (the
    same 32 prompts with 64- vs 40-token steps differ in 3 of them). In float32 every
    schedule gives the same tokens; bf16 bit-identity under speculation is checked alone
    below."""
    return run_mixed(None)


@pytest.mark.parametrize("method", ["ngram", "dspark"])
def test_greedy_speculation_is_lossless(base_run, method):
    spec = NGRAM if method == "ngram" else dspark_config()
    if spec is None:
        pytest.skip("the dspark proposer or the bundled draft is not in this checkout")
    base_llm, base = base_run
    spec_llm, spec_outs = run_mixed(spec)
    for i, (a, b) in enumerate(zip(base, spec_outs)):
        x, y = a.outputs[0], b.outputs[0]
        assert y.token_ids == x.token_ids, f"prompt {i}"
        assert (y.text, y.finish_reason, y.stop_reason) == (x.text, x.finish_reason, x.stop_reason), f"prompt {i}"
        if x.logprobs is not None:
            assert len(y.logprobs) == len(x.logprobs)
            for da, db in zip(x.logprobs, y.logprobs):
                assert da.keys() == db.keys()
                for t in da:  # equal up to how prompts were chunked (see base_run)
                    assert db[t].logprob == pytest.approx(da[t].logprob, abs=1e-4)
    for llm in (base_llm, spec_llm):
        sched = llm.engine.core.scheduler
        assert sched.num_preemptions > 0
        assert sched.kv_cache_manager.prefix_hits > 0
        sched.kv_cache_manager.check_invariants()
        assert sched.kv_cache_manager.pool.num_used_blocks == 0
    # Drafts were accepted, some several tokens deep, so the identity above covers accepted rows.
    # (Measured on a 2-vCPU AMD EPYC on 2026-12-07: ngram accepts 191 of 255 drafted tokens here;
    # the DSpark draft retrained for the current bundled model accepts 40 of 112, 7 of them beyond
    # the first position; the draft of the pre-copy target accepted more than 50 of its drafts.)
    stats = spec_llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens > 10 and sum(stats.spec_accepted_per_pos[1:]) > 2, stats
    if method == "ngram":
        # Fewer engine steps than without speculation. Not asserted for DSpark: at ~0.36 accepted
        # per drafted token its 8-row verifications use more of the 64-token step budget than they
        # save (222 steps against 212 without speculation, same machine and date).
        assert spec_llm.engine.num_steps < base_llm.engine.num_steps
    assert any(o.outputs[0].stop_reason in ("the", "\n\n") for o in spec_outs)  # stop strings hit inside runs


@pytest.mark.parametrize("method", ["ngram", "dspark"])
def test_verification_rows_are_bit_identical_to_decode_rows(method):
    """Verified rows take the decode attention kernel row by row: alone, a request's greedy
    tokens and logprobs with speculation are bit-identical to one-at-a-time decoding (bf16)."""
    spec = NGRAM if method == "ngram" else dspark_config()
    if spec is None:
        pytest.skip("the dspark proposer or the bundled draft is not in this checkout")
    # Prompts whose drafts are accepted early (a request whose first drafts all fail backs off:
    # engine/spec_decode/backoff.py): one the bundled model partly copies for ngram, and code of
    # the kind the draft was distilled on for dspark (measured on an AVX-512 Xeon, 2026-12-07:
    # the ngram prompt gets 0 of 2 dspark drafts accepted, this one 25 over 7 drafts).
    if method == "ngram":
        text = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("
    else:
        text = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
        text += "        self.items.append(item)\n\n    def pop(self):\n        "
    params = SamplingParams(temperature=0.0, max_tokens=96, logprobs=1)
    base = LLM(enable_prefix_caching=False).generate(text, params)[0].outputs[0]
    llm = LLM(enable_prefix_caching=False, speculative_config=spec)
    spec = llm.generate(text, params)[0].outputs[0]
    assert spec.token_ids == base.token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in spec.logprobs] == [
        {t: lp.logprob for t, lp in d.items()} for d in base.logprobs
    ]
    assert llm.engine.get_stats().spec_num_accepted_tokens > 0


class OracleProposer:
    """Drafts the known greedy continuation (every draft is accepted), optionally with a
    soft draft distribution q (the dspark-style path)."""

    aux_layers = ()

    def __init__(self, sequence, vocab_size, soft=False):
        self.sequence, self.vocab_size, self.soft = list(sequence), vocab_size, soft

    def propose(self, requests):
        from musespark.engine.spec_decode.proposer import Proposal

        out = []
        for r in requests:
            n = len(r.token_ids)
            ids = self.sequence[n : n + r.num_tokens] if list(r.token_ids) == self.sequence[:n] else []
            probs = None
            if self.soft and ids:
                probs = torch.full((len(ids), self.vocab_size), 0.5 / self.vocab_size)
                probs[torch.arange(len(ids)), torch.tensor(ids)] += 0.5
            out.append(Proposal(ids, probs))
        return out

    def drop(self, request_id):
        pass


@pytest.mark.parametrize("soft", [False, True])
def test_stops_inside_accepted_runs(soft):
    """Every draft accepted (an oracle proposer), so stop tokens, stop strings, max_tokens
    and min_tokens all land inside multi-token runs: the outputs, texts, finish reasons and
    logprobs must be those of one-at-a-time decoding (bf16, bit for bit)."""
    text = "the quick brown fox. the quick brown fox. the quick"
    base_llm = LLM(enable_prefix_caching=False)
    spec_llm = LLM(enable_prefix_caching=False, speculative_config=NGRAM)
    prompt_ids = base_llm.get_tokenizer().encode(text)
    full = base_llm.generate(
        {"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )[0].outputs[0]
    vocab = spec_llm.engine.config.vocab_size
    spec_llm.engine.core.speculator.proposer = OracleProposer(prompt_ids + full.token_ids, vocab, soft)
    stop_token = full.token_ids[9]
    stop_text = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cases = [
        dict(stop_token_ids=[stop_token]),
        dict(max_tokens=13),
        dict(stop=[stop_text]),
        dict(stop=[stop_text], include_stop_str_in_output=True),
        dict(stop_token_ids=[stop_token], min_tokens=11),
        dict(logprobs=2, max_tokens=17),
    ]
    for case in cases:
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **case})
        want = base_llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0]
        got = spec_llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        ), case
        if want.logprobs is not None:
            assert [{t: lp.logprob for t, lp in d.items()} for d in got.logprobs] == [
                {t: lp.logprob for t, lp in d.items()} for d in want.logprobs
            ]
            assert got.cumulative_logprob == want.cumulative_logprob
    stats = spec_llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens > 30  # all but where min_tokens changes the continuation
    spec_llm.engine.core.scheduler.kv_cache_manager.check_invariants()


class WrongProposer(OracleProposer):
    """Drafts a token that is never the greedy one (every draft rejected)."""

    def propose(self, requests):
        from musespark.engine.spec_decode.proposer import Proposal

        out = []
        for r in requests:
            n = len(r.token_ids)
            right = self.sequence[n : n + r.num_tokens]
            out.append(Proposal([(t + 1) % self.vocab_size for t in right]))
        return out


def test_speculation_backs_off_where_drafts_are_rejected():
    """A request whose drafts are all rejected stops drafting after its first one-token draft and
    then only probes, one token at a time, further and further apart (so it decodes at about the
    plain speed); one whose drafts are accepted drafts every step. Outputs are the same either way."""
    from musespark.engine.spec_decode import backoff

    text = "the quick brown fox. the quick brown fox. the quick"
    base_llm = LLM(enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompt_ids = base_llm.get_tokenizer().encode(text)
    full = base_llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0]
    for proposer, accepted in ((WrongProposer, False), (OracleProposer, True)):
        llm = LLM(enable_prefix_caching=False, speculative_config=NGRAM)
        llm.engine.core.speculator.proposer = proposer(prompt_ids + full.token_ids, llm.engine.config.vocab_size)
        got = llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0]
        assert got.token_ids == full.token_ids
        stats = llm.engine.get_stats()
        drafts, draft_tokens = stats.spec_num_drafts, stats.spec_num_draft_tokens
        if accepted:
            assert drafts >= 64 // (NGRAM["num_speculative_tokens"] + 1) - 1
        else:  # a one-token draft, then probes of one token PROBE, PROBE * GROWTH, ... steps apart
            probes = drafts - 1
            assert 1 <= probes <= 2 and backoff.PROBE * (1 + backoff.GROWTH) > 64 - 2, drafts
            assert draft_tokens == drafts


def test_rejected_drafts_never_enter_the_prefix_cache():
    """After every step, each registered (prefix-cache) block of a running request lies
    wholly below num_computed_tokens and its hash is that of the request's accepted tokens;
    rejected drafts do happen meanwhile."""
    from musespark.engine.block_pool import hash_block

    llm = LLM(block_size=4, max_num_batched_tokens=32, speculative_config=NGRAM)
    engine = llm.engine
    tok = llm.get_tokenizer()
    texts = ["one two three one two three one two", "a b a b a b c d c d", "the fox the dog the fox the"]
    for i, t in enumerate(texts):
        engine.add_request(f"r{i}", t, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    kv = engine.core.scheduler.kv_cache_manager
    while engine.has_unfinished_requests():
        engine.step()
        kv.check_invariants()
        for request in engine.core.scheduler.running:
            chain = None
            for i, bid in enumerate(kv.block_tables(request.request_id)[0]):
                chain = hash_block(chain, request.token_ids[i * 4 : (i + 1) * 4])
                key = kv.pool.blocks[bid].cache_key if bid >= 0 else None
                if key is not None:
                    assert (i + 1) * 4 <= request.num_computed_tokens
                    assert key == (0, chain)
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # some drafts were rejected
    assert len(tok.encode(texts[0])) > 4


def test_tensor_parallel_with_ngram():
    """tensor_parallel_size=2 with ngram: the same greedy tokens as one process without
    speculation (float32), and seeded sampling reproducible."""
    prompts = [
        "the quick brown fox. the quick brown fox. the quick",
        "def add(a, b):\n    return a + b\n\ndef add(",
        "Hello",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in LLM(dtype="float32").generate(prompts, params)]
    tp = LLM(dtype="float32", tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, params)] == want
        assert tp.engine.get_stats().spec_num_accepted_tokens > 0
        seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=16)
        a, b = tp.generate(prompts, seeded), tp.generate(prompts, seeded)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    finally:
        tp.engine.core.executor.shutdown()


def test_bench_latency_reports_mean_acceptance_length(tmp_path):
    import os
    import subprocess
    import sys

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "musespark",
            "bench",
            "latency",
            "--batch-size",
            "1",
            "--input-len",
            "16",
            "--output-len",
            "24",
            "--num-iters",
            "1",
            "--num-iters-warmup",
            "0",
            "--speculative-config",
            spec,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    s = out["speculative"]
    assert s["config"]["num_speculative_tokens"] == 3 and s["num_drafts"] > 0
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])


class AuxRecorder(NgramProposer):
    """ngram drafts, plus a record of the aux rows the engine hands over (the dspark contract),
    and of the positions whose rows it withheld (a request backing off that drafts nothing next
    step: `backoff` is the engine's)."""

    aux_layers = (0, 2)

    def __init__(self, backoff):
        super().__init__(3, 1, 3)
        self.backoff = backoff
        self.rows = {}  # request id -> {position: row}
        self.withheld = {}  # request id -> {position}
        self.seen_tokens = {}

    def propose(self, requests):
        for r in requests:
            rows = self.rows.setdefault(r.request_id, {})
            withheld = self.withheld.setdefault(r.request_id, set())
            for p in [p for p in rows if p >= r.context_start]:  # invalid now: replaced below
                del rows[p]
            withheld -= {p for p in withheld if p >= r.context_start}
            self.seen_tokens[r.request_id] = list(r.token_ids)
            if r.hidden is None:  # in decode: the step computed [context_start, anchor)
                assert r.num_tokens == 0 and self.backoff.backing_off(r.request_id)
                withheld.update(range(r.context_start, len(r.token_ids) - 1))
                continue
            assert r.hidden.dtype == torch.float32 and r.hidden.shape[1] == 2 * 256
            for j in range(r.hidden.shape[0]):
                rows[r.context_start + j] = r.hidden[j].clone()
            end = r.context_start + r.hidden.shape[0]  # up to the anchor, excluded (a prefill chunk: before it)
            assert end == len(r.token_ids) - 1 if r.num_tokens else end <= len(r.token_ids) - 1
        return super().propose(requests)


def test_aux_streams_reach_the_proposer():
    """A proposer with aux_layers gets, for every position its request validly computed
    (prefill chunks, accepted drafts; rejected ones replaced), the fp32 streams after those
    layers: equal to the streams of one full forward over the final tokens. The exception:
    the steps of a request backing off that drafts nothing next step, whose rows are withheld
    (engine/spec_decode/speculator.py); a draft always has the row just before its anchor."""
    from musespark.layers.attention import AttentionContext

    llm = LLM(dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=16, speculative_config=NGRAM)
    recorder = AuxRecorder(llm.engine.core.speculator.backoff)
    llm.engine.core.speculator.proposer = recorder
    llm.engine.core.runner.aux_layers = recorder.aux_layers
    texts = ["the quick brown fox. the quick brown fox. the quick", "one two three one two three one two"]
    llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    model = llm.engine.model
    for rid, tokens in recorder.seen_tokens.items():
        n = len(tokens) - 1
        with torch.inference_mode():
            _, aux = model(
                torch.tensor(tokens[:n]),
                torch.arange(n),
                AttentionContext.for_prompts([n]),
                aux_layers=recorder.aux_layers,
            )
        rows, withheld = recorder.rows[rid], recorder.withheld[rid]
        assert sorted([*rows, *withheld]) == list(range(n))
        given = sorted(rows)
        got = torch.stack([rows[p] for p in given])
        assert torch.allclose(got, aux[given], atol=1e-4, rtol=1e-4)
