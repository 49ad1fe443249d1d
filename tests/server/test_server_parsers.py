"""Chat with `--reasoning-parser muse --enable-auto-tool-choice --tool-call-parser muse`: the
route maps the output processor's parsed deltas to OpenAI's `reasoning`, `content` and
`tool_calls`, streamed and not, with the same aggregate.

The bundled model does not speak Muse yet, so a stand-in engine replays a Muse transcript
(MUSE_CHAT §7 #2) token by token through the real output processor and parser."""

from __future__ import annotations

import asyncio
import json

import pytest

from musespark.engine.core import EngineCoreOutput
from musespark.engine.llm_engine import LLMEngine
from musespark.engine.output_processor import OutputProcessor
from musespark.server.chat_output import check_parsers
from musespark.server.protocol import ChatCompletionRequest
from musespark.server.serving import ChatSettings, Serving

TRANSCRIPT = (
    " to=self<|message|>Need weather.<|eom|><|start|>assistant to=get_weather<|message|>"
    '<atem:function_calls>\n<atem:invoke name="get_weather">\n'
    '<atem:parameter name="city">Paris</atem:parameter>\n'
    '<atem:parameter name="days">3</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]


class ReplayEngine:
    """An AsyncEngine stand-in: every request 'generates' `text`, one token per step."""

    def __init__(self, engine: LLMEngine, text: str) -> None:
        self.input_processor, self.tokenizer = engine.input_processor, engine.tokenizer
        self.tokens = engine.tokenizer.encode(text, add_special_tokens=False)
        self.params = []

    async def generate(self, request_id, prompt, params, output_parser=None):
        self.params.append(params)
        processor = OutputProcessor(self.tokenizer)
        processor.add_request(request_id, prompt.text, prompt.token_ids, params, [request_id], output_parser)
        for i, token in enumerate(self.tokens):
            done = i == len(self.tokens) - 1
            (out,) = processor.process_outputs(
                [EngineCoreOutput(request_id, [token], None, finish_reason="stop" if done else None)]
            ).request_outputs
            yield out
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(max_model_len=2048)  # the Muse system prompt with tools is ~600 tokens


def serving_for(engine, text=TRANSCRIPT, **settings):
    replay = ReplayEngine(engine, text)
    return Serving(replay, "m", 16, ChatSettings(**settings)), replay


def run_chat(serving, body):
    req = ChatCompletionRequest.model_validate(body)
    base, jobs = serving.chat_jobs(req)

    async def go():
        if req.stream:
            return [chunk async for chunk in serving.chat_stream(base, req, jobs)]
        (final,) = await serving.final_outputs(jobs)
        return serving.chat_response(base, req, final)

    return asyncio.run(go())


def aggregate(chunks):
    events = [json.loads(c[6:]) for c in chunks if c.startswith("data: {")]
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish = None
    for e in events:
        for ch in e["choices"]:
            d = ch["delta"]
            reasoning += d.get("reasoning") or ""
            content += d.get("content") or ""
            for t in d.get("tool_calls", []):
                call = calls.setdefault(
                    t["index"], {"id": t.get("id"), "name": t["function"].get("name"), "arguments": ""}
                )
                call["arguments"] += t["function"].get("arguments", "")
            finish = ch["finish_reason"] or finish
    return reasoning or None, content or None, [calls[i] for i in sorted(calls)], finish, events


def test_reasoning_and_tool_calls_map_to_openai_fields(engine):
    serving, replay = serving_for(engine, reasoning_parser="muse", tool_call_parser="muse")
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "max_tokens": 100}
    out = run_chat(serving, body)
    assert replay.params[-1].skip_special_tokens is False  # the parser needs the markers
    (choice,) = out["choices"]
    msg = choice["message"]
    assert msg["reasoning"] == "Need weather." and msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert choice["finish_reason"] == "tool_calls"
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0

    reasoning, content, calls, finish, events = aggregate(run_chat(serving, {**body, "stream": True}))
    assert (reasoning, content, finish) == ("Need weather.", None, "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    first = next(t for e in events for ch in e["choices"] for t in ch["delta"].get("tool_calls", []))
    assert first["id"].startswith("chatcmpl-tool-") and first["function"]["name"] == "get_weather"


def test_without_tools_or_parsers_the_text_is_content(engine):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100}
    plain, replay = serving_for(engine)
    out = run_chat(plain, body)
    assert out["choices"][0]["message"] == {
        "role": "assistant",
        "content": replay.tokenizer.decode(replay.tokens, skip_special_tokens=True),
    }
    assert replay.params[-1].skip_special_tokens is True
    # A reasoning parser but no tools in the request: the ATEM stays in the tool message, never a call.
    reasoning_only, _ = serving_for(engine, reasoning_parser="muse", tool_call_parser="muse")
    msg = run_chat(reasoning_only, body)["choices"][0]
    assert msg["message"]["reasoning"] == "Need weather." and "tool_calls" not in msg["message"]
    assert msg["finish_reason"] == "stop"
    hidden = run_chat(reasoning_only, {**body, "include_reasoning": False})["choices"][0]["message"]
    assert "reasoning" not in hidden


def test_unknown_parser_names_are_a_startup_error_listing_the_supported_ones():
    with pytest.raises(ValueError, match="supported: muse, musespark1x"):
        check_parsers("deepseek_r1", None, False)
    with pytest.raises(ValueError, match="supported: muse, musespark1x"):
        check_parsers(None, "hermes", True)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_parsers(None, None, True)
