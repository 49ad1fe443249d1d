"""Muse reasoning/tool parsers: MUSE_CHAT §7 transcripts, §4 edge cases, streaming == non-streaming."""

from __future__ import annotations

import itertools
import json
import random
import sys

import pytest

from musespark.parsers import (
    PARSERS,
    MuseOutputParser,
    ParsedMessage,
    ReasoningTokenCounter,
    assemble,
    get_parser_factory,
    resolve_finish_reason,
    tool_schemas_from_openai,
)

S = "<|start|>assistant"
TOOLS = tool_schemas_from_openai(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "calendar.add_event",
                "parameters": {
                    "type": "object",
                    "properties": {"title": {"type": "string"}, "attendees": {"type": "array"}},
                },
            },
        },
    ]
)


def FC(x: str) -> str:
    return "<atem:function_calls>\n" + x + "</atem:function_calls>"


def I(name: str, *kv: tuple[str, str]) -> str:  # noqa: E743
    params = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in kv)
    return f'<atem:invoke name="{name}">\n' + params + "</atem:invoke>\n"


def ids():
    c = itertools.count()
    return lambda: f"chatcmpl-tool-{next(c):016x}"


def make(reasoning=True, tools=True, tool_names=TOOLS, **kw) -> MuseOutputParser:
    return MuseOutputParser(reasoning, tools, tool_names, ids(), **kw)


SELF6 = 'Maybe <atem:invoke name="get_weather"><atem:parameter name="city">X</atem:parameter></atem:invoke>? No.'
# (name, raw output, engine finish, reasoning, content, [(tool name, arguments)])
TRANSCRIPTS = [
    ("t1", f" to=self<|message|>User greets.<|eom|>{S} to=user<|message|>Hello!", "stop", "User greets.", "Hello!", []),
    (
        "t2",
        f" to=self<|message|>Need weather.<|eom|>{S} to=get_weather.get_weather<|message|>"
        + FC(I("get_weather.get_weather", ("city", "Paris"), ("days", "3"))),
        "stop",
        "Need weather.",
        None,
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        "t3",
        f" to=self<|message|>Call it.{S} to=get_weather<|message|>" + FC(I("get_weather")),
        "stop",
        "Call it.",
        None,
        [("get_weather", "{}")],
    ),
    (
        "t4",
        " to=calendar.add_event<|message|>"
        + FC(
            I("calendar.add_event", ("title", '{"a": 1}'), ("attendees", '["ann", "bob"]'))
            + I("get_weather", ("city", "007"), ("days", "07"))
        ),
        "stop",
        None,
        None,
        [
            ("calendar.add_event", '{"title": "{\\"a\\": 1}", "attendees": ["ann", "bob"]}'),
            ("get_weather", '{"city": "007", "days": "07"}'),
        ],
    ),
    (
        "t5",
        f"<|message|>bare thought<|eom|>{S} to=developer<|message|>internal<|eom|>{S} to=commentary"
        f"<|message|>Working on it.<|eom|>{S} to=get_weather<|message|>" + FC(I("get_weather", ("city", "Lima"))),
        "stop",
        "bare thought",
        "Working on it.",
        [("get_weather", '{"city": "Lima"}')],
    ),
    (
        "t6",
        f" to=self<|message|>{SELF6}<|eom|>{S} to=user<|message|>No call needed.",
        "stop",
        SELF6,
        "No call needed.",
        [],
    ),
    (
        "t7",
        f" to=self<|message|>r<|eom|>{S} to=user<|message|>Checking.<|eom|>{S} to=get_weather<|message|>"
        + FC(I("get_weather", ("city", "Rome"))),
        "stop",
        "r",
        "Checking.",
        [("get_weather", '{"city": "Rome"}')],
    ),
    ("t8", f" to=self<|message|>A<|eom|>{S} to=self<|message|>B<|eom|>{S} to=user<|message|>C", "stop", "AB", "C", []),
    # vLLM writes invalid JSON (bare NaN); we keep the raw string (#55429).
    (
        "t9",
        " to=get_weather<|message|>" + FC(I("get_weather", ("city", " NaN "), ("days", "NaN"))),
        "stop",
        None,
        None,
        [("get_weather", '{"city": " NaN ", "days": "NaN"}')],
    ),
    # Cut by max_tokens: never content. The name was already streamed, so the call is closed with
    # the parameters completed so far (vLLM: framed text as content / nothing when streaming).
    (
        "t10",
        f" to=self<|message|>r<|eom|>{S} to=get_weather<|message|><atem:function_calls>\n"
        '<atem:invoke name="get_weather">\n<atem:parameter name="city">Par',
        "length",
        "r",
        None,
        [("get_weather", "{}")],
    ),
]

