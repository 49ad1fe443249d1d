"""Chat templates rendered as HF's apply_chat_template renders them, with vLLM's request
handling (docs/muse_chat.md §2): the Muse template's worked examples byte for byte, parity with
transformers' renderer, kwargs precedence, message preprocessing, the server's 400s and the
render endpoint, `LLM.chat` and the CLI's template loading."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from musespark import LLM, SamplingParams
from musespark.cli import build_parser
from musespark.engine import chat, chat_jinja
from musespark.engine.args import bundled_model_path
from musespark.engine.chat import load_chat_template
from musespark.engine.tokenizer import Tokenizer
from musespark.errors import InvalidArgumentError
from musespark.server.api import ServerConfig, build_app

MODEL_DIR = bundled_model_path()
MUSE = Path(__file__).resolve().parents[1] / "data" / "muse_chat_template.jinja"
BOS = "<|begin_of_text|>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calendar.add_event",
            "description": "Add an event.",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "attendees": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["title"],
            },
        },
    },
]

# docs/muse_chat.md §2.2, verbatim.
EXAMPLE_A = (
    "<|begin_of_text|><|start|>system<|message|>Be terse.\n\nReasoning strength: high.\n\n"
    '# Valid recipients: "self", "user".<|eot|><|start|>user<|message|>Hi<|eot|><|start|>assistant'
)

SYSTEM_B = """<|begin_of_text|><|start|>system<|message|>You are a helpful AI assistant.
Knowledge cutoff: 2026-01-04.
Current date: 2026-09-30.

Reasoning strength: high.

In this environment you have access to a set of tools you can use to answer the user's question.

You can invoke a function by writing a "<atem:function_calls>" block like the following:
<atem:function_calls>
<atem:invoke name="$FUNCTION_NAME">
<atem:parameter name="$PARAMETER_NAME">$PARAMETER_VALUE</atem:parameter>
...
</atem:invoke>
</atem:function_calls>

