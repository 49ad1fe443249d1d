"""The Muse output parser: reasoning, content and tool calls from decoded text (MUSE_CHAT §3-§6).

One incremental pass serves both modes: `parse(text)` is by definition `feed(text)` + `finish()`
aggregated, so a stream, cut into any chunks, adds up to exactly the non-streaming message.

Routing of message bodies (by recipient, see `muse_reasoning.channel_of`):
    None / self          → reasoning (dropped when reasoning=False, as vLLM's tool parser does)
    user / commentary    → content; unframed output (no header at all) is content too
    developer, other roles → dropped
    any other recipient  → a tool channel: ATEM → tool_calls (tools=True); the body text is
                           content when tools=False; ATEM anywhere else is never a call
reasoning=False and tools=False is a passthrough: content is the raw text (vLLM with no parser).
Whitespace-only content is held back; it is dropped at the end if the turn made tool calls
(vLLM: content is null then), else released.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from .muse_reasoning import Channel, Framer
from .muse_tools import AtemParser, ToolCall, ToolCallDelta, default_tool_call_id


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


def assemble(deltas: Iterable[ParsedDelta]) -> ParsedMessage:
    """Aggregate stream deltas as a client would: text concatenated ("" → None), tool calls per
    index with id and name from their first delta and arguments concatenated."""
    reasoning, content = [], []
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        reasoning.append(d.reasoning)
        content.append(d.content)
        for t in d.tool_calls:
            if t.index not in calls:
                calls[t.index] = ToolCall(t.id or "", t.name or "", "")
            calls[t.index].arguments += t.arguments
    return ParsedMessage("".join(reasoning) or None, "".join(content) or None, [calls[i] for i in sorted(calls)])


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Join consecutive deltas of one call (id/name stay from the first)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None and d.name is None:
            out[-1].arguments += d.arguments
        else:
            out.append(ToolCallDelta(d.index, d.id, d.name, d.arguments))
    return out


class MuseOutputParser:
    """Incremental Muse reasoning + tool parser. Feed decoded text with special tokens kept.

    tool_names: the request's tool names, or a mapping name → JSON-schema `parameters` (see
    `tool_schemas_from_openai`), which also keeps string-typed parameters raw. None: no
    normalisation of names and every value is JSON-decoded."""

    def __init__(
        self,
        reasoning: bool,
        tools: bool,
        tool_names: Collection[str] | Mapping[str, object] | None = None,
        id_factory: Callable[[], str] | None = None,
        *,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoning, self.tools = reasoning, tools
        self._passthrough = not reasoning and not tools
        if tool_names is None or isinstance(tool_names, Mapping):
            schemas = tool_names
        else:
            schemas = {n: None for n in tool_names}
        self._atem = AtemParser(schemas, id_factory or default_tool_call_id, parallel_tool_calls)
        self._framer = Framer(self)
        self._r: list[str] = []
        self._c: list[str] = []
        self._tc: list[ToolCallDelta] = []
        self._ws_hold: list[str] = []
        self._content_live = False
        self._fed = False
        self._finished = False
        self.reasoning_ended = False  # a content or tool body has begun (structured outputs may start)

    # -- public --------------------------------------------------------------------------
    def feed(self, delta_text: str) -> ParsedDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._fed = True
        if self._passthrough:
            return ParsedDelta("", delta_text, [])
        self._framer.feed(delta_text)
        return self._take()

    def finish(self, finish_reason: str | None = None) -> ParsedDelta:
        """Flush everything held back. An open call ("length" or not) is closed with the
        parameters completed so far; it never becomes content."""
        if self._finished:
            return ParsedDelta()
        self._finished = True
        if self._passthrough:
            return ParsedDelta()
        self._framer.flush()
        if self._ws_hold and self._atem.num_calls == 0:
            self._c.extend(self._ws_hold)
        self._ws_hold = []
        return self._take()

    def parse(self, text: str, finish_reason: str | None = None) -> ParsedMessage:
        """Non-streaming: feed(text) + finish(finish_reason), aggregated. Use a fresh parser."""
        if self._fed or self._finished:
            raise RuntimeError("parse() needs a fresh parser")
        msg = assemble([self.feed(text), self.finish(finish_reason)])
        if not self.reasoning:
            msg.reasoning = None
        return msg

    @property
    def num_tool_calls(self) -> int:
        return self._atem.num_calls

    @property
    def ops(self) -> int:
        """Characters examined so far (for the linear-work test)."""
        return self._framer.total_ops + self._atem.ops

    # -- Sink (called by the Framer) ---------------------------------------------------
    def begin(self, channel: Channel, recipient: str | None) -> None:
        if channel in ("content", "tool"):
            self.reasoning_ended = True

    def text(self, text: str) -> None:
        ch = self._framer.channel
        if ch == "reasoning":
            if self.reasoning:
                self._r.append(text)
        elif ch == "content" or (ch == "tool" and not self.tools):
            self._content(text)
        elif ch == "tool":
            self._tc.extend(self._atem.feed(text))

    def end(self) -> None:
        if self._framer.channel == "tool" and self.tools:
            self._tc.extend(self._atem.end())

    # -- internals -----------------------------------------------------------------------
    def _content(self, text: str) -> None:
        if self._content_live:
            self._c.append(text)
        elif text.isspace():
            self._ws_hold.append(text)
        else:
            self._c.extend(self._ws_hold)
            self._c.append(text)
            self._ws_hold, self._content_live = [], True

    def _take(self) -> ParsedDelta:
        d = ParsedDelta("".join(self._r), "".join(self._c), _merge(self._tc))
        self._r, self._c, self._tc = [], [], []
        return d


class ReasoningTokenCounter:
    """`usage.completion_tokens_details.reasoning_tokens` (§6): feed each generated token's text
    (special tokens kept); a token counts when it is read inside a reasoning body and ends no
    message. Headers and markers never count; like vLLM, a header written straight after a
    reasoning body without `<|eom|>` (` to=X`, §4.1) counts."""

    def __init__(self) -> None:
        self._p = MuseOutputParser(reasoning=True, tools=False)
        self.count = 0

    def add(self, token_text: str) -> bool:
        f = self._p._framer
        before = f.in_body and f.channel == "reasoning"
        seen = f.messages
        self._p.feed(token_text)
        counted = before and f.in_body and f.messages == seen
        self.count += counted
        return counted


def resolve_finish_reason(
    engine_reason: str | None, has_tool_calls: bool, named_tool_choice: bool = False
) -> str | None:
    """`tool_calls` if there are calls, the engine said `stop` and the choice is not a named
    function; `length` and others are kept (§3 step 4)."""
    if has_tool_calls and engine_reason == "stop" and not named_tool_choice:
        return "tool_calls"
    return engine_reason
