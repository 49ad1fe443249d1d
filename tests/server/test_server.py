"""`musespark serve` end to end: a real server process on 127.0.0.1, driven by the official
openai client and by httpx. Greedy outputs must equal the offline LLM's."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from musespark import LLM, SamplingParams

MAX_MODEL_LEN = 256
API_KEY = "test-key"
MODEL_NAME = "musespark-tiny"
# The bundled model's chat template is the Muse one, so serve turns the Muse parsers on by default.
NO_PARSERS = ("--reasoning-parser", "none", "--tool-call-parser", "none")
PROMPTS = [
    "Once upon a time",
    "def add(a, b):",
    "The capital of France is",
    "import numpy as np\n",
    "Hello, my name is",
    "for i in range(10):",
    "# A list of fruits:\n",
    "class Stack:",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ctrl_c_as_in_a_terminal() -> None:
    """Runs in the server's child before exec: SIGINT back to its default action. A shell
    starts background jobs (`make test &`) with SIGINT ignored, and an ignored signal stays
    ignored across exec, so a server started from such a job could not be stopped by Ctrl-C;
    a server started from a terminal can."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServerProcess:
    def __init__(self, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "musespark",
                "serve",
                "--port",
                str(self.port),
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--disable-log-requests",
                "--uvicorn-log-level",
                "warning",
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_ctrl_c_as_in_a_terminal,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early: {log_path.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # No parsers: chat content is the raw text the offline engine gives (the Muse defaults off).
    srv = ServerProcess(tmp_path_factory.mktemp("server") / "server.log", "--api-key", API_KEY, *NO_PARSERS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def greedy(llm, prompts, max_tokens):
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
    return [o.outputs[0] for o in outs]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z0-9_:]+)(\{[^}]*\})? (\S+)$", line)
        if m and "finished_reason" not in (m.group(2) or ""):
            values[m.group(1)] = float(m.group(3))
    return values


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0
        ) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def parse_sse(lines: list[str]) -> list[dict]:
    """Check the stream is well formed ('data: ' events, [DONE] last) and return the chunks."""
    events = [line for line in lines if line]
    assert events and events[-1] == "data: [DONE]", events[-3:]
    chunks = []
    for e in events[:-1]:
        assert e.startswith("data: "), e
        chunk = json.loads(e[len("data: ") :])
        assert "error" not in chunk, chunk
        chunks.append(chunk)
    return chunks


# -- basic endpoints ------------------------------------------------------------------------


def test_models_health_version_tokenize(server, client, llm):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}).json()
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPTS[0]
    strs = httpx.post(
        f"{server.url}/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True}, headers=AUTH
    ).json()["token_strs"]
    assert strs == [llm.get_tokenizer().id_to_token(t) for t in ids] and len(strs) == len(ids)
    m = metrics(server.url)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in m, name


# -- parity with the offline API ----------------------------------------------------------------


def test_completions_match_offline(client, llm):
    expected = greedy(llm, PROMPTS, [12] * len(PROMPTS))
    for prompt, exp in zip(PROMPTS[:4], expected):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == exp.text
        assert r.choices[0].finish_reason == exp.finish_reason
        assert r.usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt))
        assert r.usage.completion_tokens == len(exp.token_ids)
    # A batch of prompts in one request: choices in prompt order.
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [e.text for e in expected]
    assert r.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    # Token-id prompts and echo.
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[1] + expected[1].text


def test_stream_equals_non_stream_and_usage_is_exact(client, llm):
    for prompt in PROMPTS[:3]:
        (exp,) = greedy(llm, [prompt], [20])
        full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0)
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text == exp.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == exp.finish_reason
        usage = chunks[-1].usage
        assert not chunks[-1].choices
        assert usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt)) == full.usage.prompt_tokens
        assert usage.completion_tokens == len(exp.token_ids) == full.usage.completion_tokens


def test_chat_matches_offline(client, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    (exp,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16))
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == exp.outputs[0].text
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
    assert r.usage.completion_tokens == len(exp.outputs[0].token_ids)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == exp.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(exp.outputs[0].token_ids)


def test_sampling_options(client, llm):
    # n with a seed is reproducible; logprobs have the asked-for shape; stop strings cut.
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=7, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert len(a.choices) == 3 and [c.text for c in a.choices] == [c.text for c in b.choices]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(len(t) == 3 for t in lp.top_logprobs)
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(r.choices[0].logprobs.content) == 4
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    (exp,) = greedy(llm, [PROMPTS[1]], [24])
    stop = exp.text[4:7]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=6,
        temperature=0,
        extra_body={
            "ignore_eos": True,
            "min_tokens": 6,
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "some_unknown_field": 1,
        },
    )
    assert r.usage.completion_tokens == 6


# -- errors --------------------------------------------------------------------------------------


def _assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and isinstance(err["message"], str)
    return err


