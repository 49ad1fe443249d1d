"""Chat templates rendered as Hugging Face's `apply_chat_template` renders them, with vLLM's
request handling around them (docs/muse_chat.md §2.0).

* `compile_template` (chat_jinja.py) builds HF's Jinja environment; `load_chat_template`
  reads a `--chat-template` value (the template itself, or a file naming it).
* `normalize_messages` is vLLM's message preprocessing plus HF's: roles system, developer,
  user, assistant, tool, and any other non-empty role name, which reaches the template as it
  is (the template decides: the Muse template raises on a role it does not know); text
  parts joined with "\\n"; None-valued keys dropped; assistant
  `tool_calls[].function.arguments` parsed to dicts (invalid JSON or a non-object -> {}; an
  empty list is removed); reasoning under `reasoning`, `reasoning_content` and `thinking`;
  developer messages become system messages (merged into one at position 0) when the
  template does not mention "developer".
* `normalize_tools` gives `[{"type": "function", "function": {name, description,
  parameters[, strict]}}]`; `check_tool_choice` refuses a named function not in the tools.
* `template_kwargs` merges kwargs, lowest first: server defaults, the request's
  `chat_template_kwargs`, then the request's fields; None and "auto" never override.
* `render` fills the template (and cuts after the final message for
  `continue_final_message`, HF's tag trick).

Every refusal is an `InvalidArgumentError` naming `messages`, `tools`, `tool_choice`,
`reasoning_effort`, `chat_template_kwargs` or `add_generation_prompt`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from .chat_jinja import compile_template

# The roles OpenAI defines; any other non-empty role is a custom one, handed to the template.
CHAT_ROLES: frozenset[str] = frozenset({"system", "developer", "user", "assistant", "tool"})
# OpenAI's (and vLLM's) reasoning_effort values.
REASONING_EFFORTS: tuple[str, ...] = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# The names a message's reasoning reaches the template under (vLLM's two, plus HF's `thinking`).
_REASONING_FIELDS = ("reasoning", "reasoning_content", "thinking")
# Template variables the caller's kwargs may never replace.
_RESERVED = frozenset({"messages"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# -- messages --------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A copy made of JSON types only (the template never sees caller objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool):  # subclasses (enums, ...) are stripped back to the base type
        return bool(value)
    if isinstance(value, (str, int, float)):
        return (str.__str__ if isinstance(value, str) else int.__int__ if isinstance(value, int) else float.__float__)(
            value
        )
    return f"<{type(value).__name__}>"


def _content_text(content: Any, index: int) -> str:
    """A message's content as one string: a str as is, text parts joined with "\\n"."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidArgumentError(
                    f"messages[{index}].content[{j}] must be a {{'type': 'text', 'text': str}} part, got {part!r}",
                    param="messages",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidArgumentError(
        f"messages[{index}].content must be a str or a list of text parts, got {type(content).__name__}",
        param="messages",
    )


def _tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InvalidArgumentError(f"messages[{index}].tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgumentError(
                f"{where} must be {{'type': 'function', 'function': {{'name': str, 'arguments': str}}}}, got {call!r}",
                param="messages",
            )
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                args = {}
        if not isinstance(args, Mapping):
            args = {}  # vLLM: invalid JSON or a non-object becomes {}
        copy = {k: v for k, v in call.items() if v is not None}
        copy["type"] = call.get("type") or "function"
        copy["function"] = {**{k: v for k, v in fn.items() if v is not None}, "arguments": dict(args)}
        out.append(copy)
    return out


