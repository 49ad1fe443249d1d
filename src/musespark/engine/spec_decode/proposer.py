"""The proposer seam: what the engine hands a drafter each step, and what it gets back.

The engine core owns verification and rollback (once, for every method); a proposer only
guesses the next tokens of each request. A proposer that reads the target's residual
stream (dspark) names the decoder layers it needs in `aux_layers`; the runner then exports
the fp32 stream after each of those layers (the tensor entering the next layer) for every
token the target computed, and passes the rows of the valid (accepted or prefilled)
positions in `ProposalRequest.hidden` — except at the steps between probes of a request
backing off (`speculator.py`), whose rows it withholds: a proposer takes positions it was
never given rows for as a gap in its context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftKVSpec:
    """A proposer's own KV layers: per layer K and V [num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    lookahead: int  # positions its group holds past the target's (scratch rows of one proposal)

    def bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


@dataclass
class ProposalRequest:
    request_id: str
    token_ids: Sequence[int]  # every token of the request so far; the last one is the anchor,
    #                           sampled but not yet run through the target
    context_start: int  # position of hidden's first row; positions >= context_start that the
    #                     proposer saw before are invalid now (rejected drafts, preemption) and are replaced
    hidden: torch.Tensor | None  # [n, len(aux_layers) * H] fp32, positions [context_start, context_start + n),
    #                              layers in ascending order; None when aux_layers is empty, or when the
    #                              engine withholds the step's rows (a request backing off that drafts
    #                              nothing next step): positions never given rows are a gap
    num_tokens: int  # propose at most this many (0: update state only, e.g. a prefill chunk)
    block_table: list[int] | None = None  # the proposer's KV group's block table (with `kv_spec`), read-only


@dataclass
class Proposal:
    token_ids: list[int]  # at most num_tokens drafts, in order
    probs: torch.Tensor | None = None  # [len(token_ids), V] fp32 draft distribution q per position,
    #                                    or None for a deterministic draft (q one-hot on each token)


class Proposer(ABC):
    aux_layers: tuple[int, ...] = ()  # decoder layer indices whose output stream the target exports
    probe_interval: int = 16  # steps to the first probe of a request backing off (backoff.py)
    kv_spec: DraftKVSpec | None = None  # K/V of its own, held in the engine's KV cache

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> None:
        """Take the engine's tensors for `kv_spec` (per layer K, V); only called when it is set."""
        raise NotImplementedError(f"{type(self).__name__} declares no kv_spec")

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One Proposal per request, in order."""

    def drop(self, request_id: str) -> None:  # noqa: B027 - stateless proposers keep nothing
        """Forget a finished, aborted or preempted request's state."""
