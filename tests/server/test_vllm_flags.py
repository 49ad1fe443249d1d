"""`musespark serve` takes a copy-pasted `vllm serve` command line: vLLM's flags parse, the
ones with no meaning here each log one warning, refused ones fail before loading weights,
and unknown flags still fail (musespark.server.vllm_flags)."""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex

import httpx
import pytest

from musespark.cli import build_parser, main
from musespark.server.api import GuardMiddleware, ServerConfig
from musespark.server.vllm_flags import (
    VLLM_SERVE_FLAGS,
    check_vllm_compat,
    human_readable_int,
    parse_override_generation_config,
)

# A Muse Spark `vllm serve` line as deployments write it (MODEL: the bundled model's name).
VLLM_LINE = (
    "--served-model-name muse-spark --max-model-len 256 --gpu-memory-utilization 0.92 "
    "--tensor-parallel-size 1 --enforce-eager --max-num-seqs 8 --kv-cache-dtype auto "
    "--reasoning-parser musespark1x --enable-auto-tool-choice --tool-call-parser musespark1x "
    "--trust-remote-code --enable-prefix-caching --max-num-batched-tokens 2048 --async-scheduling "
    '--compilation-config \'{"cudagraph_mode":"FULL_AND_PIECEWISE"}\' --disable-log-stats '
    "--api-key a --api-key b"
)
IGNORED_IN_LINE = [
    "--gpu-memory-utilization",
    "--enforce-eager",
    "--async-scheduling",
    "--compilation-config",
    "--disable-log-stats",
]


def parse(line: str):
    return build_parser().parse_args(["serve", *shlex.split(line)])


def warnings_of(args, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="musespark.server"):
        check_vllm_compat(args, logging.getLogger("musespark.server"))
    return [r.getMessage() for r in caplog.records]


def test_every_vllm_spelling_parses():
    """Each option string of the table (and the derived --no-/--disable- forms) is known."""
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    known = serve._option_string_actions
    for flag in VLLM_SERVE_FLAGS:
        on, off = flag.option_strings()
        missing = [s for s in on + off if s not in known]
        assert not missing, (flag, missing)
    assert len({s for f in VLLM_SERVE_FLAGS for s in f.names}) == sum(len(f.names) for f in VLLM_SERVE_FLAGS)


def test_realistic_line_parses_and_warns_once_per_ignored_flag(caplog):
    args = parse(VLLM_LINE)
    assert args.served_model_name == ["muse-spark"] and args.api_key == ["a", "b"]
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (256, 8, 2048)
    assert args.enable_auto_tool_choice and args.enable_prefix_caching and args.trust_remote_code
    lines = warnings_of(args, caplog)
    assert len(lines) == len(IGNORED_IN_LINE)
    for flag in IGNORED_IN_LINE:
        assert sum(f"flag {flag} ignored" in line for line in lines) == 1, (flag, lines)


def test_vllm_value_syntax_and_aliases():
    args = parse(
        "--max-model-len 2k --max-num-batched-tokens 4K --kv-cache-memory-bytes 1G --dtype half "
        "--disable-prefix-caching --disable-log-requests --disable-auto-tool-choice --served-model-name x y"
    )
    assert (args.max_model_len, args.max_num_batched_tokens, args.kv_cache_memory) == (2000, 4096, 1 << 30)
    assert args.dtype == "float16" and args.enable_prefix_caching is False and args.log_requests is False
    assert args.enable_auto_tool_choice is False and args.served_model_name == ["x", "y"]
    assert parse("--max-model-len auto").max_model_len is None
    assert parse("--kv-cache-memory 123").kv_cache_memory == 123
    assert parse("").log_requests is True  # default logging unchanged
    assert parse("--enable-log-requests").log_requests is True
    assert parse("--api-key a b").api_key == ["a", "b"]
    assert human_readable_int("25.6k") == 25600
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int("1.5K")


@pytest.mark.parametrize(
    "line, message",
    [
        ("-dp 2", "--data-parallel-size: data parallelism is not implemented (got 2; tensor, pipeline"),
        ("--decode-context-parallel-size 2", "context parallelism is not implemented"),
        ("--distributed-executor-backend ray", "only mp (local workers) and external_launcher"),
        ("--enable-lora", "LoRA"),
        ("--middleware m.M", "middleware"),
    ],
)
def test_refused(line, message, capsys):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_vllm_compat(parse(line))
    # Through main(): exit status 2 and the message, before any weights are loaded (a missing
    # model directory would otherwise be the error).
    assert main(["serve", "/nonexistent/model", *shlex.split(line)]) == 2
    assert message in capsys.readouterr().err


def test_parallel_flags_are_ours():
    args = parse("-tp 2 -ep -pp 1 --distributed-executor-backend mp")
    assert (args.tensor_parallel_size, args.enable_expert_parallel, args.pipeline_parallel_size) == (2, True, 1)
    args = parse("--tensor-parallel-size 4 --no-enable-expert-parallel --pipeline-parallel-size 2")
    assert (args.tensor_parallel_size, args.enable_expert_parallel, args.pipeline_parallel_size) == (4, False, 2)
    check_vllm_compat(args)  # ours: the engine runs them


