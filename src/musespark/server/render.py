"""/v1/chat/completions/render and /v1/completions/render: what a request would run, in
vLLM's `GenerateRequest` shape (the body /inference/v1/generate takes), computed exactly as
the generation routes compute it; nothing reaches the engine.

    {"request_id", "token_ids", "sampling_params", "model", "stream", "stream_options",
     "cache_salt", "priority", "return_token_ids", "output_mode": "tokens", ...,
     "prompt": TEXT}                              (chat: one object; completions: a list)

`sampling_params` holds every public `SamplingParams` field, with `max_tokens` resolved,
so posting a rendered request to /inference/v1/generate samples what the route would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..sampling_params import SamplingParams
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import Job, Serving


def sampling_params_dict(params: SamplingParams) -> dict[str, Any]:
    """The public fields of `params` as JSON values (structured_outputs: its set fields)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        if f.name.startswith("_"):
            continue
        value = getattr(params, f.name)
        if f.name == "structured_outputs" and value is not None:
            value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        elif f.name == "logit_bias" and value is not None:
            value = {str(k): v for k, v in value.items()}
        out[f.name] = value
    return out


def _generate_request(job: Job, req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    return {
        "request_id": job.request_id,
        "token_ids": list(job.prompt.token_ids),
        "features": None,
        "sampling_params": sampling_params_dict(job.params),
        "model": req.model,
        "stream": bool(req.stream),
        "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
        "cache_salt": job.prompt.cache_salt,
        "priority": 0,
        "return_token_ids": getattr(req, "return_token_ids", None),
        "output_mode": "tokens",
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "prompt": job.prompt.text,
    }


def _history_tool_calls(messages: list[dict[str, Any]]) -> int:
    return sum(len(m.get("tool_calls") or ()) for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def render_chat(serving: Serving, req: ChatCompletionRequest) -> dict[str, Any]:
    """The chat request's prompt, token ids and sampling parameters (checked as
    /v1/chat/completions checks them), and the context its output is parsed with."""
    _, (job,) = serving.chat_jobs(req)
    body = _generate_request(job, req)
    body["parse_context"] = {
        "tools": req.tools,
        "tool_choice": req.tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "include_reasoning": req.include_reasoning,
        "chat_template_kwargs": req.chat_template_kwargs or {},
        "history_tool_call_cnt": _history_tool_calls(req.messages),
    }
    return body


def render_completion(serving: Serving, req: CompletionRequest) -> list[dict[str, Any]]:
    """One GenerateRequest per prompt of the completion request (checked as /v1/completions
    checks it)."""
    _, jobs = serving.completion_jobs(req)
    return [_generate_request(job, req) for job in jobs]
