"""Per-request back-off for speculation whose drafts keep failing.

A drafted step verifies 1 + k rows per request; when the drafts are rejected that work buys
nothing, and on a model bound by its arithmetic (small, fp32, one thread) every extra row
costs. So each request keeps:

* `rate`: a running acceptance rate (accepted / drafted, weight 1 - DECAY on the newest
  draft, starting at 1, so a new request drafts fully);
* `misses`: how many verified drafts in a row accepted nothing.

A request backs off while `rate < RATE` or `misses >= MISSES`: it drafts only on probe steps,
one token each (the cheapest verification), `interval` steps apart. A probe that is accepted
ends the back-off (rate lifted to RATE, misses 0); one that is not doubles the interval, up to
PROBE_MAX. Text nothing predicts then costs about a plain decode, and a run that becomes
predictable again is found within `interval` steps. Outputs never depend on any of this:
drafts only change speed.

Between probes a request also stops feeding its proposer (speculator.py): the rows of a step
after which it drafts nothing go nowhere, and `rests_next` says so before a step without
drafts, so that the runner need not even export them.
"""

from __future__ import annotations

from dataclasses import dataclass

RATE = 0.25
DECAY = 0.7
MISSES = 2
PROBE = 8
PROBE_MAX = 64


@dataclass
class _State:
    rate: float = 1.0
    misses: int = 0
    idle: int = 0  # steps since the last probe, while backing off
    interval: int = PROBE  # steps between probes, while backing off

    @property
    def backing_off(self) -> bool:
        return self.rate < RATE or self.misses >= MISSES


class Backoff:
    def __init__(self) -> None:
        self._state: dict[str, _State] = {}

    def drop(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` >= 1 tokens, `accepted` of them accepted."""
        st = self._state.setdefault(request_id, _State())
        probe = st.backing_off  # drafted while backing off: it was a probe
        st.rate = DECAY * st.rate + (1 - DECAY) * accepted / drafted
        st.misses = 0 if accepted else st.misses + 1
        if probe and accepted:
            st.rate, st.interval, st.idle = max(st.rate, RATE), PROBE, 0
        elif probe:
            st.interval = min(2 * st.interval, PROBE_MAX)

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
        """How many of `budget` drafts the request may have next step: all of them, or while
        backing off 0 between probes and 1 on a probe. Call once per step per request."""
        st = self._state.get(request_id)
        if st is None or not st.backing_off or budget == 0:
            return budget
        st.idle += 1
        if st.idle < st.interval:
            return 0
        st.idle = 0
        return 1
