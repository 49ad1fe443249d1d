"""ATEM tool calls inside Muse tool channels, parsed incrementally (MUSE_CHAT §3, §4.5-4.7).

    <atem:function_calls>            (optional trigger, ignored)
    <atem:invoke name="NAME">        a call; its name is streamed as soon as this tag closes
    <atem:parameter name="K">V</atem:parameter>   arguments grow by `"K": json` as each closes
    </atem:invoke>                   the call's arguments close with `}`

Invariants:
* `arguments` of a call is always a JSON object text, valid for any input: non-finite numbers
  (NaN, Infinity, 1e999) and undecodable values are kept as raw strings.
* Per feed, work is O(len(text) + longest tag): held back is at most a proper prefix of a tag.
* A call whose body ends before `</atem:invoke>` (max_tokens, a new message) is closed with the
  parameters completed so far, so its streamed arguments stay valid JSON.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

INVOKE_OPEN, INVOKE_CLOSE = "<atem:invoke", "</atem:invoke>"
PARAM_OPEN, PARAM_CLOSE = "<atem:parameter", "</atem:parameter>"
_BOUNDARY_TAGS = (INVOKE_OPEN, PARAM_OPEN)  # must be followed by a non-word character
_MAX_TAG = max(len(t) for t in (INVOKE_OPEN, INVOKE_CLOSE, PARAM_OPEN, PARAM_CLOSE)) + 1
_NAME_ATTR = re.compile(r'\bname="([^"]*)"')


@dataclass
class ToolCallDelta:
    """OpenAI streaming shape: id and name on a call's first delta, then argument text pieces."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object text, always valid JSON


def default_tool_call_id() -> str:
    return "chatcmpl-tool-" + secrets.token_hex(8)


def tool_schemas_from_openai(tools: list[dict] | None) -> dict[str, dict | None]:
    """OpenAI `tools` → {function name: parameters schema}, the form `tool_names` accepts."""
    out: dict[str, dict | None] = {}
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters")
    return out


def normalize_name(name: str, registered: Mapping[str, object] | None) -> str:
    """A registered name is kept; `A.A` → `A` when A is registered; else passed through (§3)."""
    if registered is None or name in registered:
        return name
    h = len(name) // 2
    if len(name) % 2 == 1 and name[h] == "." and name[:h] == name[h + 1 :] and name[:h] in registered:
        return name[:h]
    log.warning("tool call to unregistered function %r", name)
    return name


def _local_ref(schema: object, root: object) -> object:
    """`schema` with a local "#/..." `$ref` at its top followed into `root` (a few hops)."""
    for _ in range(16):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#/"):
            break
        target = root
        for part in ref[2:].split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            break
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _is_string_param(schema: object, key: str) -> bool:
    """True only for `"type": "string"` exactly; a type list or anyOf does not count (§3).
    Local `$ref`s (at the root, or a property's) are followed."""
    resolved = _local_ref(schema, schema)
    props = resolved.get("properties") if isinstance(resolved, dict) else None
    prop = _local_ref(props.get(key), schema) if isinstance(props, dict) else None
    return isinstance(prop, dict) and prop.get("type") == "string"


def _reject_constant(s: str) -> float:
    raise ValueError(f"non-finite JSON constant {s}")


def _finite_float(s: str) -> float:
    f = float(s)
    if not math.isfinite(f):
        raise ValueError(f"non-finite number {s}")
    return f


def _dumps(v: object) -> str:
    s = json.dumps(v, ensure_ascii=False)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from a JSON escape: keep them escaped
        s = json.dumps(v)
    return s


def value_json(raw: str, keep_raw: bool) -> str:
    """The JSON text of one parameter value: raw string if string-typed, else decoded JSON with
    the raw string as fallback (also for NaN, ±Infinity and overflowing numbers, §4.5)."""
    if not keep_raw:
        try:
            v = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
            return _dumps(v)
        except (ValueError, RecursionError):
            pass
    return _dumps(raw)