def normalize_messages(messages: Any, template: str | None = None) -> list[dict[str, Any]]:
    """Check chat messages and return the copies the template sees (see the module doc)."""
    if not isinstance(messages, list):
        raise InvalidArgumentError(f"messages must be a list of dicts, got {type(messages).__name__}", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidArgumentError(f"messages[{i}] must be a dict, got {type(msg).__name__}", param="messages")
        if "role" not in msg:
            raise InvalidArgumentError(f"messages[{i}] is missing the 'role' field", param="messages")
        role = msg["role"]
        if not isinstance(role, str) or not role:  # custom roles reach the template (vLLM's rule)
            raise InvalidArgumentError(f"messages[{i}].role must be a non-empty string, got {role!r}", param="messages")
        copy = {k: v for k, v in _plain(msg).items() if v is not None}  # HF drops None-valued keys
        if "content" in copy:
            copy["content"] = _content_text(copy["content"], i)
        elif role != "assistant":  # an assistant may send only tool calls (or only reasoning)
            raise InvalidArgumentError(f"messages[{i}] is missing the 'content' field", param="messages")
        if role == "assistant" and "tool_calls" in copy:
            copy["tool_calls"] = _tool_calls(copy["tool_calls"], i)
            if not copy["tool_calls"]:
                del copy["tool_calls"]
        if role == "tool" and not isinstance(copy.get("tool_call_id", ""), str):
            raise InvalidArgumentError(f"messages[{i}].tool_call_id must be a string", param="messages")
        reasoning = next((copy[k] for k in _REASONING_FIELDS if k in copy), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise InvalidArgumentError(f"messages[{i}].reasoning must be a string", param="messages")
            copy.update({k: reasoning for k in _REASONING_FIELDS})
        out.append(copy)
    if template is not None and not _mentions_developer(template) and any(m["role"] == "developer" for m in out):
        out = _developer_as_system(out)
    return out


def _mentions_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM: for a template without a developer role, developer messages become system
    messages, all merged into one at position 0, joined by a blank line."""
    system = [m for m in messages if m["role"] in ("system", "developer")]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    merged = {**system[0], "role": "system", "content": "\n\n".join(m.get("content", "") for m in system)}
    return [merged, *rest]


# -- tools -----------------------------------------------------------------------------------


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI tools as `[{"type": "function", "function": {name, description, parameters}}]`
    (description and parameters may be None; `strict` only when given)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidArgumentError(f"tools must be a list, got {type(tools).__name__}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidArgumentError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}, got {tool!r}", param="tools"
            )
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise InvalidArgumentError(f"tools[{i}].function must be an object", param="tools")
        name, desc, params = fn.get("name"), fn.get("description"), fn.get("parameters")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(
                f"tools[{i}].function.name must be a non-empty string, got {name!r}", param="tools"
            )
        if desc is not None and not isinstance(desc, str):
            raise InvalidArgumentError(f"tools[{i}].function.description must be a string", param="tools")
        if params is not None and not isinstance(params, Mapping):
            raise InvalidArgumentError(
                f"tools[{i}].function.parameters must be an object, got {params!r}", param="tools"
            )
        function = {"name": name, "description": desc, "parameters": _plain(params)}
        if fn.get("strict") is not None:
            if not isinstance(fn["strict"], bool):
                raise InvalidArgumentError(f"tools[{i}].function.strict must be a bool", param="tools")
            function["strict"] = fn["strict"]
        out.append({"type": "function", "function": function})
    return out


def check_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> None:
    """vLLM's rules: "none", "auto", "required" or {"type": "function", "function": {"name"}};
    anything but "none" needs tools, and a named function must be one of them."""
    if tool_choice is None or tool_choice == "none":
        return
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise InvalidArgumentError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
                param="tool_choice",
            )
        name = None
    else:
        fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
            raise InvalidArgumentError(
                f"tool_choice must be {{'type': 'function', 'function': {{'name': str}}}}, got {tool_choice!r}",
                param="tool_choice",
            )
    if not tools:
        raise InvalidArgumentError("when tool_choice is not 'none', tools must be given", param="tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise InvalidArgumentError(
            f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice"
        )


# -- kwargs ----------------------------------------------------------------------------------


def parse_reasoning_effort_map(value: str | Mapping[str, Any] | None) -> dict[str, str]:
    """`--reasoning-effort-map`: a JSON object from effort names to template values. Missing
    names map to themselves (the default is the identity)."""
    value = parse_template_kwargs(value, "reasoning_effort_map")
    bad = sorted(set(value) - set(REASONING_EFFORTS))
    if bad:
        raise InvalidArgumentError(
            f"reasoning effort map has unknown effort(s) {bad}; known: {list(REASONING_EFFORTS)}",
            param="reasoning_effort_map",
        )
    if not all(isinstance(v, str) and v for v in value.values()):
        raise InvalidArgumentError(
            "reasoning effort map values must be non-empty strings", param="reasoning_effort_map"
        )
    return dict(value)


def parse_template_kwargs(value: str | Mapping[str, Any] | None, param: str) -> dict[str, Any]:
    """A kwargs object given as JSON text or a mapping."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidArgumentError(f"{param} is not JSON: {e}", param=param) from e
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidArgumentError(f"{param} must be a JSON object", param=param)
    return dict(value)


def _overrides(layer: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in layer.items() if v is not None and not (isinstance(v, str) and v == "auto")}


def template_kwargs(
    defaults: Mapping[str, Any] | None,
    request_kwargs: Mapping[str, Any] | None,
    *,
    tools: Any = None,
    documents: Any = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    reasoning_effort: str | None = None,
    reasoning_effort_map: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """All template kwargs of one request, lowest precedence first: `defaults` (the server's
    --default-chat-template-kwargs), the request's `chat_template_kwargs`, then the request's
    fields. None and "auto" never override. A set `reasoning_effort` is mapped through
    `reasoning_effort_map`, passed as both `reasoning_effort` and `reasoning_strength`, and
    sets `enable_thinking = effort != "none"` unless the request's kwargs set it."""
    request_kwargs = parse_template_kwargs(request_kwargs, "chat_template_kwargs")
    fields: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
        "tools": tools,
    }
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise InvalidArgumentError(
                f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {reasoning_effort!r}",
                param="reasoning_effort",
            )
        effort = (reasoning_effort_map or {}).get(reasoning_effort, reasoning_effort)
        fields.update(reasoning_effort=effort, reasoning_strength=effort)
        if "enable_thinking" not in request_kwargs:
            fields["enable_thinking"] = effort != "none"
    merged = dict(defaults or {})
    merged.update(_overrides(request_kwargs))
    merged.update(_overrides(fields))
    return merged


def load_chat_template(value: str | None) -> str | None:
    """A `--chat-template` value as template text. vLLM's rule: a value holding any of "{}\n"
    is the template itself; else it names a file."""
    if value is None or any(c in value for c in "{}\n"):
        return value
    path = Path(value)
    if not path.is_file():
        raise InvalidArgumentError(f"--chat-template: no such file {value!r}", param="chat_template")
    return path.read_text(encoding="utf-8")


# -- rendering -------------------------------------------------------------------------------


def render(source: str, messages: Any, kwargs: Mapping[str, Any], special_tokens: Mapping[str, Any]) -> str:
    """Render `messages` with template `source` as HF's apply_chat_template does: the
    special tokens, then `kwargs` (which win; only the names the template reads are passed;
    `messages` is never replaced). Template errors become InvalidArgumentError('messages')."""
    template, names = compile_template(source)
    kwargs = dict(kwargs)
    add_generation_prompt = bool(kwargs.pop("add_generation_prompt", False))
    continue_final = bool(kwargs.pop("continue_final_message", False))
    if continue_final and add_generation_prompt:
        raise InvalidArgumentError(
            "continue_final_message and add_generation_prompt cannot both be true (set add_generation_prompt to false)",
            param="add_generation_prompt",
        )
    tools = normalize_tools(kwargs.pop("tools", None))
    documents = kwargs.pop("documents", None)
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, Mapping) for d in documents)):
        raise InvalidArgumentError("documents must be a list of objects", param="documents")
    chat = normalize_messages(messages, source)
    if not chat:
        raise InvalidArgumentError("messages must not be empty", param="messages")
    final = None
    if continue_final:
        last = chat[-1]
        final = last.get("content")
        if not isinstance(final, str):
            raise InvalidArgumentError(
                "continue_final_message is set but the final message has no content", param="messages"
            )
        last["content"] = final + _CONTINUE_TAG
    context = {
        **_plain(dict(special_tokens)),
        **{k: v for k, v in _plain(kwargs).items() if k in names and k not in _RESERVED},
    }
    try:
        text = template.render(
            **context,
            messages=chat,
            tools=tools,
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
        )
    except InvalidArgumentError:
        raise
    except Exception as e:  # raise_exception, undefined attributes, sandbox refusals, type errors
        raise InvalidArgumentError(f"chat template error: {e}", param="messages") from e
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise InvalidArgumentError(
                "continue_final_message is set but the final message does not appear in the rendered chat",
                param="messages",
            )
        at = text.rindex(tag)
        text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
