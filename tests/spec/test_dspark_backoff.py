"""The DSpark draft in the engine while its request backs off (engine/spec_decode/backoff.py):
between probes the draft's context is not updated and the target exports no streams; the
skipped positions are a gap in the draft's context; a probe's draft has the row just before
its anchor; greedy outputs stay those of plain decoding across the back-off, rejected and
accepted probes, and the drafting resumed after them."""

import pytest
from test_spec_decode import dspark_config

from musespark import LLM, SamplingParams

OPTIONS = dict(dtype="float32", enable_prefix_caching=False)
SWITCH = 24  # drafts are wrong while fewer tokens than this were generated, right afterwards
#             (after the first draft, before the first probe)


@pytest.fixture(scope="module")
def spec():
    s = dspark_config()
    if s is None:
        pytest.skip("the dspark proposer or the bundled draft is not in this checkout")
    return s


def test_a_backing_off_request_does_not_update_the_draft_context(spec):
    params = SamplingParams(temperature=0.0, max_tokens=112, ignore_eos=True)
    base_llm = LLM(**OPTIONS)
    prompt = base_llm.get_tokenizer().encode("def add(a, b):\n    return a + b\n\n\nclass Point:\n")
    plain = base_llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    sequence = prompt + plain

    llm = LLM(speculative_config=spec, **OPTIONS)
    core = llm.engine.core
    speculator, proposer = core.speculator, core.speculator.proposer
    vocab = llm.engine.config.vocab_size
    steps = []  # per step: {"drafts", "resting", "exported", "rows"} (rows: context rows the draft computed)
    gaps = []  # the draft context's gaps at each draft

    features = proposer.draft.context_features

    def counted(aux):
        steps[-1]["rows"] += aux.shape[0]
        return features(aux)

    proposer.draft.context_features = counted
    propose = proposer.propose

    def steered(requests):
        """The real proposer (context update, block pass), its drafts then replaced: wrong ones
        first (every draft rejected: the request backs off), the true continuation after SWITCH."""
        out = propose(requests)
        for r, proposal in zip(requests, out):
            n = len(r.token_ids)
            if proposal.token_ids:
                seq = proposer._seqs[r.request_id]  # the draft reads the row just before its anchor
                assert seq.length == n - 1 and seq.known(seq.length)[-1] == n - 2
                gaps.append(list(seq.gaps))
                right = sequence[n : n + len(proposal.token_ids)]
                proposal.token_ids = right if n - len(prompt) >= SWITCH else [(t + 1) % vocab for t in right]
        return out

    proposer.propose = steered
    schedule, forward = core.scheduler.schedule, core.runner.forward

    def watched_schedule():
        batch = schedule()
        if batch.requests:
            (request,), drafts = batch.requests, batch.spec_token_ids[0] if batch.spec_token_ids else []
            resting = not drafts and speculator.backoff.rests_next(request.request_id)
            steps.append(dict(drafts=len(drafts), resting=resting, exported=False, rows=0))
        return batch

    def watched_forward(inputs, score=None, aux_layers=()):
        steps[-1]["exported"] = bool(aux_layers)
        return forward(inputs, score, aux_layers)

    core.scheduler.schedule, core.runner.forward = watched_schedule, watched_forward
    got = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    assert got == plain

    resting = [s for s in steps if s["resting"]]
    assert len(resting) >= 16
    assert all(not s["exported"] and s["rows"] == 0 for s in resting)  # nothing computed for the draft
    assert all(s["exported"] and s["rows"] > 0 for s in steps if not s["resting"] and s["drafts"] == 0)
    # back-off: a one-token first draft rejected, then probes of one token (rejected before
    # SWITCH, the last accepted), then drafts doubling up to the full k
    drafts = [s["drafts"] for s in steps if s["drafts"]]
    k = spec["num_speculative_tokens"]
    accepted_probe = drafts.index(2) - 1
    assert accepted_probe >= 1  # the first draft rejected before it
    assert drafts[: accepted_probe + 1] == [1] * (accepted_probe + 1)
    assert drafts[accepted_probe + 1 : accepted_probe + 4] == [2, 4, k]
    # one gap per rest before a probe (the step just before each probe hands its row over)
    assert gaps[0] == [] and len(gaps[-1]) == accepted_probe
    stats = llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens >= k
