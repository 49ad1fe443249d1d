"""Request and response semantics of vLLM 0.33.0 on /v1/completions, /v1/chat/completions and
/v1/messages, through the official clients against two real `musespark serve` processes:

* `muse`: the Muse parsers, --enable-prompt-tokens-details, max_model_len 1024 and a chat
  template (the bundled one) that also renders custom roles;
* `plain`: --return-tokens-as-token-ids and --override-generation-config max_new_tokens 5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from test_server import API_KEY, MODEL_NAME, ServerProcess

from musespark.engine.args import bundled_model_path

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CAP = 5  # plain server's --override-generation-config max_new_tokens
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a place",
        "parameters": {
            "type": "object",
            "$defs": {
                "Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
            "properties": {"place": {"$ref": "#/$defs/Place"}},
            "required": ["place"],
        },
    },
}
ROOT_REF = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {
            "$ref": "#/$defs/Args",
            "$defs": {"Args": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}},
        },
    },
}


def custom_role_template(path: Path) -> Path:
    """The bundled Muse template, with a header of their own for roles it does not know."""
    text = (bundled_model_path() / "chat_template.jinja").read_text()
    raising = "{{- raise_exception('unknown role ' ~ message.role) -}}"
    assert raising in text
    path.write_text(text.replace(raising, "{{- '<|start|>' + message.role + '<|message|>' + content + '<|eot|>' -}}"))
    return path


@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muse")
    srv = ServerProcess(
        tmp / "server.log",
        "--api-key",
        API_KEY,
        "--max-model-len",
        "1024",
        "--reasoning-parser",
        "muse",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "muse",
        "--enable-prompt-tokens-details",
        "--chat-template",
        str(custom_role_template(tmp / "template.jinja")),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    srv = ServerProcess(
        tmp_path_factory.mktemp("plain") / "server.log",
        "--api-key",
        API_KEY,
        "--return-tokens-as-token-ids",
        "--override-generation-config",
        json.dumps({"max_new_tokens": CAP}),
    )
    yield srv
    srv.stop()


def client_of(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(srv: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers=AUTH, timeout=120)


USER = [{"role": "user", "content": "What is 2+2? Think first."}]


# -- max_tokens ------------------------------------------------------------------------------------


def test_max_tokens_is_the_requests_and_only_the_server_caps_it(muse, plain):
    c = client_of(muse)
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    r = c.completions.create(max_tokens=300, **kw)  # over the checkpoint's max_new_tokens (256)
    assert r.usage.completion_tokens == 300 and r.choices[0].finish_reason == "length"
    r = c.completions.create(max_tokens=300, **{**kw, "extra_body": {"ignore_eos": True, "min_tokens": 300}})
    assert r.usage.completion_tokens == 300
    # More than the room left: cut to it (vLLM's get_max_tokens); more than max_model_len: a 400.
    r = c.completions.create(max_tokens=1020, **kw)
    assert r.usage.completion_tokens == 1024 - r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(max_tokens=5000, **kw)
    assert err.value.body["param"] == "max_tokens" and "max_model_len=1024" in err.value.body["message"]
    # --override-generation-config max_new_tokens caps every request.
    p = client_of(plain)
    r = p.completions.create(max_tokens=50, **kw)
    assert r.usage.completion_tokens == CAP and r.choices[0].finish_reason == "length"
    r = p.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_completion_tokens=50, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == CAP


def test_generate_caps_max_tokens_like_the_server(tmp_path):
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "musespark", "generate", "Once upon a time", "--max-tokens", "40"]
    run = subprocess.run([*cmd, "--generation-config", str(gen)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "[3 tokens, finish_reason=length]" in run.stderr


# -- usage -----------------------------------------------------------------------------------------


def test_continuous_usage_stats_put_usage_on_every_chunk(muse):
    c = client_of(muse)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        c.completions.create(
            model=MODEL_NAME, prompt="def add(a, b):", max_tokens=6, temperature=0, stream=True, stream_options=opts
        )
    )
    assert len(chunks) >= 3 and all(ch.usage is not None for ch in chunks)
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    chunks = list(
        c.chat.completions.create(
            model=MODEL_NAME, messages=USER, max_tokens=8, temperature=0, stream=True, stream_options=opts
        )
    )
    assert all(ch.usage is not None for ch in chunks) and chunks[0].usage.completion_tokens == 0
    # include_usage alone: the usage chunk only.
    chunks = list(
        c.chat.completions.create(
            model=MODEL_NAME,
            messages=USER,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [ch.usage is not None for ch in chunks].count(True) == 1 and chunks[-1].usage is not None


def test_null_fields_and_prompt_tokens_details(muse, plain):
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    r = post(plain, "/v1/completions", body).json()
    choice = r["choices"][0]
    assert {"prompt_logprobs", "prompt_token_ids", "token_ids"} <= choice.keys()
    assert choice["prompt_logprobs"] is None and choice["prompt_token_ids"] is None
    assert r["usage"]["prompt_tokens_details"] is None  # no --enable-prompt-tokens-details
    chat = post(plain, "/v1/chat/completions", {"model": MODEL_NAME, "messages": USER, "max_tokens": 2}).json()
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    assert chat["choices"][0]["token_ids"] is None and chat["usage"]["prompt_tokens_details"] is None
    tok = post(plain, "/tokenize", {"prompt": "hello"}).json()
    assert "token_strs" in tok and tok["token_strs"] is None
    assert post(plain, "/tokenize", {"prompt": "hello", "return_token_strs": True}).json()["token_strs"]
    # --enable-prompt-tokens-details: cached_tokens counts prefix-cache hits.
    long = {**body, "prompt": "The capital of France is Paris. " * 8}
    post(muse, "/v1/completions", long)
    again = post(muse, "/v1/completions", long).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] > 0


# -- logprobs --------------------------------------------------------------------------------------


def test_logprobs_zero_is_the_sampled_token(muse):
    c = client_of(muse)
    r = c.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=4, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4
    assert all(top == {tok: chosen} for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    r = c.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=4, temperature=0, logprobs=True, top_logprobs=0
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(e.token and e.top_logprobs == [] for e in content)


def test_chat_prompt_logprobs_token_ids_and_lax_logprobs(muse):
    base = {"model": MODEL_NAME, "messages": USER, "max_tokens": 3, "temperature": 0}
    r = post(muse, "/v1/chat/completions", {**base, "prompt_logprobs": 1, "return_token_ids": True}).json()
    plp, ids = r["prompt_logprobs"], r["prompt_token_ids"]
    rendered = post(muse, "/v1/chat/completions/render", base).json()["token_ids"]
    assert ids == rendered and len(plp) == len(ids) == r["usage"]["prompt_tokens"] and plp[0] is None
    assert all(str(t) in e for t, e in zip(ids[1:], plp[1:]))
    assert len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"]
    err = post(muse, "/v1/chat/completions", {**base, "prompt_logprobs": -1})
    assert err.status_code == 400 and err.json()["error"]["param"] == "prompt_logprobs"
    err = post(muse, "/v1/chat/completions", {**base, "prompt_logprobs": 1, "stream": True})
    assert err.status_code == 400 and err.json()["error"]["param"] == "prompt_logprobs"
    # "true" is coerced (vLLM's lax bool); top_logprobs -1 means the whole vocabulary, which the
    # logprob limit (20) refuses with vLLM's message.
    r = post(muse, "/v1/chat/completions", {**base, "logprobs": "true", "top_logprobs": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"]) == 3
    err = post(muse, "/v1/chat/completions", {**base, "logprobs": True, "top_logprobs": -1})
    assert err.status_code == 400 and "greater than max allowed: 20" in err.json()["error"]["message"]
    # Tokens named by id, per request.
    r = post(muse, "/v1/chat/completions", {**base, "logprobs": True, "return_tokens_as_token_ids": True}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert all(e["token"] == f"token_id:{t}" for e, t in zip(content, post_ids(muse, base)))


def post_ids(srv: ServerProcess, base: dict) -> list[int]:
    return post(srv, "/v1/chat/completions", {**base, "return_token_ids": True}).json()["choices"][0]["token_ids"]


def test_server_flag_names_tokens_by_id_and_echo_continues(plain):
    c = client_of(plain)
    r = c.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=3, temperature=0, logprobs=1)
    assert all(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
    r = c.completions.create(
        model=MODEL_NAME,
        prompt="def add(a, b):",
        max_tokens=3,
        temperature=0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": False},
    )
    assert not any(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    r = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0, extra_body=extra)
    assert r.choices[0].message.content.startswith("The answer is")
    chunks = list(
        c.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0, extra_body=extra, stream=True
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == r.choices[0].message.content


# -- refused, custom roles, thinking budget --------------------------------------------------------


def test_beam_search_is_refused_naming_the_field(muse):
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": USER}),
    ):
        r = post(muse, path, {**body, "model": MODEL_NAME, "max_tokens": 2, "use_beam_search": True, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


def test_custom_roles_reach_the_template(muse):
    messages = [{"role": "my-custom-role", "content": "Be brief."}, *USER]
    rendered = post(muse, "/v1/chat/completions/render", {"model": MODEL_NAME, "messages": messages}).json()
    assert "<|start|>my-custom-role<|message|>Be brief.<|eot|>" in rendered["prompt"]
    r = client_of(muse).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_thinking_token_budget_ends_the_reasoning(muse):
    c = client_of(muse)
    kw = dict(model=MODEL_NAME, messages=USER, max_tokens=120, temperature=0)
    free = c.chat.completions.create(**kw).choices[0].message
    tokens = lambda text: post(muse, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["count"]  # noqa: E731
    assert tokens(free.reasoning) > 5  # the model reasons longer on its own
    chunks = list(c.chat.completions.create(**kw, stream=True, extra_body={"thinking_token_budget": 5}))
    reasoning = [getattr(ch.choices[0].delta, "reasoning", None) for ch in chunks if ch.choices]
    text = "".join(r for r in reasoning if r)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert 0 < tokens(text) <= 5 and sum(1 for r in reasoning if r) <= 5 and content.strip()
    msg = c.chat.completions.create(**kw, extra_body={"thinking_token_budget": 5}).choices[0].message
    assert msg.reasoning == text and msg.content == content


# -- tools -----------------------------------------------------------------------------------------


def test_defs_refs_in_forced_tools_and_named_choice_content(muse):
    c = client_of(muse)
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=250)
    r = c.chat.completions.create(**kw, tools=[WEATHER, ROOT_REF], tool_choice="required", temperature=0)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert (call.function.name == "get_weather" and isinstance(args["place"]["city"], str)) or (
        call.function.name == "lookup" and isinstance(args["word"], str)
    )
    named = {"type": "function", "function": {"name": "lookup"}}
    r = c.chat.completions.create(**kw, tools=[WEATHER, ROOT_REF], tool_choice=named, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "lookup" and isinstance(json.loads(call.function.arguments)["word"], str)
    assert r.choices[0].message.content == ""
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}},
    }
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(**kw, response_format=bad)
    assert err.value.body["param"] == "response_format" and "structured_outputs" not in err.value.body["message"]


def test_streamed_tool_calls_never_send_an_empty_delta(muse):
    c = client_of(muse)
    chunks = list(
        c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            temperature=0,
            stream=True,
        )
    )
    deltas = [ch.choices[0].delta.model_dump(exclude_none=True) for ch in chunks if ch.choices]
    assert deltas and all(deltas), [i for i, d in enumerate(deltas) if not d]
    assert any(ch.choices and ch.choices[0].delta.tool_calls for ch in chunks)


def test_anthropic_tool_ids_and_thinking_only_on_request(muse):
    a = anthropic.Anthropic(base_url=muse.url, api_key=API_KEY, max_retries=0, timeout=120)
    tool = {
        "name": "get_weather",
        "description": "Weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    kw = dict(model=MODEL_NAME, max_tokens=120, messages=[{"role": "user", "content": "Weather in Paris?"}])
    msg = a.messages.create(**kw, tools=[tool], tool_choice={"type": "any"})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and all(b.id.startswith("toolu_") for b in uses)
    assert not any(b.type == "thinking" for b in msg.content)  # reasoned, but not asked for
    asked = a.messages.create(**kw, thinking={"type": "adaptive"})
    assert asked.content[0].type == "thinking" and asked.content[0].thinking
    with a.messages.stream(**kw) as stream:
        events = [e for e in stream if e.type == "content_block_start"]
    assert [e.index for e in events] == list(range(len(events)))
    assert not any(e.content_block.type == "thinking" for e in events)
    with pytest.raises(anthropic.BadRequestError):
        a.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})  # budget >= max_tokens
