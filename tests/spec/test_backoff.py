"""The per-request back-off of speculation (engine/spec_decode/backoff.py), step by step."""

from musespark.engine.spec_decode import backoff
from musespark.engine.spec_decode.backoff import Backoff


def run(b: Backoff, steps: int, accept: bool, budget: int = 4) -> list[int]:
    """Each step's allowance; every allowed draft is verified, all accepted or none."""
    allowed = []
    for _ in range(steps):
        n = b.allowance("r", budget)
        allowed.append(n)
        if n:
            b.record("r", n, n if accept else 0)
    return allowed


def test_a_new_request_drafts_fully_until_it_misses_twice():
    b = Backoff()
    assert run(b, 3, accept=True) == [4, 4, 4]
    assert run(b, backoff.MISSES, accept=False) == [4] * backoff.MISSES
    assert b.allowance("r", 4) == 0  # backing off now


def test_failed_probes_come_further_apart_and_draft_one_token():
    b = Backoff()
    run(b, backoff.MISSES, accept=False)
    allowed = run(b, 8 + 16 + 32 + 64 + 64, accept=False)
    probes = [i for i, n in enumerate(allowed) if n]
    assert all(allowed[i] == 1 for i in probes)
    gaps = [later - earlier for earlier, later in zip([-1, *probes], probes)]
    assert gaps == [8, 16, 32, 64, 64]  # doubling, capped at PROBE_MAX


def test_an_accepted_probe_ends_the_back_off():
    b = Backoff()
    run(b, backoff.MISSES, accept=False)
    run(b, 7, accept=False)  # idle steps before the first probe
    assert run(b, 1, accept=True) == [1]
    assert run(b, 3, accept=True) == [4, 4, 4]


def test_requests_are_independent_and_dropped():
    b = Backoff()
    run(b, backoff.MISSES, accept=False)
    assert b.allowance("other", 3) == 3
    b.drop("r")
    assert b.allowance("r", 4) == 4
    assert b.allowance("r", 0) == 0


def test_rests_next_foretells_a_step_without_drafts():
    """Before a step in which the request has no drafts, `rests_next` says whether it is backing
    off and gets no drafts the step after (the engine then withholds that step's rows from the
    proposer, and need not export them): probes rejected and accepted, back-offs ended and begun."""
    b = Backoff()
    n, probes, rests = 4, 0, 0
    for _ in range(400):
        if n:  # a step verifying n drafts: full drafts are rejected, every third probe is accepted
            probe = b.backing_off("r")
            probes += probe
            b.record("r", n, n if probe and probes % 3 == 0 else 0)
            n = b.allowance("r", 4)
        else:
            resting = b.rests_next("r")
            n = b.allowance("r", 4)
            assert resting == (b.backing_off("r") and n == 0)
            rests += resting
    assert probes > 6 and rests > 200
    assert not Backoff().rests_next("new")  # a new request drafts
