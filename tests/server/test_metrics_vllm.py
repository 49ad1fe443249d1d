"""vLLM's Prometheus families through a real `musespark serve` (one server, started without
the load-tracking and tokenizer-info flags): each family of vLLM's per-request and
per-step metrics has vLLM's type, labels and buckets and moves with the requests served;
/load stays 0 and /tokenizer_info does not exist without their flags."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_endpoints import load_while_streaming
from test_server import API_KEY, MAX_MODEL_LEN, MODEL_NAME, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LABELS = {"model_name": MODEL_NAME, "engine": "0"}
HISTOGRAMS = (
    "vllm:iteration_tokens_total",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("metrics") / "server.log", "--api-key", API_KEY, "--block-size", "32")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def scrape(url: str) -> dict:
    """{family name: (type, {(sample name, labels as a sorted tuple): value})}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples})
    return out


def sample(fams: dict, family: str, suffix: str = "", **labels: str) -> float:
    kind, samples = fams[family]
    key = (family + suffix, tuple(sorted({**LABELS, **labels}.items())))
    return samples[key]


def test_families_have_vllms_types_labels_and_buckets(server):
    fams = scrape(server.url)
    for name in HISTOGRAMS:
        assert fams[name][0] == "histogram", name
        for _, labels in fams[name][1]:
            assert {k for k, _ in labels} - {"le"} == {"model_name", "engine"}, (name, labels)
    buckets = {dict(lbl)["le"] for (n, lbl) in fams["vllm:iteration_tokens_total"][1] if n.endswith("_bucket")}
    assert buckets == {str(float(b)) for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)} | {
        "+Inf"
    }
    prompt_buckets = {dict(lbl)["le"] for (n, lbl) in fams["vllm:request_prompt_tokens"][1] if n.endswith("_bucket")}
    one_two_five = [m * 10**e for e in range(6) for m in (1, 2, 5) if m * 10**e <= MAX_MODEL_LEN]
    assert prompt_buckets == {str(float(b)) for b in one_two_five} | {"+Inf"}  # vLLM's 1-2-5 series to max_model_len
    kind, waiting = fams["vllm:num_requests_waiting_by_reason"]
    assert kind == "gauge"
    assert {dict(lbl)["reason"] for (_, lbl) in waiting} == {"capacity", "deferred"}
    kind, info = fams["vllm:cache_config_info"]
    assert kind == "gauge"
    ((_, labels), value), *_ = info.items()
    labels = dict(labels)
    assert value == 1 and labels["block_size"] == "32" and labels["engine"] == "0"
    assert int(labels["num_gpu_blocks"]) > 0 and labels["enable_prefix_caching"] == "True"


def test_request_metrics_move_with_requests(server, client):
    before = scrape(server.url)
    to_the_end = {"ignore_eos": True}
    out = client.completions.create(
        model=MODEL_NAME, prompt="def add(a, b):", max_tokens=7, n=2, temperature=1.0, extra_body=to_the_end
    )
    hi = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=hi, max_tokens=3, temperature=0, extra_body=to_the_end
    )
    after = scrape(server.url)

    def delta(family: str, suffix: str) -> float:
        return sample(after, family, suffix) - sample(before, family, suffix)

    sequences = 3  # n=2, then one chat sequence
    assert delta("vllm:request_prompt_tokens", "_count") == sequences
    assert delta("vllm:request_prompt_tokens", "_sum") == 2 * out.usage.prompt_tokens + chat.usage.prompt_tokens
    assert delta("vllm:request_generation_tokens", "_sum") == out.usage.completion_tokens + chat.usage.completion_tokens
    assert delta("vllm:request_params_n", "_count") == 2 and delta("vllm:request_params_n", "_sum") == 3
    assert delta("vllm:request_params_max_tokens", "_count") == sequences
    assert delta("vllm:request_params_max_tokens", "_sum") == 2 * 7 + 3
    assert delta("vllm:request_max_num_generation_tokens", "_count") == 2
    assert delta("vllm:request_max_num_generation_tokens", "_sum") == 7 + 3  # ignore_eos: each runs to max_tokens
    assert delta("vllm:request_time_per_output_token_seconds", "_count") == sequences
    for family in HISTOGRAMS[7:]:
        assert delta(family, "_count") == sequences, family
    assert delta("vllm:request_inference_time_seconds", "_sum") >= delta("vllm:request_decode_time_seconds", "_sum")
    assert delta("vllm:request_inference_time_seconds", "_sum") >= delta("vllm:request_prefill_time_seconds", "_sum")
    # Every step is observed once: at least one per token of the longest sequence.
    assert delta("vllm:iteration_tokens_total", "_count") >= 7
    generated = out.usage.completion_tokens + chat.usage.completion_tokens
    assert delta("vllm:iteration_tokens_total", "_sum") > generated  # the generated tokens and some prompt tokens
    waiting = sum(v for (n, _), v in after["vllm:num_requests_waiting_by_reason"][1].items())
    assert waiting == sample(after, "vllm:num_requests_waiting")


def test_load_and_tokenizer_info_without_their_flags(server):
    assert asyncio.run(load_while_streaming(server.url))[0] == 0  # vLLM: /load reports 0 when not tracking
    assert httpx.get(f"{server.url}/tokenizer_info", timeout=10).status_code == 404
