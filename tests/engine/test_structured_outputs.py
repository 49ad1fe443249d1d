"""Structured outputs through the engine with the bundled model: every output of 100
generated JSON schemas validates with `jsonschema`; regular expressions and choices hold
under sampling; n > 1 sequences each follow their own grammar; a grammar runs beside
logit_bias; an uncompilable constraint is refused before the engine sees it."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from json_schemas import gen_object

from musespark import LLM, SamplingParams
from musespark.errors import InvalidArgumentError
from musespark.sampling_params import StructuredOutputsParams

SCHEMAS = [gen_object(random.Random(seed)) for seed in range(100)]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024)


def test_one_hundred_generated_schemas_validate(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=s))
        for s in SCHEMAS
    ]
    outs = llm.generate(["Reply in JSON:\n"] * len(SCHEMAS), params)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_sampled_json_validates_too(llm):
    schemas = SCHEMAS[:16]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs={"json": s})
        for i, s in enumerate(schemas)
    ]
    for schema, out in zip(schemas, llm.generate(["{"] * len(schemas), params)):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


@pytest.mark.parametrize(
    "pattern", [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z]{2,8}\.", r"[A-Z][a-z]{1,6} [0-9]{1,2}(st|nd|rd|th)"]
)
def test_regex_outputs_match(llm, pattern):
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs={"regex": pattern}) for i in range(6)
    ]
    for out in llm.generate(["Answer:"] * 6, params):
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_choice_and_n_sequences(llm):
    choices = ["red", "green", "blue sky", 'say "hi"\n']
    (out,) = llm.generate(
        ["Pick a color:"],
        SamplingParams(n=8, temperature=1.5, seed=7, max_tokens=10, structured_outputs={"choice": choices}),
    )
    texts = [c.text for c in out.outputs]
    assert all(t in choices for t in texts) and len(set(texts)) > 1


def test_json_object_and_grammar(llm):
    # Any JSON object: strings are unbounded, so a small model may run to max_tokens inside one;
    # every output that stopped is a JSON object, and most stop.
    outs = llm.generate(
        ["x = "] * 4,
        [
            SamplingParams(temperature=0.8, seed=s, max_tokens=400, structured_outputs={"json_object": True})
            for s in range(4)
        ],
    )
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 3
    assert all(isinstance(json.loads(c.text), dict) for c in stopped)
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    (out,) = llm.generate(
        ["x = "], SamplingParams(temperature=0.8, seed=1, max_tokens=40, structured_outputs={"grammar": ebnf})
    )
    assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", out.outputs[0].text)


def test_logit_bias_cannot_break_the_grammar(llm):
    tok = llm.get_tokenizer()
    brace = tok.encode("}", add_special_tokens=False)[0]
    x = tok.encode("x", add_special_tokens=False)[0]
    # +100 on "x" wins wherever the grammar allows it, never where it does not.
    (out,) = llm.generate(
        ["{"],
        SamplingParams(
            temperature=0,
            max_tokens=60,
            logit_bias={x: 100.0, brace: -100.0},
            structured_outputs={"regex": r"\{x{1,5}\}"},
        ),
    )
    assert re.fullmatch(r"\{x{1,5}\}", out.outputs[0].text)


def test_uncompilable_schema_is_refused_before_the_engine(llm):
    steps = llm.engine.num_steps
    with pytest.raises(InvalidArgumentError) as err:
        llm.generate(
            ["x"],
            SamplingParams(
                structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}
            ),
        )
    assert err.value.param == "structured_outputs.json"
    assert llm.engine.num_steps == steps and not llm.engine.has_unfinished_requests()
