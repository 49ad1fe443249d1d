"""/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): request translation
(unit), the Muse mapping through the official client in process (a replayed Muse transcript:
thinking + tool_use), and a real server process, whose assertions hold for any model output."""

from __future__ import annotations

from types import SimpleNamespace

import anthropic
import httpx
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient
from test_server import ServerProcess
from test_server_parsers import TOOLS, ReplayEngine

from musespark.server import messages
from musespark.server.api import Preparation
from musespark.server.messages import MessagesRequest, chat_tool_choice, chat_tools, to_chat_messages, to_chat_request
from musespark.server.serving import APIError, ChatSettings, Serving
from musespark.server.turn_blocks import Block

API_KEY = "test-key"
MODEL = "musespark-tiny"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


# -- translation (no engine) ------------------------------------------------------------------


def test_blocks_become_chat_messages():
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need it.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    assert to_chat_messages([{"type": "text", "text": "Be terse."}], msgs) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "reasoning": "Need it.",
            "content": "Checking.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "18C"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: boom"},
        {"role": "user", "content": "Thanks"},
    ]


def test_tools_tool_choice_and_sampling_translate():
    assert chat_tools([WEATHER]) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": WEATHER["description"],
            },
        }
    ]
    assert chat_tool_choice({"type": "auto"}) == ("auto", None)
    assert chat_tool_choice({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)
    assert chat_tool_choice({"type": "tool", "name": "get_weather"}) == (
        {"type": "function", "function": {"name": "get_weather"}},
        None,
    )
    assert chat_tool_choice({"type": "none"}) == ("none", None)
    chat = to_chat_request(
        MessagesRequest(
            model="m",
            max_tokens=9,
            system="S",
            stop_sequences=["END"],
            top_k=3,
            temperature=0,
            messages=[{"role": "user", "content": "Hi"}],
        )
    )
    assert chat.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert (chat.max_tokens, chat.stop, chat.top_k, chat.temperature) == (9, ["END"], 3, 0)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat_request(
        MessagesRequest(
            model="m",
            max_tokens=9,
            messages=[{"role": "user", "content": "Hi"}],
            output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}},
        )
    )
    assert chat.reasoning_effort == "low"
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]},
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
    ],
)
def test_refusals(body):
    with pytest.raises(APIError) as err:
        to_chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **body}))
    assert err.value.status == 400


def test_stop_reasons():
    req = MessagesRequest(model="m", max_tokens=5, stop_sequences=["END"], messages=[{"role": "user", "content": "x"}])
    turn = messages.Turn(SimpleNamespace(model_name="m"), req, [SimpleNamespace(prompt=SimpleNamespace(token_ids=[1]))])

    def out(finish, stop):
        return SimpleNamespace(outputs=[SimpleNamespace(finish_reason=finish, stop_reason=stop)])

    assert turn.stop(out("stop", "END")) == ("stop_sequence", "END")
    assert turn.stop(out("stop", 200008)) == ("end_turn", None)  # a stop token
    assert turn.stop(out("length", None)) == ("max_tokens", None)
    turn.blocks.blocks.append(Block("call", 0))
    assert turn.stop(out("stop", None)) == ("tool_use", None)
    assert turn.stop(out("length", None)) == ("max_tokens", None)


# -- Muse output through the official client, in process ---------------------------------------


@pytest.fixture(scope="module")
def replay_client():
    from test_server_parsers import TRANSCRIPT

    from musespark.engine.llm_engine import LLMEngine

    replay = ReplayEngine(LLMEngine(max_model_len=2048), TRANSCRIPT)
    serving = Serving(replay, "m", 16, ChatSettings(reasoning_parser="muse", tool_call_parser="muse"))
    app = FastAPI()
    messages.add_routes(app, serving, Preparation())
    with TestClient(app) as tc:
        yield anthropic.Anthropic(base_url=str(tc.base_url), api_key="x", http_client=tc, max_retries=0), tc


def summary(msg) -> list[tuple]:
    out = []
    for b in msg.content:
        out.append(
            ("thinking", b.thinking)
            if b.type == "thinking"
            else ("text", b.text)
            if b.type == "text"
            else ("tool_use", b.name, b.input)
        )
    return out + [msg.stop_reason, msg.usage.input_tokens, msg.usage.output_tokens]