class AtemParser:
    """Incremental ATEM parser for the text of tool-channel bodies; returns ToolCallDeltas."""

    def __init__(
        self,
        schemas: Mapping[str, object] | None,
        id_factory: Callable[[], str],
        parallel_tool_calls: bool = True,
    ) -> None:
        self.schemas = schemas
        self.id_factory = id_factory
        self.parallel = parallel_tool_calls
        self.num_calls = 0  # calls started (indices handed out)
        self.ops = 0
        self._state = "out"  # out | itag | invoke | ptag | value
        self._hold = ""
        self._tag: list[str] = []
        self._value: list[str] = []
        self._key: str | None = None
        self._call: int | None = None  # index of the open call, None if skipped or none
        self._name = ""
        self._seen: set[str] = set()

    # -- public --------------------------------------------------------------------------
    def feed(self, text: str) -> list[ToolCallDelta]:
        s = self._hold + text if self._hold else text
        self._hold = ""
        out: list[ToolCallDelta] = []
        cache: dict[str, int] = {}
        pos, n = 0, len(s)
        while pos <= n:
            st = self._state
            if st in ("itag", "ptag"):
                j = s.find(">", pos)
                self.ops += (n if j < 0 else j) - pos + 1
                if j < 0:
                    self._tag.append(s[pos:])
                    break
                self._tag.append(s[pos:j])
                pos = j + 1
                m = _NAME_ATTR.search("".join(self._tag))
                self._tag = []
                if st == "itag":
                    self._start_call(m.group(1) if m else None, out)
                    self._state = "invoke"
                else:
                    self._key = m.group(1) if m else None
                    self._value = []
                    self._state = "value"
                continue
            needles = {"out": (INVOKE_OPEN,), "invoke": (PARAM_OPEN, INVOKE_CLOSE)}.get(st, (PARAM_CLOSE, INVOKE_CLOSE))
            j, tag = self._find(s, pos, needles, cache)
            if tag is None:  # hold back a possible tag start, drop/keep the rest
                k = j
                if st == "value":
                    self._value.append(s[pos:k])
                self._hold = s[k:]
                break
            if st == "value":
                self._value.append(s[pos:j])
            pos = j + len(tag)
            if tag == INVOKE_OPEN:
                self._state, self._tag = "itag", []
            elif tag == PARAM_OPEN:
                self._state, self._tag = "ptag", []
            elif tag == PARAM_CLOSE:
                self._add_param(out)
                self._state = "invoke"
            else:  # INVOKE_CLOSE (an unterminated parameter before it is dropped)
                self._close_call(out)
                self._state = "out"
        return out

    def end(self) -> list[ToolCallDelta]:
        """The tool body ended (new message, end of stream): close an open call as it stands."""
        out: list[ToolCallDelta] = []
        if self._state in ("invoke", "ptag", "value"):
            self._close_call(out)
        self._state, self._hold, self._tag, self._value = "out", "", [], []
        return out

    # -- scanning ------------------------------------------------------------------------
    def _find(self, s: str, pos: int, needles: tuple[str, ...], cache: dict[str, int]) -> tuple[int, str | None]:
        """Earliest complete tag at or after pos → (index, tag); else (start of the held tail, None)."""
        n = len(s)
        best, best_tag = n, None
        for nd in needles:
            j = cache.get(nd, -2)
            if j == -2 or (j >= 0 and j < pos):
                j = s.find(nd, pos)
                while j >= 0 and nd in _BOUNDARY_TAGS and j + len(nd) < n and _is_word(s[j + len(nd)]):
                    j = s.find(nd, j + 1)
                self.ops += (n if j < 0 else j) - pos + 1
                cache[nd] = j
            if j >= 0 and j < best and not (nd in _BOUNDARY_TAGS and j + len(nd) == n):
                best, best_tag = j, nd
        if best_tag is not None:
            return best, best_tag
        # Every tag has one `<`, at its start: only the last `<` can begin a held tail.
        k = s.rfind("<", max(pos, n - _MAX_TAG))
        self.ops += _MAX_TAG
        if k >= 0 and any(nd.startswith(s[k:]) for nd in needles):
            return k, None
        return n, None

    # -- calls ---------------------------------------------------------------------------
    def _start_call(self, name: str | None, out: list[ToolCallDelta]) -> None:
        self._call, self._seen = None, set()
        if not name or (not self.parallel and self.num_calls > 0):
            return  # an invoke without a name is skipped; parallel_tool_calls=false keeps the first
        self._name = normalize_name(name, self.schemas)
        self._call = self.num_calls
        self.num_calls += 1
        out.append(ToolCallDelta(self._call, self.id_factory(), self._name, "{"))

    def _add_param(self, out: list[ToolCallDelta]) -> None:
        key, raw = self._key, "".join(self._value)
        self._value = []
        if self._call is None or not key or key in self._seen:
            return  # first occurrence of a key wins (vLLM: the last), so arguments can stream
        schema = self.schemas.get(self._name) if self.schemas is not None else None
        piece = _dumps(key) + ": " + value_json(raw, _is_string_param(schema, key))
        out.append(ToolCallDelta(self._call, None, None, (", " if self._seen else "") + piece))
        self._seen.add(key)

    def _close_call(self, out: list[ToolCallDelta]) -> None:
        if self._call is not None:
            out.append(ToolCallDelta(self._call, None, None, "}"))
        self._call, self._value = None, []


def _is_word(c: str) -> bool:
    return c.isalnum() or c == "_"
