"""The copy-only fine-tuning data (tools/muse_copy_data.py): open-ended values, deterministic
from a seed, a held-out split whose values never occur in training, held-out evaluation tasks
that benchmarks/tool_eval.py reads and scores, and training text rendered exactly as the server
renders the same conversation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "benchmarks"))

import muse_copy_data as mcp  # noqa: E402
import tool_eval  # noqa: E402

from musespark.apps.demo_tools import calculator  # noqa: E402
from musespark.parsers import MuseOutputParser, tool_schemas_from_openai  # noqa: E402

N_TRAIN = 1500


@pytest.fixture(scope="module")
def train_sample():
    return [mcp.example(0, i) for i in range(N_TRAIN)]


@pytest.fixture(scope="module")
def tasks():
    return mcp.eval_tasks(1000)


def test_the_stream_is_a_pure_function_of_seed_and_index():
    a, b = mcp.example(3, 17), mcp.example(3, 17)
    assert a[0] == b[0] and a[1] == b[1]
    assert mcp.eval_tasks(5, 6, 2, 2) == mcp.eval_tasks(5, 6, 2, 2)
    assert [mcp.example(1, i)[0].messages for i in range(5)] != [mcp.example(2, i)[0].messages for i in range(5)]


def test_values_come_from_open_ended_spaces(train_sample):
    values: dict[str, set[str]] = {}
    for _, vals in train_sample:
        for kind, v in vals:
            values.setdefault(kind, set()).add(v)
    # A closed list (muse_chat_data: 95 cities, 486 paths) could be memorised; these keep growing.
    assert len(values["city"]) > 400 and len(values["path"]) > 400 and len(values["expression"]) > 400
    assert len(values["line"]) > 1000
    kinds = {conv.kind for conv, _ in train_sample}
    assert kinds == {"tool_call", "tool_result", "plain", "no_tool"}
    with_history = [c for c, _ in train_sample if sum(m["role"] == "user" for m in c.messages) > 1]
    assert len(with_history) > N_TRAIN // 5
    assert any(m["role"] == "tool" for c in with_history for m in c.messages[:-1])  # an earlier tool round


def test_held_out_values_never_occur_in_training(train_sample, tasks):
    train_values = {v for _, vals in train_sample for _, v in vals}
    train_words = {
        w.lower() for _, vals in train_sample for k, v in vals if k in ("city", "path") for w in mcp.value_words(v)
    }
    held: list[tuple[str, str]] = []
    for i, t in enumerate(tasks):
        kind = {"tool": "tool_call"}.get(t["kind"], t["kind"])
        held += mcp.heldout_example(1000, i, kind, t["expected"].get("name") or t["expected"].get("missing_tool"))[1]
    assert len(held) > 200
    assert not train_values & {v for _, v in held}
    assert not train_words & {w.lower() for k, v in held if k in ("city", "path") for w in mcp.value_words(v)}
    # ... and every argument of a held-out task is one of the held-out values drawn for it
    held_values = {v for _, v in held}
    for t in tasks:
        for value in (t["expected"].get("arguments") or {}).values():
            assert value in held_values or value in ("celsius", "fahrenheit"), value


def test_at_least_100_held_out_tool_tasks_in_a_file_the_evaluator_reads(tmp_path):
    out = tmp_path / "tasks.jsonl"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "muse_copy_data.py"), "tasks", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = tool_eval.load_tasks(str(out), seed=0)
    assert loaded == json.loads(json.dumps(mcp.eval_tasks(1000)))
    assert sum(t["kind"] == "tool" for t in loaded) >= 100
    assert {t["expected"]["name"] for t in loaded if t["kind"] == "tool"} == set(mcp.TOOL_NAMES)
    assert {t["kind"] for t in loaded} == {"tool", "plain", "no_tool"}
    for t in loaded:
        names = {x["function"]["name"] for x in t["tools"] or []}
        if t["kind"] == "tool":
            assert t["expected"]["name"] in names and t["followup"][-1]["role"] == "tool"
        if t["kind"] == "no_tool":
            assert t["expected"]["missing_tool"] not in names
    assert len(tool_eval.limit_tasks(loaded, 8)) == 8 + 2 + 2


def test_targets_score_as_right_under_the_evaluator():
    """What the data teaches is what the evaluation rewards: each held-out target, parsed by
    the Muse parser, is the right call with exact arguments, restates the result, or refuses."""
    for i in range(60):
        kind = ["tool_call", "tool_result", "no_tool", "plain"][i % 4]
        conv, _ = mcp.heldout_example(7, i, kind, mcp.TOOL_NAMES[i % 3] if kind != "plain" else None)
        parser = MuseOutputParser(reasoning=True, tools=True, tool_names=tool_schemas_from_openai(conv.tools or []))
        msg = parser.parse(conv.target)
        calls = [(c.name, c.arguments) for c in msg.tool_calls]
        task = {"expected": conv.expected, "restate": conv.expected.get("restate")}
        if kind == "tool_call":
            assert tool_eval.score_call(task, calls) == (True, True), (conv.target, calls)
        elif kind == "tool_result":
            assert not calls and tool_eval.restates(task, msg.content), (msg.content, task["restate"])
        elif kind == "no_tool":
            assert tool_eval.refuses(msg.content, calls), msg.content
        else:
            assert tool_eval.plain_ok(msg.content, calls)


def test_calculator_results_are_the_demo_tools_own():
    convs = [mcp.heldout_example(9, i, "tool_result", "calculator")[0] for i in range(20)]
    for conv in convs:
        expression = conv.expected["arguments"]["expression"]
        result = conv.messages[-1]["content"]
        assert result == calculator(expression) or result.startswith("error: ")


@pytest.mark.parametrize(
    "answer, restate, ok",
    [
        ("It's 18C and cloudy in Porto.", {"all": ["18", "cloudy"]}, True),
        ("It's 118C and cloudy.", {"all": ["18", "cloudy"]}, False),
        ("It's -18C and cloudy.", {"all": ["18", "cloudy"]}, False),
        ("It's 18C.", {"all": ["18", "cloudy"]}, False),
        ("4 = 3.5", {"all": ["3.5"]}, True),
        ("4 = 3.55", {"all": ["3.5"]}, False),
        ("it says:\nkelvo=12", {"any": ["bran: x", "kelvo=12"]}, True),
    ],
)
def test_restate_scoring(answer, restate, ok):
    assert tool_eval.restates({"restate": restate}, answer) is ok


def test_argument_scoring_ignores_whitespace_in_expressions_only():
    calc = {"expected": {"name": "calculator", "arguments": {"expression": "(3 + 4) * 5"}}}
    assert tool_eval.score_call(calc, [("calculator", '{"expression": "(3+4)*5"}')]) == (True, True)
    assert tool_eval.score_call(calc, [("calculator", '{"expression": "(3+4)*6"}')]) == (True, False)
    assert tool_eval.score_call(calc, [("read_file", '{"expression": "(3+4)*5"}')]) == (False, False)
    city = {"expected": {"name": "get_weather", "arguments": {"city": "Port Velmo"}}}
    assert tool_eval.score_call(city, [("get_weather", '{"city": "PortVelmo"}')]) == (True, False)
    assert tool_eval.score_call(city, [("get_weather", '{ "city" : "Port Velmo" }')]) == (True, True)


@pytest.fixture(scope="module")
def render_client():
    from musespark import LLM
    from musespark.server.api import ServerConfig, build_app

    llm = LLM(max_model_len=4096)
    app = build_app(llm.engine, ServerConfig(model_name="m", log_requests=False))
    with TestClient(app) as c:
        yield c


def test_training_text_is_what_the_server_renders(render_client):
    for i in range(24):
        conv, _ = mcp.example(11, i)
        body = {"model": "m", "messages": conv.messages, "chat_template_kwargs": conv.kwargs}
        if conv.tools:
            body["tools"] = conv.tools
        r = render_client.post("/v1/chat/completions/render", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == mcp.render_prompt(conv)
        assert mcp.training_text(conv) == mcp.render_prompt(conv) + conv.target


def test_a_target_renders_as_the_server_renders_that_turn_in_history():
    """A call target, sent back as an assistant message, renders to the very text trained on."""
    for i in range(12):
        conv, _ = mcp.heldout_example(13, i, "tool_call", mcp.TOOL_NAMES[i % 3])
        args = conv.expected["arguments"]
        call = mcp.assistant_call(conv.expected["name"], args, _reasoning(conv.target), "call_1")
        later = mcp.tokenizer().apply_chat_template(conv.messages + [call], False, tools=conv.tools, **conv.kwargs)
        assert later == mcp.training_text(conv)


def _reasoning(target: str) -> str:
    return target.split("<|message|>", 1)[1].split("<|eom|>", 1)[0]
