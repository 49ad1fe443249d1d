"""The bundled tiny model speaks Muse (docs/muse_chat.md §1-§3): the four markers are single special
tokens, `<|eot|>` ends a turn, the checkpoint's chat template is the Muse template, and greedy
generation through the engine reasons, calls the offered tool with schema-valid JSON arguments,
and after the tool's result reasons again and answers in content. It copies the argument value
from the question (the city, the expression, the path) and restates the result (the tools'
results as the demo tools give them, musespark.apps.demo_tools).

What it does not do (its card says so): every value, every time (tools/muse_copy_data.py's
held-out tasks measure how often), nor a result whose digits repeat ("444" for 37 * 12: the
copy finds the same digit again and again and runs to max_tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from musespark import LLM, SamplingParams
from musespark.apps.demo_tools import DEMO_TOOLS, weather_result
from musespark.engine.args import bundled_model_path
from musespark.parsers import MuseOutputParser, tool_schemas_from_openai

tokenizers = pytest.importorskip("tokenizers")

MODEL_DIR = bundled_model_path()
TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "muse_chat_template.jinja"
MARKERS = {"<|start|>": 4096, "<|message|>": 4097, "<|eom|>": 4098, "<|eot|>": 4099}
EOT = 4099

WEATHER, CALCULATOR, READ_FILE = (DEMO_TOOLS[name] for name in ("get_weather", "calculator", "read_file"))

# (question, offered tools, expected tool, argument name, the value it must pass, tool result)
CASES = [
    (
        "What's the weather like in Berlin right now?",
        [CALCULATOR, WEATHER],
        "get_weather",
        "city",
        "Berlin",
        weather_result("Berlin", 12, "celsius", "cloudy"),
    ),
    ("Please compute 37 * 19 for me.", [CALCULATOR, READ_FILE, WEATHER], "calculator", "expression", "37 * 19", "703"),
    (
        "What's inside the file config/app.yaml?",
        [READ_FILE, WEATHER],
        "read_file",
        "path",
        "config/app.yaml",
        "port: 8080",
    ),
]
KWARGS = {"current_date": "2026-05-04", "reasoning_strength": "medium"}
GREEDY = SamplingParams(temperature=0, max_tokens=160, skip_special_tokens=False)


def test_markers_are_single_special_tokens():
    tok = tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    added = {t.content: (i, t.special) for i, t in tok.get_added_tokens_decoder().items()}
    for marker, i in MARKERS.items():
        assert added.get(marker) == (i, True), marker
        assert tok.encode(f"x{marker}y", add_special_tokens=False).ids[1] == i
        assert tok.encode(marker, add_special_tokens=False).ids == [i]
    assert tok.token_to_id("<|begin_of_text|>") == 0 and tok.token_to_id("<|end_of_text|>") == 1
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["text_config"]["vocab_size"] == tok.get_vocab_size() == 4100


def test_eot_is_eos_and_eom_is_not():
    cfg = json.loads((MODEL_DIR / "config.json").read_text())["text_config"]
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    for eos in (cfg["eos_token_id"], gen["eos_token_id"]):
        assert sorted(eos) == [1, EOT]
    assert 4098 not in cfg["eos_token_id"]


def test_chat_template_is_the_muse_template():
    assert (MODEL_DIR / "chat_template.jinja").read_bytes() == TEMPLATE.read_bytes()
    assert "chat_template" not in json.loads((MODEL_DIR / "tokenizer_config.json").read_text())


@pytest.fixture(scope="module")
def llm():
    return LLM(model=MODEL_DIR, dtype="float32", max_model_len=2048, seed=0)


def _parse(text: str, tools: list[dict]):
    return MuseOutputParser(reasoning=True, tools=True, tool_names=tool_schemas_from_openai(tools)).parse(text)


def test_engine_stops_on_eot(llm):
    assert {1, EOT} <= llm.get_tokenizer().eos_token_ids
    assert 4098 not in llm.get_tokenizer().eos_token_ids


@pytest.mark.parametrize("question,tools,name,arg,value,result", CASES, ids=[c[2] for c in CASES])
def test_greedy_tool_call_then_answer(llm, question, tools, name, arg, value, result):
    messages = [{"role": "user", "content": question}]
    out = llm.chat(messages, GREEDY, tools=tools, chat_template_kwargs=KWARGS)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOT, out.text
    parsed = _parse(out.text, tools)
    assert parsed.reasoning and parsed.reasoning.strip(), out.text
    assert len(parsed.tool_calls) == 1, out.text
    call = parsed.tool_calls[0]
    assert call.name == name, out.text
    args = json.loads(call.arguments)
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    jsonschema.validate(args, schema)  # the required argument is there, as a string
    assert args == {arg: value}, out.text  # copied from the question

    # Second turn: the client sends the call back with the tool's result.
    messages += [
        {
            "role": "assistant",
            "content": None,
            "reasoning": parsed.reasoning,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]
    out2 = llm.chat(messages, GREEDY, tools=tools, chat_template_kwargs=KWARGS)[0].outputs[0]
    assert out2.finish_reason == "stop" and out2.token_ids[-1] == EOT, out2.text
    answer = _parse(out2.text, tools)
    assert not answer.tool_calls, out2.text
    assert answer.reasoning and answer.reasoning.strip(), out2.text
    assert answer.content and answer.content.strip(), out2.text
    restated = ["12", "cloudy"] if name == "get_weather" else [result]
    assert all(v in answer.content for v in restated), answer.content
