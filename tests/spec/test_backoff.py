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
