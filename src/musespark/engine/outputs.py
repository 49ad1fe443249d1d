"""What the engine hands back, in vLLM's shapes: `RequestOutput` with one
`CompletionOutput` per sample (`n` of them).

Invariants (the output processor builds these once per step, in O(new tokens)):
* `token_ids`, `logprobs` and `prompt_token_ids` are the sequence's own lists, shared by every
  output of the request and appended to as it advances: they are complete once `finished`.
  While streaming, read the `delta_*` fields (fresh per step) for what the step added,
  or copy the lists you keep.
* `text` is the completion's text as of this step; `delta_text` is what this step added.
* A `Logprob` is built once per generated token and never rebuilt.
* With an output parser (reasoning channels, tool calls), `delta_parsed` is what this step's
  text parsed into and, once finished, `parsed` is the whole message (the aggregate of the
  deltas, so streamed and non-streamed agree); `num_reasoning_tokens` counts as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..parsers import ParsedDelta, ParsedMessage, ToolCall


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str  # the whole completion so far
    token_ids: list[int]  # live: see the module docstring
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # live; per output token: the chosen one and the top-n
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    # What this step added (for streaming); the whole completion is in text/token_ids/logprobs.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None
    # Only with an output parser (see the module docstring).
    delta_parsed: ParsedDelta | None = None
    parsed: ParsedMessage | None = None
    num_reasoning_tokens: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None

    # The parsed view (None / [] without a parser): what the server returns as reasoning, content, tool_calls.
    @property
    def reasoning(self) -> str | None:
        return self.parsed.reasoning if self.parsed is not None else None

    @property
    def content(self) -> str | None:
        return self.parsed.content if self.parsed is not None else None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self.parsed.tool_calls) if self.parsed is not None else []


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token, its logprob and the top ones
    # (None for the first token, which nothing predicts), as vLLM gives them; live while the
    # prompt is being computed, complete from the first generated token on.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # time.monotonic() when the engine first scheduled any of the request's sequences (None
    # until then); with the arrival time it gives vLLM's queue / prefill / inference times.
    scheduled_time: float | None = None
