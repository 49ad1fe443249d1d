"""`musespark serve` started as a vLLM user starts it: a realistic vLLM command line (dotted
config flags, underscores, `--uds`, `--root-path`, `VLLM_API_KEY`), the start-up summary, the
Muse parsers on by default, `--enable-force-include-usage`, `--skip-tokenizer-init`, a clean
exit on a process-group SIGTERM with `-tp 2`, and a quiet Ctrl-C in `generate`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_server import ServerProcess, free_port

KEY = "env-key"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
                "required": ["city"],
            },
        },
    }
]


class UdsServer:
    """`musespark serve --uds PATH ...` with VLLM_API_KEY in its environment."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.path = str(tmp / "serve.sock")
        self.log_path = tmp / "server.log"
        self.log = open(self.log_path, "wb")
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_API_KEY=KEY)
        env.pop("MUSESPARK_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "musespark", "serve", "--uds", self.path, "--uvicorn-log-level", "warning", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            try:
                if self.http().get("http://localhost/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def http(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.path), timeout=60)

    def client(self, base: str, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://localhost{base}", api_key=key, http_client=self.http(), max_retries=0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def uds_server(tmp_path_factory):
    srv = UdsServer(
        tmp_path_factory.mktemp("uds"),
        "--max_model_len",
        "2048",
        "--structured-outputs-config.backend",
        "xgrammar",
        "--data_parallel_size=1",
        "--root-path",
        "/llm",
        "--enable-force-include-usage",
        "--disable-log-requests",
    )
    yield srv
    srv.stop()


def test_realistic_vllm_line_serves_on_a_unix_socket_with_the_env_key(uds_server):
    for base in ("/llm/v1", "/v1"):  # behind a proxy that keeps the prefix, or one that strips it
        models = uds_server.client(base).models.list()
        assert [m.id for m in models.data] == ["musespark-tiny"]
    with pytest.raises(openai.AuthenticationError):
        uds_server.client("/llm/v1", key="wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        uds_server.client("/v1", key="wrong").models.list()


def test_start_up_summary(uds_server):
    log = uds_server.log_path.read_text()
    assert log.count("musespark serve:") == 1
    for line in ("model:", "dtype:", "backend:", "KV cache:", "max_model_len: 2048", "parsers:       reasoning=muse"):
        assert line in log, log[-2000:]
    assert f"URL:           unix:{uds_server.path}/llm" in log
    assert "Traceback" not in log


def test_muse_parsers_are_on_without_flags(uds_server):
    r = uds_server.client("/v1").chat.completions.create(
        model="musespark-tiny",
        messages=[{"role": "user", "content": "What's the weather like in Paris right now?"}],
        tools=TOOLS,
        temperature=0,
        max_tokens=200,
        extra_body={"chat_template_kwargs": {"current_date": "2026-12-01"}},
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", msg
    assert [t.function.name for t in msg.tool_calls] == ["get_weather"]
    assert getattr(msg, "reasoning", None) and "to=self" not in (msg.content or "")


def test_force_include_usage_ends_every_stream_with_usage(uds_server):
    client = uds_server.client("/v1")
    chunks = list(
        client.completions.create(model="musespark-tiny", prompt="def f(x):", max_tokens=4, temperature=0, stream=True)
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    chat = list(
        client.chat.completions.create(
            model="musespark-tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
        )
    )
    assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == 4


def test_skip_tokenizer_init_takes_and_returns_token_ids(tmp_path):
    srv = ServerProcess(tmp_path / "server.log", "--skip-tokenizer-init")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
        r = client.completions.create(model="musespark-tiny", prompt=[1, 2, 3, 4], max_tokens=5, temperature=0)
        assert r.choices[0].text == "" and r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 4
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="musespark-tiny", prompt="text needs a tokenizer", max_tokens=2)
        with pytest.raises(openai.BadRequestError):  # a chat template needs one too
            client.chat.completions.create(model="musespark-tiny", messages=[{"role": "user", "content": "hi"}])
    finally:
        srv.stop()


@pytest.mark.slow
def test_tensor_parallel_group_sigterm_is_a_clean_exit(tmp_path):
    """What `timeout`, `kill -- -PGID` and systemd do: SIGTERM to every process of the group."""
    port = free_port()
    log = tmp_path / "tp.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "musespark", "serve", "-tp", "2", "--port", str(port), "--max-model-len", "256"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            start_new_session=True,  # its own process group, so the signal reaches only it
        )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        body = {"prompt": "a", "max_tokens": 2}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code == 200
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert "exited with code" not in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_ctrl_c_in_generate_exits_quietly(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "musespark", "generate", "--max-tokens", "100000", "--max-model-len", "4096", "Once"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True,  # a signal of our own, as a terminal's Ctrl-C gives the foreground group
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None and proc.stdout.read(4) == b"Once"  # generating
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err
