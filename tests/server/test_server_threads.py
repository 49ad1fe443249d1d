"""The server tokenizes and renders chats off its event loop (a large prompt must not hold
every other connection), and the routes reach the engine only through AsyncEngine."""

import asyncio

import pytest
from starlette.testclient import TestClient

from musespark.engine.llm_engine import LLMEngine
from musespark.server.api import ServerConfig, build_app


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(max_model_len=256)


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_tokenization_and_chat_rendering_run_off_the_event_loop(engine, monkeypatch):
    calls: list[tuple[str, bool]] = []
    tok = engine.tokenizer
    for name in ("encode", "apply_chat_template"):
        original = getattr(tok, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append((_name, _on_event_loop()))
            return _original(*args, **kwargs)

        monkeypatch.setattr(tok, name, spy)
    app = build_app(engine, ServerConfig(model_name="m", log_requests=False))
    chat = [{"role": "user", "content": "Hello"}]
    with TestClient(app) as client:
        for path, body in [
            ("/v1/completions", {"prompt": "def f():", "max_tokens": 2}),
            ("/v1/completions", {"prompt": "def f():", "max_tokens": 2, "stream": True}),
            ("/v1/chat/completions", {"messages": chat, "max_tokens": 2}),
            ("/tokenize", {"prompt": "def f():"}),
            ("/tokenize", {"messages": chat}),
        ]:
            r = client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
    assert {name for name, _ in calls} == {"encode", "apply_chat_template"}
    assert not [c for c in calls if c[1]], f"called on the event loop: {calls}"


def test_routes_hold_only_the_async_engine(engine):
    app = build_app(engine, ServerConfig(model_name="m", log_requests=False))
    async_engine = app.state.async_engine
    assert not hasattr(async_engine, "engine")  # no public path to the LLMEngine, its scheduler or runner
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert "vllm:num_requests_running" in client.get("/metrics").text
    assert async_engine.stats().num_running == 0
