"""Structured outputs, token by token, without a model: grammars compiled for a tokenizer
with the Muse markers, and `GrammarState` following scripted Muse turns (where the grammar
applies, what each phase allows), plus the refusals that name their field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from musespark.engine.args import bundled_model_path
from musespark.engine.tokenizer import Tokenizer
from musespark.errors import InvalidArgumentError
from musespark.layers.sampler import LogitAdjustments
from musespark.sampling_params import SamplingParams, StructuredOutputsParams
from musespark.structured import StructuredOutputManager, unpack_bitmask

MARKERS = ["<|start|>", "<|message|>", "<|eom|>", "<|eot|>"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The bundled tokenizer with the Muse markers (added if this checkout's lacks them)."""
    import tokenizers

    src = bundled_model_path()
    d = tmp_path_factory.mktemp("muse_tok")
    backend = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    backend.add_special_tokens(MARKERS)
    backend.save(str(d / "tokenizer.json"))
    shutil.copy(src / "tokenizer_config.json", d / "tokenizer_config.json")
    eot = backend.token_to_id("<|eot|>")
    return Tokenizer.from_dir(d, extra_eos_ids=[1, eot])


@pytest.fixture(scope="module")
def manager(tok):
    return StructuredOutputManager(tok, tok.vocab_size)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def allowed(state, V: int) -> torch.Tensor:
    """Bool [V]: what `state` lets the sampler pick now."""
    adjust = LogitAdjustments(1, V)
    state.mask(adjust, 0)
    return torch.ones(V, dtype=torch.bool) if adjust.tensor is None else adjust.tensor[0] > float("-inf")


def walk(state, tokens: list[int], V: int) -> None:
    for t in tokens:
        assert allowed(state, V)[t], f"token {t} refused in phase {state.phase}"
        state.accept(t)


def test_unpack_bitmask_matches_xgrammar_layout():
    words = torch.tensor([0b1011, -(2**31)], dtype=torch.int32)  # tokens 0, 1, 3 and 63
    got = unpack_bitmask(words, 64).nonzero().flatten().tolist()
    assert got == [0, 1, 3, 63]


def test_reasoning_is_free_then_header_and_json_are_constrained(tok, manager):
    V = tok.vocab_size
    start, message, eom, eot = (tok.token_to_id(m) for m in MARKERS)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    compiled = manager.compile(StructuredOutputsParams(json=schema, final_message_only=True))
    state = compiled.new_state([1, eot])
    # Header and reasoning: anything goes except ending the turn.
    free = allowed(state, V)
    assert not free[eot] and not free[1] and free.sum() == V - 2
    walk(state, ids(tok, " to=self") + [message] + ids(tok, "Think {not json} here."), V)
    assert state.phase == "free" and allowed(state, V)[eom]
    walk(state, [eom], V)
    only = allowed(state, V)
    assert only.sum() == 1 and only[start]  # the answer's header must follow
    walk(state, [start], V)
    assert state.phase == "grammar"
    header = ids(tok, "assistant to=user") + [message]
    first = allowed(state, V)
    assert first[header[0]] and not first[ids(tok, "{")[0]] and not first[eot]
    walk(state, header, V)
    mid = allowed(state, V)
    assert not mid[message] and not mid[start] and not mid[eot]  # no markers inside the answer
    walk(state, ids(tok, '{"n": 42}'), V)
    end = allowed(state, V)
    assert end[eot] and end[1] and end.sum() == 2
    walk(state, [eot], V)
    assert state.phase == "done"


def test_direct_answer_header_switches_to_the_body_grammar(tok, manager):
    V = tok.vocab_size
    message, eot = tok.token_to_id("<|message|>"), tok.token_to_id("<|eot|>")
    compiled = manager.compile(StructuredOutputsParams(choice=["yes", "no"], final_message_only=True))
    state = compiled.new_state([eot])
    walk(state, ids(tok, " to=user") + [message], V)
    now = allowed(state, V)
    assert state.phase == "grammar" and now[ids(tok, "yes")[0]] and not now[ids(tok, "maybe")[0]]
    walk(state, ids(tok, "no") + [eot], V)


