"""Which output constraint a request asks for: `response_format`, vLLM's
`structured_outputs`, or a forced `tool_choice`, as one `StructuredOutputsParams` (or None).

Rules (OpenAI's and vLLM's fields; where they are silent, what an agent framework expects):
* `response_format`: {"type": "text"} (none), {"type": "json_object"}, or {"type":
  "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}. The grammar is
  always strict: the output validates against the schema, `strict` or not.
* `structured_outputs`: {json | regex | choice | grammar | json_object, disable_any_whitespace?}
  (vLLM's keys). Giving it together with a non-text `response_format` is a 400.
* `tool_choice` "required" or {"type": "function", "function": {"name"}} forces one ATEM call
  (to any tool, or to the named one) whose parameters follow the tool's schema; the Muse
  tool parser turns it into `tool_calls` even without `--enable-auto-tool-choice`
  (chat_output.py). For that turn it replaces `response_format`: one message cannot be both
  a tool call and the structured answer.
* With `--reasoning-parser` (and `include_reasoning` not false), the constraint applies to the
  final message only: the model reasons freely first (MUSE_CHAT §4.12 is what vLLM does
  instead). Otherwise it applies from the first token, as vLLM's does.
Every refusal is an `InvalidArgumentError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError
from ..sampling_params import StructuredOutputsParams

_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def from_response_format(value: Any) -> dict[str, Any] | None:
    """StructuredOutputsParams fields for an OpenAI `response_format` (None for text)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise InvalidArgumentError("response_format must be an object with a 'type'", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidArgumentError(
                "response_format.json_schema must be an object with a 'schema'", param="response_format.json_schema"
            )
        schema = spec.get("schema")
        if schema is None:  # OpenAI makes it optional: then any JSON object
            return {"json_object": True}
        if not isinstance(schema, Mapping):
            raise InvalidArgumentError(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        return {"json": dict(schema)}
    raise InvalidArgumentError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param="response_format"
    )


def from_structured_outputs(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgumentError("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(str(k) for k in value if k not in _SO_KEYS)
    if unknown:
        raise InvalidArgumentError(
            f"structured_outputs has unsupported key(s): {', '.join(unknown)} (supported: {', '.join(_SO_KEYS)})",
            param="structured_outputs",
        )
    return {k: v for k, v in value.items() if v is not None}


def forced_tools(tool_choice: Any, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools a forced tool_choice allows (all for "required", the named one), or None."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        return list(tools)
    name = tool_choice["function"]["name"]  # checked by engine/chat.py check_tool_choice
    return [t for t in tools if t["function"]["name"] == name]


def request_constraint(
    response_format: Any,
    structured_outputs: Any,
    *,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    final_message_only: bool = False,
) -> StructuredOutputsParams | None:
    fields = from_structured_outputs(structured_outputs)
    fmt = from_response_format(response_format)
    if fields is not None and fmt is not None:
        raise InvalidArgumentError(
            "give structured_outputs or a non-text response_format, not both", param="structured_outputs"
        )
    fields = fields if fields is not None else fmt
    forced = forced_tools(tool_choice, tools)
    if forced is not None:
        fields = {"tool_calls": forced}
    if fields is None:
        return None
    return StructuredOutputsParams(**fields, final_message_only=final_message_only)
