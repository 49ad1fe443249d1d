"""The tool loop against a real `musespark serve` with the Muse parsers: the OpenAI-client
example (examples/openai_tool_loop.py) and the held-out tool evaluation
(benchmarks/tool_eval.py), both through the official `openai` client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from test_server import API_KEY, ServerProcess

from musespark.apps.demo_tools import run_tool

REPO = Path(__file__).resolve().parents[2]
PARSERS = ("--reasoning-parser", "muse", "--enable-auto-tool-choice", "--tool-call-parser", "muse")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("tool-loop") / "server.log"
    srv = ServerProcess(log, "--api-key", API_KEY, "--max-model-len", "4096", *PARSERS)
    yield srv
    srv.stop()


def test_the_example_runs_question_call_result_answer(server, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "examples"))
    import openai_tool_loop

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    answer = openai_tool_loop.ask(client, "musespark-tiny", "What is 4817 * 23?", str(tmp_path), 120)
    lines = capsys.readouterr().out.splitlines()
    tags = [line.split("]", 1)[0] + "]" for line in lines]
    assert tags[:3] == ["[question]", "[tool call calculator]", "[tool result calculator]"], lines
    assert tags[-1] == "[answer]" and answer is not None
    arguments = lines[1].split("] ", 1)[1]
    assert lines[2] == f"[tool result calculator] {run_tool('calculator', arguments, tmp_path)}"


def test_tool_eval_reports_each_rate_as_one_json_line(server):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tool_eval.py"), "--base-url", f"{server.url}/v1"]
        + ["--api-key", API_KEY, "--limit", "3", "--max-tokens", "120"],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["tool_tasks"], out["plain_tasks"], out["no_tool_tasks"]) == (3, 1, 1)
    for key in ("right_tool_pct", "exact_arguments_pct", "restate_pct", "plain_no_call_pct", "no_tool_refusal_pct"):
        assert isinstance(out[key], float) and 0 <= out[key] <= 100, key
    assert out["model"] == "musespark-tiny" and out["machine"]["cpu_count"]
