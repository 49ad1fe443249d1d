"""Speculative decoding: proposers (ngram, dspark), verification and rollback (engine core).

* `config.py`     SpeculativeConfig: vLLM's --speculative-config keys, checked at start-up.
* `proposer.py`   the seam: ProposalRequest -> Proposal; a drafter implements `Proposer`.
* `ngram.py`      prompt lookup (method "ngram").
* `rejection.py`  verification: greedy matching and rejection sampling, exact by construction.
* `speculator.py` the engine core's side: builds the proposer, asks it for drafts after each
                  step, counts acceptance (vLLM's spec_decode metrics).

Rollback lives in `Scheduler.update` (num_computed_tokens set back over rejected drafts);
the runner computes an anchor and its drafts as one chunk (see model_runner.py).
Not speculating: requests with structured outputs (a grammar), and any pipeline-parallel
engine (refused at start-up). Tensor parallel works with ngram (the verification rows are
ordinary sample rows for every rank); dspark with tensor parallel is refused at start-up.
"""
