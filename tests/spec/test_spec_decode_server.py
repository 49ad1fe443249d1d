"""`musespark serve --speculative-config` (ngram): the whole openai-client suite of
test_server.py runs again against a speculating server (same answers as the offline LLM
without speculation), and /metrics shows vLLM's spec_decode series with acceptance."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from test_server import *  # noqa: F401,F403 - the same tests, collected again with the fixture below
from test_server import API_KEY, MODEL_NAME, ServerProcess

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("spec_server") / "server.log",
        "--api-key",
        API_KEY,
        "--speculative-config",
        json.dumps(SPEC),
        # the raw chat text, compared with the offline LLM's (the Muse parsers are on by default)
        "--reasoning-parser",
        "none",
        "--tool-call-parser",
        "none",
    )
    yield srv
    srv.stop()


def spec_metrics(url: str) -> tuple[dict[str, float], dict[int, float]]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    totals = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(vllm:spec_decode_num_\w+?_total)\{[^}]*model_name=[^}]*\} (\S+)$", text, re.M)
    }
    per_pos = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(
            r"^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position=\"(\d+)\"[^}]*\} (\S+)$", text, re.M
        )
    }
    return totals, per_pos


def test_metrics_show_acceptance(server, client):
    prompt = "the quick brown fox. the quick brown fox. the quick brown fox. the quick"
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=32, temperature=0)
    totals, per_pos = spec_metrics(server.url)
    drafts = totals["vllm:spec_decode_num_drafts_total"]
    draft_tokens = totals["vllm:spec_decode_num_draft_tokens_total"]
    accepted = totals["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= draft_tokens
    assert sorted(per_pos) == list(range(SPEC["num_speculative_tokens"]))
    assert sum(per_pos.values()) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2] >= per_pos[3]
