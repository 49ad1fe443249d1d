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
from .protocol import CompletionRequest


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)


class LogprobFormatter:
    """Formats logprobs for one server's tokenizer (None: a model without one)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def token_name(self, token_id: int, entry: dict[int, Logprob]) -> str:
        lp = entry.get(token_id)
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        tok = self.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"token_id:{token_id}"

    def completion(
        self, entries: list[dict[int, Logprob] | None] | None, ids: list[int], offset: int, top: int | None = None
    ) -> dict[str, Any] | None:
        """OpenAI's completion logprobs of `ids`, whose entries are `entries` (same length; a
        None entry, the first prompt token's, gives null logprobs); at most `top` top ones;
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
            chosen.append(entry[token_id].logprob)
            tops.append({self.token_name(t, entry): lp.logprob for t, lp in _ranked(entry)[:top]})
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

    def chat(self, entries: list[dict[int, Logprob]] | None, ids: list[int]) -> dict[str, Any] | None:
        """OpenAI's chat logprobs of `ids`, whose entries are `entries` (same length)."""
        if entries is None:
            return None
        content = []
        for token_id, entry in zip(ids, entries):
            name = self.token_name(token_id, entry)
            content.append(
                {
                    "token": name,
                    "logprob": entry[token_id].logprob,
                    "bytes": list(name.encode()),
                    "top_logprobs": [
                        {
                            "token": self.token_name(t, entry),
                            "logprob": lp.logprob,
                            "bytes": list(self.token_name(t, entry).encode()),
                        }
                        for t, lp in _ranked(entry)
                    ],
                }
            )
        return {"content": content}


def scoring_fields(
    req: CompletionRequest, out: RequestOutput, choice: dict[str, Any], token_ids: list[int]
) -> dict[str, Any]:
    """`choice` with vLLM's prompt_logprobs ({token id: {logprob, rank, decoded_token}} per
    prompt token) and return_token_ids (prompt_token_ids, token_ids) added when asked for."""
    if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = [
            None
            if e is None
            else {
                str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in e.items()
                if lp.rank is None or lp.rank <= req.prompt_logprobs
            }
            for e in out.prompt_logprobs
        ]
    if req.return_token_ids:
        choice["prompt_token_ids"] = out.prompt_token_ids
        choice["token_ids"] = list(token_ids)
    return choice
