"""`musespark serve --kv-cache-dtype fp8` (vLLM's spelling) through the real command line: the
server keeps its KV cache in float8 e4m3, twice the blocks of the default for the same
--kv-cache-memory-bytes, and answers as the offline engine with the same cache does."""

from __future__ import annotations

import re

import openai
from test_server import MAX_MODEL_LEN, ServerProcess

from musespark import LLM, SamplingParams

BUDGET = 4 << 20


def kv_line(log: str) -> tuple[int, str, int]:
    m = re.search(r"KV cache: +(\d+) blocks x \d+ tokens = \d+ tokens, (\w+), (\d+) bytes", log)
    assert m, log[-3000:]
    return int(m.group(1)), m.group(2), int(m.group(3))


def test_serve_fp8_kv_cache(tmp_path):
    prompt = "The history of the Roman empire is long and"
    offline = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory=BUDGET, kv_cache_dtype="fp8")
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    bf16_blocks = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory=BUDGET).engine.core.runner.num_blocks
    log_path = tmp_path / "server.log"
    srv = ServerProcess(log_path, "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", str(BUDGET))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
        got = client.completions.create(model=srv_model(client), prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want
    finally:
        srv.stop()
    blocks, dtype, nbytes = kv_line(log_path.read_text())
    assert dtype == "float8_e4m3fn"
    assert blocks == 2 * bf16_blocks and nbytes <= BUDGET


def srv_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
