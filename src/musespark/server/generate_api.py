"""/inference/v1/generate: vLLM's token-in/token-out API. A request gives prompt token ids
and `sampling_params` (the body /v1/*/render returns); the answer gives generated token
ids (`output_mode: "tokens"`, the default) or also their text (`"text"`), as one JSON body
or, with `stream`, server-sent events ending in `data: [DONE]`. POST
/inference/v1/abort_requests `{"request_ids": [...]}` aborts running ones (their answer
ends with finish_reason "abort").

Invariants:
* `sampling_params` keys are SamplingParams fields (vLLM's names); a vLLM-only key is
  accepted only at its default value (it would change nothing), any other key is a 400
  naming it. An absent `max_tokens` is the server's default, as on /v1/completions.
* The response's `request_id` is `generate-tokens-` + the request's `request_id`; abort
  takes that id. `TokenGeneration.running` holds exactly the requests being answered.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator

from ..engine.input_processor import ProcessedPrompt
from ..engine.outputs import CompletionOutput, Logprob, RequestOutput
from ..sampling_params import SamplingParams
from .chat_fields import prompt_logprobs_body
from .http import (
    SSE_DONE,
    APIError,
    Preparation,
    SSEResponse,
    bad_request,
    error_body,
    parse_body,
    sse,
    until_disconnect,
)
from .protocol import RequestModel, StreamOptions
from .serving import Job, Serving

_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_"))
# vLLM SamplingParams fields with no counterpart here, at the values that change nothing.
_VLLM_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "detokenize": (True, False),  # checked against output_mode below
    "output_kind": (0, 1, 2, None),  # the route decides (streamed deltas or the final output)
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (None,),
    "extra_args": (None, {}),
    "logits_processors": (None, []),
    "flat_logprobs": (False,),
    "logprob_token_ids": (None,),
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,),
    "thinking_token_budget": (None,),
    "skip_clone": (False,),
    "watermarking": (None, False),
    "stream_interval": (None, 1),
    "output_text_buffer_length": (0,),
    "skip_reading_prefix_cache": (None, False),
    "repetition_detection": (None,),
    "routed_experts_prompt_start": (0,),
    "trace_decode_token_ids": (None,),
}


class GenerateRequest(RequestModel):
    request_id: StrictStr = Field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: list[StrictInt] = Field(min_length=1)
    sampling_params: dict[str, Any]
    model: StrictStr | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=1024)
    priority: StrictInt = 0
    return_token_ids: StrictBool | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    features: Any = None
    content_parts: Any = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v


def _sampling_params(sp: dict[str, Any], output_mode: str) -> dict[str, Any]:
    fields = {}
    for key, value in sp.items():
        if key in _FIELDS:
            fields[key] = value
        elif key not in _VLLM_DEFAULTS or value not in _VLLM_DEFAULTS[key]:
            raise APIError(400, f"sampling_params.{key} is not supported here (value {value!r})", "sampling_params")
    bias = fields.get("logit_bias")
    if isinstance(bias, dict):  # JSON object keys are strings: "50256" means token 50256
        fields["logit_bias"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in bias.items()}
    if output_mode != "tokens" and sp.get("detokenize") is False:
        raise APIError(
            400, f"output_mode={output_mode!r} requires sampling_params.detokenize to be true", "output_mode"
        )
    return fields


class AbortRequest(RequestModel):
    request_ids: Any = None


class TokenGeneration:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        # Running requests: the client's id (`generate-tokens-<request_id>`) -> engine ids
        # (one client id may be running more than once); read by /inference/v1/abort_requests.
        self.running: dict[str, set[str]] = {}

    def _started(self, req: GenerateRequest, job: Job) -> None:
        self.running.setdefault(_response_id(req), set()).add(job.request_id)

    def _ended(self, req: GenerateRequest, job: Job) -> None:
        ids = self.running.get(_response_id(req))
        if ids is not None:
            ids.discard(job.request_id)
            if not ids:
                del self.running[_response_id(req)]

    def abort(self, request_ids: list[str]) -> None:
        """Abort the running requests with these ids; unknown ids are ignored."""
        for rid in request_ids:
            for engine_id in list(self.running.get(rid, ())):
                self.serving.engine.abort(engine_id)

    async def final(self, req: GenerateRequest, job: Job) -> RequestOutput:
        self._started(req, job)
        try:
            (out,) = await self.serving.final_outputs([job])
        finally:
            self._ended(req, job)
        return out

    def job(self, req: GenerateRequest) -> Job:
        """The engine request (worker thread): every refusal is a 400 naming the field."""
        s = self.serving
        s.check_model(req)  # type: ignore[arg-type]
        if req.output_mode == "derender":
            raise APIError(400, "output_mode='derender' is not supported; use 'tokens' or 'text'", "output_mode")
        if req.features is not None or req.content_parts is not None:
            raise APIError(400, "multimodal inputs are not supported (Muse Spark is text-only here)", "features")
        if req.output_mode == "text" and s.inputs.tokenizer is None:
            raise APIError(400, "output_mode='text' requires a tokenizer; this model has none", "output_mode")
        fields = _sampling_params(req.sampling_params, req.output_mode)
        n = fields.get("n", 1)
        if isinstance(n, int) and n > s.max_sequences:
            raise APIError(400, f"sampling_params.n must be at most {s.max_sequences}, got {n}", "sampling_params")
        try:
            s.inputs.validate_prompt(req.token_ids)
            fields["max_tokens"] = s.inputs.resolve_max_tokens(fields.get("max_tokens"), len(req.token_ids))
            params = SamplingParams(**fields)
            s.inputs.validate(req.token_ids, params)
        except TypeError as exc:
            raise APIError(400, f"invalid sampling_params: {exc}", "sampling_params") from None
        except ValueError as exc:
            raise bad_request(exc) from None
        prompt = ProcessedPrompt(None, list(req.token_ids), req.cache_salt)
        # The engine's id is made unique: clients choose request_id and may reuse one.
        return Job(f"{_response_id(req)}-{uuid.uuid4().hex[:8]}", prompt, params)

    # -- bodies ----------------------------------------------------------------------------
    def _logprobs(self, req: GenerateRequest, c: CompletionOutput, entries: Any, ids: list[int]) -> Any:
        if req.sampling_params.get("logprobs") is None:
            return None
        if req.output_mode == "text":
            return self.serving.logprobs.chat(entries, ids)
        content = []
        for token, entry in zip(ids, entries or ()):
            chosen = entry.get(token)
            if chosen is None:
                content.append({"token_id": token, "logprob": -9999.0, "rank": None, "top_logprobs": []})
                continue
            others = sorted(((t, lp) for t, lp in entry.items() if t != token), key=lambda x: x[1].rank or 1 << 30)
            content.append(
                {
                    **_entry(token, chosen),
                    "top_logprobs": [_entry(t, lp) for t, lp in [(token, chosen), *others]],
                }
            )
        return {"content": content}

    def _choice(self, req: GenerateRequest, c: CompletionOutput, final: bool) -> dict[str, Any]:
        ids = list(c.token_ids if final else c.delta_token_ids)
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": (c.finish_reason or "stop") if final else c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": ids,
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
            "logprobs": self._logprobs(req, c, c.logprobs if final else c.delta_logprobs, ids),
        }
        if req.output_mode == "text":
            choice["text"] = c.text if final else c.delta_text
        return choice

    def response(self, req: GenerateRequest, job: Job, final: RequestOutput) -> dict[str, Any]:
        n_prompt = len(final.prompt_token_ids)
        n_out = sum(len(c.token_ids) for c in final.outputs)
        return {
            "request_id": _response_id(req),
            "model": self.serving.model_name,
            "created": int(time.time()),
            "usage": _usage(n_prompt, n_out),
            "prompt_logprobs": prompt_logprobs_body(final.prompt_logprobs, sys.maxsize),  # every entry
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": list(final.prompt_token_ids) if req.return_token_ids else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": req.output_mode,
            "choices": [self._choice(req, c, True) for c in final.outputs],
        }

    async def stream(self, req: GenerateRequest, job: Job) -> AsyncIterator[str]:
        text = req.output_mode == "text"
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts and opts.continuous_usage_stats)
        n_prompt, generated = len(job.prompt.token_ids), [0] * job.params.n
        send_prompt_ids = bool(req.return_token_ids)
        self._started(req, job)  # here, not in the route: a stream that never starts registers nothing
        gen = self.serving.run([job])
        try:
            async for _, out in gen:
                for c in out.outputs:
                    generated[c.index] = len(c.token_ids)
                    if not (c.delta_token_ids or c.finish_reason is not None or (text and c.delta_text)):
                        continue
                    chunk: dict[str, Any] = {"request_id": _response_id(req), "usage": None}
                    if continuous:
                        chunk["usage"] = _usage(n_prompt, generated[c.index])
                    if send_prompt_ids:
                        chunk["prompt_token_ids"], send_prompt_ids = list(out.prompt_token_ids), False
                    chunk["output_mode"] = req.output_mode
                    chunk["choices"] = [self._choice(req, c, False)]
                    yield sse(chunk)
            if include_usage:
                usage = _usage(n_prompt, sum(generated))
                rid = _response_id(req)
                yield sse({"request_id": rid, "usage": usage, "output_mode": req.output_mode, "choices": []})
        except Exception as exc:
            yield sse(error_body(f"generation failed: {exc}", 500))
        finally:
            self._ended(req, job)
            await gen.aclose()
        yield SSE_DONE


def _response_id(req: GenerateRequest) -> str:
    return f"generate-tokens-{req.request_id}"


def _entry(token: int, lp: Logprob) -> dict[str, Any]:
    return {"token_id": token, "logprob": max(lp.logprob, -9999.0), "rank": lp.rank or None}


def _usage(n_prompt: int, n_out: int) -> dict[str, Any]:
    return {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": None,
    }


def add_routes(app: FastAPI, serving: Serving, prep: Preparation) -> None:
    tokens = TokenGeneration(serving)

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        req = await parse_body(request, GenerateRequest)
        job = await prep.run(tokens.job, req)
        if req.stream:
            return SSEResponse(tokens.stream(req, job))

        async def work() -> JSONResponse:
            return JSONResponse(tokens.response(req, job, await tokens.final(req, job)))

        return await until_disconnect(request, work())

    @app.post("/inference/v1/abort_requests")
    async def abort_requests(request: Request) -> Response:
        """vLLM's abort: {"request_ids": [...]}, the ids /inference/v1/generate answers with."""
        ids = (await parse_body(request, AbortRequest)).request_ids
        if ids is None:
            raise APIError(400, "Missing 'request_ids' in request body", "request_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise APIError(400, "request_ids must be a list of strings", "request_ids")
        tokens.abort(ids)
        return Response(status_code=200)