def test_thinking_and_tool_use_streamed_and_not(replay_client):
    replay_client, _ = replay_client
    tools = [{**WEATHER, "input_schema": TOOLS[0]["function"]["parameters"]}]
    params = dict(model="m", max_tokens=200, tools=tools, messages=[{"role": "user", "content": "Weather in Paris?"}])
    params["thinking"] = {"type": "adaptive"}  # thinking blocks are sent only when asked for
    msg = replay_client.messages.create(**params)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == "m"
    thinking, call = msg.content
    assert thinking.type == "thinking" and thinking.thinking == "Need weather."
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris", "days": 3}
    assert call.id.startswith("toolu_") and msg.stop_reason == "tool_use" and msg.stop_sequence is None
    with replay_client.messages.stream(**params) as stream:  # the SDK accumulates the events
        types = [e.type for e in stream]
        final = stream.get_final_message()
    assert summary(final) == summary(msg)
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert (
        replay_client.messages.count_tokens(model="m", tools=tools, messages=params["messages"]).input_tokens
        == msg.usage.input_tokens
    )


def test_errors_have_anthropics_shape(replay_client):
    replay_client, tc = replay_client
    with pytest.raises(anthropic.NotFoundError) as err:
        replay_client.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert err.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `claude-x` does not exist."},
    }
    missing = tc.post("/v1/messages", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 400 and missing.json()["type"] == "error"
    assert (
        missing.json()["error"]["type"] == "invalid_request_error"
        and "max_tokens" in missing.json()["error"]["message"]
    )
    with pytest.raises(anthropic.BadRequestError) as err:
        replay_client.messages.count_tokens(model="m", messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"


# -- a real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("messages") / "server.log",
        "--api-key",
        API_KEY,
        "--max-model-len",
        "2048",
        "--reasoning-parser",
        "muse",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "muse",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def check_message(msg, max_tokens: int) -> None:
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert 0 < msg.usage.output_tokens <= max_tokens and msg.usage.input_tokens > 0
    if msg.stop_reason == "tool_use":
        assert any(b.type == "tool_use" for b in msg.content)
    elif any(b.type == "tool_use" for b in msg.content):
        assert msg.stop_reason == "max_tokens"  # a call cut short (closed with the parameters so far)
    for b in msg.content:
        assert b.type in ("thinking", "text", "tool_use")


def test_server_streamed_and_not_agree(client):
    params = dict(
        model=MODEL,
        max_tokens=24,
        extra_body={"temperature": 0},
        system="Answer briefly.",
        messages=[{"role": "user", "content": "Hello there"}],
    )
    msg = client.messages.create(**params)
    check_message(msg, 24)
    with client.messages.stream(**params) as stream:
        events = list(stream)
        final = stream.get_final_message()
    check_message(final, 24)
    assert summary(final) == summary(msg)
    raw = [e for e in events if not e.type.startswith(("text", "thinking", "input_json"))]  # no SDK sugar
    kinds = [e.type for e in raw]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.index for e in raw if e.type == "content_block_start"]
    assert starts == [e.index for e in raw if e.type == "content_block_stop"] == list(range(len(msg.content)))
    assert (
        client.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=params["messages"]).input_tokens
        == msg.usage.input_tokens
    )


def test_server_forced_tool_use_and_tool_result_turn(client):
    params = dict(
        model=MODEL,
        max_tokens=400,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    msg = client.messages.create(**params)
    check_message(msg, 400)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input, dict) and uses[0].id
    assert msg.stop_reason in ("tool_use", "max_tokens")
    with client.messages.stream(**params) as stream:
        assert summary(stream.get_final_message()) == summary(msg)

    follow = [
        *params["messages"],
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18C and sunny"}]},
    ]
    second = client.messages.create(
        model=MODEL, max_tokens=16, extra_body={"temperature": 0}, tools=[WEATHER], messages=follow
    )
    check_message(second, 16)
    assert second.usage.input_tokens > msg.usage.input_tokens
    assert (
        client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=follow).input_tokens
        == second.usage.input_tokens
    )


def test_server_auth_and_errors(client, server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    # x-api-key works on the OpenAI routes too; a wrong one with a right bearer token still passes.
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    assert (
        httpx.get(
            f"{server.url}/v1/models", headers={"x-api-key": "no", "Authorization": f"Bearer {API_KEY}"}
        ).status_code
        == 200
    )
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "no"}).status_code == 401
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model=MODEL,
            max_tokens=5,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "nope"},
            messages=[{"role": "user", "content": "x"}],
        )
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"


def test_transport_errors_use_anthropics_shape_on_messages_routes():
    from fastapi.testclient import TestClient

    from musespark import LLM
    from musespark.server.api import ServerConfig, build_app

    app = build_app(LLM(max_model_len=128).engine, ServerConfig(model_name="m", api_key="k", log_requests=False))
    with TestClient(app) as c:
        r = c.post("/v1/messages", content=b"{}", headers={"x-api-key": "k", "content-type": "text/plain"})
        assert r.status_code == 415 and r.json()["type"] == "error" and r.json()["error"]["message"]
        r = c.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = c.post("/v1/completions", json={}, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401  # OpenAI's shape elsewhere