String and scalar parameters should be specified as is, while lists and objects should use JSON format. Note that spaces for string values are not stripped. The output is not expected to be valid XML and is parsed with regular expressions.
Here are the functions available in JSONSchema format:
// Tool metadata
{"name": "get_weather", "description": ""}
{"name": "calendar", "description": ""}
// Function schemas
{"name": "get_weather", "description": "Current weather for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
{"name": "calendar.add_event", "description": "Add an event.", "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "attendees": {"type": "array", "items": {"type": "string"}}}, "required": ["title"]}}

Here's an example of how to call a function in the tool set:
(If the tool namespace is not specified, invoke the function directly as `example_function_name` rather than `example_tool_name.example_function_name`)

to=example_tool_name.example_function_name

<atem:function_calls>
<atem:invoke name="example_tool_name.example_function_name">
<atem:parameter name="example_parameter_1">value_1</atem:parameter>
<atem:parameter name="example_parameter_2">This is the value for the second parameter
that can span
"multiple" lines
</atem:parameter>
</atem:invoke>
</atem:function_calls>

# Valid recipients: "self", "get_weather.*", "calendar.*", "user".<|eot|>"""

USER_B = "<|start|>user<|message|>Weather in Paris?<|eot|>"
EXAMPLE_B = SYSTEM_B + USER_B + "<|start|>assistant"

TURN_C = """<|start|>assistant to=self<|message|>Need weather.<|eom|><|start|>assistant to=get_weather<|message|><atem:function_calls>
<atem:invoke name="get_weather">
<atem:parameter name="city">Paris</atem:parameter>
<atem:parameter name="days">3</atem:parameter>
</atem:invoke>
</atem:function_calls><|eot|><|start|>tool get_weather<|message|><tool_output name="get_weather">
18C, clear
</tool_output><|eot|><|start|>assistant"""

CALL_C = {
    "role": "assistant",
    "content": None,
    "reasoning": "Need weather.",
    "tool_calls": [
        {
            "id": "chatcmpl-tool-1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":3}'},
        }
    ],
}
RESULT_C = {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18C, clear"}


@pytest.fixture(scope="module")
def muse_tok(tmp_path_factory) -> Tokenizer:
    """The bundled tokenizer with the Muse template as chat_template.jinja beside it (which
    wins over tokenizer_config.json's key)."""
    d = tmp_path_factory.mktemp("muse")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, d / name)
    shutil.copy(MUSE, d / "chat_template.jinja")
    return Tokenizer.from_dir(d)


def _render(tok: Tokenizer, messages, **kw) -> str:
    kw.setdefault("current_date", "2026-09-30")
    return tok.apply_chat_template(messages, **kw)


# -- the Muse template: MUSE_CHAT §2.2 byte for byte -------------------------------------------


def test_muse_example_a(muse_tok):
    assert muse_tok.chat_template == MUSE.read_text()
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert _render(muse_tok, msgs) == EXAMPLE_A


def test_muse_example_b_tools_and_date(muse_tok, monkeypatch):
    assert _render(muse_tok, [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS) == EXAMPLE_B

    class Fixed(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 9, 30, 12, 0)

    monkeypatch.setattr(chat_jinja, "datetime", Fixed)  # strftime_now('%Y-%m-%d') when no current_date is given
    assert muse_tok.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS) == EXAMPLE_B


def test_muse_example_c_second_turn(muse_tok):
    msgs = [{"role": "user", "content": "Weather in Paris?"}, CALL_C, RESULT_C]
    assert _render(muse_tok, msgs, tools=TOOLS) == SYSTEM_B + USER_B + TURN_C


def test_muse_example_c_two_calls_and_past_answer(muse_tok):
    two = {
        **CALL_C,
        "reasoning": None,
        "tool_calls": [
            CALL_C["tool_calls"][0],
            {
                "id": "t2",
                "type": "function",
                "function": {"name": "calendar.add_event", "arguments": {"title": "Trip", "attendees": ["A", "B"]}},
            },
        ],
    }
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        two,
        RESULT_C,
        {"role": "tool", "tool_call_id": "t2", "content": "ok"},
    ]
    text = _render(muse_tok, msgs, tools=TOOLS, add_generation_prompt=False)
    assert (
        "</atem:function_calls><|eom|><|start|>assistant to=calendar.add_event<|message|><atem:function_calls>\n"
        '<atem:invoke name="calendar.add_event">\n<atem:parameter name="title">Trip</atem:parameter>\n'
        '<atem:parameter name="attendees">["A", "B"]</atem:parameter>\n</atem:invoke>\n'
        "</atem:function_calls><|eot|><|start|>tool get_weather"
    ) in text
    assert text.endswith(
        '<|start|>tool calendar.add_event<|message|><tool_output name="calendar.add_event">\nok\n</tool_output><|eot|>'
    )
    past = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "A", "reasoning_content": "R"},
        {"role": "user", "content": "Again"},
    ]
    assert (
        "<|start|>assistant to=self<|message|>R<|eom|><|start|>assistant to=user<|message|>A<|eot|>"
        "<|start|>user<|message|>Again<|eot|><|start|>assistant"
    ) in _render(muse_tok, past)


def test_muse_example_d_reasoning_strength(muse_tok, tmp_path):
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    low = EXAMPLE_A.replace("Reasoning strength: high.", "Reasoning strength: low.")
    assert _render(muse_tok, msgs, reasoning_strength="low") == low
    # Through the input processor: request kwargs, reasoning_effort, the effort map.
    from musespark.engine.input_processor import InputProcessor

    proc = InputProcessor(muse_tok, muse_tok.vocab_size, 4096)
    assert proc.render_chat(msgs, chat_template_kwargs={"reasoning_strength": "low"}).text == low
    assert proc.render_chat(msgs, reasoning_effort="low").text == low
    assert proc.render_chat(msgs, reasoning_effort="max", reasoning_effort_map={"max": "low"}).text == low
    assert proc.render_chat(msgs, default_chat_template_kwargs={"reasoning_strength": "low"}).text == low
    out = proc.render_chat(
        msgs,
        default_chat_template_kwargs={"reasoning_strength": "medium"},
        chat_template_kwargs={"reasoning_strength": "low"},
    )
    assert out.text == low and out.token_ids == muse_tok.encode(low, add_special_tokens=False)


