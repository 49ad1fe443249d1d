"""Grammars for structured outputs: what a `StructuredOutputsParams` means as an xgrammar
`Grammar`. Pure functions; nothing here knows a tokenizer (see `manager.py`).

A Muse turn's final message is `HEADER <|message|> BODY`. The body grammars are:
  json / json_object / regex / choice / grammar: the `to=user` answer itself;
  tool_calls: one ATEM call to tool NAME, in channel `to=NAME`:
      <atem:function_calls>\\n<atem:invoke name="NAME">\\n
      (<atem:parameter name="KEY">VALUE</atem:parameter>\\n)*
      </atem:invoke>\\n</atem:function_calls>
    with the tool's required parameters first (schema order), then its optional ones, each
    optional. A parameter whose schema has `"type": "string"` is written raw, as the Muse
    tool parser keeps it (no `<` inside, so the closing tag cannot be forged; an `enum` is
    one of its values, a `pattern` is matched); any other parameter is compact JSON
    following its schema (the parser JSON-decodes it).

Every refusal is an `InvalidArgumentError` naming the field (`structured_outputs.json`,
`tools`, ...) and the grammar engine's reason, never a silent free-form answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError
from ..sampling_params import StructuredOutputsParams

MESSAGE = "<|message|>"
# Raw string parameter values: anything but '<' (so `</atem:parameter>` ends the value).
_RAW_STRING = "root ::= [^<]*"
_ENGINE_NOISE = re.compile(r"^\s*\[[0-9:. ]+\]\s*\S+:\d+:\s*")  # "[17:09:23] /project/cpp/x.cc:94: "


def xgr() -> Any:
    """xgrammar, imported on first use: importing it costs about a second (it imports
    transformers), which a server that never sees a structured request should not pay."""
    import xgrammar

    return xgrammar


def _reason(exc: Exception) -> str:
    return _ENGINE_NOISE.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


def _refuse(param: str, what: str, exc: Exception, where: str | None = None) -> InvalidArgumentError:
    """`param` is the request field to blame; `where` (default: param) says where inside it."""
    return InvalidArgumentError(
        f"{where or param}: the grammar engine cannot compile this {what}: {_reason(exc)}", param=param
    )


def literal(text: str) -> Any:
    """A grammar matching exactly `text`."""
    return xgr().Grammar.from_ebnf("root ::= " + _ebnf_string(text))


def _ebnf_string(text: str) -> str:
    # JSON string escaping is valid EBNF string escaping for xgrammar (\" \\ \n \uXXXX).
    return json.dumps(text, ensure_ascii=False)


def json_schema(schema: Any, param: str, compact: bool, where: str | None = None) -> Any:
    where = where or param
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"{where} is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, (Mapping, bool)):
        raise InvalidArgumentError(f"{where} must be a JSON schema object, got {type(schema).__name__}", param=param)
    try:
        return xgr().Grammar.from_json_schema(json.dumps(schema), any_whitespace=not compact, strict_mode=True)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its reason
        raise _refuse(param, "JSON schema", exc, where) from None


def body_grammar(spec: StructuredOutputsParams) -> Any:
    """The answer's own grammar for every kind but tool_calls."""
    x = xgr()
    compact = spec.disable_any_whitespace
    if spec.json is not None:
        return json_schema(spec.json, "structured_outputs.json", compact)
    if spec.json_object:
        return json_schema({"type": "object"}, "structured_outputs.json_object", compact)
    if spec.regex is not None:
        try:
            return x.Grammar.from_regex(spec.regex)
        except Exception as exc:
            raise _refuse("structured_outputs.regex", "regular expression", exc) from None
    if spec.choice is not None:
        return x.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(c) for c in spec.choice))
    if spec.grammar is not None:
        text = spec.grammar
        try:
            return x.Grammar.from_ebnf(text) if "::=" in text else x.Grammar.from_lark(text)
        except Exception as exc:
            raise _refuse("structured_outputs.grammar", "grammar (EBNF with `root ::= ...`, or Lark)", exc) from None
    raise InvalidArgumentError(f"structured_outputs kind {spec.kind!r} has no body grammar", param="structured_outputs")


