"""/v1/responses (OpenAI's Responses API): request translation (unit), the Muse mapping through
the official client in process (a replayed Muse transcript: reasoning + a function call), and a
real server process, whose assertions hold for any model output."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient
from test_server import ServerProcess
from test_server_parsers import TOOLS, ReplayEngine

from musespark.server import responses
from musespark.server.api import Preparation, add_error_handlers
from musespark.server.responses import ResponseStore
from musespark.server.responses_items import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    items_to_messages,
    response_format,
    to_chat_request,
)
from musespark.server.serving import APIError, ChatSettings, Serving

API_KEY = "test-key"
MUSE_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "muse_chat_template.jinja"
MODEL = "musespark-tiny"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


# -- translation (no engine) ------------------------------------------------------------------


def test_string_input_and_instructions_become_system_and_user_messages():
    chat, items = to_chat_request(
        ResponsesRequest(
            input="Hi", instructions="Be terse.", max_output_tokens=7, temperature=0, reasoning={"effort": "low"}
        )
    )
    assert chat.messages == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0 and chat.reasoning_effort == "low"
    assert items == [{"type": "message", "role": "user", "content": "Hi"}]  # instructions are not kept


def test_items_merge_into_one_assistant_turn_and_tool_messages():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Need it."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lima"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18C"},
        {"type": "function_call_output", "call_id": "c2", "output": "25C"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "18C and 25C."}]},
    ]
    assert items_to_messages(items) == [
        {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "reasoning": "Need it.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "25C"},
        {"role": "assistant", "content": "18C and 25C."},
    ]


def test_flat_tools_tool_choice_and_text_format_translate():
    assert chat_tools([WEATHER]) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER["description"],
                "parameters": WEATHER["parameters"],
            },
        }
    ]
    assert chat_tool_choice({"type": "function", "name": "get_weather"}) == {
        "type": "function",
        "function": {"name": "get_weather"},
    }
    assert chat_tool_choice("required") == "required"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format({"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}) == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": schema, "strict": True},
    }
    assert response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    assert response_format(None) is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": []}, "input"),
    ],
)
def test_refusals_name_the_responses_field(body, param):
    with pytest.raises(APIError) as err:
        to_chat_request(ResponsesRequest.model_validate(body))
    assert err.value.status == 400 and err.value.param == param


def test_store_is_a_bounded_lru():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"n": i}])
        if i == 1:
            assert store.get("r0") is not None  # r0 is now the most recent
    assert store.get("r1") is None and store.get("r0") == ({"id": "r0"}, [{"n": 0}]) and store.get("r2")


def test_a_length_stop_is_incomplete_and_store_false_is_not_kept():
    store = ResponseStore()
    for keep in (True, False):
        req = ResponsesRequest(input="Hi", max_output_tokens=3, store=keep)
        _, items = to_chat_request(req)
        turn = responses.Turn(SimpleNamespace(model_name="m"), store, req, [], items)
        turn.blocks.feed(SimpleNamespace(delta_parsed=None, delta_text="a b c"))
        turn.blocks.close()
        last = SimpleNamespace(
            prompt_token_ids=[1, 2],
            num_cached_tokens=0,
            outputs=[SimpleNamespace(finish_reason="length", token_ids=[5, 6, 7], num_reasoning_tokens=0)],
        )
        body = turn.finish(last)
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert body["output"][-1]["status"] == "incomplete" and body["output"][-1]["content"][0]["text"] == "a b c"
        assert body["usage"]["total_tokens"] == 5 and body["max_output_tokens"] == 3
        stored = store.get(body["id"])
        assert (stored is not None) == keep
        if keep:
            assert stored[1] == [*items, *body["output"]]


# -- Muse output through the official client, in process ---------------------------------------


class RecordingReplay(ReplayEngine):
    """Replays the Muse transcript (reasoning, then a get_weather call) and records prompts."""

    def __init__(self, engine, text=None) -> None:
        from test_server_parsers import TRANSCRIPT

        super().__init__(engine, text or TRANSCRIPT)
        self.prompts: list[str] = []

    async def generate(self, request_id, prompt, params, output_parser=None):
        self.prompts.append(prompt.text)
        async for out in super().generate(request_id, prompt, params, output_parser):
            yield out


@pytest.fixture(scope="module")
def replay_client():
    from musespark.engine.llm_engine import LLMEngine

    replay = RecordingReplay(LLMEngine(max_model_len=2048))
    serving = Serving(
        replay,
        "m",
        16,
        ChatSettings(chat_template=MUSE_TEMPLATE.read_text(), reasoning_parser="muse", tool_call_parser="muse"),
    )
    app = FastAPI()
    add_error_handlers(app)
    responses.add_routes(app, serving, Preparation())
    with TestClient(app) as tc:
        yield openai.OpenAI(base_url=f"{tc.base_url}/v1", api_key="x", http_client=tc, max_retries=0), replay, tc


def summary(resp) -> list[tuple]:
    """What a response says, without its ids."""
    out = []
    for item in resp.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append(("function_call", item.name, item.arguments))
    return out


def test_reasoning_and_function_call_items_streamed_and_not(replay_client):
    client, replay, _ = replay_client
    params = dict(
        model="m",
        input="Weather in Paris?",
        tools=[{**WEATHER, "parameters": TOOLS[0]["function"]["parameters"]}],
        max_output_tokens=200,
    )
    resp = client.responses.create(**params)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.status == "completed"
    reasoning, call = resp.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == "Need weather."
    assert call.type == "function_call" and call.id.startswith("fc_") and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert call.call_id.startswith("chatcmpl-tool-")
    assert resp.output_text == ""
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.tools[0].name == "get_weather"

    # The SDK's stream helper checks the event sequence and rebuilds the response from it.
    with client.responses.stream(**params) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.reasoning_text.delta" in types and "response.function_call_arguments.delta" in types
    assert summary(final) == summary(resp)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments


def test_previous_response_id_continues_the_stored_conversation(replay_client):
    client, replay, tc = replay_client
    first = client.responses.create(model="m", input="Weather in Paris?", instructions="Be terse.", tools=[WEATHER])
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C, clear"}],
    )
    assert second.previous_response_id == first.id
    prompt = replay.prompts[-1]  # MUSE_CHAT §2.2 (c): the stored turn is rendered back
    assert prompt.endswith(
        "<|start|>user<|message|>Weather in Paris?<|eot|><|start|>assistant to=self<|message|>Need weather.<|eom|>"
        '<|start|>assistant to=get_weather<|message|><atem:function_calls>\n<atem:invoke name="get_weather">\n'
        '<atem:parameter name="city">Paris</atem:parameter>\n<atem:parameter name="days">3</atem:parameter>\n'
        "</atem:invoke>\n</atem:function_calls><|eot|><|start|>tool get_weather<|message|>"
        '<tool_output name="get_weather">\n18C, clear\n</tool_output><|eot|><|start|>assistant'
    )
    assert "Be terse." not in prompt  # instructions are not carried over
    # The same conversation sent in full renders the same prompt.
    client.responses.create(
        model="m",
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            *[i.model_dump(exclude_none=True) for i in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "18C, clear"},
        ],
    )
    assert replay.prompts[-1] == prompt
    # GET returns a stored response; unknown ids and store=false are 404s.
    assert tc.get(f"/v1/responses/{second.id}").json()["id"] == second.id
    unstored = client.responses.create(model="m", input="Hi", store=False)
    for rid in ("resp_nope", unstored.id):
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.create(model="m", input="Hi", previous_response_id=rid)
        assert err.value.body["param"] == "previous_response_id"


# -- a real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("responses") / "server.log",
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
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def check_body(resp, max_output_tokens: int) -> None:
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    assert resp.status in ("completed", "incomplete")
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"  # (or the checkpoint's max_new_tokens)
    u = resp.usage
    assert 0 < u.output_tokens <= max_output_tokens and u.input_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.output_tokens_details.reasoning_tokens <= u.output_tokens
    for item in resp.output:
        assert item.type in ("reasoning", "message", "function_call") and item.id


def test_server_streamed_and_not_agree(client):
    params = dict(model=MODEL, input="Hello there", instructions="Answer briefly.", max_output_tokens=24, temperature=0)
    resp = client.responses.create(**params)
    check_body(resp, 24)
    with client.responses.stream(**params) as stream:  # the SDK checks the events as it accumulates them
        events = list(stream)
    final = events[-1].response  # get_final_response() wants response.completed, not response.incomplete
    check_body(final, 24)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{resp.status}"
    assert summary(final) == summary(resp) and final.status == resp.status
    same = ("input_tokens", "output_tokens", "total_tokens")  # cached_tokens differ: the prefix cache
    assert [getattr(final.usage, k) for k in same] == [getattr(resp.usage, k) for k in same]
    # Raw stream: every item added is done, deltas add up to the done text.
    raw = list(client.responses.create(**params, stream=True))
    added = [e.output_index for e in raw if e.type == "response.output_item.added"]
    assert added == [e.output_index for e in raw if e.type == "response.output_item.done"] == list(range(len(added)))
    text = "".join(e.delta for e in raw if e.type == "response.output_text.delta")
    assert text == "".join(e.text for e in raw if e.type == "response.output_text.done") == final.output_text


def test_server_forced_function_call_then_second_turn(client, server):
    tool_choice = {"type": "function", "name": "get_weather"}
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice=tool_choice,
        max_output_tokens=400,
        temperature=0,
    )
    check_body(first, 400)
    assert first.tool_choice.name == "get_weather"
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments), dict)
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice=tool_choice,
        max_output_tokens=400,
        temperature=0,
    ) as stream:
        assert summary(list(stream)[-1].response) == summary(first)

    follow_up = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C and sunny"}]
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=follow_up,
        tools=[WEATHER],
        max_output_tokens=16,
        temperature=0,
    )
    check_body(second, 16)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    # The history really reached the prompt: the same conversation sent in full costs the same tokens.
    full = client.responses.create(
        model=MODEL,
        tools=[WEATHER],
        max_output_tokens=16,
        temperature=0,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            *follow_up,
        ],
    )
    assert full.usage.input_tokens == second.usage.input_tokens
    assert summary(full) == summary(second)


def test_server_errors(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown")
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-9", input="Hi")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL, input="Hi", tool_choice={"type": "function", "name": "nope"}, tools=[WEATHER]
        )
    assert err.value.body["param"] == "tool_choice"
    bad = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi"}, headers={"Authorization": "Bearer no"})
    assert bad.status_code == 401
