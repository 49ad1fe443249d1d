"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A Messages request is translated into a `ChatCompletionRequest` (`to_chat_request`) and runs
through the chat machinery (`Serving.chat_jobs`, `Serving.run`), exactly as a chat completion.
The turn is cut into blocks in the order the model wrote them (turn_blocks.py):
reasoning -> `thinking`, text -> `text`, tool calls -> `tool_use` (input: the parsed
arguments). Streamed events and the non-streamed body come from the same blocks.

Errors on these routes leave in Anthropic's shape:
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from ..engine.outputs import RequestOutput
from .async_engine import EngineDeadError
from .http import (
    APIError,
    SSEResponse,
    anthropic_error_response,
    parse_body,
    sse,
    until_disconnect,
)
from .protocol import ChatCompletionRequest, RequestModel, TokenizeRequest
from .serving import Job, Serving
from .turn_blocks import Block, Event, TurnBlocks, run_into_blocks

# -- request ----------------------------------------------------------------------------------


class CountTokensRequest(RequestModel):
    model: StrictStr
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {effort?, format?: {type: json_schema, schema}}
    # {type: "enabled", budget_tokens} | {type: "adaptive"} | {type: "disabled"}: thinking blocks
    # are sent only when enabled or adaptive; "enabled" bounds the reasoning (thinking_token_budget).
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt
    stop_sequences: list[StrictStr] | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    stream: StrictBool | None = False
    metadata: dict[str, Any] | None = None


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            raise APIError(
                400,
                f"{where}[{j}]: only text blocks are supported here, got "
                f"{block.get('type') if isinstance(block, dict) else block!r}",
            )
        texts.append(block["text"])
    return "\n".join(texts)


