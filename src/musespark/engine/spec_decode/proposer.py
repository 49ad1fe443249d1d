"""The proposer seam: what the engine hands a drafter each step, and what it gets back.

The engine core owns verification and rollback (once, for every method); a proposer only
guesses the next tokens of each request. A proposer that reads the target's residual
stream (dspark) names the decoder layers it needs in `aux_layers`; the runner then exports
the fp32 stream after each of those layers (the tensor entering the next layer) for every
token the target computed, and passes the rows of the valid (accepted or prefilled)
positions in `ProposalRequest.hidden`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class ProposalRequest:
    request_id: str
    token_ids: Sequence[int]  # every token of the request so far; the last one is the anchor,
    #                           sampled but not yet run through the target
    context_start: int  # position of hidden's first row; positions >= context_start that the
    #                     proposer saw before are invalid now (rejected drafts, preemption) and are replaced
    hidden: torch.Tensor | None  # [n, len(aux_layers) * H] fp32, positions [context_start, context_start + n),
    #                              layers in ascending order; None when aux_layers is empty
    num_tokens: int  # propose at most this many (0: update state only, e.g. a prefill chunk)


@dataclass
class Proposal:
    token_ids: list[int]  # at most num_tokens drafts, in order
    probs: torch.Tensor | None = None  # [len(token_ids), V] fp32 draft distribution q per position,
    #                                    or None for a deterministic draft (q one-hot on each token)


class Proposer(ABC):
    aux_layers: tuple[int, ...] = ()  # decoder layer indices whose output stream the target exports

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """One Proposal per request, in order."""

    def drop(self, request_id: str) -> None:  # noqa: B027 - stateless proposers keep nothing
        """Forget a finished, aborted or preempted request's state."""
