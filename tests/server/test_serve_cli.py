"""The `musespark` command line as a vLLM user types it: vLLM's dotted and underscore
spellings, `--help` and its `--help=KEYWORD` forms, short errors, one value syntax for
`serve` and `generate`, `max_model_len` against the checkpoint, the Muse parser defaults, and
VLLM_API_KEY. In-process through `build_parser` / `main`, and through the real command where
the exit status and the printed lines are the point."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from musespark import serve_cli
from musespark.cli import build_parser, main
from musespark.cli_parsing import normalize_argv
from musespark.engine.args import EngineArgs, bundled_model_path

MODEL = bundled_model_path()


def musespark(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "musespark", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def resolve(*argv: str) -> serve_cli.ServeSettings:
    return serve_cli.resolve(build_parser().parse_args(["serve", *argv]), logging.getLogger("test_serve_cli"))


# -- vLLM's spellings --------------------------------------------------------------------------


def test_dotted_and_underscore_spellings_normalise_as_vllm_does():
    argv, keyword = normalize_argv(
        [
            "--max_model_len=64",
            "--structured-outputs-config.backend",
            "xgrammar",
            "--speculative_config.method=ngram",
            "--speculative-config.num_speculative_tokens",
            "2",
            "--speculative-config.prompt_lookup_max",
            "4k",
        ]
    )
    assert keyword is None
    assert argv[0] == "--max-model-len=64"
    assert json.loads(argv[argv.index("--structured-outputs-config") + 1]) == {"backend": "xgrammar"}
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4000}
    # A dotted field merges into the JSON object given for the flag itself.
    argv, _ = normalize_argv(
        ["--speculative-config", '{"method": "ngram"}', "--speculative-config.num_speculative_tokens=3"]
    )
    assert argv == ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3})]
    # Values and arguments after a bare `--` are left as written.
    assert normalize_argv(["--served-model-name", "a_b.c", "--", "--x_y"])[0] == [
        "--served-model-name",
        "a_b.c",
        "--",
        "--x_y",
    ]


def test_vllm_spellings_reach_the_settings(caplog):
    with caplog.at_level(logging.WARNING):
        s = resolve(
            "--data_parallel_size",
            "1",
            "--max_model_len=64",
            "--structured-outputs-config.backend",
            "xgrammar",
            "--speculative-config.method",
            "ngram",
            "--speculative-config.num_speculative_tokens",
            "2",
        )
    assert s.engine_args.max_model_len == 64
    spec = s.engine_args.create_engine_config().speculative
    assert spec is not None and spec.num_speculative_tokens == 2
    assert not [r for r in caplog.records if "structured-outputs" in r.getMessage()]  # xgrammar: accepted silently


# -- help and errors ---------------------------------------------------------------------------


def test_serve_help_shows_ours_and_the_vllm_flags_on_request(capsys):
    def help_of(flag: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            main(["serve", flag])
        assert exit_.value.code == 0
        return capsys.readouterr().out

    short = help_of("--help")
    assert "--max-model-len" in short and "--uds" in short and "--help=all" in short
    assert "--gpu-memory-utilization" not in short
    assert "--gpu-memory-utilization" in help_of("--help=all")
    group = help_of("--help=vllm")
    assert "--gpu-memory-utilization" in group and "--max-model-len" not in group
    front = help_of("--help=frontend")  # vLLM's --help=<group> form, on our own groups too
    assert "--uds" in front and "--max-model-len" not in front and "--gpu-memory-utilization" not in front
    found = help_of("--help=root_path")
    assert "--root-path" in found and "--max-model-len" not in found
    assert "No group or flag" in help_of("--help=nosuchflagxyz")


def test_bad_port_is_one_line_without_traceback():
    out = musespark("serve", "--port", "99999")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["musespark serve: error: --port 99999: a port is between 0 and 65535"]


@pytest.mark.parametrize("argv", [["--dtype", "float8"], ["--api-key"]])
def test_bad_flag_value_prints_a_short_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: musespark serve") and "error:" in lines[1]


def test_generate_reports_its_own_unknown_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--bogus", "hello"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "musespark generate: error: unrecognized arguments: --bogus" in err
    assert err.startswith("usage: musespark generate")


def test_port_in_use_is_reported_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # A model that does not exist: the port is checked first, so the port is the error.
        out = musespark("serve", "/nonexistent/model", "--port", str(port))
    assert out.returncode == 2, out.stderr
    assert f"--port {port}: address 127.0.0.1:{port} is already in use" in out.stderr
    assert "Traceback" not in out.stderr


# -- max_model_len -----------------------------------------------------------------------------


def model_copy(tmp_path: Path, max_position_embeddings: int) -> Path:
    """The bundled model with another max_position_embeddings (weights linked, not copied)."""
    dst = tmp_path / "model"
    dst.mkdir()
    for f in MODEL.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((MODEL / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = max_position_embeddings
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_max_model_len_above_the_model_is_refused_by_serve_and_generate(capsys):
    with pytest.raises(ValueError, match=r"max_model_len=100000 is greater than the model's max_position_embeddings"):
        EngineArgs(max_model_len=100000).create_engine_config()
    # The same value syntax for both commands: 32k is 32000, over the bundled model's 4096.
    assert main(["generate", "--max-model-len", "32k", "x"]) == 2
    assert "max_model_len=32000 is greater than the model's max_position_embeddings=4096" in capsys.readouterr().err
    args = build_parser().parse_args(["generate", "--max-model-len", "1K", "x"])
    assert EngineArgs.from_cli_args(args).max_model_len == 1024
    assert (
        EngineArgs.from_cli_args(build_parser().parse_args(["generate", "--max-model-len", "auto", "x"])).max_model_len
        is None
    )


def test_default_max_model_len_is_the_models_own(tmp_path):
    model = model_copy(tmp_path, 6000)
    assert EngineArgs(model=model).create_engine_config().scheduler.max_model_len == 6000


def test_kv_cache_too_small_for_one_sequence_says_which_flags(tmp_path):
    from musespark import LLM

    model = model_copy(tmp_path, 1 << 20)
    with pytest.raises(ValueError, match=r"--max-model-len.*--kv-cache-memory"):
        LLM(model=model, kv_cache_memory=1 << 20)


# -- server settings ---------------------------------------------------------------------------


def test_vllm_api_key_env_is_the_default_key(monkeypatch):
    monkeypatch.delenv("MUSESPARK_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert resolve().server.all_api_keys == ("from-env",)
    assert resolve("--api-key", "flag").server.all_api_keys == ("flag",)  # the flag wins, as in vLLM


def test_muse_template_turns_the_muse_parsers_on_by_default(tmp_path):
    s = resolve()
    assert (s.server.reasoning_parser, s.server.tool_call_parser, s.server.enable_auto_tool_choice) == (
        "muse",
        "muse",
        True,
    )
    assert s.parsers.muse_defaults and "reasoning=muse" in s.parsers.describe()
    off = resolve("--reasoning-parser", "none", "--tool-call-parser", "none")
    assert (off.server.reasoning_parser, off.server.tool_call_parser, off.server.enable_auto_tool_choice) == (
        None,
        None,
        False,
    )
    only_reasoning = resolve("--tool-call-parser", "none")
    assert only_reasoning.server.reasoning_parser == "muse" and only_reasoning.server.tool_call_parser is None
    # Another template keeps vLLM's behaviour: no parser unless a flag names one.
    plain = resolve("--chat-template", "{{ messages[0]['content'] }}")
    assert (plain.server.reasoning_parser, plain.server.tool_call_parser) == (None, None)
    named = resolve("--chat-template", "{{ messages[0]['content'] }}", "--reasoning-parser", "muse")
    assert named.server.reasoning_parser == "muse" and not named.server.enable_auto_tool_choice


def test_frontend_switches_reach_the_server_config(tmp_path):
    s = resolve(
        "--root-path",
        "/llm/",
        "--enable-force-include-usage",
        "--enable-server-load-tracking",
        "--enable-tokenizer-info-endpoint",
        "--uds",
        str(tmp_path / "s.sock"),
    )
    assert s.server.root_path == "/llm" and s.uds == str(tmp_path / "s.sock")
    assert s.server.enable_force_include_usage and s.server.enable_server_load_tracking
    assert s.server.enable_tokenizer_info_endpoint
    assert resolve("--skip-tokenizer-init").engine_args.skip_tokenizer_init


def test_llm_chat_gives_the_parsed_view_beside_the_raw_text():
    from musespark import LLM, SamplingParams

    llm = LLM(max_model_len=2048)
    from test_startup import TOOLS as tools

    (out,) = llm.chat(
        [{"role": "user", "content": "What's the weather like in Paris right now?"}],
        SamplingParams(temperature=0, max_tokens=200),
        tools=tools,
        chat_template_kwargs={"current_date": "2026-12-01"},
    )
    c = out.outputs[0]
    assert c.parsed is not None and c.reasoning and c.reasoning in c.text  # .text stays the raw completion
    assert [t.name for t in c.tool_calls] == ["get_weather"]
    (plain,) = llm.chat(
        [{"role": "user", "content": "Who wrote Hamlet?"}], SamplingParams(temperature=0, max_tokens=200)
    )
    p = plain.outputs[0]
    assert p.content and p.content in p.text and p.content != p.text and p.tool_calls == []


# -- progress ----------------------------------------------------------------------------------


def test_kernel_build_announces_itself_and_its_time(tmp_path, monkeypatch, capsys):
    import torch.utils.cpp_extension as cpp_extension

    from musespark.kernels import cpu

    monkeypatch.setenv("MUSESPARK_CACHE", str(tmp_path))  # an empty cache: the build runs
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: None)  # the compiler's part, skipped
    cpu._compile()
    err = capsys.readouterr().err
    assert "musespark: building the CPU kernels (first run only; about" in err
    assert re.search(r"musespark: the CPU kernels built in \d+ s", err)


def test_weight_loading_and_benchmark_iterations_show_progress():
    env = {"MUSESPARK_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    out = musespark("generate", "--max-tokens", "1", "--max-model-len", "64", "x", env=env)
    assert out.returncode == 0, out.stderr
    assert re.search(r"Loading weights: +\d+%.*\d+(\.\d+)?[kMG]?/\d+(\.\d+)?[kMG]", out.stderr), out.stderr[-500:]
    bench = ["bench", "latency", "--input-len", "4", "--output-len", "2", "--batch-size", "1", "--num-iters", "2"]
    out = musespark(*bench, "--num-iters-warmup", "1", env=env)
    assert out.returncode == 0, out.stderr
    assert "Warmup iterations" in out.stderr and "Profiling iterations" in out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["benchmark"] == "latency"  # stdout stays clean


def test_help_keyword_does_not_stick_to_the_next_parse(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help=all"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--gpu-memory-utilization" not in capsys.readouterr().out
