"""What a hostile probe of `musespark serve` found, as regression tests: no 5xx on any
client input (lone surrogates, control characters, invalid UTF-8), JSON-only POST bodies
(415), `/health` stays fast while huge prompts are refused, half-open connections are
closed after the header timeout, a client error logs one line, X-Forwarded-For is ignored
unless a proxy is trusted, CORS only for allowed origins, `stream_options` needs `stream`,
`Authorization: bearer` in any case, and `max_tokens` capped by the checkpoint's default."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import ServerProcess

KEY = "k-hardening"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("hard") / "server.log",
        "--api-key",
        KEY,
        "--header-timeout",
        "1",
        "--allowed-origins",
        '["https://ok.example"]',
    )
    yield srv
    srv.stop()


def log_text(server) -> str:
    server.log.flush()
    return open(server.log.name, encoding="utf-8", errors="replace").read()


# -- no 5xx on any text ---------------------------------------------------------------------------

nasty_text = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0, max_codepoint=0x1F),
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
        st.characters(max_codepoint=0x10FFFF),
    ),
    min_size=1,
    max_size=12,
)


def _encode(body: dict, raw_bytes: bytes | None) -> bytes:
    data = json.dumps(body).encode()  # ensure_ascii: surrogates travel as \\udXXX escapes
    if raw_bytes is not None:  # splice invalid UTF-8 into a string value
        data = data.replace(b"HOLE", raw_bytes, 1)
    return data


@st.composite
def nasty_request(draw):
    text = draw(nasty_text)
    raw = draw(st.one_of(st.none(), st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80abc"])))
    target = draw(st.sampled_from(["prompt", "chat", "tokenize", "stop", "system", "tools", "key", "detok"]))
    value = text + ("HOLE" if raw is not None else "")
    if target == "prompt":
        return "/v1/completions", _encode({"prompt": value, "max_tokens": 2}, raw)
    if target == "stop":
        return "/v1/completions", _encode({"prompt": "hi", "max_tokens": 2, "stop": [value]}, raw)
    if target == "tokenize":
        return "/tokenize", _encode({"prompt": value}, raw)
    if target == "detok":
        return "/detokenize", _encode({"tokens": [1, 2], "model": value}, raw)
    if target == "tools":
        return "/v1/chat/completions", _encode(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "tools": [{"type": "function", "function": {"name": value}}],
            },
            raw,
        )
    if target == "key":
        return "/v1/completions", _encode({"prompt": "hi", "max_tokens": 2, value: 1}, raw)
    role = "system" if target == "system" else "user"
    return "/v1/chat/completions", _encode({"messages": [{"role": role, "content": value}], "max_tokens": 2}, raw)


def test_no_client_input_yields_a_5xx(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:

        @settings(
            max_examples=150, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(nasty_request())
        def check(req):
            path, body = req
            r = http.post(path, content=body)
            assert r.status_code < 500, (path, body[:200], r.text[:300])
            if r.status_code >= 400:
                assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
            # The connection is still usable: the next pooled request succeeds.
            assert http.get("/health").status_code == 200

        check()
    assert "Traceback" not in log_text(server)


def test_lone_surrogate_is_a_400_naming_the_field(server):
    body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(f"{server.url}/tokenize", content=b'{"prompt": "\\udfff"}', headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    ok = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'  # a surrogate pair is one valid character
    assert httpx.post(f"{server.url}/v1/completions", content=ok, headers=AUTH).status_code == 200


# -- content types, CORS, auth scheme ----------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_non_json_bodies_are_refused_with_415(server, content_type):
    headers = {"Authorization": f"Bearer {KEY}"}
    if content_type:
        headers["Content-Type"] = content_type
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(f"{server.url}{path}", content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers)
        assert r.status_code == 415, (path, r.status_code, r.text)
    ok = {**headers, "Content-Type": "application/json; charset=utf-8"}
    assert (
        httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', headers=ok).status_code
        == 200
    )


def test_cors_only_for_allowed_origins(server):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,authorization"}
    good = httpx.options(f"{server.url}/v1/completions", headers={**pre, "Origin": "https://ok.example"})
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == "https://ok.example"
    bad = httpx.options(f"{server.url}/v1/completions", headers={**pre, "Origin": "https://evil.example"})
    assert bad.headers.get("access-control-allow-origin") is None


def test_bearer_scheme_in_any_case_and_stream_options_need_stream(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, scheme
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Basic {KEY}"})
    assert r.status_code == 401
    r = httpx.post(
        f"{server.url}/v1/completions", headers=AUTH, json={**body, "stream_options": {"include_usage": True}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_generation_config_max_new_tokens_is_a_default_and_caps_only_when_given():
    from musespark.engine.input_processor import InputProcessor

    inputs = InputProcessor(None, 4096, 1024, {"max_tokens": 100})  # generation_config max_new_tokens 100
    assert inputs.resolve_max_tokens(500, 10) == 500 and inputs.resolve_max_tokens(50, 10) == 50
    assert inputs.resolve_max_tokens(None, 10) == 100 and inputs.resolve_max_tokens(1020, 10) == 1014
    inputs.override_max_tokens = 100  # --generation-config DIR / --override-generation-config
    assert inputs.resolve_max_tokens(500, 10) == 100 and inputs.resolve_max_tokens(50, 10) == 50


# -- event loop, timeouts, logs -----------------------------------------------------------------------


def test_health_stays_fast_while_huge_prompts_are_refused(server):
    huge = "word " * (200_000)  # ~1 MiB, far over max_model_len

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            posts = [
                asyncio.ensure_future(http.post(path, json=body))
                for path, body in [
                    ("/v1/completions", {"prompt": huge, "max_tokens": 2}),
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}),
                ]
                * 3
            ]
            worst = 0.0
            while not all(p.done() for p in posts):
                t = time.perf_counter()
                assert (await http.get("/health")).status_code == 200
                worst = max(worst, time.perf_counter() - t)
                await asyncio.sleep(0.02)
            codes = [(await p).status_code for p in posts]
            return worst, codes

    worst, codes = asyncio.run(main())
    assert all(c in (400, 413) for c in codes), codes
    assert worst < 0.5, worst


def test_half_open_connection_is_closed_after_the_header_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        t = time.monotonic()
        assert s.recv(100) == b""  # closed by the server, without a response
        assert time.monotonic() - t < 4
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:  # a silent one too
        assert s.recv(100) == b""


def test_client_error_logs_one_line_and_forwarded_for_is_ignored(server):
    before = log_text(server).splitlines()
    r = httpx.post(
        f"{server.url}/v1/completions",
        headers={**AUTH, "X-Forwarded-For": "203.0.113.9"},
        content=b'{"prompt": "\\ud800", "max_tokens": 2}',
    )
    assert r.status_code == 400
    time.sleep(0.3)
    new = log_text(server).splitlines()[len(before) :]
    assert len(new) <= 1 and "Traceback" not in "\n".join(new), new
    assert not any("203.0.113.9" in line for line in new)
