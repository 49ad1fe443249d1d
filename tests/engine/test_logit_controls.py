"""Logit controls (vLLM's names and meanings): logit_bias, allowed_token_ids, bad_words.

They reach both the greedy and the sampled path through one additive [B, V] tensor per
batch, leave the rows that do not ask untouched, and are validated (offline and in the
server) before anything reaches the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import save_random_checkpoint
from starlette.testclient import TestClient
from test_engine import CFG

from musespark import LLM, SamplingParams
from musespark.errors import InvalidArgumentError
from musespark.layers.sampler import LogitAdjustments, SamplingBatch, banned_by_bad_words, sample

N = 10
PROMPTS = [[5, 17, 33, 80, 9], [44, 3, 120, 7, 61, 18, 90]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_random_checkpoint(tmp_path_factory.mktemp("logit_ckpt"), CFG, seed=33)
    return LLM(model=path, dtype="float32", max_model_len=64, block_size=4)


@pytest.fixture(scope="module")
def bundled():
    return LLM(max_model_len=256)


def gen(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0] for o in outs]


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, **kw)


def sampled(**kw):
    return SamplingParams(temperature=1.0, seed=7, max_tokens=N, ignore_eos=True, **kw)


# ---- logit_bias -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [greedy, sampled], ids=["greedy", "sampled"])
def test_positive_bias_forces_the_token_every_step(llm, make):
    for out in gen(llm, PROMPTS, make(logit_bias={77: 100.0})):
        assert out.token_ids == [77] * N


@pytest.mark.parametrize("make", [greedy, sampled], ids=["greedy", "sampled"])
def test_negative_bias_bans_the_token(llm, make):
    base = gen(llm, PROMPTS, make())
    for prompt, b in zip(PROMPTS, base):
        victim = max(set(b.token_ids), key=b.token_ids.count)  # the token it picks most
        out = gen(llm, [prompt], make(logit_bias={victim: -100}))[0]
        assert victim not in out.token_ids
        assert out.token_ids != b.token_ids


def test_logprobs_stay_those_of_the_raw_model(llm):
    """As for penalties: reported logprobs are the model's, before bias/masks (vLLM's
    raw_logprobs), so a forced token reports its own (low) model logprob."""
    import musespark

    model = musespark.load_model(llm.engine.core.config.model.path, dtype="float32")
    raw = torch.log_softmax(model.prompt_logits(PROMPTS[0])[-1].float(), dim=-1)
    forced = int(raw.argmin())
    out = gen(llm, PROMPTS[:1], greedy(logit_bias={forced: 100.0}, logprobs=0))[0]
    assert out.token_ids[0] == forced
    assert out.logprobs[0][forced].logprob == pytest.approx(float(raw[forced]), abs=1e-4)


# ---- allowed_token_ids ------------------------------------------------------------------


@pytest.mark.parametrize("make", [greedy, sampled], ids=["greedy", "sampled"])
def test_allowed_token_ids_restrict_every_token(llm, make):
    allowed = [11, 23, 57, 99]
    base = gen(llm, PROMPTS, make())
    outs = gen(llm, PROMPTS, make(allowed_token_ids=allowed))
    for b, out in zip(base, outs):
        assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == N
        assert not set(b.token_ids) <= set(allowed)  # it did restrict something


def test_min_tokens_and_allowed_ids_compose(llm):
    """The min_tokens stop mask shares the tensor: EOS (2) is allowed but banned until min_tokens."""
    p = SamplingParams(temperature=0.0, max_tokens=N, min_tokens=4, allowed_token_ids=[2, 40], logit_bias={2: 100.0})
    out = gen(llm, PROMPTS[:1], p)[0]
    assert out.token_ids == [40, 40, 40, 40, 2] and out.finish_reason == "stop"


# ---- mixed batch --------------------------------------------------------------------------


def test_rows_that_do_not_ask_are_untouched(llm):
    solo = [gen(llm, [p], mk())[0].token_ids for p, mk in zip(PROMPTS, (greedy, sampled))]
    # One batch: row 0 biased, row 1 plain (sampled, seeded), and row 0 plain with row 1 banned.
    outs = gen(llm, PROMPTS, [greedy(logit_bias={77: 100.0}), sampled()])
    assert outs[0].token_ids == [77] * N and outs[1].token_ids == solo[1]
    outs = gen(llm, PROMPTS, [greedy(), sampled(allowed_token_ids=[3, 4])])
    assert outs[0].token_ids == solo[0] and set(outs[1].token_ids) <= {3, 4}


# ---- bad_words (bundled model: needs its tokenizer) ----------------------------------------


def test_bad_words_multi_token_and_single_token(bundled):
    tok = bundled.engine.tokenizer
    p = SamplingParams(temperature=0.0, max_tokens=20)
    # vLLM's rule keeps " word" only when it tokenizes to as many tokens as "word": "same" is
    # two tokens and " same" one, so bad_words=["same"] bans only the bare form.
    same = SamplingParams(temperature=0.0, max_tokens=20, bad_words=["same"])
    same.update_from_tokenizer(tok)
    assert same._bad_words_token_ids == [tok.encode("same", add_special_tokens=False)]

    def two_token_word(ids: list[int]) -> int | None:
        """Where the output has an identifier of two tokens that is the word's own tokenization."""
        return next(
            (
                i
                for i in range(len(ids) - 1)
                if tok.decode(ids[i : i + 2]).strip().isidentifier()
                and tok.encode(tok.decode(ids[i : i + 2]).strip(), add_special_tokens=False) == ids[i : i + 2]
            ),
            None,
        )

    # A word the greedy output contains (two tokens: a multi-token ban), and its first token's text:
    # from the first of these prompts whose greedy output has one (which one depends on the model).
    prompts = [
        "def fibonacci(n):",
        "import os\n\n\ndef read_config(path):",
        "import os\nimport sys\n\n",
        "def main():\n    parser = argparse.ArgumentParser()",
    ]
    outs = ((q, bundled.generate(q, p)[0].outputs[0]) for q in prompts)  # generated until one has it
    prompt, base = next(((q, b) for q, b in outs if two_token_word(b.token_ids) is not None), (None, None))
    assert base is not None, f"no greedy output of {prompts} has a two-token word"
    ids = base.token_ids
    i = two_token_word(ids)
    two = tok.decode(ids[i : i + 2]).strip()
    one = next(tok.decode([t]).strip() for t in ids if tok.decode([t]).strip().isalnum())
    for words in ([two], [one]):
        params = SamplingParams(temperature=0.0, max_tokens=20, bad_words=words)
        out = bundled.generate(prompt, params)[0].outputs[0]
        assert out.token_ids != base.token_ids
        seqs = params._bad_words_token_ids
        # vLLM's tokenization: the bare word, then " word" when it is a new word token of the same length.
        assert seqs[0] == tok.encode(words[0], add_special_tokens=False)
        for seq in seqs:
            ids_out = out.token_ids
            assert not any(ids_out[j : j + len(seq)] == seq for j in range(len(ids_out))), (words, seq, ids_out)
    # A sampled request honours it too, and n > 1 children keep the tokenized words.
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=20, bad_words=["#"])
    for c in bundled.generate(prompt, params)[0].outputs:
        assert tok.encode("#", add_special_tokens=False)[0] not in c.token_ids
        assert tok.encode(" #", add_special_tokens=False)[0] not in c.token_ids


