"""The engine core's side of speculative decoding: build the proposer, ask it for drafts
after every step, forget finished requests, count acceptance.

Flow of one step (the core calls `after_step` once the scheduler has applied the step):
the scheduler verified each request's drafts (rows anchor + k, `rejection.py`), appended
the accepted ones plus one token and rolled `num_computed_tokens` back over the rejected
ones. Here every request of the step that is still running gets a `ProposalRequest`: its
tokens, the rows of the positions it validly computed this step (aux streams when the
proposer reads them), how many drafts it may have next step and, for a proposer with K/V
of its own, its block table in the draft's KV group (`draft_group`). Drafts land in
`Request.spec_token_ids` and are consumed by the next `schedule()`.

Who speculates: a running request in decode without a grammar (structured outputs do not
speculate: the grammar would have to advance through drafts), with drafts capped so that
max_tokens and max_model_len still hold if every draft is accepted. Requests mid-prefill
get `num_tokens=0` (the proposer only updates its state).

Back-off (`backoff.py`): a request whose drafts keep failing drafts only on probe steps,
one token each, further and further apart. Invariant: the proposer is given a request's rows
of a step unless the request is backing off and drafts nothing next step; the positions of
those steps are a gap in its context (dspark masks them out of the draft's attention, as for
a prefix-cache hit of the target; the runner keeps no stream past its step, so a probe does
not catch up on them). So between probes a request costs its proposer nothing (it is not even asked), and a draft
always has the rows of the step just before it. `needs_aux` tells the core before a step
whether any of its rows can be given (`Backoff.rests_next` foretells the withheld ones); a
step in which none can exports no streams and runs as a plain decode step. Outputs never
depend on any of this (drafts only change speed).

Counters follow vLLM's spec_decode metrics: a draft = one request-step that verified >= 1
draft token; accepted tokens count accepted drafts (not the bonus token); per position j,
the drafts whose first j + 1 tokens were all accepted.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import InvalidArgumentError
from ..model_runner import ModelRunnerOutput
from ..request import Request, RequestStatus
from ..scheduler import ScheduledBatch
from .backoff import Backoff
from .config import SpeculativeConfig
from .ngram import NgramProposer
from .proposer import ProposalRequest, Proposer


def build_proposer(config: SpeculativeConfig, target: torch.nn.Module, target_path: Path) -> Proposer:
    """The proposer of `config.method` (dspark: the draft at `config.model`, else the target's directory)."""
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "dspark":
        try:
            from .dspark import DSparkProposer
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.endswith("spec_decode.dspark"):
                raise InvalidArgumentError(
                    "speculative_config: method 'dspark' is not available in this build "
                    "(musespark.engine.spec_decode.dspark is missing)",
                    param="speculative_config",
                ) from None
            raise
        path = config.model if config.model is not None else str(target_path)
        if config.draft_sample_method == "greedy":
            return DSparkProposer.load(path, target, config.num_speculative_tokens)
        try:  # probabilistic drafts: the proposer returns q with them (Proposal.probs)
            return DSparkProposer.load(
                path, target, config.num_speculative_tokens, draft_sample_method=config.draft_sample_method
            )
        except TypeError as exc:
            raise InvalidArgumentError(
                f"speculative_config: this dspark proposer does not take "
                f"draft_sample_method={config.draft_sample_method!r} ({exc})",
                param="speculative_config",
            ) from None
    raise InvalidArgumentError(f"speculative_config: unknown method {config.method!r}", param="speculative_config")


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        vocab_size: int,
        max_model_len: int,
        draft_group: int | None = None,
    ) -> None:
        self.config = config
        self.draft_group = draft_group  # the proposer's KV group in the block tables (with its kv_spec)
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.backoff = Backoff(probe=proposer.probe_interval)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def drop(self, request_id: str) -> None:
        self.proposer.drop(request_id)
        self.backoff.drop(request_id)

    def _budget(self, request: Request) -> int:
        """Drafts this request may verify next step (0: it does not speculate)."""
        if request.grammar is not None or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        return max(
            0,
            min(
                self.config.num_speculative_tokens,
                request.max_tokens - len(request.output_token_ids) - 1,
                self.max_model_len - request.num_tokens - 1,
            ),
        )

    def needs_aux(self, batch: ScheduledBatch) -> bool:
        """Before `batch` runs: whether `after_step` may give the proposer any of its rows (not
        when every request has no drafts this step and `Backoff.rests_next`)."""
        if not self.proposer.aux_layers:
            return False
        drafts = batch.spec_token_ids or [()] * len(batch.requests)
        return any(d or not self.backoff.rests_next(r.request_id) for r, d in zip(batch.requests, drafts))

    def after_step(
        self, batch: ScheduledBatch, out: ModelRunnerOutput, computed_before: list[int], finished: list[Request]
    ) -> None:
        """Count acceptance, forget finished and preempted requests, propose next drafts."""
        asks: list[ProposalRequest] = []
        targets: list[Request] = []
        for i, request in enumerate(batch.requests):
            drafts = batch.spec_token_ids[i] if batch.spec_token_ids else ()
            tokens = out.verified.get(request.request_id)
            if drafts and tokens is not None:
                accepted = len(tokens) - 1
                self.num_drafts += 1
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += accepted
                for j in range(accepted):
                    self.accepted_per_pos[j] += 1
                self.backoff.record(request.request_id, len(drafts), accepted)
            if request.status is not RequestStatus.RUNNING:
                continue
            start = computed_before[i]
            budget = self.backoff.allowance(request.request_id, self._budget(request))
            hidden = None  # withheld while backing off with no drafts next step (see the module doc)
            if out.aux is not None and (budget > 0 or not self.backoff.backing_off(request.request_id)):
                row = out.first_row[request.request_id]
                hidden = out.aux[row : row + request.num_computed_tokens - start]
            elif budget == 0 and self.backoff.backing_off(request.request_id):
                # resting between probes: nothing to give or ask (the proposer takes the
                # positions it next sees past its context as a gap, or catches up on tokens)
                request.spec_token_ids, request.spec_probs = [], None
                continue
            table = None if self.draft_group is None else batch.block_tables[i][self.draft_group]
            asks.append(ProposalRequest(request.request_id, request.token_ids, start, hidden, budget, table))
            targets.append(request)
        # last: a request that finished in this step had its drafts recorded above
        for request in [*batch.preempted, *finished]:
            self.drop(request.request_id)
        if not asks:
            return
        for ask, request, proposal in zip(asks, targets, self.proposer.propose(asks)):
            ids = list(proposal.token_ids[: ask.num_tokens])
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                raise RuntimeError(f"proposer drafted token ids outside [0, {self.vocab_size}): {ids}")
            request.spec_token_ids = ids
            request.spec_probs = None if proposal.probs is None or not ids else proposal.probs[: len(ids)]

    def stats(self) -> dict[str, int | tuple[int, ...]]:
        """`EngineStats` fields."""
        return dict(
            num_speculative_tokens=self.config.num_speculative_tokens,
            spec_num_drafts=self.num_drafts,
            spec_num_draft_tokens=self.num_draft_tokens,
            spec_num_accepted_tokens=self.num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.accepted_per_pos),
        )
