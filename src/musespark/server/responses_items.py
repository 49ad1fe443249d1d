"""The Responses API's request and items, as chat: `ResponsesRequest`, input items -> chat
messages (`items_to_messages`), flat function tools and tool_choice -> chat's, `text.format`
-> response_format, the whole request -> a `ChatCompletionRequest` (`to_chat_request`), and a
turn block -> an output item (`output_item`). Refusals are `APIError(400)` naming the
Responses field (`remap_error` renames a chat field in an error from the chat machinery).
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from .http import APIError
from .protocol import ChatCompletionRequest, RequestModel
from .turn_blocks import Block


class ResponsesRequest(RequestModel):
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


def remap_error(exc: APIError) -> APIError:
    """`exc` naming the Responses field for the chat field it names."""
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
            "content": [text_part(b.text)],
        }
    return {
        "id": f"fc_{b.uid}",
        "type": "function_call",
        "call_id": b.call_id,
        "name": b.name,
        "arguments": b.text,
        "status": status,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
