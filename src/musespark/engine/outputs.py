"""What the engine hands back, in vLLM's shapes: `RequestOutput` with one
`CompletionOutput` per sample (`n` of them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str  # the whole completion so far
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per output token: the chosen one and the top-n
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    # What this step added (for streaming); the whole completion is in text/token_ids.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