@pytest.mark.parametrize(
    "line, warns",
    [
        ("-tp 1 -pp 1 -dp 1 --kv-cache-dtype auto --disable-expert-parallel --disable-lora", 0),
        ('--structured-outputs-config \'{"backend": "xgrammar"}\'', 0),
        ('--structured-outputs-config \'{"backend": "guidance"}\'', 1),
        ("--quantization fp8", 1),
        ("--kv-cache-dtype bfloat16", 0),  # ours (EngineArgs.kv_cache_dtype): no warning
        ("--kv-cache-dtype fp8", 0),
        ("--spec-tokens 3", 1),
        ("--enable-chunked-prefill", 1),
        ("--no-enforce-eager --swap-space 4 --hf-token", 3),
    ],
)
def test_checked_and_ignored(line, warns, caplog):
    lines = warnings_of(parse(line), caplog)
    assert len(lines) == warns, lines
    if "spec-tokens" in line:
        assert "--speculative-config" in lines[0]
    if "chunked" in line:
        assert "always on" in lines[0]


def test_speculative_config_is_ours():
    args = parse('-sc \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    assert json.loads(args.speculative_config)["num_speculative_tokens"] == 3
    check_vllm_compat(args)  # ours: no warning, the engine parses it (and refuses a bad one)


def test_unknown_flag_still_fails(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--no-such-flag"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_tokenizer_must_be_the_model(tmp_path, capsys):
    assert main(["serve", "--tokenizer", str(tmp_path)]) == 2
    assert "only MODEL's own tokenizer" in capsys.readouterr().err


def test_override_generation_config(caplog):
    assert parse_override_generation_config('{"temperature": 0.6, "max_new_tokens": 9}') == {
        "temperature": 0.6,
        "max_tokens": 9,
    }
    with caplog.at_level(logging.WARNING, logger="musespark.server"):
        assert parse_override_generation_config('{"top_k": 5, "typical_p": 0.9}') == {"top_k": 5}
    assert len(caplog.records) == 1 and "typical_p" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_override_generation_config("{")


def test_server_config_keys():
    assert ServerConfig(model_name="m", api_key="a").all_api_keys == ("a",)
    assert ServerConfig(model_name="m", api_key="a", api_keys=("b", "a")).all_api_keys == ("a", "b")
    guard = GuardMiddleware(None, ServerConfig(model_name="m", api_keys=("a", "bb")))
    assert guard._authorized(b"Bearer a") and guard._authorized(b"bearer bb") and not guard._authorized(b"Bearer c")
    with pytest.raises(ValueError):
        ServerConfig(model_name="m", api_keys=("",))
    with pytest.raises(ValueError):
        ServerConfig(model_name="m", max_logprobs=-2)


def test_vllm_command_line_end_to_end(tmp_path):
    from test_server import ServerProcess

    log = tmp_path / "server.log"
    srv = ServerProcess(log, *shlex.split(VLLM_LINE), "--disable-fastapi-docs")
    try:
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        for key in ("a", "b"):
            r = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "muse-spark"
        assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer c"}, timeout=10).status_code == 401
        assert httpx.get(f"{srv.url}/openapi.json", timeout=10).status_code == 404
        r = httpx.post(
            f"{srv.url}/v1/completions",
            headers={"Authorization": "Bearer b"},
            timeout=60,
            json={"model": "muse-spark", "prompt": "Hello", "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
    text = log.read_text()
    for flag in IGNORED_IN_LINE:
        assert len(re.findall(rf"WARNING .*vLLM flag {re.escape(flag)} ignored", text)) == 1, (flag, text[-3000:])
    assert len(re.findall(r"vLLM flag \S+ ignored", text)) == len(IGNORED_IN_LINE)


def test_fastapi_docs_switch():
    """/docs, /redoc and /openapi.json by default; none with fastapi_docs=False."""
    from fastapi.testclient import TestClient

    from musespark.engine.args import EngineArgs
    from musespark.engine.llm_engine import LLMEngine
    from musespark.server.api import build_app

    engine = LLMEngine(EngineArgs(max_model_len=64).create_engine_config())
    on = TestClient(build_app(engine, ServerConfig(model_name="m")))  # no `with`: the engine loop stays off
    off = TestClient(build_app(engine, ServerConfig(model_name="m", fastapi_docs=False)))
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert on.get(path).status_code == 200, path
        assert off.get(path).status_code == 404, path


def test_max_logprobs_and_model_aliases_are_enforced():
    from fastapi.testclient import TestClient

    from musespark import LLM
    from musespark.server.api import ServerConfig, build_app

    llm = LLM(max_model_len=128)
    config = ServerConfig(model_name="first", model_aliases=("second",), max_logprobs=2, log_requests=False)
    with TestClient(build_app(llm.engine, config)) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["first", "second"]
        ok = c.post("/v1/completions", json={"model": "second", "prompt": "hi", "max_tokens": 1, "logprobs": 2})
        assert ok.status_code == 200, ok.text
        for body, field in [
            ({"prompt": "hi", "logprobs": 3}, "logprobs"),
            ({"prompt": "hi", "prompt_logprobs": 5}, "prompt_logprobs"),
        ]:
            r = c.post("/v1/completions", json={**body, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        r = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "logprobs": True,
                "top_logprobs": 4,
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        assert c.post("/v1/completions", json={"model": "third", "prompt": "hi"}).status_code == 404
