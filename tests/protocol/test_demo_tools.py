"""The three demo tools run locally (musespark.apps.demo_tools) and `musespark generate --chat
--run-tools DIR`, which feeds their results back to the model: question -> call -> result ->
answer in one command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from musespark.apps.demo_tools import (
    MAX_FILE_BYTES,
    ToolError,
    calculator,
    get_weather,
    read_file,
    run_tool,
)
from musespark.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

# -- calculator --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, value",
    [
        ("4817 * 23", "110791"),
        ("(3 + 4) * 5", "35"),
        ("  12/4 ", "3"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.3333333333"),
        ("-5 + 2", "-3"),
        ("-(2 + 3) * -2", "10"),
        ("--3", "3"),
        ("+4", "4"),
        ("2 ** 10", "1024"),
        ("-2 ** 2", "-4"),  # ** binds tighter than unary minus, as in Python
        ("2 ** -1", "0.5"),
        ("1.5 + 1.5", "3"),
        ("0.1 + 0.2", "0.3"),
        ("999999 * 999999 * 999999", "999997000002999999"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "function call is not allowed"),
        ("abs(-3)", "function call is not allowed"),
        ("x + 1", "a name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "non-number literal"),
        ("[1, 2]", "List is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("2j + 1", "non-number literal"),
        ("True + 1", "non-number literal"),
        ("7 // 2", "operator // is not supported"),
        ("7 % 2", "operator % is not supported"),
        ("3 & 1", "operator & is not supported"),
        ("1 +", "is not an arithmetic expression"),
        ("import os", "is not an arithmetic expression"),
        ("", "non-empty string"),
        ("1 / 0", "division by zero"),
        ("1 / (2 - 2.0)", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 100000", "exponent 100000 is too large"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 200", "too large"),
        ("1.5 ** 1000", "too large"),
        ("1e400", "too large"),
        ("(-8) ** 0.5", "no real value"),
        ("1" * 150, "too large"),
        ("1 + " * 60 + "1", "characters long"),
    ],
)
def test_calculator_refuses_anything_but_arithmetic(expression, message):
    with pytest.raises(ToolError, match=message):
        calculator(expression)


def test_calculator_does_not_run_code(tmp_path):
    marker = tmp_path / "ran"
    out = run_tool("calculator", {"expression": f"open({str(marker)!r}, 'w')"}, tmp_path)
    assert out.startswith("error: ") and not marker.exists()


# -- get_weather ---------------------------------------------------------------------------------


def test_weather_is_deterministic_per_city():
    porto = json.loads(get_weather("Porto"))
    assert porto == json.loads(get_weather("  porto ")) | {"city": "Porto"}  # case and spaces ignored
    assert set(porto) == {"city", "temperature_c", "conditions"} and -10 <= porto["temperature_c"] <= 35
    cities = [f"Town{i}" for i in range(40)]
    assert len({get_weather(c).split(",", 1)[1] for c in cities}) > 10  # seeded by the name, not constant
    f = json.loads(get_weather("Porto", "fahrenheit"))
    assert f["temperature_f"] == round(porto["temperature_c"] * 9 / 5 + 32) and f["conditions"] == porto["conditions"]


@pytest.mark.parametrize("city, unit, message", [("", "celsius", "city"), ("Oslo", "kelvin", "unit must be")])
def test_weather_refuses_bad_arguments(city, unit, message):
    with pytest.raises(ToolError, match=message):
        get_weather(city, unit)


# -- read_file -------------------------------------------------------------------------------------


@pytest.fixture()
def tree(tmp_path) -> Path:
    root = tmp_path / "root"
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "todo.txt").write_text("buy milk\ncall Anna\n")
    (tmp_path / "secret.txt").write_text("password=hunter2\n")
    (root / "big.txt").write_text("x" * (MAX_FILE_BYTES + 1))
    (root / "binary.bin").write_bytes(b"\xff\xfe\x00\x81")
    (root / "out_link.txt").symlink_to(tmp_path / "secret.txt")
    (root / "out_dir").symlink_to(tmp_path)
    (root / "in_link.txt").symlink_to(root / "notes" / "todo.txt")
    return root


def test_read_file_reads_inside_the_directory(tree):
    assert read_file("notes/todo.txt", tree) == "buy milk\ncall Anna\n"
    assert read_file("./notes/../notes/todo.txt", tree) == "buy milk\ncall Anna\n"  # `..` that stays inside
    assert read_file("in_link.txt", tree) == "buy milk\ncall Anna\n"  # a symlink that stays inside


@pytest.mark.parametrize(
    "path, message",
    [
        ("/etc/hostname", "only paths relative"),
        ("~/secret.txt", "only paths relative"),
        ("../secret.txt", "outside the tool directory"),
        ("notes/../../secret.txt", "outside the tool directory"),
        ("out_link.txt", "outside the tool directory"),
        ("out_dir/secret.txt", "outside the tool directory"),
        ("missing.txt", "no such file"),
        ("notes", "not a regular file"),
        ("big.txt", f"at most {MAX_FILE_BYTES}"),
        ("binary.bin", "not a UTF-8 text file"),
        ("a\x00b", "NUL"),
        ("", "non-empty"),
    ],
)
def test_read_file_refuses_escapes_and_bad_files(tree, path, message):
    with pytest.raises(ToolError, match=message):
        read_file(path, tree)


# -- run_tool --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, arguments, message",
    [
        ("search", "{}", "unknown tool 'search'"),
        ("calculator", "{not json", "not valid JSON"),
        ("calculator", "[1]", "must be a JSON object"),
        ("calculator", "{}", "needs the argument 'expression'"),
        ("get_weather", '{"city": "Oslo", "when": "now"}', "takes no argument 'when'"),
        ("read_file", '{"path": "../x"}', "outside the tool directory"),
    ],
)
def test_run_tool_reports_every_failure_as_a_result(tmp_path, name, arguments, message):
    out = run_tool(name, arguments, tmp_path)
    assert out.startswith("error: ") and message in out


def test_run_tool_runs_each_tool(tree):
    assert run_tool("calculator", '{"expression": "4817 * 23"}', tree) == "110791"
    assert run_tool("get_weather", '{"city": "Porto", "unit": "fahrenheit"}', tree) == get_weather(
        "Porto", "fahrenheit"
    )
    assert run_tool("read_file", {"path": "notes/todo.txt"}, tree) == "buy milk\ncall Anna\n"


# -- musespark generate --chat --run-tools -------------------------------------------------------


def test_run_tools_flag_is_parsed():
    args = build_parser().parse_args(["generate", "--chat", "--run-tools", "some/dir", "hi"])
    assert args.run_tools == "some/dir"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--run-tools", "."], "--run-tools needs --chat"),
        (["--chat", "--run-tools", "no/such/dir"], "is not a directory"),
    ],
)
def test_run_tools_is_checked_before_the_model_loads(argv, message, capsys, monkeypatch):
    import musespark.engine.llm as llm_module

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llm_module, "LLM", no_load)
    assert main(["generate", *argv, "hello"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_generate_runs_the_tool_loop_end_to_end(tmp_path):
    """The bundled model calls the calculator; the CLI runs it, sends the result back and the
    model answers: the call, the result and the answer are printed in that order."""
    proc = subprocess.run(
        [sys.executable, "-m", "musespark", "generate", "--chat", "--run-tools", str(tmp_path)]
        + ["--temperature", "0", "--max-tokens", "120", "What is 4817 * 23?"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    call = out.index("[tool call calculator #0]")
    result_line = next(line for line in out.splitlines() if line.startswith("[tool result calculator #0] "))
    expression = json.loads(out[call:].splitlines()[0].split("] ", 1)[1])["expression"]
    assert result_line == f"[tool result calculator #0] {run_tool('calculator', {'expression': expression}, tmp_path)}"
    assert call < out.index(result_line) < out.index("[answer]", out.index(result_line))
    assert proc.stderr.count("finish_reason=") >= 2  # a turn that called, then one after the result
