"""The server-sent-event streams of /v1/completions and /v1/chat/completions.

Invariants:
* Every stream ends with `data: [DONE]`; an engine failure becomes one error event first.
* Streamed logprobs come from each step's `delta_logprobs`, never from the growing lists.
* A chat chunk never carries an empty delta: a step that parsed into nothing (a channel
  header, a tool call's control tokens) is skipped unless it finishes the choice or carries
  logprobs or token ids, and then its delta is `{"content": ""}`.
* `stream_options.include_usage` adds a final usage chunk; with `continuous_usage_stats` too,
  every chunk carries the usage so far (vLLM's rule).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from ..engine.outputs import CompletionOutput, RequestOutput
from .chat_fields import chat_top, echo_text
from .chat_output import chat_finish_reason, chat_usage, parsed_delta
from .http import SSE_DONE, error_body, sse
from .logprobs import scoring_fields
from .protocol import ChatCompletionRequest, CompletionRequest, envelope, usage


def _running_usage(out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
    """The usage so far of one choice (continuous_usage_stats): its prompt and its tokens."""
    body = usage(len(out.prompt_token_ids), len(c.token_ids))
    del body["prompt_tokens_details"]
    if c.delta_parsed is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": c.num_reasoning_tokens}
    return body


async def completion_stream(serving: Any, base: str, req: CompletionRequest, jobs: list) -> AsyncIterator[str]:
    """`serving` is the route's `Serving` (its run, logprob formatter and settings)."""
    created = int(time.time())
    head = envelope("text_completion", base, serving.model_name, created)
    fmt = serving.logprobs.for_request(req.return_tokens_as_token_ids)
    started: set[int] = set()
    finished: set[int] = set()
    offsets: dict[int, int] = {}
    last: dict[int, RequestOutput] = {}
    gen = serving.run(jobs)
    try:
        async for i, out in gen:
            last[i] = out
            for c in out.outputs:
                index = i * req.n + c.index
                if index in finished or not (c.delta_token_ids or c.finish_reason):
                    continue
                text = c.delta_text
                first = index not in started
                if req.echo and first:
                    text = (out.prompt or "") + text
                started.add(index)
                lp = fmt.completion_choice(req, out, c.delta_logprobs, c.delta_token_ids, first)
                if lp is not None:
                    lp["text_offset"] = [o + offsets.get(index, 0) for o in lp["text_offset"]]
                    offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if first:
                    choice = scoring_fields(req, out, choice, [])
                if req.return_token_ids:
                    choice["token_ids"] = list(c.delta_token_ids)
                if c.finish_reason:
                    finished.add(index)
                chunk = {**head, "choices": [choice]}
                if req.continuous_usage:
                    chunk["usage"] = _running_usage(out, c)
                yield sse(chunk)
        if req.include_usage:
            n_prompt = sum(len(o.prompt_token_ids) for o in last.values())
            n_out = sum(len(c.token_ids) for o in last.values() for c in o.outputs)
            n_cached = serving.cached_tokens(sum(o.num_cached_tokens for o in last.values()))
            yield sse({**head, "choices": [], "usage": usage(n_prompt, n_out, n_cached)})
    except Exception as exc:
        yield sse(error_body(f"generation failed: {exc}", 500))
    finally:
        await gen.aclose()
    yield SSE_DONE


def _opening(head: dict[str, Any], req: ChatCompletionRequest, out: RequestOutput, index: int) -> list[str]:
    """A choice's first chunks: the role (with the prompt's token ids for return_token_ids),
    then the echoed final message."""
    usage0 = usage(len(out.prompt_token_ids), 0) if req.continuous_usage else None
    if usage0 is not None:
        del usage0["prompt_tokens_details"]
    role: dict[str, Any] = {
        **head,
        "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }
    if req.return_token_ids:
        role["prompt_token_ids"] = out.prompt_token_ids
    chunks = [role]
    echo = echo_text(req)
    if echo:
        chunks.append(
            {**head, "choices": [{"index": index, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}]}
        )
    for chunk in chunks:
        if usage0 is not None:
            chunk["usage"] = usage0
    return [sse(chunk) for chunk in chunks]


async def chat_stream(serving: Any, base: str, req: ChatCompletionRequest, jobs: list) -> AsyncIterator[str]:
    """`serving` is the route's `Serving` (its run, logprob formatter and settings)."""
    created = int(time.time())
    head = envelope("chat.completion.chunk", base, serving.model_name, created)
    fmt, top = serving.logprobs.for_request(req.return_tokens_as_token_ids), chat_top(req)
    started: set[int] = set()
    finished: set[int] = set()
    called: set[int] = set()  # choices that streamed a tool call
    last: RequestOutput | None = None
    gen = serving.run(jobs)
    try:
        async for _, out in gen:
            last = out
            for c in out.outputs:
                if c.index in finished or not (c.delta_token_ids or c.finish_reason):
                    continue
                if c.index not in started:  # the role goes out once the first token exists
                    started.add(c.index)
                    for line in _opening(head, req, out, c.index):
                        yield line
                if c.delta_parsed is None:
                    delta = {"content": c.delta_text} if c.delta_text else {}
                else:
                    delta = parsed_delta(c.delta_parsed, req.include_reasoning)
                    if c.delta_parsed.tool_calls:
                        called.add(c.index)
                logprobs = fmt.chat(c.delta_logprobs, c.delta_token_ids, top)
                if not delta:
                    if not (c.finish_reason or logprobs or req.return_token_ids):
                        continue  # nothing to say for this step (vLLM skips it too)
                    delta = {"content": ""}
                choice = {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": chat_finish_reason(c, c.index in called, req.tool_choice),
                    "stop_reason": c.stop_reason,
                }
                if req.return_token_ids:
                    choice["token_ids"] = list(c.delta_token_ids)
                if c.finish_reason:
                    finished.add(c.index)
                chunk = {**head, "choices": [choice]}
                if req.continuous_usage:
                    chunk["usage"] = _running_usage(out, c)
                yield sse(chunk)
        if req.include_usage and last is not None:
            n_out = sum(len(c.token_ids) for c in last.outputs)
            total = chat_usage(last, n_out, serving.cached_tokens(last.num_cached_tokens))
            yield sse({**head, "choices": [], "usage": total})
    except Exception as exc:
        yield sse(error_body(f"generation failed: {exc}", 500))
    finally:
        await gen.aclose()
    yield SSE_DONE