def test_bad_words_rule():
    words = [[5], [7, 8, 9], [3, 4]]
    assert banned_by_bad_words(words, []) == [5]
    assert banned_by_bad_words(words, [1, 3]) == [5, 4]
    assert banned_by_bad_words(words, [7, 8]) == [5, 9]
    assert banned_by_bad_words(words, [8]) == [5]  # shorter than the word's prefix
    assert banned_by_bad_words(words, [7, 8, 1]) == [5]


# ---- the tensor ---------------------------------------------------------------------------


def test_adjustments_cost_nothing_when_no_row_asks():
    adj = LogitAdjustments(3, 10)
    for i in range(3):
        adj.add_request(i, SamplingParams(), [1, 2])
    assert adj.tensor is None
    adj.add_request(1, SamplingParams(logit_bias={4: 2.5}), [])
    adj.allow_only(2, torch.tensor([True] * 5 + [False] * 5))  # a structured-output style bitmask
    t = adj.tensor
    assert t[0].eq(0).all() and t[1, 4] == 2.5 and t[1].count_nonzero() == 1
    assert torch.isinf(t[2, 5:]).all() and t[2, :5].eq(0).all()
    logits = torch.zeros(3, 10)
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * 3, [[]] * 3, [[]] * 3, 10, [None] * 3)
    assert sample(logits, batch, logit_adjust=t).token_ids.tolist() == [0, 4, 0]


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={True: 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias=[5]), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1.0]), "allowed_token_ids"),
        (dict(bad_words="word"), "bad_words"),
        (dict(bad_words=["ok", " "]), "bad_words"),
        (dict(bad_words=[3]), "bad_words"),
    ],
)
def test_sampling_params_refuse(kwargs, param):
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_out_of_vocabulary_ids_are_refused_before_any_work(llm):
    steps = llm.engine.num_steps
    for kwargs, param in [
        (dict(logit_bias={CFG.vocab_size: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[1, CFG.vocab_size + 5]), "allowed_token_ids"),
        (dict(bad_words=["x"]), "bad_words"),
    ]:  # this checkpoint has no tokenizer
        with pytest.raises(InvalidArgumentError) as e:
            llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(**kwargs))
        assert e.value.param == param
    assert llm.engine.num_steps == steps and not llm.engine.has_unfinished_requests()


# ---- server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(bundled):
    from musespark.server.api import ServerConfig, build_app

    app = build_app(bundled.engine, ServerConfig(model_name="m", log_requests=False))
    with TestClient(app) as c:
        yield c, app.state.async_engine


def test_server_applies_logit_controls(client, bundled):
    c, _ = client
    tok = bundled.engine.tokenizer
    r = c.post(
        "/v1/completions", json={"prompt": "def f():", "max_tokens": 3, "temperature": 0, "logit_bias": {"500": 100}}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode([500] * 3)
    allowed = tok.encode(" yes no", add_special_tokens=False)
    r = c.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "temperature": 1.0,
            "seed": 2,
            "allowed_token_ids": allowed,
            "bad_words": ["yes"],
        },
    )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text and set(tok.encode(text, add_special_tokens=False)) <= set(allowed) and "yes" not in text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"allowed_token_ids": [5, 999999]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": ["5"]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_server_refuses_bad_logit_controls(client, monkeypatch, route, body, param):
    c, async_engine = client

    async def never(*args, **kwargs):
        raise AssertionError("a refused request reached the engine")
        yield

    monkeypatch.setattr(async_engine, "generate", never)
    payload = (
        {"prompt": "def f():"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    r = c.post(route, json={**payload, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
