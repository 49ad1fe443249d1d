"""The bundled model speaks Muse, end to end through `musespark serve --reasoning-parser muse
--enable-auto-tool-choice --tool-call-parser muse` and the official `openai` client: a tool
call, the tool result sent back, a final answer with reasoning; streamed and non-streamed
agree. Structured outputs with the reasoning parser on: generated JSON schemas validate,
streamed and not; `tool_choice="required"` and a named function always give a valid call;
bad constraints are 400s that never reach the engine."""

from __future__ import annotations

import asyncio
import json
import random
import re

import jsonschema
import openai
import pytest
from json_schemas import gen_object
from test_server import ServerProcess, metrics

from musespark.apps.demo_tools import DEMO_TOOLS

TOOLS = list(DEMO_TOOLS.values())  # get_weather, calculator, read_file
DATE = {"current_date": "2026-12-01"}
QUESTIONS = [
    "What's the weather like in Paris right now?",
    "Is it raining in Tokyo?",
    "What is 17 * 23?",
    "Please show me the contents of /etc/hostname.",
    "Hello! How are you today?",
    "Who wrote Hamlet?",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("muse") / "server.log",
        "--max-model-len",
        "2048",
        "--reasoning-parser",
        "muse",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "muse",
        "--default-chat-template-kwargs",
        json.dumps(DATE),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(server):
    return lambda: openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def chat(client, messages, **kw):
    return client.chat.completions.create(
        model="musespark-tiny",
        messages=messages,
        temperature=kw.pop("temperature", 0),
        max_tokens=kw.pop("max_tokens", 200),
        **kw,
    )


def streamed(client, messages, **kw) -> dict:
    """The stream's aggregate in the non-streamed message's shape."""
    out = {"reasoning": "", "content": "", "tool_calls": {}, "finish_reason": None}
    for chunk in chat(client, messages, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            out["reasoning"] += getattr(d, "reasoning", None) or ""
            out["content"] += d.content or ""
            for t in d.tool_calls or []:
                call = out["tool_calls"].setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = t.id or call["id"]
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
            out["finish_reason"] = ch.finish_reason or out["finish_reason"]
    out["tool_calls"] = [out["tool_calls"][i] for i in sorted(out["tool_calls"])]
    return out


def flat(resp) -> dict:
    m = resp.choices[0].message
    return {
        "reasoning": getattr(m, "reasoning", None) or "",
        "content": m.content or "",
        "tool_calls": [
            {"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in m.tool_calls or []
        ],
        "finish_reason": resp.choices[0].finish_reason,
    }


def same(a: dict, b: dict) -> None:
    strip = lambda d: {**d, "tool_calls": [{**t, "id": None} for t in d["tool_calls"]]}  # noqa: E731 (ids are random)
    assert strip(a) == strip(b)


def test_weather_question_tool_call_then_final_answer(client):
    user = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    first = chat(client, user, tools=TOOLS)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", msg
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])  # (the tiny model does not copy "Paris" yet)
    assert getattr(msg, "reasoning", None)
    same(flat(first), streamed(client, user, tools=TOOLS))

    second = user + [
        {
            "role": "assistant",
            "content": None,
            "reasoning": msg.reasoning,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18C, clear skies"},
    ]
    final = chat(client, second, tools=TOOLS)
    answer = final.choices[0].message
    assert final.choices[0].finish_reason == "stop" and not answer.tool_calls
    assert answer.content and getattr(answer, "reasoning", None)
    assert final.usage.completion_tokens_details.reasoning_tokens > 0
    same(flat(final), streamed(client, second, tools=TOOLS))


@pytest.mark.parametrize("question", QUESTIONS)
def test_streamed_equals_non_streamed(client, question):
    user = [{"role": "user", "content": question}]
    same(flat(chat(client, user, tools=TOOLS)), streamed(client, user, tools=TOOLS))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "read_file"}}])