def test_errors(server, client):
    url = f"{server.url}/v1/completions"
    ok = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    _assert_error(httpx.post(url, json=ok), 401)
    _assert_error(httpx.post(url, json=ok, headers={"Authorization": "Bearer nope"}), 401)
    _assert_error(httpx.get(f"{server.url}/v1/models"), 401)
    _assert_error(httpx.post(url, json={**ok, "model": "gpt-4"}, headers=AUTH), 404)
    big = {**ok, "prompt": "x" * (1 << 20)}
    _assert_error(httpx.post(url, json=big, headers=AUTH), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"x" * (1 << 15)
        yield b'"}'

    json_auth = {**AUTH, "Content-Type": "application/json"}
    _assert_error(httpx.post(url, content=chunked(), headers=json_auth), 413)
    for bad, param in [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),  # more than the room is cut (vLLM)
        ({"prompt": 5}, "prompt"),
        ({"stop": [1]}, "stop"),
    ]:
        err = _assert_error(httpx.post(url, json={**ok, **bad}, headers=AUTH), 400)
        assert err["param"] == param, (bad, err)
    _assert_error(httpx.post(url, content=b"{not json", headers=json_auth), 400)
    chat = f"{server.url}/v1/chat/completions"
    for messages in ([], [{"content": "x"}], [{"role": "wizard", "content": "x"}], [{"role": "user"}], "hi"):
        _assert_error(httpx.post(chat, json={"messages": messages}, headers=AUTH), 400)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=3)
    assert httpx.get(f"{server.url}/health").status_code == 200


# -- load and faults ------------------------------------------------------------------------------


async def _stream_completion(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines()]
    chunks = parse_sse(lines)
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    return "".join(c["choices"][0]["text"] for c in chunks)


def test_load_64_concurrent_streams(server, llm):
    rng = random.Random(0)
    prompts = [f"{rng.choice(PROMPTS)} {i}" for i in range(64)]
    lengths = [rng.randint(4, 24) for _ in prompts]
    expected = [c.text for c in greedy(llm, prompts, lengths)]

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(_stream_completion(http, server.url, p, n) for p, n in zip(prompts, lengths)))

    texts = asyncio.run(main())
    assert texts == expected
    m = wait_idle(server.url)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


def test_disconnecting_clients_free_their_blocks(server, llm):
    rng = random.Random(1)

    async def quitter(http: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": MODEL_NAME,
            "prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}",
            "max_tokens": 200,
            "temperature": 0.8,
            "ignore_eos": True,
            "stream": True,
            "n": 1 + i % 2,
        }
        k = rng.randint(1, 12)
        seen = 0
        async with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= k:
                        break  # leaving the block closes the connection mid-stream
        return seen

    async def impatient(http: httpx.AsyncClient) -> None:  # a non-streaming client that gives up
        body = {"model": MODEL_NAME, "prompt": "patience", "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            await http.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=0.3)

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as http:
            res = await asyncio.gather(*(quitter(http, i) for i in range(20)), impatient(http))
            return res[:-1]

    seen = asyncio.run(main())
    assert all(s >= 1 for s in seen)
    m = wait_idle(server.url, timeout=3.0)  # far less than the 200 tokens each would take
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
    text = httpx.get(f"{server.url}/metrics").text
    aborts = re.search(r'vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', text)
    assert aborts and float(aborts.group(1)) >= 21  # every client that left was aborted
    (exp,) = greedy(llm, [PROMPTS[2]], [10])
    r = httpx.post(
        f"{server.url}/v1/completions",
        headers=AUTH,
        timeout=60,
        json={"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0},
    )
    assert r.json()["choices"][0]["text"] == exp.text


# -- graceful shutdown -------------------------------------------------------------------------------

SIGTERM_TOKENS = 2000  # long enough (~2 s here) to still be running 0.3 s after the signal


def test_sigterm_lets_running_requests_finish(tmp_path):
    # --generation-config vllm: the checkpoint's max_new_tokens (256) would cap the stream.
    srv = ServerProcess(
        tmp_path / "sigterm.log", "--max-model-len", str(SIGTERM_TOKENS + 16), "--generation-config", "vllm"
    )
    try:
        lines: list[str] = []
        first = threading.Event()

        def consume() -> None:
            body = {
                "prompt": "Once",
                "max_tokens": SIGTERM_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()

        t = threading.Thread(target=consume)
        t.start()
        assert first.wait(30)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no new connections while the running one finishes
            httpx.get(f"{srv.url}/health", timeout=2)
        assert t.is_alive()
        t.join(60)
        chunks = parse_sse(lines)
        assert sum(1 for c in chunks if c["choices"]) == SIGTERM_TOKENS  # the running request ran to its end
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(40) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{srv.url}/health", timeout=2)
    finally:
        srv.stop()
