"""A request as the scheduler sees it: token ids, progress counters and stop state.

Invariants: `token_ids == prompt_token_ids + output_token_ids`, and
`0 <= num_computed_tokens <= len(token_ids)`. A step computes the next n tokens of the
request; when that reaches `len(token_ids)`, the step samples one new token. A request
holds ids and counters only: text, stop strings and logprobs belong to the output
processor, blocks to the KV cache manager. Drafts (`spec_token_ids`) are never part of
`token_ids`: a verified draft is appended like any sampled token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved from params.max_tokens and max_model_len
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None  # the request's RNG for sampled (non-greedy) rows
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    scheduled_time: float | None = None  # time.monotonic() of the first admission (metrics: queue time)
    # structured.GrammarState (structured_outputs), thinking_budget.ThinkingBudget, or both chained
    grammar: Any = None
    cache_salt: str | None = None  # prefix-cache namespace: blocks are shared only within one salt
    # Speculative decoding: drafts proposed for the next step (after the last token, which
    # is the anchor); consumed by the next schedule(), cleared on preemption.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None  # [len(spec_token_ids), V] draft distribution, None: one-hot drafts

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.token_ids.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def check_token_stop(self, max_model_len: int) -> bool:
        """After a token is appended: finish on EOS, a stop token id or a length limit."""
        if self.is_finished:
            return True
        token = self.output_token_ids[-1]
        n_out = len(self.output_token_ids)
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and token in self.eos_token_ids:
                self.finish("stop")
                return True
            if token in self.params.stop_token_ids:
                self.finish("stop", token)
                return True
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            self.finish("length")
            return True
        return False