def test_forced_tool_choice_always_gives_a_valid_call(client, choice):
    """Every answer is a call (of the named tool), and every call that ends is schema-valid.
    Forced to call a tool the question does not fit ("Hello!" forced to read_file), the model has
    no value to copy: a small model may then repeat itself inside the free-text value until
    max_tokens, and the call is cut off (finish_reason "length", as vLLM reports it). The file
    question must end."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    ended = set()
    for question in QUESTIONS:
        resp = chat(client, [{"role": "user", "content": question}], tools=TOOLS, tool_choice=choice)
        calls, finish = resp.choices[0].message.tool_calls, resp.choices[0].finish_reason
        assert calls, (question, resp.choices[0].message)
        for call in calls:
            if isinstance(choice, dict):
                assert call.function.name == "read_file"
            if finish != "length":
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if finish != "length":
            assert finish == ("stop" if isinstance(choice, dict) else "tool_calls")
            ended.add(question)
    assert "Please show me the contents of /etc/hostname." in ended


SCHEMAS = [gen_object(random.Random(1000 + i)) for i in range(100)]


def _schema_request(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Describe item {i} as JSON."}],
        "temperature": 0,
        "max_tokens": 400,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": f"item{i}", "schema": SCHEMAS[i], "strict": True},
        },
    }


async def _run_all(make_client, stream: bool) -> list[tuple[str, str, str]]:
    """(reasoning, content, finish_reason) for every schema, sent concurrently."""
    async with make_client() as c:

        async def one(i):
            body = _schema_request(i)
            if not stream:
                r = await c.chat.completions.create(model="musespark-tiny", **body)
                m = r.choices[0].message
                return getattr(m, "reasoning", None) or "", m.content or "", r.choices[0].finish_reason
            reasoning = content = finish = ""
            async for chunk in await c.chat.completions.create(model="musespark-tiny", stream=True, **body):
                for ch in chunk.choices:
                    reasoning += getattr(ch.delta, "reasoning", None) or ""
                    content += ch.delta.content or ""
                    finish = ch.finish_reason or finish
            return reasoning, content, finish

        return await asyncio.gather(*(one(i) for i in range(len(SCHEMAS))))


@pytest.fixture(scope="module")
def plain_aclient(tmp_path_factory):
    """A server without the parsers: the grammar constrains the output from its first token."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("plain") / "server.log",
        "--max-model-len",
        "2048",
        "--reasoning-parser",
        "none",
        "--tool-call-parser",
        "none",
    )
    yield lambda: openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)
    srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_json_schemas_validate_with_reasoning_off(plain_aclient, stream):
    results = asyncio.run(_run_all(plain_aclient, stream))
    for schema, (reasoning, content, finish) in zip(SCHEMAS, results):
        assert finish == "stop" and not reasoning, content
        jsonschema.validate(json.loads(content), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schemas_validate_with_reasoning_on(aclient, stream):
    results = asyncio.run(_run_all(aclient, stream))
    for schema, (reasoning, content, finish) in zip(SCHEMAS, results):
        assert finish == "stop", (content, reasoning)
        jsonschema.validate(json.loads(content), schema)
    # The model reasons first (the grammar only constrains the final message).
    assert sum(bool(r) for r, _, _ in results) >= 90


def test_regex_and_choice_with_reasoning_on(client):
    for i in range(4):
        r = chat(
            client,
            [{"role": "user", "content": f"Give me code number {i}."}],
            extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{4}"}},
            temperature=1.0,
            seed=i,
        )
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", r.choices[0].message.content)
        r = chat(
            client,
            [{"role": "user", "content": "Is the sky blue?"}],
            temperature=1.0,
            seed=i,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "it depends"]}},
        )
        assert r.choices[0].message.content in ("yes", "no", "it depends")


def test_bad_constraints_never_reach_the_engine(server, client):
    before = metrics(server.url)["vllm:prompt_tokens_total"]
    bad = [
        dict(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}},
            }
        ),
        dict(extra_body={"structured_outputs": {"regex": "(("}}),
        dict(tools=[{"type": "function", "function": {"parameters": {}}}]),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch_rocket"}}),
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as err:
            chat(client, [{"role": "user", "content": "hi"}], **kw)
        assert err.value.body["param"] in (
            "response_format",
            "structured_outputs.regex",
            "tools",
            "tool_choice",
        )
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, [{"role": "wizard", "content": "hi"}])
    assert err.value.body["param"] == "messages"
    assert metrics(server.url)["vllm:prompt_tokens_total"] == before
