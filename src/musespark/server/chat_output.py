"""Chat output with Muse parsers -> OpenAI fields: which parser a request gets, and how its
parsed deltas and final message become `reasoning`, `content`, `tool_calls`,
`finish_reason` and `usage.completion_tokens_details` (MUSE_CHAT §3, §5, §6).

The engine's output processor does the parsing; this file only maps, so a streamed
response aggregates to exactly the non-streamed one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..engine.chat import normalize_tools
from ..engine.outputs import CompletionOutput, RequestOutput
from ..parsers import (
    PARSERS,
    MuseOutputParser,
    ParsedDelta,
    get_parser_factory,
    resolve_finish_reason,
    tool_schemas_from_openai,
)
from .protocol import ChatCompletionRequest, usage


def check_parsers(reasoning_parser: str | None, tool_call_parser: str | None, auto_tool_choice: bool) -> None:
    """Startup check of the parser flags: unknown names list the supported ones."""
    if reasoning_parser is not None:
        get_parser_factory(reasoning_parser, "reasoning")
    if tool_call_parser is not None:
        get_parser_factory(tool_call_parser, "tool")
    if auto_tool_choice and tool_call_parser is None:
        raise ValueError(
            f"--enable-auto-tool-choice needs --tool-call-parser (supported: {', '.join(sorted(PARSERS))})"
        )


def output_parser_factory(
    reasoning_parser: str | None, tool_call_parser: str | None, req: ChatCompletionRequest
) -> Callable[[], MuseOutputParser] | None:
    """One parser per sequence: reasoning with --reasoning-parser; tool calls with
    --enable-auto-tool-choice (`tool_call_parser` set) when the request has tools and
    tool_choice is not "none", and always for a forced tool_choice ("required" or a named
    function: the grammar writes the model's own ATEM call, so the Muse parser reads it even
    without the flags). None when nothing applies."""
    reasoning = reasoning_parser is not None
    forced = bool(req.tools) and (req.tool_choice == "required" or isinstance(req.tool_choice, dict))
    tools = forced or bool(tool_call_parser and req.tools and req.tool_choice != "none")
    if not (reasoning or tools):
        return None
    name = reasoning_parser if reasoning else tool_call_parser or "muse"
    return functools.partial(
        get_parser_factory(name, "reasoning" if reasoning else "tool"),
        reasoning=reasoning,
        tools=tools,
        tool_names=tool_schemas_from_openai(normalize_tools(req.tools)) if tools else None,
        parallel_tool_calls=req.parallel_tool_calls is not False,
    )


def chat_message(c: CompletionOutput, include_reasoning: bool, tool_choice: Any = None) -> dict[str, Any]:
    """The assistant message: the raw text, or with an output parser its reasoning, content
    and tool calls (MUSE_CHAT §3). A named tool_choice answers with content "" (vLLM's), never null."""
    if c.parsed is None:
        return {"role": "assistant", "content": c.text}
    content = c.parsed.content
    if content is None and isinstance(tool_choice, dict):
        content = ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if include_reasoning:
        message["reasoning"] = c.parsed.reasoning
    if c.parsed.tool_calls:
        message["tool_calls"] = [
            {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in c.parsed.tool_calls
        ]
    return message


def parsed_delta(d: ParsedDelta, include_reasoning: bool) -> dict[str, Any]:
    """One streamed step: reasoning and content text, and tool calls in OpenAI's streaming
    shape (id, type and name on a call's first delta, then argument pieces)."""
    delta: dict[str, Any] = {}
    if d.reasoning and include_reasoning:
        delta["reasoning"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        calls = []
        for t in d.tool_calls:
            call: dict[str, Any] = {"index": t.index, "function": {"arguments": t.arguments}}
            if t.id is not None:
                call.update(id=t.id, type="function")
            if t.name is not None:
                call["function"]["name"] = t.name
            calls.append(call)
        delta["tool_calls"] = calls
    return delta


def chat_finish_reason(c: CompletionOutput, has_tool_calls: bool, tool_choice: Any = None) -> str | None:
    """ "tool_calls" when a call was made and the engine stopped, unless tool_choice named the
    function (vLLM then keeps "stop"); "length" is kept."""
    if c.delta_parsed is None:
        return c.finish_reason
    return resolve_finish_reason(c.finish_reason, has_tool_calls, named_tool_choice=isinstance(tool_choice, dict))


def chat_usage(out: RequestOutput, n_out: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """The usage block; `cached_tokens` None leaves prompt_tokens_details null (vLLM without
    --enable-prompt-tokens-details)."""
    body: dict[str, Any] = usage(len(out.prompt_token_ids), n_out, cached_tokens)
    if any(c.delta_parsed is not None for c in out.outputs):
        body["completion_tokens_details"] = {"reasoning_tokens": sum(c.num_reasoning_tokens for c in out.outputs)}
    return body