# -- ATEM tool calls ----------------------------------------------------------------------------


def tool_functions(tools: Any, param: str = "tools") -> list[dict[str, Any]]:
    """The `function` objects of OpenAI tool definitions (already checked by engine/chat.py
    for requests; checked again here for offline callers)."""
    out = []
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgumentError(
                f"{param}[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param=param
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise InvalidArgumentError(f"{param}[{i}].function.parameters must be a JSON schema object", param=param)
        out.append(dict(fn))
    if not out:
        raise InvalidArgumentError(f"{param} must name at least one tool", param=param)
    return out


def _value_grammar(schema: Any, param: str, compact: bool, where: str) -> Any:
    x = xgr()
    if isinstance(schema, Mapping) and schema.get("type") == "string":
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]) and schema["enum"]:
            return x.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(v) for v in schema["enum"]))
        if isinstance(schema.get("pattern"), str):
            try:
                return x.Grammar.from_regex(schema["pattern"])
            except Exception as exc:
                raise _refuse(param, "string pattern", exc, where) from None
        return x.Grammar.from_ebnf(_RAW_STRING)
    return json_schema(schema if isinstance(schema, (Mapping, bool)) else {}, param, compact, where)


def _optional(grammar: Any) -> Any:
    return xgr().Grammar.union(grammar, literal(""))


_DEF_KEYS = ("$defs", "definitions")


def _resolve(schema: Any, root: Mapping[str, Any]) -> Any:
    """`schema` with a local `$ref` ("#/$defs/X", "#/definitions/X") at its top replaced by
    what it points to in `root` (the schema's other keys kept); other schemas as they are."""
    for _ in range(16):  # a chain of references, never a cycle
        ref = schema.get("$ref") if isinstance(schema, Mapping) else None
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return schema
        target: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, Mapping) else None
        if not isinstance(target, Mapping):
            return schema
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _with_defs(schema: Any, root: Mapping[str, Any]) -> Any:
    """A property's schema with the root's `$defs` / `definitions`, so that its references
    resolve when it is compiled on its own."""
    if not isinstance(schema, Mapping):
        return schema
    return {**{k: root[k] for k in _DEF_KEYS if k in root and k not in schema}, **schema}


def atem_body(fn: Mapping[str, Any], compact: bool, param: str = "tools") -> Any:
    """One ATEM call to `fn` (an OpenAI `function` object), parameters per its schema (local
    `$ref`s into the schema's `$defs` resolve, at the root and in each property)."""
    name = fn["name"]
    root = fn.get("parameters") or {}
    schema = _resolve(root, root)
    props = schema.get("properties") or {}
    if not isinstance(props, Mapping):
        raise InvalidArgumentError(f"{param}: {name}.parameters.properties must be an object", param=param)
    required = [k for k in schema.get("required") or () if k in props]
    order = required + [k for k in props if k not in required]
    parts = [literal(f'<atem:function_calls>\n<atem:invoke name="{name}">\n')]
    for key in order:
        one = x_concat(
            literal(f'<atem:parameter name="{key}">'),
            _value_grammar(
                _with_defs(_resolve(props[key], root), root),
                param,
                compact,
                f"{param}: {name}.parameters.properties.{key}",
            ),
            literal("</atem:parameter>\n"),
        )
        parts.append(one if key in required else _optional(one))
    parts.append(literal("</atem:invoke>\n</atem:function_calls>"))
    return x_concat(*parts)


def x_concat(*grammars: Any) -> Any:
    return xgr().Grammar.concat(*grammars)


def with_header(prefix: str, bodies: Mapping[str, Any]) -> Any:
    """`prefix RECIPIENT <|message|> BODY` for each (recipient, body): the answer's header
    and body in one grammar. prefix is " to=" for the first message of a turn (the prompt
    ends with `<|start|>assistant`) and "assistant to=" after the model's own `<|start|>`."""
    alternatives = [x_concat(literal(f"{prefix}{recipient}{MESSAGE}"), body) for recipient, body in bodies.items()]
    return alternatives[0] if len(alternatives) == 1 else xgr().Grammar.union(*alternatives)
