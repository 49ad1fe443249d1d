"""OpenAI's Responses API: `POST /v1/responses` and `GET /v1/responses/{id}`.

A Responses request is translated into a `ChatCompletionRequest` (responses_items.py
`to_chat_request`) and runs
through the chat machinery (`Serving.chat_jobs`, `Serving.run`), so templates, parsers
(`--reasoning-parser`, `--tool-call-parser`), forced tool choice and structured outputs behave
exactly as on /v1/chat/completions.

Output: the turn is cut into blocks in the order the model wrote them (turn_blocks.py: reasoning,
text, tool calls; a new block whenever the kind changes), and each block is one output item:
`reasoning` (reasoning_text), `message` (output_text) or `function_call`. The streamed events
and the non-streamed body come from the same blocks, so they always agree.

`previous_response_id`: every stored response (`store` is true by default) keeps its whole
conversation (input items and output items, without `instructions`) in a bounded in-memory
LRU (`ResponseStore`); a later request names it to continue, and its input is appended.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import RequestOutput
from .http import APIError, SSEResponse, parse_body, sse, until_disconnect
from .responses_items import ResponsesRequest, output_item, remap_error, text_part, to_chat_request
from .serving import Job, Serving
from .turn_blocks import Block, Event, TurnBlocks, run_into_blocks

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


# -- the response object --------------------------------------------------------------------------


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
        return sse(payload, event=kind)

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
                yield self._event("response.content_part.added", **where, content_index=0, part=text_part(""))
            return
        # close
        if b.kind == "reasoning":
            yield self._event("response.reasoning_text.done", **where, content_index=0, text=b.text)
            yield self._event(
                "response.content_part.done", **where, content_index=0, part={"type": "reasoning_text", "text": b.text}
            )
        elif b.kind == "text":
            yield self._event("response.output_text.done", **where, content_index=0, text=b.text, logprobs=[])
            yield self._event("response.content_part.done", **where, content_index=0, part=text_part(b.text))
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
        raise remap_error(exc) from None
    return Turn(serving, store, req, jobs, conversation)


def add_routes(app: FastAPI, serving: Serving, prep: Any, store: ResponseStore | None = None) -> ResponseStore:
    """Register /v1/responses and GET /v1/responses/{id} on `app`."""
    store = store if store is not None else ResponseStore()

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req = await parse_body(request, ResponsesRequest)
        turn = await prep.run(prepare, serving, store, req)
        if req.stream:
            return SSEResponse(turn.stream())

        async def work() -> JSONResponse:
            return JSONResponse(await turn.response())

        return await until_disconnect(request, work())

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        entry = store.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return entry[0]

    return store