CALL_ROME = FC(I("get_weather", ("city", "Rome")))
EDGES = [
    # §4.1 second form: header straight after reasoning; the space stays in reasoning (as vLLM).
    (
        "e4.1",
        f" to=self<|message|>Call it. to=get_weather<|message|>{FC(I('get_weather'))}",
        "stop",
        "Call it. ",
        None,
        [("get_weather", "{}")],
    ),
    # §4.3 ATEM in a to=user answer is content, never a call (vLLM non-streaming makes it a call).
    (
        "e4.3",
        f" to=self<|message|>r<|eom|>{S} to=user<|message|>Try {I('get_weather', ('city', 'X'))}",
        "stop",
        "r",
        "Try " + I("get_weather", ("city", "X")),
        [],
    ),
    (
        "e4.5",
        " to=get_weather<|message|>"
        + FC(
            I("get_weather", ("days", "Infinity"))
            + I(
                "x.y", ("a", "1e999"), ("b", "-Infinity"), ("c", "[1, NaN]"), ("d", "2.5"), ("e", '{"k": [true, null]}')
            )
        ),
        "stop",
        None,
        None,
        [
            ("get_weather", '{"days": "Infinity"}'),
            ("x.y", '{"a": "1e999", "b": "-Infinity", "c": "[1, NaN]", "d": 2.5, "e": {"k": [true, null]}}'),
        ],
    ),
    (
        "e4.6",
        " to=get_weather<|message|>"
        + FC(I("get_weather", ("city", "  x "), ("days", " 4 ")) + I("other", ("city", "007"), ("n", "true"))),
        "stop",
        None,
        None,
        [("get_weather", '{"city": "  x ", "days": 4}'), ("other", '{"city": "007", "n": true}')],
    ),
    (
        "e4.7",
        ' to=read<|message|><atem:invoke name="read.filePath">/tmp/x</atem:parameter></atem:invoke>',
        "stop",
        None,
        None,
        [("read.filePath", "{}")],
    ),
    ("e4.8", " to=mcp:x<|message|>" + FC(I("mcp:x", ("q", "a b"))), "stop", None, None, [("mcp:x", '{"q": "a b"}')]),
    ("e4.9-to", " to=user<|message|>I want to", "stop", None, "I want to", []),
    ("e4.9-to=x", " to=self<|message|>go to=x", "stop", "go to=x", None, []),
    ("e4.9-marker", " to=user<|message|>a <|e", "length", None, "a <|e", []),
    ("e4.9-lt", " to=user<|message|>1 < 2 <", "stop", None, "1 < 2 <", []),
    ("e4.10", "Hello, no framing <b>at</b> all to", "stop", None, "Hello, no framing <b>at</b> all to", []),
    ("e4.10-ws", "  to be or not", "stop", None, "  to be or not", []),
    (
        "e4.13",
        f" to=user<|message|>Answer.<|eom|>{S} to=get_weather<|message|>{CALL_ROME}",
        "stop",
        None,
        "Answer.",
        [("get_weather", '{"city": "Rome"}')],
    ),
    ("eot-kept", f" to=self<|message|>r<|eom|>{S} to=user<|message|>Hi<|eot|>", "stop", "r", "Hi", []),
    (
        "ws-content+call",
        f" to=user<|message|>\n <|eom|>{S} to=get_weather<|message|>{CALL_ROME}",
        "stop",
        None,
        None,
        [("get_weather", '{"city": "Rome"}')],
    ),
    ("ws-content", " to=user<|message|>\n ", "stop", None, "\n ", []),
    (
        "other-role",
        f" to=user<|message|>A<|eom|><|start|>user<|message|>hidden<|eot|>{S} to=user<|message|>B",
        "stop",
        None,
        "AB",
        [],
    ),
    (
        "two-tool-msgs",
        f" to=get_weather<|message|>{CALL_ROME}<|eom|>{S} to=calendar.add_event<|message|>"
        + FC(I("calendar.add_event", ("title", "T"), ("title", "dup"), ("attendees", '["a"]'))),
        "stop",
        None,
        None,
        [("get_weather", '{"city": "Rome"}'), ("calendar.add_event", '{"title": "T", "attendees": ["a"]}')],
    ),
    (
        "no-name-invoke",
        f" to=get_weather<|message|><atem:invoke>\n</atem:invoke>{CALL_ROME}",
        "stop",
        None,
        None,
        [("get_weather", '{"city": "Rome"}')],
    ),
    (
        "body-ends-mid-call",
        f' to=get_weather<|message|><atem:invoke name="get_weather"><atem:parameter name="city">'
        f'Oslo</atem:parameter><atem:parameter name="days">2<|eom|>{S} to=user<|message|>ok',
        "stop",
        None,
        "ok",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    (
        "invoke-word-boundary",
        ' to=get_weather<|message|><atem:invokes name="no"></atem:invoke>',
        "stop",
        None,
        None,
        [],
    ),
]
CASES = TRANSCRIPTS + EDGES


def check(case, msg: ParsedMessage):
    name, raw, engine, reasoning, content, calls = case
    assert msg.reasoning == reasoning
    assert msg.content == content
    assert [(c.name, c.arguments) for c in msg.tool_calls] == calls
    for c in msg.tool_calls:
        assert c.id.startswith("chatcmpl-tool-")
        assert isinstance(json.loads(c.arguments), dict)


def expected_finish(case) -> str:
    return resolve_finish_reason(case[2], bool(case[5]))


def chunkings(text: str, n_random: int = 50, seed: int = 0):
    yield [text]
    yield list(text)  # every char boundary at once
    if len(text) <= 120:
        for i in range(1, len(text)):
            yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = (
            sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        )
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream(parser: MuseOutputParser, chunks, finish=None):
    deltas = [parser.feed(c) for c in chunks] + [parser.finish(finish)]
    started: set[int] = set()
    for d in deltas:  # OpenAI shape: id+name exactly on a call's first delta
        for t in d.tool_calls:
            assert (t.id is not None and t.name is not None) == (t.index not in started)
            started.add(t.index)
    return deltas


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_non_streaming(case):
    check(case, make().parse(case[1], case[2]))
    expect = "length" if case[2] == "length" else "tool_calls" if case[5] else "stop"
    assert expected_finish(case) == expect


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_streaming_equals_non_streaming(case):
    raw, engine = case[1], case[2]
    want = make().parse(raw, engine)
    for i, chunks in enumerate(chunkings(raw, seed=hash(case[0]) & 0xFFFF)):
        got = assemble(stream(make(), chunks, engine))
        assert got == want, (i, chunks)


def test_tools_disabled_keeps_atem_in_content():
    raw = f" to=self<|message|>r<|eom|>{S} to=get_weather<|message|>{CALL_ROME}"
    want = ParsedMessage("r", CALL_ROME, [])
    for chunks in chunkings(raw):
        assert assemble(stream(make(tools=False), chunks)) == want
    assert make(tools=False).parse(raw) == want


def test_reasoning_disabled_drops_reasoning():
    raw = TRANSCRIPTS[0][1]
    assert make(reasoning=False).parse(raw) == ParsedMessage(None, "Hello!", [])
    p = make(reasoning=False, tools=False)  # no parser at all: raw passthrough, like vLLM
    assert p.feed(raw).content == raw and p.finish("stop").content == ""


def test_parallel_tool_calls_false_keeps_first():
    msg = make(parallel_tool_calls=False).parse(TRANSCRIPTS[3][1])
    assert [c.name for c in msg.tool_calls] == ["calendar.add_event"]


def test_name_streams_first_and_arguments_grow_per_parameter():
    p = make()
    d = p.feed(' to=get_weather<|message|><atem:invoke name="get_weather.get_weather">')
    assert [(t.index, t.id, t.name) for t in d.tool_calls] == [(0, "chatcmpl-tool-0000000000000000", "get_weather")]
    d = p.feed('<atem:parameter name="city">Paris</atem:parameter>\n<atem:parameter name="days">3')
    assert d.tool_calls[0].arguments == '"city": "Paris"' and d.tool_calls[0].id is None
    d = p.feed("</atem:parameter>")
    assert d.tool_calls[0].arguments == ', "days": 3'
    assert p.feed("</atem:invoke>").tool_calls[0].arguments == "}"


def test_arguments_always_valid_json_fuzz():
    rng = random.Random(7)
    atoms = [
        "NaN",
        "-NaN",
        "Infinity",
        "-Infinity",
        "1e999",
        "-1e999",
        "1e-999",
        "[NaN]",
        '{"a": Infinity}',
        "9" * 5000,
        "[" * 3000,
        '"\\ud800"',
        "\u00e9\u6f22",
        "",
        " ",
        "null",
        '"q"',
        "0x1F",
        "1_000",
        "{",
        "<",
    ]
    for _ in range(200):
        kv = [
            (rng.choice(["city", "days", "x", "é"]), rng.choice(atoms) + rng.choice(["", " ", "1"])) for _ in range(3)
        ]
        name = rng.choice(["get_weather", "calendar.add_event", "free"])
        raw = " to=t<|message|>" + FC(I(name, *kv))
        msg = make().parse(raw)
        (call,) = msg.tool_calls
        json.loads(call.arguments)
        call.arguments.encode("utf-8")
        assert assemble(stream(make(), chunkings(raw, 1, rng.random()).__next__())) == msg


def test_random_fragment_soup_streams_consistently():
    frags = [
        S,
        " to=self",
        " to=user",
        " to=get_weather",
        " to=",
        "<|message|>",
        "<|eom|>",
        "<|eot|>",
        "<|start|>",
        '<atem:invoke name="get_weather">',
        '<atem:parameter name="city">',
        "</atem:parameter>",
        "</atem:invoke>",
        "<atem:function_calls>",
        "<",
        "<|",
        "t",
        "to",
        " ",
        "\n",
        "word",
        "NaN",
        ">",
        '"',
    ]
    rng = random.Random(11)
    for k in range(150):
        raw = "".join(rng.choice(frags) for _ in range(rng.randint(1, 30)))
        for reasoning, tools in ((True, True), (True, False), (False, True)):
            want = make(reasoning, tools).parse(raw, "length")
            for c in want.tool_calls:
                assert isinstance(json.loads(c.arguments), dict)
            for chunks in itertools.islice(chunkings(raw, 5, k), 8):
                assert assemble(stream(make(reasoning, tools), chunks, "length")) == want, (raw, chunks)


def test_call_cut_by_length_is_never_content():
    raw = TRANSCRIPTS[9][1]
    for cut in range(raw.index("to=get_weather"), len(raw) + 1):
        msg = make().parse(raw[:cut], "length")
        assert msg.content is None, raw[:cut]
        assert all(isinstance(json.loads(c.arguments), dict) for c in msg.tool_calls)


def test_reasoning_token_count():
    toks = [" to", "=self", "<|message|>", "Think", "ing", ".", "<|eom|>", S, " to", "=user", "<|message|>", "Hi"]
    c = ReasoningTokenCounter()
    assert [c.add(t) for t in toks].count(True) == 3 == c.count
    c = ReasoningTokenCounter()  # §4.1 second form: the header tokens after reasoning count, like vLLM
    for t in ["<|message|>", "a", " to", "=get_weather", "<|message|>", "<atem:invoke"]:
        c.add(t)
    assert c.count == 3


def test_reasoning_ended():
    p = make()
    p.feed(" to=self<|message|>thinking")
    assert not p.reasoning_ended
    p.feed(f"<|eom|>{S} to=user<|message|>x")
    assert p.reasoning_ended


def test_parser_registry():
    assert get_parser_factory("muse", "reasoning") is get_parser_factory("musespark1x", "tool") is MuseOutputParser
    assert set(PARSERS) == {"muse", "musespark1x"}
    with pytest.raises(ValueError, match="muse, musespark1x"):
        get_parser_factory("hermes", "tool")


def test_feed_work_is_linear():
    unit = (
        f" to=self<|message|>a < b to t <x {'t' * 20} to=y\n<|eom|>{S} to=user<|message|>An answer with <|e "
        f"and to words.<|eom|>{S} to=get_weather<|message|>"
        + FC(I("get_weather", ("city", "Rome " * 20), ("days", "3")))
        + "<|eom|>"
        + S
    )
    text = (unit * (100_000 // len(unit) + 1))[:100_000]
    p = make()
    for ch in text:
        p.feed(ch)
    p.finish("length")
    assert p.num_tool_calls > 50
    assert p.ops < 60 * len(text), p.ops / len(text)
    # one long unframed word and one long recipient-looking run stay linear too
    for junk in ("x" * 100_000, " to=" + "y" * 100_000, "\n" * 100_000):
        p = make()
        for ch in junk:
            p.feed(ch)
        p.finish()
        assert p.ops < 60 * len(junk), (junk[:5], p.ops / len(junk))


def test_parsers_import_only_stdlib():
    import subprocess

    code = "import sys, musespark.parsers; bad = {'torch', 'numpy', 'musespark.engine'} & set(sys.modules); print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "set()"