def test_muse_template_matches_transformers(muse_tok):
    """The same template and inputs through transformers' own renderer."""
    hf = pytest.importorskip("transformers.utils.chat_template_utils")
    src = MUSE.read_text()
    cases = [
        ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}], None),
        ([{"role": "user", "content": "Weather in Paris?"}, CALL_C, RESULT_C], TOOLS),
    ]
    for msgs, tools in cases:
        ours = _render(muse_tok, msgs, tools=tools)
        (theirs,), _ = hf.render_jinja_template(
            conversations=[chat.normalize_messages(msgs)],
            tools=chat.normalize_tools(tools),
            chat_template=src,
            add_generation_prompt=True,
            bos_token=BOS,
            eos_token="<|end_of_text|>",
            current_date="2026-09-30",
        )
        assert ours == theirs


# -- HF's Jinja environment ------------------------------------------------------------------

ENV_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}{%- if loop.index > 2 %}{% break %}{% endif -%}{% set ns.n = ns.n + 1 %}
{{ m.role }}={{ m.content | tojson }}|{{ {"b": 1, "a": "é<"} | tojson(indent=1, sort_keys=true) }}
{%- endfor %}
{% generation %}n={{ ns.n }} {{ dict(x=1) | tojson }}{% endgeneration %}
"""


def test_environment_matches_transformers():
    hf = pytest.importorskip("transformers.utils.chat_template_utils")
    msgs = [
        {"role": "user", "content": 'é "q" <b>'},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "y"},
    ]
    ours = chat.render(ENV_TEMPLATE, msgs, {"add_generation_prompt": False}, {})
    (theirs,), _ = hf.render_jinja_template(conversations=[msgs], chat_template=ENV_TEMPLATE)
    assert ours == theirs and '"é \\"q\\" <b>"' in ours


def test_template_sandbox_and_raise_exception_are_400s():
    for bad in (
        "{{ raise_exception('nope') }}",
        "{{ messages.__class__ }}{{ ''.__class__.__mro__ }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append(1) }}",
    ):
        with pytest.raises(InvalidArgumentError) as e:
            chat.render(bad, [{"role": "user", "content": "x"}], {}, {})
        assert e.value.param == "messages"


def test_continue_final_message(muse_tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, wor"}]
    text = _render(muse_tok, msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|start|>assistant to=user<|message|>Hello, wor")
    with pytest.raises(InvalidArgumentError):
        _render(muse_tok, msgs, continue_final_message=True)  # with add_generation_prompt


# -- kwargs precedence (vLLM) ----------------------------------------------------------------


def test_kwargs_precedence():
    kw = chat.template_kwargs(
        {"a": 1, "b": 1, "c": 1, "reasoning_strength": "x"}, {"b": 2, "c": None, "d": "auto"}, reasoning_effort="low"
    )
    assert kw["a"] == 1 and kw["b"] == 2 and kw["c"] == 1 and "d" not in kw
    assert kw["reasoning_effort"] == kw["reasoning_strength"] == "low" and kw["enable_thinking"] is True
    kw = chat.template_kwargs({}, {"enable_thinking": True, "add_generation_prompt": False}, reasoning_effort="none")
    assert kw["enable_thinking"] is True and kw["add_generation_prompt"] is True  # fields win over request kwargs
    assert chat.template_kwargs({}, {}, reasoning_effort="none")["enable_thinking"] is False
    assert "enable_thinking" not in chat.template_kwargs({}, {})
    mapped = chat.template_kwargs({}, {}, reasoning_effort="none", reasoning_effort_map={"none": "low"})
    assert mapped["reasoning_strength"] == "low" and mapped["enable_thinking"] is True
    with pytest.raises(InvalidArgumentError):
        chat.parse_reasoning_effort_map('{"huge": "x"}')
    assert chat.parse_reasoning_effort_map('{"max": "high"}') == {"max": "high"}


def test_unreferenced_kwargs_are_dropped_and_messages_is_reserved():
    src = "{{ messages | length }}{{ x is defined }}"
    assert chat.render(src, [{"role": "user", "content": "a"}], {"x": 1, "y": 2}, {}) == "1True"
    tok = Tokenizer.from_dir(MODEL_DIR)
    from musespark.engine.input_processor import InputProcessor

    proc = InputProcessor(tok, tok.vocab_size, 4096)
    out = proc.render_chat(
        [{"role": "user", "content": "a"}],
        chat_template=src,
        chat_template_kwargs={"messages": [], "chat_template": "zzz"},
    )
    assert out.text == "1False"


# -- messages and tools ----------------------------------------------------------------------


def test_message_preprocessing():
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "developer", "content": "D"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "not json"}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
            ],
        },
        {"role": "assistant", "content": "x", "tool_calls": [], "reasoning_content": "r"},
    ]
    out = chat.normalize_messages(msgs, "{{ messages }}")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "assistant"]
    assert out[0]["content"] == "S\n\nD" and out[1]["content"] == "a\nb"
    assert "content" not in out[2] and [c["function"]["arguments"] for c in out[2]["tool_calls"]] == [{}, {}]
    assert "tool_calls" not in out[3] and out[3]["reasoning"] == out[3]["reasoning_content"] == "r"
    kept = chat.normalize_messages(msgs, "{% if m.role == 'developer' %}{% endif %}")
    assert [m["role"] for m in kept][:3] == ["system", "user", "developer"]
    parsed = chat.normalize_messages(
        [
            {
                "role": "assistant",
                "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"a": [1, {"b": null}]}'}}],
            }
        ]
    )
    assert parsed[0]["tool_calls"][0] == {
        "id": "1",
        "type": "function",
        "function": {"name": "f", "arguments": {"a": [1, {"b": None}]}},
    }


@pytest.mark.parametrize(
    "tools",
    [
        [{"type": "function", "function": {"description": "no name"}}],
        [{"type": "function", "function": {"name": "f", "parameters": "nope"}}],
        [{"type": "function"}],
        ["f"],
        {"f": 1},
    ],
)
def test_bad_tools(tools):
    with pytest.raises(InvalidArgumentError) as e:
        chat.normalize_tools(tools)
    assert e.value.param == "tools"


def test_tools_normalised_and_tool_choice():
    tools = chat.normalize_tools(
        [
            {"type": "function", "function": {"name": "f", "strict": None}},
            {"function": {"name": "g", "strict": True, "parameters": {"type": "object"}}},
        ]
    )
    assert tools == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {
            "type": "function",
            "function": {"name": "g", "description": None, "parameters": {"type": "object"}, "strict": True},
        },
    ]
    chat.check_tool_choice({"type": "function", "function": {"name": "g"}}, tools)
    chat.check_tool_choice("none", None)
    for choice, t in [
        ({"type": "function", "function": {"name": "h"}}, tools),
        ("required", None),
        ("sometimes", tools),
    ]:
        with pytest.raises(InvalidArgumentError) as e:
            chat.check_tool_choice(choice, t)
        assert e.value.param == "tool_choice"


# -- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=2048)


@pytest.fixture(scope="module")
def client(llm):
    config = ServerConfig(
        model_name="m",
        log_requests=False,
        chat_template=MUSE.read_text(),
        default_chat_template_kwargs={"current_date": "2026-09-30"},
        reasoning_effort_map={"max": "xhigh"},
    )
    app = build_app(llm.engine, config)
    calls = []
    engine = app.state.async_engine
    original = engine.generate

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    engine.generate = spy
    with TestClient(app) as c:
        c.engine_calls = calls
        yield c


def test_render_endpoint(client, llm):
    msgs = [{"role": "user", "content": "Weather in Paris?"}, CALL_C, RESULT_C]
    r = client.post("/v1/chat/completions/render", json={"messages": msgs, "tools": TOOLS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt"] == SYSTEM_B + USER_B + TURN_C
    assert body["token_ids"] == llm.get_tokenizer().encode(body["prompt"], add_special_tokens=False)
    r = client.post(
        "/v1/chat/completions/render",
        json={
            "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
            "reasoning_effort": "max",
        },
    )
    assert r.json()["prompt"] == EXAMPLE_A.replace("strength: high", "strength: xhigh")
    tok = client.post("/tokenize", json={"messages": msgs, "tools": TOOLS}).json()
    assert tok["tokens"] == body["token_ids"]


def test_chat_accepts_developer_and_tool_calls_without_content(client):
    msgs = [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Weather in Paris?"},
        CALL_C,
        RESULT_C,
    ]
    before = len(client.engine_calls)
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": msgs,
            "tools": TOOLS,
            "max_tokens": 2,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    )
    assert r.status_code == 200, r.text
    assert len(client.engine_calls) == before + 1
    prompt = client.post("/v1/chat/completions/render", json={"messages": msgs, "tools": TOOLS}).json()["prompt"]
    assert prompt.startswith("<|begin_of_text|><|start|>system<|message|>Be terse.\n\nReasoning strength: high.")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "tool_call_id": "zz", "content": "x"}]}, "messages"),  # template exception
        ({"reasoning_effort": "huge"}, "reasoning_effort"),
        ({"continue_final_message": True}, "add_generation_prompt"),
        # Structured outputs: a schema, regex or grammar the engine cannot compile, bad shapes.
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
                    },
                }
            },
            "response_format",  # the field the request gave, not the key it became
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_chat_refusals_name_the_field(client, change, param):
    before = len(client.engine_calls)
    for path in ("/v1/chat/completions", "/v1/chat/completions/render"):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **change}
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param, r.text
    assert len(client.engine_calls) == before  # nothing reached the engine


def test_server_config_checks_chat_flags():
    with pytest.raises(ValueError):
        ServerConfig(model_name="m", reasoning_effort_map={"huge": "x"})
    with pytest.raises(ValueError):
        ServerConfig(model_name="m", default_chat_template_kwargs="[1]")
    with pytest.raises(ValueError):
        ServerConfig(model_name="m", chat_template="{% if %}")


# -- offline and CLI ---------------------------------------------------------------------------


def test_llm_chat_with_template_and_tools(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Weather in Paris?"}, CALL_C, RESULT_C]
    (out,) = llm.chat(
        msgs,
        SamplingParams(temperature=0, max_tokens=2),
        chat_template=MUSE.read_text(),
        chat_template_kwargs={"current_date": "2026-09-30"},
        tools=TOOLS,
    )
    assert out.prompt_token_ids == tok.encode(SYSTEM_B + USER_B + TURN_C, add_special_tokens=False)
    with pytest.raises(InvalidArgumentError) as e:
        llm.chat(msgs, tools=[{"type": "function", "function": {"name": ""}}])
    assert e.value.param == "tools"


def test_cli_chat_template_flags(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(f)) == "{{ messages[0].content }}"
    assert load_chat_template("{{ bos_token }}") == "{{ bos_token }}"
    with pytest.raises(ValueError):
        load_chat_template(str(tmp_path / "missing.jinja"))
    args = build_parser().parse_args(
        [
            "serve",
            "--chat-template",
            str(f),
            "--default-chat-template-kwargs",
            json.dumps({"reasoning_strength": "low"}),
            "--reasoning-effort-map",
            '{"max": "xhigh"}',
        ]
    )
    assert args.reasoning_effort_map == '{"max": "xhigh"}' and args.chat_template == str(f)
    gen = build_parser().parse_args(["generate", "--chat", "--chat-template", str(f), "hi"])
    assert gen.chat and gen.chat_template == str(f)
