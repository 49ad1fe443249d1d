"""The bundled model through the user-facing paths: CLI without --model, LLM() defaults,
chat template, stop strings on detokenized text, streaming text."""

import json
import subprocess
import sys

import pytest

from musespark import LLM, SamplingParams
from musespark.engine.args import bundled_model_path

MODEL = bundled_model_path()


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def test_cli_without_model_generates_from_the_bundled_model():
    prompt = "def add(a, b):"
    out = subprocess.run(
        [sys.executable, "-m", "musespark", "generate", "--max-tokens", "12", "--temperature", "0", prompt],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(prompt)
    assert len(out.stdout.strip()) > len(prompt)
    assert "12 tokens" in out.stderr or "finish_reason=stop" in out.stderr


def test_cli_reports_a_missing_model_clearly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "musespark", "generate", "--model", str(tmp_path / "nope"), "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "does not exist" in out.stderr


def test_llm_uses_the_bundled_model_and_its_generation_defaults(llm):
    assert llm.engine.model_path.resolve() == MODEL.resolve()
    defaults = json.loads((MODEL / "generation_config.json").read_text())
    params = llm.default_sampling_params()
    assert params.temperature == defaults["temperature"] and params.top_p == defaults["top_p"]


def test_greedy_text_matches_token_ids(llm):
    out = llm.generate("import os\n", SamplingParams(temperature=0, max_tokens=24))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 24
    assert c.text == llm.get_tokenizer().decode(c.token_ids)


def test_stop_string_cuts_text_and_stream(llm):
    prompt = "class Stack:\n"
    # Seeded sampling: the same draws every run, and varied text whatever the model's quality.
    base = dict(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    full = llm.generate(prompt, SamplingParams(**base))[0].outputs[0].text
    # A 3-character stop string from inside the greedy text, at its first occurrence.
    starts = [i for i in range(4, len(full) - 3) if full[i : i + 3].strip()]
    assert starts, f"greedy text has no visible characters: {full!r}"
    stop = full[starts[0] : starts[0] + 3]
    params = SamplingParams(**base, stop=[stop])
    out = llm.generate(prompt, params)[0].outputs[0]
    cut = full.index(stop)
    assert out.text == full[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    streamed = "".join(o.outputs[0].delta_text for o in llm.generate_stream(prompt, params))
    assert streamed == out.text
    kept = llm.generate(prompt, SamplingParams(**base, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[: cut + len(stop)]


def test_chat_applies_the_template_once(llm):
    tok = llm.get_tokenizer()
    out = llm.chat([{"role": "user", "content": "Write a function."}], SamplingParams(temperature=0, max_tokens=8))[0]
    ids = out.prompt_token_ids
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert "assistant" in tok.decode(ids, skip_special_tokens=False)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "hi"}])
