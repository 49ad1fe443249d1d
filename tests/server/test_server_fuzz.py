"""Malformed requests against the live server: every answer is a 4xx in OpenAI's error
shape, and the server stays healthy throughout (hypothesis, derandomized)."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import API_KEY, MAX_MODEL_LEN, MODEL_NAME, server  # noqa: F401  (the fixture)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
N_EXAMPLES = 240

not_int = st.one_of(
    st.text(max_size=5),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
not_number = st.one_of(
    st.text(max_size=5), st.booleans(), st.lists(st.floats(), max_size=2), st.none().map(lambda _: {})
)
not_bool = st.one_of(
    st.text(max_size=5), st.integers(), st.floats(allow_nan=False), st.lists(st.booleans(), max_size=2)
)

# (field, strategy of values that must be refused)
BAD_FIELDS = {
    "max_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=MAX_MODEL_LEN + 1), not_int),
    "temperature": st.one_of(st.floats(max_value=-1e-3), st.just(float("nan")), st.just(float("inf")), not_number),
    "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0001), st.just(float("nan")), not_number),
    "top_k": st.one_of(st.integers(max_value=-2), not_int),
    "min_p": st.one_of(st.floats(max_value=-1e-6), st.floats(min_value=1.0001), not_number),
    "presence_penalty": st.one_of(st.floats(min_value=2.0001), st.floats(max_value=-2.0001), not_number),
    "frequency_penalty": st.one_of(st.floats(min_value=2.0001), st.floats(max_value=-2.0001), not_number),
    "repetition_penalty": st.one_of(st.floats(max_value=0.0), st.just(float("inf")), not_number),
    "n": st.one_of(st.integers(max_value=0), st.integers(min_value=10_000), not_int),
    "seed": st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63) - 1), not_int),
    "stop": st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=3), st.just([""]), st.just("")),
    "stop_token_ids": st.one_of(st.lists(st.integers(max_value=-1), min_size=1, max_size=3), st.text(min_size=1)),
    "min_tokens": st.one_of(st.integers(max_value=-1), st.integers(min_value=17), not_int),
    "ignore_eos": not_bool,
    "stream": not_bool,
    "stream_options": st.one_of(
        st.integers(), st.text(max_size=4), st.fixed_dictionaries({"include_usage": st.integers()})
    ),
    "model": st.text(min_size=1, max_size=20).filter(lambda m: m != MODEL_NAME),
}
COMPLETION_ONLY = {
    "prompt": st.one_of(
        st.none(),
        st.integers(),
        st.just(""),
        st.just([]),
        st.booleans(),
        st.lists(st.integers(min_value=4096), min_size=1, max_size=3),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
        st.lists(st.one_of(st.integers(), st.text()), min_size=2, max_size=3).filter(
            lambda x: not all(isinstance(v, int) for v in x) and not all(isinstance(v, str) for v in x)
        ),
        st.just("word " * (MAX_MODEL_LEN + 10)),
    ),
    "logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=21), not_int),
    "echo": not_bool,
}
CHAT_ONLY = {
    "messages": st.one_of(
        st.just([]),
        st.text(max_size=5),
        st.integers(),
        st.lists(st.integers(), min_size=1, max_size=2),
        st.lists(st.fixed_dictionaries({"content": st.text(max_size=5)}), min_size=1, max_size=2),
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.text(max_size=6).filter(lambda r: r not in ("system", "user", "assistant", "tool")),
                    "content": st.text(max_size=5),
                }
            ),
            min_size=1,
            max_size=2,
        ),
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.just("user"),
                    "content": st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=2)),
                }
            ),
            min_size=1,
            max_size=2,
        ),
    ),
    "top_logprobs": st.one_of(st.integers(max_value=-1), st.integers(min_value=21), not_int),
    "max_completion_tokens": st.one_of(st.integers(max_value=0), not_int),
}


@st.composite
def bad_request(draw):
    chat = draw(st.booleans())
    kind = draw(st.sampled_from(["field", "field", "field", "field", "raw", "not_object"]))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if kind == "raw":
        text = draw(st.text(max_size=40))
        try:
            json.loads(text)
            text = "{" + text  # make sure it is not JSON
            json.loads(text)
        except ValueError:
            pass
        else:  # pragma: no cover
            text = "{{{"
        return path, text.encode()
    if kind == "not_object":
        value = draw(st.one_of(st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3), st.none()))
        return path, json.dumps(value).encode()
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    body.update(model=MODEL_NAME, max_tokens=4, temperature=0)
    fields = {**BAD_FIELDS, **(CHAT_ONLY if chat else COMPLETION_ONLY)}
    name = draw(st.sampled_from(sorted(fields)))
    body[name] = draw(fields[name])
    if name == "min_tokens" and isinstance(body[name], int) and body[name] >= 0:
        body["max_tokens"] = 4  # min_tokens > max_tokens
    if draw(st.booleans()):  # unknown fields ride along and are ignored
        body[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in fields and k not in body))] = 1
    return path, json.dumps(body).encode()


def test_malformed_requests_get_4xx_and_server_stays_up(server):  # noqa: F811
    seen = []
    with httpx.Client(base_url=server.url, headers={**AUTH, "Content-Type": "application/json"}, timeout=30) as http:

        @settings(
            max_examples=N_EXAMPLES,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(bad_request())
        def check(req):
            path, body = req
            r = http.post(path, content=body)
            assert 400 <= r.status_code < 500, (r.status_code, body[:300], r.text[:300])
            err = r.json()["error"]
            assert isinstance(err["message"], str) and {"type", "param", "code"} <= set(err)
            assert http.get("/health").status_code == 200
            seen.append(r.status_code)

        check()
    assert len(seen) >= 200
    # Nothing was left running or holding blocks.
    metrics = http_metrics(server.url)
    assert 'vllm:num_requests_running{engine="0",model_name="musespark-tiny"} 0.0' in metrics
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="musespark-tiny"} 0.0' in metrics


def http_metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text
