"""Scoring: `prompt_logprobs` (offline) equal the log-softmax of a whole-prompt forward pass,
whatever the chunking and with prefix caching on; `cache_salt` keeps tenants' cached
prefixes apart."""

from __future__ import annotations

import pytest
import torch

from musespark import LLM, SamplingParams

TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n"
)


@pytest.fixture(scope="module")
def llm():
    # A small token budget: the prompt is computed in several chunks.
    return LLM(dtype="float32", max_model_len=512, max_num_batched_tokens=24, block_size=16)


def reference(llm, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V] log-softmax of the whole-prompt forward: row p scores token p + 1."""
    with torch.inference_mode():
        logits = llm.engine.model.prompt_logits(ids).float()
    return logits[:-1].log_softmax(-1)


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_a_whole_prompt_forward(llm, k):
    ids = llm.get_tokenizer().encode(TEXT)
    # Warm the prefix cache with the same prompt: scoring must not skip cached positions.
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1))
    (out,) = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, prompt_logprobs=k, n=2, temperature=0)
    )
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    ref = reference(llm, ids)
    for p in range(1, len(ids)):
        entry = plp[p]
        assert abs(entry[ids[p]].logprob - ref[p - 1, ids[p]].item()) < 1e-4
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None)
        assert [t for _, t in ranked] == ref[p - 1].topk(k).indices.tolist() if k else not ranked


def test_cache_salt_separates_tenants(llm):
    ids = llm.get_tokenizer().encode("# a prompt no other test sends\n" + TEXT)
    params = SamplingParams(max_tokens=1)
    (a,) = llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-a"}], params)
    (b,) = llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-b"}], params)
    (a2,) = llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-a"}], params)
    (plain,) = llm.generate([{"prompt_token_ids": ids + [5]}], params)
    assert b.num_cached_tokens == 0  # tenant b never sees tenant a's blocks
    assert a2.num_cached_tokens == (len(ids) - 1) // 16 * 16 > 0  # tenant a reuses its own
    assert plain.num_cached_tokens == 0  # nor does an unsalted request
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": ids, "cache_salt": ""}], params)


# -- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(llm):
    from fastapi.testclient import TestClient

    from musespark.server.api import ServerConfig, build_app

    config = ServerConfig(model_name="m", log_requests=False, enable_prompt_tokens_details=True)
    with TestClient(build_app(llm.engine, config)) as c:
        yield c


def test_echo_logprobs_equal_offline_prompt_logprobs(http, llm):
    ids = llm.get_tokenizer().encode("# echo scoring\n" + TEXT)
    (off,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))
    for stream in (False, True):
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "stream": stream}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            import json as _json

            chunks = [_json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            lp = {"token_logprobs": [], "tokens": []}
            for ch in chunks:
                for c in ch["choices"]:
                    lp["token_logprobs"] += c["logprobs"]["token_logprobs"]
                    lp["tokens"] += c["logprobs"]["tokens"]
        else:
            lp = r.json()["choices"][0]["logprobs"]
        got = lp["token_logprobs"]
        assert len(got) == len(ids) + 1 and got[0] is None
        for p in range(1, len(ids)):
            assert got[p] == pytest.approx(off.prompt_logprobs[p][ids[p]].logprob, abs=1e-6)
        assert "".join(lp["tokens"][: len(ids)]) == llm.get_tokenizer().decode(ids, skip_special_tokens=False)


def test_prompt_logprobs_token_ids_truncation_and_cached_tokens(http, llm):
    ids = llm.get_tokenizer().encode("# vLLM extensions\n" + TEXT)
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "return_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 2
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert all(
        str(ids[p]) in plp[p] and sum(v["rank"] is not None for v in plp[p].values()) == 2 for p in range(1, len(ids))
    )
    r = http.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 5, "return_token_ids": True}
    ).json()
    assert r["choices"][0]["prompt_token_ids"] == ids[-5:] and r["usage"]["prompt_tokens"] == 5
    # cached_tokens is the engine's own count: the second identical request hits the cache.
    ids = llm.get_tokenizer().encode("# cache accounting\n" + TEXT)
    first = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}).json()["usage"]
    again = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16 > 0
    salted = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "cache_salt": "other-tenant"}).json()[
        "usage"
    ]
    assert salted["prompt_tokens_details"]["cached_tokens"] == 0
