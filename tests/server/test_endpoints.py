"""vLLM's extra routes through a real `musespark serve` (one server, started with
--enable-server-load-tracking and --enable-tokenizer-info-endpoint): the batch chat route,
SageMaker's /invocations and /ping, the render routes in vLLM's GenerateRequest shape, the
token-in/token-out /inference/v1/generate, /load, /tokenizer_info, the ORCA load header,
and vLLM's wording for an out-of-vocabulary token id and an out-of-range seed."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from test_server import API_KEY, MODEL_NAME, ServerProcess, parse_sse

from musespark.engine.args import bundled_model_path

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Write a haiku."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("endpoints") / "server.log",
        "--api-key",
        API_KEY,
        "--enable-server-load-tracking",
        "--enable-tokenizer-info-endpoint",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={**AUTH, **kw.pop("headers", {})}, timeout=60, **kw)


# -- /v1/chat/completions/batch ------------------------------------------------------------------


def test_batch_chat_gives_one_choice_per_conversation(server, client):
    convs = [CHAT, [{"role": "user", "content": "Name a color."}]]
    body = {"model": MODEL_NAME, "messages": convs, "max_tokens": 6, "temperature": 0}
    r = post(server, "/v1/chat/completions/batch", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and [c["index"] for c in out["choices"]] == [0, 1]
    singles = [client.chat.completions.create(model=MODEL_NAME, messages=m, max_tokens=6, temperature=0) for m in convs]
    for choice, single in zip(out["choices"], singles):
        assert choice["message"]["content"] == single.choices[0].message.content
    assert out["usage"]["prompt_tokens"] == sum(s.usage.prompt_tokens for s in singles)
    assert out["usage"]["completion_tokens"] == sum(s.usage.completion_tokens for s in singles)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 2}, "n"),
        ({"stream": True}, "stream"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ],
)
def test_batch_chat_refuses_what_it_cannot_do(server, extra, param):
    r = post(server, "/v1/chat/completions/batch", {"messages": [CHAT], "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- /invocations and /ping ----------------------------------------------------------------------


def test_invocations_routes_by_body_shape(server, client):
    chat = post(server, "/invocations", {"messages": CHAT, "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
    direct = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0)
    assert chat.json()["choices"][0]["message"]["content"] == direct.choices[0].message.content
    cmpl = post(server, "/invocations", {"prompt": "def f(x):", "max_tokens": 3})
    assert cmpl.status_code == 200 and cmpl.json()["object"] == "text_completion", cmpl.text
    bad = post(server, "/invocations", {"input": "hi"})
    assert bad.status_code == 400
    assert "Expected one of: ['ChatCompletionRequest', 'CompletionRequest']" in bad.json()["error"]["message"]
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping", json={}).status_code == 200


# -- render and token-in/token-out -----------------------------------------------------------------


def test_render_routes_give_vllm_generate_requests(server):
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    chat = post(server, "/v1/chat/completions/render", body).json()
    assert chat["stream"] is True and chat["stream_options"]["include_usage"] is True
    assert chat["sampling_params"]["max_tokens"] == 5 and chat["sampling_params"]["temperature"] == 0.0
    assert chat["token_ids"] and chat["request_id"].startswith("chatcmpl-")
    plain = post(server, "/v1/chat/completions/render", {"messages": CHAT}).json()
    assert plain["stream"] is False and plain["stream_options"] is None
    cmpl = post(server, "/v1/completions/render", {"prompt": ["def f(x):", "import os"], "max_tokens": 3})
    assert cmpl.status_code == 200, cmpl.text
    reqs = cmpl.json()
    assert isinstance(reqs, list) and len(reqs) == 2
    assert all(r["sampling_params"]["max_tokens"] == 3 and r["token_ids"] for r in reqs)
    bad = post(server, "/v1/completions/render", {"prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_generate_runs_a_rendered_request_as_the_route_would(server, client):
    body = {"prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0}
    (rendered,) = post(server, "/v1/completions/render", body).json()
    r = post(server, "/inference/v1/generate", {**rendered, "return_token_ids": True})
    assert r.status_code == 200, r.text
    out = r.json()
    want = client.completions.create(model=MODEL_NAME, **body, extra_body={"return_token_ids": True})
    assert out["output_mode"] == "tokens" and out["request_id"] == f"generate-tokens-{rendered['request_id']}"
    assert out["choices"][0]["token_ids"] == want.choices[0].token_ids
    assert out["prompt_token_ids"] == rendered["token_ids"]
    assert out["usage"]["completion_tokens"] == len(want.choices[0].token_ids)
    banned = want.choices[0].token_ids[0]
    (biased,) = post(server, "/v1/completions/render", {**body, "logit_bias": {str(banned): -100}}).json()
    assert biased["sampling_params"]["logit_bias"] == {str(banned): -100.0}
    other = post(server, "/inference/v1/generate", biased).json()
    assert other["choices"][0]["token_ids"][0] != banned  # the bias survives the round trip
    text = post(server, "/inference/v1/generate", {**rendered, "output_mode": "text"}).json()
    assert text["choices"][0]["text"] == want.choices[0].text
    assert text["request_id"] == out["request_id"]  # the same request_id may be sent again


def test_generate_streams_token_deltas(server):
    body = {
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 5, "temperature": 0, "logprobs": 2},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/inference/v1/generate", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
    chunks = parse_sse(lines)
    ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    full = post(server, "/inference/v1/generate", {**body, "stream": False, "stream_options": None}).json()
    assert ids == full["choices"][0]["token_ids"] and len(ids) == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    entry = full["choices"][0]["logprobs"]["content"][0]
    assert entry["token_id"] == ids[0] and entry["top_logprobs"][0]["token_id"] == ids[0]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"token_ids": [1, -2], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [], "sampling_params": {}}, "token_ids"),
        ({"token_ids": [1], "sampling_params": {"nope": 1}}, "sampling_params"),
        ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"token_ids": [1], "sampling_params": {}, "output_mode": "derender"}, "output_mode"),
    ],
)
def test_generate_refusals_name_the_field(server, body, param):
    r = post(server, "/inference/v1/generate", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def _abort_mid_stream(url: str) -> tuple[list[dict], int, float]:
    body = {
        "request_id": "abort-me",
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 200, "ignore_eos": True},
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{url}/inference/v1/generate", json=body, headers=AUTH) as r:
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if len(lines) == 1:
                    ab = await http.post(
                        f"{url}/inference/v1/abort_requests",
                        json={"request_ids": ["generate-tokens-abort-me"]},
                        headers=AUTH,
                    )
        missing = await http.post(f"{url}/inference/v1/abort_requests", json={}, headers=AUTH)
    return parse_sse(lines), ab.status_code, missing.status_code


def test_abort_requests_ends_a_running_generation(server):
    chunks, status, missing = asyncio.run(_abort_mid_stream(server.url))
    assert status == 200 and missing == 400
    finals = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finals == ["abort"]
    assert sum(len(ch["token_ids"]) for c in chunks for ch in c["choices"]) < 200


def test_inference_routes_and_invocations_need_the_api_key(server):
    r = httpx.post(f"{server.url}/inference/v1/generate", json={"token_ids": [1], "sampling_params": {}}, timeout=30)
    assert r.status_code == 401
    r = httpx.post(f"{server.url}/invocations", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 401


# -- /load, /tokenizer_info, ORCA --------------------------------------------------------------------


async def load_while_streaming(url: str) -> tuple[int, int]:
    """(/load while a completion streams, /load after it)."""
    body = {"prompt": "hi", "max_tokens": 64, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
            it = r.aiter_lines()
            while not (await it.__anext__()).startswith("data:"):
                pass
            during = (await http.get(f"{url}/load")).json()["server_load"]
            async for _ in it:
                pass
        after = (await http.get(f"{url}/load")).json()["server_load"]
    return during, after


def test_load_counts_requests_in_flight(server):
    during, after = asyncio.run(load_while_streaming(server.url))
    assert (during, after) == (1, 0)


def test_tokenizer_info_gives_the_tokenizer_config(server):
    r = httpx.get(f"{server.url}/tokenizer_info", timeout=10)
    assert r.status_code == 200
    info = r.json()
    config = json.loads((bundled_model_path() / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] and info["eos_token"] == config["eos_token"]
    assert info["chat_template"] == (bundled_model_path() / "chat_template.jinja").read_text()


@pytest.mark.parametrize("fmt", ["TEXT", "JSON"])
def test_orca_load_header_when_asked(client, fmt):
    raw = client.completions.with_raw_response.create(
        model=MODEL_NAME, prompt="hi", max_tokens=2, extra_headers={"endpoint-load-metrics-format": fmt}
    )
    header = raw.headers["endpoint-load-metrics"]
    if fmt == "TEXT":
        assert header.startswith("TEXT named_metrics.num_requests_waiting=")
        assert "named_metrics.kv_cache_usage_perc=" in header
    else:
        assert header.startswith("JSON ")
        assert set(json.loads(header[5:])["named_metrics"]) == {"num_requests_waiting", "kv_cache_usage_perc"}
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=2, extra_headers={"endpoint-load-metrics-format": fmt}
    )
    assert chat.headers["endpoint-load-metrics"].startswith(fmt)
    plain = client.completions.with_raw_response.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert "endpoint-load-metrics" not in plain.headers


# -- vLLM's error wording ----------------------------------------------------------------------------


def test_out_of_vocabulary_token_id_is_worded_as_vllm(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt=[5, 999_999], max_tokens=2)
    assert exc.value.body["message"] == "Token id 999999 is out of vocabulary"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"stop_token_ids": [999_999]})
    assert "token_id(s) [999999] in stop_token_ids contain out-of-vocab token ids" in exc.value.body["message"]


def test_out_of_range_seed_is_worded_as_vllm(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, seed=2**63)
    message = exc.value.body["message"]
    assert message.startswith("1 validation error:\n")
    assert "'type': 'less_than_equal', 'loc': 'body.seed'" in message
    assert "'msg': 'Input should be less than or equal to 9223372036854775807'" in message
    assert exc.value.body["param"] == "seed"
