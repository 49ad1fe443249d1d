"""OpenAI's Responses API: `POST /v1/responses` and `GET /v1/responses/{id}`.

A Responses request is translated into a `ChatCompletionRequest` (`to_chat_request`) and runs
through the chat machinery (`Serving.chat_jobs`, `Serving.run`), so templates, parsers
(`--reasoning-parser`, `--tool-call-parser`), forced tool choice and structured outputs behave
exactly as on /v1/chat/completions.

Output: the turn is cut into blocks in the order the model wrote them (`TurnBlocks`: reasoning,
text, tool calls; a new block whenever the kind changes), and each block is one output item:
`reasoning` (reasoning_text), `message` (output_text) or `function_call`. The streamed events
and the non-streamed body come from the same blocks, so they always agree.

`previous_response_id`: every stored response (`store` is true by default) keeps its whole
conversation (input items and output items, without `instructions`) in a bounded in-memory
LRU (`ResponseStore`); a later request names it to continue, and its input is appended.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from ..engine.outputs import CompletionOutput, RequestOutput
from .protocol import ChatCompletionRequest, _Request
from .serving import APIError, Job, Serving

# -- turn blocks (shared with messages.py) -----------------------------------------------------


@dataclass
class Block:
    """One output item: `kind` is "reasoning", "text" or "call"; `text` is the reasoning or
    text, or the call's arguments (JSON text)."""

    kind: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""
    call_index: int | None = None
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)


Event = tuple[str, Block, str]  # ("open" | "delta" | "close", block, delta text)


async def run_into_blocks(serving: Serving, jobs: list[Job], blocks: TurnBlocks) -> RequestOutput:
    """Run one turn's job to the end, feeding each step's parsed output into `blocks`; the
    final output (the non-streamed Responses and Messages replies are built from it)."""
    last = None
    gen = serving.run(jobs)
    try:
        async for _, out in gen:
            last = out
            blocks.feed(out.outputs[0])
    finally:
        await gen.aclose()
    blocks.close()
    assert last is not None
    return last


class TurnBlocks:
    """Cuts one sequence's per-step output into consecutive blocks: `feed(step)` returns the
    ("open", block), ("delta", block, text) and ("close", block) events it causes, `close()`
    the last "close". Without an output parser all text is one text block."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None

    @staticmethod
    def _pieces(c: CompletionOutput) -> Iterator[tuple[str, str, Any]]:
        if c.delta_parsed is None:
            if c.delta_text:
                yield "text", c.delta_text, None
            return
        d = c.delta_parsed
        if d.reasoning:
            yield "reasoning", d.reasoning, None
        if d.content:
            yield "text", d.content, None
        for call in d.tool_calls:
            yield "call", call.arguments, call

    def feed(self, c: CompletionOutput) -> list[Event]:
        events: list[Event] = []
        for kind, text, call in self._pieces(c):
            b = self._open
            if b is None or b.kind != kind or (call is not None and call.index != b.call_index):
                events.extend(self.close())
                b = Block(kind, len(self.blocks))
                if call is not None:
                    b.call_index, b.call_id, b.name = call.index, call.id or "", call.name or ""
                self.blocks.append(b)
                self._open = b
                events.append(("open", b, ""))
            if text:
                b.text += text
                events.append(("delta", b, text))
        return events

    def close(self) -> list[Event]:
        b, self._open = self._open, None
        return [] if b is None else [("close", b, "")]


# -- stored conversations -----------------------------------------------------------------------


class ResponseStore:
    """The last `capacity` stored responses, each with its conversation (LRU; thread-safe)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        with self._lock:
            entry = self._items.get(response_id)
            if entry is not None:
                self._items.move_to_end(response_id)
            return entry


# -- request ----------------------------------------------------------------------------------


class ResponsesRequest(_Request):
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool | None = False
    previous_response_id: StrictStr | None = None
    store: StrictBool | None = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    background: StrictBool | None = None
    # vLLM's sampling extras
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None


# Chat field -> the Responses field to name in an error.
_PARAM = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


def _remap(exc: APIError) -> APIError:
    return APIError(exc.status, exc.message, _PARAM.get(exc.param or "", exc.param))