def to_chat_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic messages -> chat messages: an assistant turn's thinking / text / tool_use
    blocks become one message's reasoning, content and tool_calls; a user turn's tool_result
    blocks become tool messages and its text blocks user messages, in order."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _texts(system, "system")})
    for i, msg in enumerate(messages):
        where, role, content = f"messages.{i}", msg.get("role"), msg.get("content")
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role: must be 'user' or 'assistant', got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{where}.content: must be a string or a list of content blocks")
        if role == "assistant":
            turn: dict[str, Any] = {"role": "assistant"}
            for j, block in enumerate(content):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text":
                    turn["content"] = turn.get("content", "") + block.get("text", "")
                elif kind == "thinking":
                    turn["reasoning"] = turn.get("reasoning", "") + block.get("thinking", "")
                elif kind == "redacted_thinking":
                    continue
                elif kind == "tool_use":
                    turn.setdefault("tool_calls", []).append(
                        {
                            "id": block.get("id"),
                            "type": "function",
                            "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})},
                        }
                    )
                else:
                    raise APIError(400, f"{where}.content.{j}: unsupported block type {kind!r} on an assistant turn")
            out.append(turn)
            continue
        texts: list[str] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(block.get("text", ""))
            elif kind == "tool_result":
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                result = _texts(block.get("content", ""), f"{where}.content.{j}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
            else:
                raise APIError(
                    400, f"{where}.content.{j}: unsupported block type {kind!r} (this model reads text, tool_result)"
                )
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools.{i}: only custom tools {{name, description, input_schema}} are supported")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, f"tool_choice: must be {{type: auto | any | none}} or {{type: tool, name}}, got {choice!r}")


def response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` ({type: json_schema, schema}) -> chat response_format."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, f"output_config.format: must be {{type: json_schema, schema: {{...}}}}, got {fmt!r}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def thinking_fields(thinking: dict[str, Any] | None, max_tokens: int | None) -> dict[str, Any]:
    """Chat fields for Anthropic's `thinking` (vLLM's mapping): enabled -> thinking_token_budget =
    budget_tokens (>= 1024 and < max_tokens); disabled -> reasoning_effort "none"; adaptive and
    absent -> nothing."""
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise APIError(400, f"thinking.budget_tokens: must be an integer >= 1024, got {budget!r}")
        if max_tokens is not None and budget >= max_tokens:
            raise APIError(400, "thinking.budget_tokens must be less than max_tokens")
        return {"thinking_token_budget": budget}
    if kind == "disabled":
        return {"reasoning_effort": "none"}
    if kind == "adaptive":
        return {}
    raise APIError(400, f"thinking.type: must be 'enabled', 'disabled' or 'adaptive', got {kind!r}")


def shows_thinking(thinking: dict[str, Any] | None) -> bool:
    """Thinking blocks are sent only to a request that asks for thinking."""
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    tool_choice, parallel = chat_tool_choice(req.tool_choice)
    body = {
        "model": req.model,
        "messages": to_chat_messages(req.system, req.messages),
        "tools": chat_tools(req.tools),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "max_tokens": req.max_tokens,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "response_format": response_format(req.output_config),
        "reasoning_effort": (req.output_config or {}).get("effort"),
        **thinking_fields(req.thinking, req.max_tokens),
    }
    return _validated(ChatCompletionRequest, body)


def _validated(model: Any, body: dict[str, Any]) -> Any:
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise APIError(400, f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}") from None


def count_tokens(serving: Serving, req: CountTokensRequest) -> dict[str, int]:
    """The prompt's token count, exactly as /v1/messages renders it."""
    chat_tool_choice(req.tool_choice)  # checked as /v1/messages checks it
    body = {
        "model": req.model,
        "messages": to_chat_messages(req.system, req.messages),
        "tools": chat_tools(req.tools),
        "reasoning_effort": (req.output_config or {}).get("effort"),
        **{k: v for k, v in thinking_fields(req.thinking, None).items() if k == "reasoning_effort"},
    }
    return {"input_tokens": serving.tokenize(_validated(TokenizeRequest, body))["count"]}


# -- the message object ---------------------------------------------------------------------------


def tool_use_id(b: Block) -> str:
    """Anthropic's tool-use id shape (`toolu_...`), fixed per block: the streamed and the
    non-streamed message agree."""
    return f"toolu_{b.uid[:24]}"


def content_block(b: Block) -> dict[str, Any]:
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text, "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": b.text}
    try:
        args = json.loads(b.text) if b.text.strip() else {}
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": tool_use_id(b), "name": b.name, "input": args if isinstance(args, dict) else {}}


class Turn:
    """One /v1/messages request in flight."""

    def __init__(self, serving: Serving, req: MessagesRequest, jobs: list[Job]) -> None:
        self.serving, self.req, self.jobs = serving, req, jobs
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks = TurnBlocks()
        self.n_prompt = len(jobs[0].prompt.token_ids)
        self.show_thinking = shows_thinking(req.thinking)
        self._index: dict[int, int] = {}  # block index -> the index clients see (hidden blocks skipped)

    def visible(self, b: Block) -> bool:
        return b.kind != "reasoning" or self.show_thinking

    def stop(self, last: RequestOutput) -> tuple[str, str | None]:
        (c,) = last.outputs
        if c.finish_reason == "length":
            return "max_tokens", None
        if any(b.kind == "call" for b in self.blocks.blocks):
            return "tool_use", None
        if isinstance(c.stop_reason, str) and c.stop_reason in (self.req.stop_sequences or []):
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def head(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None], n_out: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.serving.model_name,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": {"input_tokens": self.n_prompt, "output_tokens": n_out},
        }

    async def response(self) -> dict[str, Any]:
        last = await run_into_blocks(self.serving, self.jobs, self.blocks)
        return self.head(
            [content_block(b) for b in self.blocks.blocks if self.visible(b)],
            self.stop(last),
            len(last.outputs[0].token_ids),
        )

    # -- streaming -----------------------------------------------------------------------------
    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, **fields}, event=kind)

    def _render(self, events: list[Event]) -> Iterator[str]:
        for op, b, text in events:
            if not self.visible(b):
                continue
            if op == "open":
                self._index[b.index] = len(self._index)
                start = (
                    {"type": "thinking", "thinking": "", "signature": ""}
                    if b.kind == "reasoning"
                    else {"type": "text", "text": ""}
                    if b.kind == "text"
                    else {"type": "tool_use", "id": tool_use_id(b), "name": b.name, "input": {}}
                )
                yield self._event("content_block_start", index=self._index[b.index], content_block=start)
            elif op == "delta":
                delta = (
                    {"type": "thinking_delta", "thinking": text}
                    if b.kind == "reasoning"
                    else {"type": "text_delta", "text": text}
                    if b.kind == "text"
                    else {"type": "input_json_delta", "partial_json": text}
                )
                yield self._event("content_block_delta", index=self._index[b.index], delta=delta)
            else:
                yield self._event("content_block_stop", index=self._index[b.index])

    async def stream(self) -> AsyncIterator[str]:
        yield self._event("message_start", message=self.head([], (None, None), 0))
        gen = self.serving.run(self.jobs)
        last = None
        try:
            async for _, out in gen:
                last = out
                for chunk in self._render(self.blocks.feed(out.outputs[0])):
                    yield chunk
            for chunk in self._render(self.blocks.close()):
                yield chunk
            assert last is not None
            reason, sequence = self.stop(last)
            yield self._event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage={"output_tokens": len(last.outputs[0].token_ids)},
            )
            yield self._event("message_stop")
        except Exception as exc:
            yield self._event("error", error={"type": "api_error", "message": f"generation failed: {exc}"})
        finally:
            await gen.aclose()


def prepare(serving: Serving, req: MessagesRequest) -> Turn:
    """Translate and build the engine job (a worker thread: this renders the chat)."""
    _, jobs = serving.chat_jobs(to_chat_request(req))
    return Turn(serving, req, jobs)


def add_routes(app: FastAPI, serving: Serving, prep: Any) -> None:
    """Register /v1/messages and /v1/messages/count_tokens (api.py imports this module inside"""

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        try:
            req = await parse_body(request, MessagesRequest)
            turn = await prep.run(prepare, serving, req)
        except APIError as exc:
            return anthropic_error_response(exc.status, exc.message)
        except EngineDeadError as exc:
            return anthropic_error_response(503, str(exc))
        if req.stream:
            return SSEResponse(turn.stream())

        async def work() -> JSONResponse:
            return JSONResponse(await turn.response())

        try:
            return await until_disconnect(request, work())
        except EngineDeadError as exc:
            return anthropic_error_response(503, str(exc))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request) -> Response:
        try:
            req = await parse_body(request, CountTokensRequest)
            return JSONResponse(await prep.run(count_tokens, serving, req))
        except APIError as exc:
            return anthropic_error_response(exc.status, exc.message)
