"""The `ngram` proposer (prompt lookup decoding): copy what followed the last time the
sequence's current ending appeared.

For the longest n in [prompt_lookup_max .. prompt_lookup_min] whose suffix n-gram of the
request's tokens occurred earlier, propose the tokens that followed its most recent
earlier occurrence, at most `num_tokens` of them (they may run into the suffix itself).
When that occurrence is too close to the end to supply `num_tokens` (a periodic tail such
as "ab ab ab": the most recent match overlaps the suffix), the earliest occurrence is used
instead, as vLLM's ngram proposer always does.

Each request keeps an incremental index: n-gram (a tuple) -> end of its most recent and of
its earliest occurrence that has a following token. Invariants: after `_extend(state, tokens)`,
every n-gram ending at e <= len(tokens) - 1 is indexed (the suffix itself, ending at
len(tokens), is not), so a hit is always an earlier occurrence; a step costs
O((max - min + 1) * new tokens), independent of the sequence length. Tokens only ever
grow (preemption keeps them), so the index stays valid; a shorter sequence rebuilds it.
No hidden states are read (`aux_layers` is empty).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .proposer import Proposal, ProposalRequest, Proposer


@dataclass
class _Index:
    num_indexed: int = 0  # every n-gram ending at e < num_indexed is in last_end
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    first_end: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramProposer(Proposer):
    aux_layers: tuple[int, ...] = ()

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max or num_speculative_tokens < 1:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                f"({prompt_lookup_max}) and num_speculative_tokens >= 1 ({num_speculative_tokens})"
            )
        self.k = num_speculative_tokens
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self._index: dict[str, _Index] = {}

    def _extend(self, state: _Index, tokens: Sequence[int]) -> None:
        """Index every n-gram ending at e for e in (num_indexed - 1, len(tokens) - 1]."""
        end = len(tokens) - 1  # the last end that has a following token
        if state.num_indexed > end + 1:  # the sequence got shorter: start over
            state.num_indexed, state.last_end, state.first_end = 0, {}, {}
        first = max(state.num_indexed, 1)
        if first > end:
            return
        lo, hi, last, earliest = self.lo, self.hi, state.last_end, state.first_end
        window = list(tokens[max(0, first - hi) : end])
        base = max(0, first - hi)
        for e in range(first, end + 1):
            for n in range(lo, min(hi, e) + 1):
                key = tuple(window[e - n - base : e - base])
                last[key] = e
                earliest.setdefault(key, e)
        state.num_indexed = end + 1

    def lookup(self, tokens: Sequence[int], num_tokens: int, state: _Index | None = None) -> list[int]:
        """The drafts for `tokens` (at most num_tokens); [] when no suffix n-gram recurs."""
        if state is None:
            state = _Index()
        self._extend(state, tokens)
        length = len(tokens)
        tail = list(tokens[max(0, length - self.hi) :])
        for n in range(min(self.hi, length - 1), self.lo - 1, -1):
            key = tuple(tail[len(tail) - n :])
            e = state.last_end.get(key)
            if e is not None:
                if length - e < num_tokens:
                    e = state.first_end[key]
                return list(tokens[e : min(e + num_tokens, length)])
        return []

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            state = self._index.get(r.request_id)
            if state is None:
                state = self._index[r.request_id] = _Index()
            if r.num_tokens <= 0:
                self._extend(state, r.token_ids)
                out.append(Proposal([]))
            else:
                out.append(Proposal(self.lookup(r.token_ids, min(r.num_tokens, self.k), state)))
        return out

    def drop(self, request_id: str) -> None:
        self._index.pop(request_id, None)