def _text_of(content: Any, where: str) -> str | list[dict[str, str]]:
    """An item's content: a string, or its text parts as chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "reasoning_text", "summary_text") and isinstance(
            part.get("text"), str
        ):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        else:
            raise APIError(
                400,
                f"{where}.content[{j}]: only text parts are supported (input_text, output_text), got {kind!r}",
                "input",
            )
    return parts


def _joined(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else list(value)


def items_to_messages(items: list[dict[str, Any]], offset: int = 0) -> list[dict[str, Any]]:
    """Responses input items -> chat messages. Consecutive reasoning / assistant message /
    function_call items become one assistant message (reasoning, content, tool_calls), as
    the model wrote them; function_call_output items become tool messages."""
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being assembled

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn)
        turn = None

    for i, item in enumerate(items):
        where = f"input[{i + offset}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
            content = _text_of(item.get("content"), where)
            if role != "assistant":
                flush()
                messages.append({"role": role, "content": content})
                continue
            if turn is not None and ("content" in turn or "tool_calls" in turn):
                flush()
            turn = turn or {"role": "assistant"}
            turn["content"] = _joined(content)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _joined(_text_of(parts, where))
            if turn is not None and ("content" in turn or "tool_calls" in turn):
                flush()
            turn = turn or {"role": "assistant"}
            turn["reasoning"] = turn.get("reasoning", "") + text
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not (isinstance(call_id, str) and isinstance(name, str) and name and isinstance(args, str)):
                raise APIError(400, f"{where}: a function_call needs string call_id, name and arguments", "input")
            turn = turn or {"role": "assistant"}
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            )
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise APIError(400, f"{where}: a function_call_output needs a string call_id", "input")
            flush()
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _joined(_text_of(item.get("output", ""), where))}
            )
        else:
            raise APIError(
                400,
                f"{where}: unsupported item type {kind!r} (supported: message, reasoning, "
                "function_call, function_call_output)",
                "input",
            )
    flush()
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools are flat ({type, name, description, parameters, strict})."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(
                400, f"tools[{i}]: only function tools are supported, got type {tool.get('type')!r}", "tools"
            )
        if "function" in tool:  # the chat shape, accepted as is
            out.append(tool)
            continue
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400,
        f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, got {choice!r}",
        "tool_choice",
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` (flat: {type: json_schema, name, schema, strict}) -> chat response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt  # text / json_object; anything else is refused by the chat checks


def to_chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]] | None = None
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request a Responses request runs as, and the conversation it continues
    (history + this input, as Responses items)."""
    if req.background:
        raise APIError(400, "background responses are not supported", "background")
    history = history or []
    items = history + input_items(req.input)
    messages = items_to_messages(items, -len(history))
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise APIError(400, "input must not be empty", "input")
    effort = (req.reasoning or {}).get("effort")
    body = {
        "model": req.model,
        "messages": messages,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "response_format": response_format(req.text),
        "reasoning_effort": effort,
        "user": req.user,
        "top_k": req.top_k,
        "seed": req.seed,
        "stop": req.stop,
    }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        param = str(err["loc"][0]) if err.get("loc") else None
        raise APIError(
            400, f"{_PARAM.get(param or '', param)}: {err.get('msg')}", _PARAM.get(param or "", param)
        ) from None
    return chat, items


# -- the response object --------------------------------------------------------------------------