def test_without_final_message_only_the_grammar_starts_at_the_first_token(tok, manager):
    V = tok.vocab_size
    compiled = manager.compile(StructuredOutputsParams(regex=r"[0-9]{3}"))
    state = compiled.new_state([1])
    first = allowed(state, V)
    assert first[ids(tok, "1")[0]] and not first[ids(tok, " to")[0]]
    walk(state, ids(tok, "123") + [1], V)


def test_tool_grammar_forces_an_atem_call_with_typed_parameters(tok, manager):
    V = tok.vocab_size
    start, message, eom, eot = (tok.token_to_id(m) for m in MARKERS)
    compiled = manager.compile(StructuredOutputsParams(tool_calls=[WEATHER], final_message_only=True))
    state = compiled.new_state([eot])
    walk(state, ids(tok, " to=self") + [message] + ids(tok, "Need weather.") + [eom, start], V)
    call = (
        'assistant to=get_weather<|message|><atem:function_calls>\n<atem:invoke name="get_weather">\n'
        '<atem:parameter name="city">Paris</atem:parameter>\n'
    )
    head, tail = call.split("<|message|>")
    walk(state, ids(tok, head) + [message] + ids(tok, tail), V)
    # days is optional and an integer in [1, 7]: "9" is refused, "3" allowed, so is closing.
    now = allowed(state, V)
    assert now[ids(tok, "</")[0]] or now[ids(tok, "<")[0]]
    walk(state, ids(tok, '<atem:parameter name="days">'), V)
    digits = allowed(state, V)
    assert digits[ids(tok, "3")[0]] and not digits[ids(tok, "9")[0]] and not digits[ids(tok, '"')[0]]
    walk(state, ids(tok, "3</atem:parameter>\n</atem:invoke>\n</atem:function_calls>") + [eot], V)
    assert state.phase == "done"


def test_doubled_tool_recipient_is_recognised_in_the_first_header(tok, manager):
    V = tok.vocab_size
    message, eot = tok.token_to_id("<|message|>"), tok.token_to_id("<|eot|>")
    compiled = manager.compile(StructuredOutputsParams(tool_calls=[WEATHER], final_message_only=True))
    state = compiled.new_state([eot])
    walk(state, ids(tok, " to=get_weather.get_weather") + [message], V)
    assert state.phase == "grammar"
    now = allowed(state, V)
    assert now[ids(tok, "<atem")[0]] and not now[ids(tok, "hello")[0]]


def test_compiled_grammars_are_cached(manager):
    a = manager.compile(StructuredOutputsParams(json={"type": "object"}))
    b = manager.compile(StructuredOutputsParams(json={"type": "object"}))
    c = manager.compile(StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=False))
    assert a is b and a is not c


@pytest.mark.parametrize(
    "spec, param",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "structured_outputs.json"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(regex="(ab"), "structured_outputs.regex"),
        (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
        (
            dict(
                tool_calls=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}},
                        },
                    }
                ]
            ),
            "tools",
        ),
    ],
)
def test_uncompilable_constraints_name_their_field(manager, spec, param):
    with pytest.raises(InvalidArgumentError) as err:
        manager.compile(StructuredOutputsParams(**spec))
    assert err.value.param == param
    assert "cannot compile" in str(err.value) or "not valid JSON" in str(err.value)
    assert "/project/" not in str(err.value)  # no engine source paths leak


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(json={}, regex="a"), dict(choice=[]), dict(choice=["a", 3]), dict(regex=""), dict(json=3)]
)
def test_structured_outputs_params_are_checked(kwargs):
    with pytest.raises(InvalidArgumentError) as err:
        StructuredOutputsParams(**kwargs)
    assert err.value.param.startswith("structured_outputs")


def test_sampling_params_take_a_dict_and_refuse_unknown_keys():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(structured_outputs={"chioce": ["a"]})
    assert "chioce" in str(err.value)
    json.dumps(p.structured_outputs.choice)
