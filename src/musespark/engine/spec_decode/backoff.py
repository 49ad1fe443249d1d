"""Per-request draft sizing and back-off for speculation.

A drafted step verifies 1 + k rows per request. When drafts are rejected that work buys
nothing, and on a model bound by its arithmetic or by its expert weights (a small MoE, one
thread: every extra row may route to other experts) each extra row costs nearly a decode
step. So each request's drafts are sized by what its last draft earned:

* a new request starts with `START` draft token (the cheapest check that its text is
  predictable at all; `Backoff(start=...)` for another size);
* a draft accepted in full doubles the next one; at least half accepted keeps its size;
  less than half halves it; none accepted drops it to one token;
* a one-token draft that is rejected starts the back-off: the request drafts only on probe
  steps, one token each, `interval` steps apart (first `PROBE`). A probe that is accepted
  ends the back-off (the next draft has two tokens); one that is not makes the interval
  `GROWTH` times longer, up to `PROBE_MAX`. `probe` is the proposer's (`Proposer.probe_interval`):
  a probe should cost a few percent of the steps it waits, and a draft that takes a model pass
  (dspark: about two target decode steps on a small model) costs more than a lookup (ngram).

So text that nothing predicts costs one rejected one-token check, then one probe every
probe, probe * GROWTH, ... steps, and predictable text reaches the full draft in a few
steps. Outputs never depend on any of this: drafts only change speed. The budget given to
`allowance` (num_speculative_tokens, max_tokens, max_model_len) caps every size.

Between probes a request also stops feeding its proposer (speculator.py): the rows of a step
after which it drafts nothing go nowhere, and `rests_next` says so before a step without
drafts, so that the runner need not even export them.
"""

from __future__ import annotations

from dataclasses import dataclass

START = 1
PROBE = 16  # the first probe interval of a proposer that names none (Proposer.probe_interval)
GROWTH = 4
PROBE_MAX = 256


@dataclass
class _State:
    size: int  # draft tokens the next draft may have (before the step's budget)
    interval: int = 0  # steps between probes; 0: not backing off
    idle: int = 0  # steps since the last probe, while backing off

    @property
    def backing_off(self) -> bool:
        return self.interval > 0


class Backoff:
    def __init__(self, start: int = START, probe: int = PROBE) -> None:
        if start < 1 or probe < 1:
            raise ValueError(f"start and probe must be >= 1, got {start} and {probe}")
        self.start = start  # a new request's first draft size
        self.probe = probe  # steps to the first probe once a request backs off
        self._state: dict[str, _State] = {}

    def drop(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` >= 1 tokens, `accepted` of them accepted."""
        st = self._state.setdefault(request_id, _State(self.start))
        if st.backing_off:  # drafted while backing off: it was a probe
            if accepted:
                st.interval, st.idle, st.size = 0, 0, 2 * drafted
            else:
                st.interval = min(GROWTH * st.interval, PROBE_MAX)
            return
        if accepted == drafted:
            st.size = 2 * drafted
        elif 2 * accepted >= drafted:
            st.size = drafted
        elif accepted:
            st.size = max(1, drafted // 2)
        elif drafted > 1:
            st.size = 1
        else:
            st.interval, st.idle = self.probe, 0

    def backing_off(self, request_id: str) -> bool:
        st = self._state.get(request_id)
        return st is not None and st.backing_off

    def rests_next(self, request_id: str) -> bool:
        """Before a step in which the request has no drafts: whether it is backing off and its
        `allowance` after the step is 0 whatever the budget. (No drafts, no `record`: that
        allowance adds 1 to `idle` and is 0 while `idle < interval`; keep the two in step.)"""
        st = self._state.get(request_id)
        return st is not None and st.backing_off and st.idle + 1 < st.interval

    def allowance(self, request_id: str, budget: int) -> int:
        """How many of `budget` drafts the request may have next step: up to its size, or while
        backing off 0 between probes and 1 on a probe. Call once per step per request."""
        if budget == 0:
            return 0
        st = self._state.setdefault(request_id, _State(self.start))
        if not st.backing_off:
            return min(budget, st.size)
        st.idle += 1
        if st.idle < st.interval:
            return 0
        st.idle = 0
        return 1
