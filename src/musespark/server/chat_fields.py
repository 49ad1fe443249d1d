"""vLLM's chat-request extensions around the OpenAI fields: how many logprobs a chat request
asks for (`logprobs`, `top_logprobs`, `prompt_logprobs`, with vLLM's -1 and its checks), the
text `echo` puts before the answer, and the fields that are refused rather than ignored.

Rules (vLLM 0.33.0's):
* `top_logprobs` and `prompt_logprobs` are -1 (the whole vocabulary) or >= 0; any other
  negative value is a 400 naming the field. `top_logprobs` -1 or > 0 needs `logprobs`.
* -1 means the vocabulary size, which is then held to the server's logprob limit
  (--max-logprobs, at most the protocol's 20 here): over it is a 400 naming the field.
* `prompt_logprobs` (> 0 or -1) cannot be streamed.
* With `echo`, prompt logprobs default to `top_logprobs`; the final message's content is put
  before each choice's content when that message is the assistant's (the role answered).
* `use_beam_search: true` is a 400 naming the field: beam search is not implemented.
"""

from __future__ import annotations

from typing import Any

from .http import APIError
from .protocol import MAX_LOGPROBS, ChatCompletionRequest, CompletionRequest


def refuse_beam_search(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.use_beam_search:
        raise APIError(400, "use_beam_search is not supported: beam search is not implemented here", "use_beam_search")


def _limit(max_logprobs: int, vocab_size: int) -> int:
    """The most logprobs a request may ask for: --max-logprobs (-1: the vocabulary), never
    over the protocol's cap."""
    return min(vocab_size if max_logprobs == -1 else max_logprobs, MAX_LOGPROBS)


def _count(name: str, value: int, kind: str, vocab_size: int, limit: int) -> int:
    if value < -1:
        raise APIError(400, f"{name} must be a positive value or -1, got {value}", name)
    wanted = vocab_size if value == -1 else value
    if wanted > limit:
        raise APIError(400, f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: {limit}", name)
    return wanted


def chat_logprob_counts(
    req: ChatCompletionRequest, vocab_size: int, max_logprobs: int
) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) for the engine's SamplingParams, checked as vLLM checks them."""
    limit = _limit(max_logprobs, vocab_size)
    top = req.top_logprobs
    if top is not None and top < -1:
        raise APIError(400, f"top_logprobs must be a positive value or -1, got {top}", "top_logprobs")
    if top is not None and (top == -1 or top > 0) and not req.logprobs:
        raise APIError(400, "when using top_logprobs, logprobs must be set to true", "top_logprobs")
    logprobs = _count("top_logprobs", top or 0, "sample", vocab_size, limit) if req.logprobs else None
    prompt = req.prompt_logprobs
    if prompt is not None and req.stream and (prompt > 0 or prompt == -1):
        raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")
    if prompt is None and req.echo:
        prompt = top if top is not None else 0  # vLLM's top_logprobs default
    prompt_logprobs = None if prompt is None else _count("prompt_logprobs", prompt, "prompt", vocab_size, limit)
    return logprobs, prompt_logprobs


def echo_text(req: ChatCompletionRequest) -> str:
    """The text `echo` puts before the answer: the final message's content when it is an
    assistant message (parts joined by newlines), else ""."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    if last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def prompt_logprobs_body(entries: list[Any] | None, limit: int | None) -> list[Any] | None:
    """vLLM's prompt_logprobs: per prompt token {token id: {logprob, rank, decoded_token}} (the
    first token's is null), the token itself and its `limit` best alternatives; -inf is
    clamped to -9999.0 (JSON has no infinity)."""
    if entries is None or limit is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in e.items()
            if lp.rank is None or lp.rank <= limit
        }
        for e in entries
    ]


def chat_top(req: ChatCompletionRequest) -> int | None:
    """How many candidates each chat logprobs entry lists (None: all, for top_logprobs -1)."""
    return None if req.top_logprobs == -1 else (req.top_logprobs or 0)


def final_prompt_limit(req: ChatCompletionRequest) -> int | None:
    """The alternatives each prompt_logprobs entry lists: prompt_logprobs, else with echo
    top_logprobs; None when the request asked for none."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return (req.top_logprobs or 0) if req.echo else None
