"""One turn's output cut into blocks, in the order the model wrote them (the Responses and
Messages APIs both render from them): `TurnBlocks.feed` turns each step's output into "open",
"delta" and "close" events on blocks of kind reasoning, text or call (a new block whenever
the kind, or the tool call, changes). Without an output parser all text is one text block.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.outputs import CompletionOutput, RequestOutput
from .serving import Job, Serving


@dataclass
class Block:
    """One output item: `kind` is "reasoning", "text" or "call"; `text` is the reasoning or
    text, or the call's arguments (JSON text)."""

    kind: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""
    call_index: int | None = None
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)


Event = tuple[str, Block, str]  # ("open" | "delta" | "close", block, delta text)


async def run_into_blocks(serving: Serving, jobs: list[Job], blocks: TurnBlocks) -> RequestOutput:
    """Run one turn's job to the end, feeding each step's parsed output into `blocks`; the
    final output (the non-streamed Responses and Messages replies are built from it)."""
    last = None
    gen = serving.run(jobs)
    try:
        async for _, out in gen:
            last = out
            blocks.feed(out.outputs[0])
    finally:
        await gen.aclose()
    blocks.close()
    assert last is not None
    return last


class TurnBlocks:
    """Cuts one sequence's per-step output into consecutive blocks: `feed(step)` returns the
    ("open", block), ("delta", block, text) and ("close", block) events it causes, `close()`
    the last "close". Without an output parser all text is one text block."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None

    @staticmethod
    def _pieces(c: CompletionOutput) -> Iterator[tuple[str, str, Any]]:
        if c.delta_parsed is None:
            if c.delta_text:
                yield "text", c.delta_text, None
            return
        d = c.delta_parsed
        if d.reasoning:
            yield "reasoning", d.reasoning, None
        if d.content:
            yield "text", d.content, None
        for call in d.tool_calls:
            yield "call", call.arguments, call

    def feed(self, c: CompletionOutput) -> list[Event]:
        events: list[Event] = []
        for kind, text, call in self._pieces(c):
            b = self._open
            if b is None or b.kind != kind or (call is not None and call.index != b.call_index):
                events.extend(self.close())
                b = Block(kind, len(self.blocks))
                if call is not None:
                    b.call_index, b.call_id, b.name = call.index, call.id or "", call.name or ""
                self.blocks.append(b)
                self._open = b
                events.append(("open", b, ""))
            if text:
                b.text += text
                events.append(("delta", b, text))
        return events

    def close(self) -> list[Event]:
        b, self._open = self._open, None
        return [] if b is None else [("close", b, "")]
