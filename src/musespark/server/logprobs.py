"""OpenAI's logprobs blocks, from the engine's per-token `Logprob` entries ({token id:
Logprob}, the chosen token's included; ranked alternatives have `rank` set).

* completion logprobs: {tokens, token_logprobs, top_logprobs, text_offset}; with `echo` the
  first chunk also covers the prompt, whose first token has none (nothing predicts it).
* chat logprobs: {content: [{token, logprob, bytes, top_logprobs}]}.
* `scoring_fields`: vLLM's prompt_logprobs and return_token_ids on a completion choice.

A token's name is its entry's `decoded_token`, else the tokenizer's decoding of it (no
tokenizer: "token_id:N").
"""

from __future__ import annotations

from typing import Any

from ..engine.outputs import Logprob, RequestOutput
from ..engine.tokenizer import Tokenizer
from .chat_fields import prompt_logprobs_body
from .protocol import CompletionRequest


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)


def _engine_order(token_id: int, entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """vLLM's order of a position's candidates: the sampled token first, then the ranked
    alternatives (each token once)."""
    first = [(token_id, entry[token_id])] if token_id in entry else []
    return first + [(t, lp) for t, lp in _ranked(entry) if t != token_id]


class LogprobFormatter:
    """Formats logprobs for one server's tokenizer (None: a model without one). With
    `as_token_ids` (--return-tokens-as-token-ids; a request's return_tokens_as_token_ids
    overrides it) every token is named "token_id:N"."""

    def __init__(self, tokenizer: Tokenizer | None, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def for_request(self, as_token_ids: bool | None) -> LogprobFormatter:
        if as_token_ids is None or as_token_ids == self.as_token_ids:
            return self
        return LogprobFormatter(self.tokenizer, as_token_ids)

    def token_name(self, token_id: int, entry: dict[int, Logprob]) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        lp = entry.get(token_id)
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        tok = self.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"token_id:{token_id}"

    def completion(
        self, entries: list[dict[int, Logprob] | None] | None, ids: list[int], offset: int, top: int | None = None
    ) -> dict[str, Any] | None:
        """OpenAI's completion logprobs of `ids`, whose entries are `entries` (same length; a
        None entry, the first prompt token's, gives null logprobs); each position's
        top_logprobs are vLLM's: the sampled token and the `top` best, `top` + 1 at most;
        text offsets count from `offset`."""
        if entries is None:
            return None
        tokens, chosen, tops, offsets = [], [], [], []
        for token_id, entry in zip(ids, entries):
            name = self.token_name(token_id, entry or {})
            offsets.append(offset)
            offset += len(name)
            tokens.append(name)
            if entry is None:
                chosen.append(None)
                tops.append(None)
                continue
            chosen.append(max(entry[token_id].logprob, -9999.0))
            keep = None if top is None else top + 1
            ranked = _engine_order(token_id, entry)[:keep]
            tops.append({self.token_name(t, entry): max(lp.logprob, -9999.0) for t, lp in ranked})
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}

    def completion_choice(
        self, req: CompletionRequest, out: RequestOutput, entries: list | None, ids: list[int], first: bool
    ) -> dict[str, Any] | None:
        """A completion choice's logprobs; with echo, the first chunk's also cover the prompt."""
        if entries is None:
            return None
        if req.echo and first and out.prompt_logprobs is not None:
            entries = out.prompt_logprobs + entries
            ids = out.prompt_token_ids + ids
        return self.completion(entries, ids, 0, req.logprobs)

    def chat(
        self, entries: list[dict[int, Logprob]] | None, ids: list[int], top: int | None = None
    ) -> dict[str, Any] | None:
        """OpenAI's chat logprobs of `ids`, whose entries are `entries` (same length): per token
        its entry and vLLM's top_logprobs, the first `top` candidates in vLLM's order (the
        sampled token first; `top` None: all of them)."""
        if entries is None:
            return None
        content = []
        for token_id, entry in zip(ids, entries):
            name = self.token_name(token_id, entry)
            content.append(
                {
                    "token": name,
                    "logprob": max(entry[token_id].logprob, -9999.0),
                    "bytes": list(name.encode()),
                    "top_logprobs": [
                        {
                            "token": self.token_name(t, entry),
                            "logprob": max(lp.logprob, -9999.0),
                            "bytes": list(self.token_name(t, entry).encode()),
                        }
                        for t, lp in _engine_order(token_id, entry)[:top]
                    ],
                }
            )
        return {"content": content}


def scoring_fields(
    req: CompletionRequest, out: RequestOutput, choice: dict[str, Any], token_ids: list[int]
) -> dict[str, Any]:
    """`choice` with vLLM's token_ids, prompt_logprobs ({token id: {logprob, rank,
    decoded_token}} per prompt token) and prompt_token_ids: null unless asked for."""
    choice["token_ids"] = list(token_ids) if req.return_token_ids else None
    choice["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs, req.prompt_logprobs)
    choice["prompt_token_ids"] = out.prompt_token_ids if req.return_token_ids else None
    return choice
