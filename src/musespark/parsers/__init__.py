"""Output parsers: `--reasoning-parser` and `--tool-call-parser` (standard library only).

factory = get_parser_factory(args.reasoning_parser, "reasoning")   # ValueError if unknown
parser = factory(reasoning=True, tools=auto_tools, tool_names=tool_schemas_from_openai(tools))
for text in deltas: send(parser.feed(text))
send(parser.finish(finish_reason))
"""

from __future__ import annotations

from typing import Literal

from .muse import (
    MuseOutputParser,
    ParsedDelta,
    ParsedMessage,
    ReasoningTokenCounter,
    assemble,
    resolve_finish_reason,
)
from .muse_tools import ToolCall, ToolCallDelta, default_tool_call_id, tool_schemas_from_openai

ParserKind = Literal["reasoning", "tool"]

# name → parser class; one class does both jobs, so both kinds share the registry.
PARSERS: dict[str, type[MuseOutputParser]] = {"muse": MuseOutputParser, "musespark1x": MuseOutputParser}


def get_parser_factory(name: str, kind: ParserKind) -> type[MuseOutputParser]:
    """The parser class for `--reasoning-parser NAME` / `--tool-call-parser NAME`."""
    if kind not in ("reasoning", "tool"):
        raise ValueError(f"unknown parser kind {kind!r}; expected 'reasoning' or 'tool'")
    try:
        return PARSERS[name]
    except KeyError:
        supported = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown {kind} parser {name!r}; supported: {supported}") from None


__all__ = [
    "PARSERS",
    "MuseOutputParser",
    "ParsedDelta",
    "ParsedMessage",
    "ReasoningTokenCounter",
    "ToolCall",
    "ToolCallDelta",
    "assemble",
    "default_tool_call_id",
    "get_parser_factory",
    "resolve_finish_reason",
    "tool_schemas_from_openai",
]
