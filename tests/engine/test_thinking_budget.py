"""thinking_token_budget on the Muse channels (engine/thinking_budget.py), token by token with
the bundled tokenizer: reasoning bodies are counted across messages, then the end of the
reasoning message and the answer's header are forced, one token per step."""

from __future__ import annotations

import pytest

from musespark.engine.args import bundled_model_path
from musespark.engine.thinking_budget import ANSWER_HEADER, plan_for
from musespark.engine.tokenizer import Tokenizer
from musespark.layers.sampler import LogitAdjustments


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(bundled_model_path())


def forced(state, vocab: int) -> int | None:
    """The one token the state allows next, or None when it allows all."""
    adjust = LogitAdjustments(1, vocab)
    state.mask(adjust, 0)
    if adjust.tensor is None:
        return None
    (allowed,) = (adjust.tensor[0] == 0).nonzero().flatten().tolist()
    return allowed


def run(tok, state, text: str) -> list[int | None]:
    """Feed `text`'s tokens; what was forced before each one."""
    out = []
    for t in tok.encode(text, add_special_tokens=False):
        out.append(forced(state, 4100))
        state.accept(t)
    return out


def test_budget_counts_reasoning_then_forces_the_answer_header(tok):
    plan = plan_for(tok)
    state = plan.new_state(3)
    assert run(tok, state, " to=self<|message|>a b") == [None] * len(tok.encode(" to=self<|message|>a b"))
    state.accept(tok.encode(" c", add_special_tokens=False)[0])  # the third reasoning token
    want = [tok.token_to_id("<|eom|>"), *tok.encode(ANSWER_HEADER, add_special_tokens=False)]
    got = []
    for _ in want:
        got.append(forced(state, 4100))
        state.accept(got[-1])
    assert got == want and forced(state, 4100) is None  # the answer is free


def test_budget_is_for_the_whole_turn_and_zero_ends_at_once(tok):
    state = plan_for(tok).new_state(2)
    run(tok, state, " to=self<|message|>a<|eom|><|start|>assistant to=user<|message|>hello<|eom|>")
    assert state.used == 1  # only reasoning bodies count
    run(tok, state, "<|start|>assistant to=self<|message|>")
    assert forced(state, 4100) is None
    state.accept(tok.encode(" b", add_special_tokens=False)[0])
    assert forced(state, 4100) == tok.token_to_id("<|eom|>")
    zero = plan_for(tok).new_state(0)
    run(tok, zero, " to=self<|message|>")
    assert forced(zero, 4100) == tok.token_to_id("<|eom|>")
    zero.accept(tok.token_to_id("<|eot|>"))  # another constraint won: the forcing is dropped
    assert forced(zero, 4100) is None


def test_no_channel_markers_no_plan():
    assert plan_for(None) is None