def output_item(b: Block, status: str = "completed") -> dict[str, Any]:
    if b.kind == "reasoning":
        return {
            "id": f"rs_{b.uid}",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": b.text}],
            "status": status,
        }
    if b.kind == "text":
        return {
            "id": f"msg_{b.uid}",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [_text_part(b.text)],
        }
    return {
        "id": f"fc_{b.uid}",
        "type": "function_call",
        "call_id": b.call_id,
        "name": b.name,
        "arguments": b.text,
        "status": status,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class Turn:
    """One /v1/responses request in flight: its id, what it echoes, and its output."""

    def __init__(
        self,
        serving: Serving,
        store: ResponseStore,
        req: ResponsesRequest,
        jobs: list[Job],
        conversation: list[dict[str, Any]],
    ) -> None:
        self.serving, self.store, self.req, self.jobs = serving, store, req, jobs
        self.conversation = conversation
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.blocks = TurnBlocks()
        self._seq = 0

    def body(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, **extra: Any
    ) -> dict[str, Any]:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.serving.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": {"format": fmt},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            **extra,
        }

    def finish(self, last: RequestOutput) -> dict[str, Any]:
        """The final response (and stored, unless store is false); blocks must be closed."""
        (c,) = last.outputs
        incomplete = c.finish_reason == "length"
        blocks = self.blocks.blocks
        output = [output_item(b, "incomplete" if incomplete and b is blocks[-1] else "completed") for b in blocks]
        n_in, n_out = len(last.prompt_token_ids), len(c.token_ids)
        usage = {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": c.num_reasoning_tokens},
            "total_tokens": n_in + n_out,
        }
        if incomplete:
            body = self.body("incomplete", output, usage, incomplete_details={"reason": "max_output_tokens"})
        else:
            body = self.body("completed", output, usage, completed_at=int(time.time()))
        if self.req.store is not False:
            self.store.put(body, self.conversation + output)
        return body

    async def response(self) -> dict[str, Any]:
        return self.finish(await run_into_blocks(self.serving, self.jobs, self.blocks))

    # -- streaming -----------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _events(self, op: str, b: Block, status: str) -> Iterator[str]:
        where = {"item_id": output_item(b)["id"], "output_index": b.index}
        if op == "open":
            item = output_item(b, "in_progress")
            if b.kind != "call":
                item["content"] = []
            else:
                item["arguments"] = ""
            yield self._event("response.output_item.added", output_index=b.index, item=item)
            if b.kind == "reasoning":
                yield self._event(
                    "response.content_part.added", **where, content_index=0, part={"type": "reasoning_text", "text": ""}
                )
            elif b.kind == "text":
                yield self._event("response.content_part.added", **where, content_index=0, part=_text_part(""))
            return
        # close
        if b.kind == "reasoning":
            yield self._event("response.reasoning_text.done", **where, content_index=0, text=b.text)
            yield self._event(
                "response.content_part.done", **where, content_index=0, part={"type": "reasoning_text", "text": b.text}
            )
        elif b.kind == "text":
            yield self._event("response.output_text.done", **where, content_index=0, text=b.text, logprobs=[])
            yield self._event("response.content_part.done", **where, content_index=0, part=_text_part(b.text))
        else:
            yield self._event("response.function_call_arguments.done", **where, name=b.name, arguments=b.text)
        yield self._event("response.output_item.done", output_index=b.index, item=output_item(b, status))

    def _delta(self, b: Block, text: str) -> str:
        where = {"item_id": output_item(b)["id"], "output_index": b.index}
        if b.kind == "reasoning":
            return self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)
        if b.kind == "text":
            return self._event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
        return self._event("response.function_call_arguments.delta", **where, delta=text)

    def _render(self, events: list[Event], status: str = "completed") -> Iterator[str]:
        for op, b, text in events:
            if op == "delta":
                yield self._delta(b, text)
            else:
                yield from self._events(op, b, status)

    async def stream(self) -> AsyncIterator[str]:
        yield self._event("response.created", response=self.body("in_progress", []))
        yield self._event("response.in_progress", response=self.body("in_progress", []))
        last = None
        gen = self.serving.run(self.jobs)
        try:
            async for _, out in gen:
                last = out
                for chunk in self._render(self.blocks.feed(out.outputs[0])):
                    yield chunk
            assert last is not None
            status = "incomplete" if last.outputs[0].finish_reason == "length" else "completed"
            for chunk in self._render(self.blocks.close(), status):
                yield chunk
            body = self.finish(last)
            yield self._event(
                "response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body
            )
        except Exception as exc:
            failed = self.body(
                "failed",
                [output_item(b) for b in self.blocks.blocks],
                error={"code": "server_error", "message": f"generation failed: {exc}"},
            )
            yield self._event("response.failed", response=failed)
        finally:
            await gen.aclose()


def prepare(serving: Serving, store: ResponseStore, req: ResponsesRequest) -> Turn:
    """Translate and build the engine job (a worker thread: this renders the chat)."""
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        entry = store.get(req.previous_response_id)
        if entry is None:
            raise APIError(
                404, f"Previous response with id '{req.previous_response_id}' not found.", "previous_response_id"
            )
        history = entry[1]
    chat, conversation = to_chat_request(req, history)
    try:
        _, jobs = serving.chat_jobs(chat)
    except APIError as exc:
        raise _remap(exc) from None
    return Turn(serving, store, req, jobs, conversation)


def add_routes(app: FastAPI, serving: Serving, prep: Any, store: ResponseStore | None = None) -> ResponseStore:
    """Register /v1/responses on `app` (api.py's helpers are imported here: api.py imports
    this module inside build_app)."""
    from .api import SSEResponse, _parse, _until_disconnect

    store = store if store is not None else ResponseStore()

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req = await _parse(request, ResponsesRequest)
        turn = await prep.run(prepare, serving, store, req)
        if req.stream:
            return SSEResponse(turn.stream())

        async def work() -> JSONResponse:
            return JSONResponse(await turn.response())

        return await _until_disconnect(request, work())

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        entry = store.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return entry[0]

    return store
