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


def back_off(b: Backoff) -> None:
    """A new request whose first draft (one token) is rejected: it backs off."""
    assert run(b, 1, accept=False) == [backoff.START] == [1]
    assert b.backing_off("r")


def test_a_new_request_starts_with_one_token_and_doubles_on_full_acceptance():
    b = Backoff()
    assert run(b, 5, accept=True) == [1, 2, 4, 4, 4]  # capped by the step's budget
    assert run(b, 2, accept=True, budget=8) == [8, 8]


def test_partial_acceptance_keeps_halves_or_restarts_the_draft_size():
    b = Backoff()
    run(b, 4, accept=True, budget=8)  # size 8
    sizes = []
    for accepted in [4, 3, 1, 1, 0]:  # half or more: keep; less: halve; none: one token
        sizes.append(b.allowance("r", 8))
        b.record("r", sizes[-1], accepted)
    assert sizes == [8, 8, 4, 2, 2]
    assert b.allowance("r", 8) == 1 and not b.backing_off("r")
    b.record("r", 1, 0)  # a rejected one-token draft: back off
    assert b.backing_off("r") and b.allowance("r", 8) == 0


def test_failed_probes_come_further_apart_and_draft_one_token():
    b = Backoff()
    back_off(b)
    p = backoff.PROBE
    allowed = run(b, p + 4 * p + 16 * p + 2 * backoff.PROBE_MAX, accept=False)
    probes = [i for i, n in enumerate(allowed) if n]
    assert all(allowed[i] == 1 for i in probes)
    gaps = [later - earlier for earlier, later in zip([-1, *probes], probes)]
    assert gaps == [p, 4 * p, min(16 * p, backoff.PROBE_MAX), backoff.PROBE_MAX, backoff.PROBE_MAX]


def test_an_accepted_probe_ends_the_back_off():
    b = Backoff()
    back_off(b)
    assert run(b, backoff.PROBE - 1, accept=False) == [0] * (backoff.PROBE - 1)  # idle steps before the probe
    assert run(b, 1, accept=True) == [1]
    assert not b.backing_off("r")
    assert run(b, 3, accept=True) == [2, 4, 4]


def test_requests_are_independent_and_dropped():
    b = Backoff()
    back_off(b)
    assert b.allowance("other", 3) == 1  # a new request: one token first
    b.drop("r")
    assert not b.backing_off("r") and b.allowance("r", 4) == 1
    assert b.allowance("r", 0) == 0


def test_rests_next_foretells_a_step_without_drafts():
    """Before a step in which the request has no drafts, `rests_next` says whether it is backing
    off and gets no drafts the step after (the engine then withholds that step's rows from the
    proposer, and need not export them): probes rejected and accepted, back-offs ended and begun."""
    b = Backoff()
    n, probes, rests = 4, 0, 0
    for _ in range(1200):
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
    assert probes > 6 and rests > 900
    assert not Backoff().rests_next("new")  # a new request drafts


def test_the_probe_interval_is_the_proposers():
    """A proposer whose drafts cost a model pass (dspark) probes less often than a lookup."""
    from musespark.engine.spec_decode.dspark import DSparkProposer
    from musespark.engine.spec_decode.ngram import NgramProposer

    assert DSparkProposer.probe_interval > NgramProposer.probe_interval == backoff.PROBE
    b = Backoff(probe=DSparkProposer.probe_interval)
    back_off(b)
    allowed = run(b, 2 * DSparkProposer.probe_interval, accept=False)
    assert [i for i, n in enumerate(allowed) if n] == [DSparkProposer.probe_interval - 1]


def test_finished_requests_leave_no_back_off_state():
    """Every request that drafts gets a state; finishing (length, stop string) and aborting drop it,
    so a long-running server does not grow one per request it ever served."""
    from musespark import LLM, SamplingParams

    llm = LLM(
        enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    engine = llm.engine
    text = "one two three one two three one two three one"
    engine.add_request("length", text, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    engine.add_request("stop", text, SamplingParams(temperature=0.0, max_tokens=12, stop=["two"], ignore_eos=True))
    engine.add_request("abort", text, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    state = engine.core.speculator.backoff._state
    seen = set()
    for step in range(40):
        engine.step()
        seen |= set(state)
        if step == 3:
            engine.abort_request("abort")
        if not engine.has_unfinished_requests():
            break
    assert seen >= {"length", "abort"}  # they drafted
    assert state == {}
