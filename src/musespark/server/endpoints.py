"""vLLM's operational and batch routes: POST /v1/chat/completions/batch, POST /invocations
and GET|POST /ping (SageMaker), POST /v1/completions/render, GET /load and GET
/tokenizer_info.

* /v1/chat/completions/batch: `messages` is a list of conversations; each runs as its own
  chat request with the shared fields, concurrently, and the answer has one choice per
  conversation (index i = conversation i) and the summed usage. Not supported (400 naming
  the field, as vLLM refuses or cannot honour them): `stream`, `tools`, `n` other than 1,
  a `tool_choice` other than "none", `use_beam_search`.
* /invocations routes by the body's shape as vLLM does: a valid chat request (it has
  `messages`) goes to /v1/chat/completions, else a valid completion request (`prompt`) to
  /v1/completions, else a 400 naming the request types expected.
* /load: {"server_load": N}, the in-flight requests counted with
  --enable-server-load-tracking (always 0 without it, as vLLM answers).
* /tokenizer_info (only with --enable-tokenizer-info-endpoint; 404 otherwise): the
  tokenizer's configuration (tokenizer_config.json without file paths), `tokenizer_class`,
  and the chat template in use.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from .http import APIError, Preparation, parse_body, until_disconnect, validation_error
from .load import ServerLoad
from .protocol import ChatCompletionRequest, CompletionRequest, envelope, random_id, usage
from .render import render_completion
from .serving import Job, Serving

Handler = Callable[[Request, Any], Awaitable[Response]]


class _AnyBody(BaseModel):
    """Any JSON object (/invocations picks the request type from it)."""

    model_config = ConfigDict(extra="allow")


class BatchChatCompletionRequest(ChatCompletionRequest):
    messages: list[Annotated[list[dict[str, Any]], Field(min_length=1)]] = Field(min_length=1)  # type: ignore[assignment]
    tool_choice: Literal["none"] | None = "none"  # type: ignore[assignment]
    use_beam_search: StrictBool = False


def _single_requests(req: BatchChatCompletionRequest) -> list[ChatCompletionRequest]:
    """One chat request per conversation, sharing every other field."""
    if req.stream:
        raise APIError(400, "Batch chat completions do not support streaming; set `stream` to false.", "stream")
    if req.tools:
        raise APIError(400, "Batch chat completions do not support tools; omit `tools`.", "tools")
    if req.use_beam_search:
        raise APIError(
            400,
            "Batch chat completions do not support beam search. Please set `use_beam_search` to False.",
            "use_beam_search",
        )
    if req.n != 1:
        raise APIError(400, "Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n")
    shared = req.model_dump(exclude={"messages", "use_beam_search", "tool_choice"}, exclude_unset=True)
    try:
        return [ChatCompletionRequest.model_validate({**shared, "messages": conv}) for conv in req.messages]
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


class BatchChat:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    def jobs(self, req: BatchChatCompletionRequest) -> list[tuple[ChatCompletionRequest, str, Job]]:
        out = []
        for single in _single_requests(req):
            base, (job,) = self.serving.chat_jobs(single)
            out.append((single, base, job))
        return out

    async def response(self, planned: list[tuple[ChatCompletionRequest, str, Job]]) -> dict[str, Any]:
        finals = await self.serving.final_outputs([job for _, _, job in planned])
        choices, n_prompt, n_out, n_cached = [], 0, 0, 0
        for i, ((single, base, _), final) in enumerate(zip(planned, finals)):
            (choice,) = self.serving.chat_response(base, single, final)["choices"]
            choices.append({**choice, "index": i})
            n_prompt += len(final.prompt_token_ids)
            n_out += sum(len(c.token_ids) for c in final.outputs)
            n_cached += final.num_cached_tokens
        return {
            **envelope("chat.completion", random_id("chatcmpl"), self.serving.model_name),
            "choices": choices,
            "usage": usage(n_prompt, n_out, n_cached),
        }


def tokenizer_info(model_path: Path, chat_template: str | None) -> dict[str, Any]:
    """vLLM's /tokenizer_info body: the tokenizer's configuration without file paths, its
    class, and the chat template in use (the server's --chat-template, else the checkpoint's)."""
    config_file = model_path / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
    for key in ("vocab_file", "merges_file"):
        config.pop(key, None)

    def plain(value: Any) -> Any:  # AddedToken-style {"content": ...} entries become their text
        if isinstance(value, dict):
            return (
                value["content"] if isinstance(value.get("content"), str) else {k: plain(v) for k, v in value.items()}
            )
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    config = {k: plain(v) for k, v in config.items()}  # added_tokens_decoder: {id: its text}
    config["tokenizer_class"] = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    template = chat_template
    if template is None and (model_path / "chat_template.jinja").is_file():
        template = (model_path / "chat_template.jinja").read_text()
    if template is None:
        template = config.get("chat_template")
    if template:
        config["chat_template"] = template
    else:
        config.pop("chat_template", None)
    return config


def add_routes(
    app: FastAPI,
    serving: Serving,
    prep: Preparation,
    *,
    chat: Handler,
    completion: Handler,
    load: ServerLoad,
    tokenizer_info_enabled: bool,
    chat_template: str | None,
) -> None:
    """Register the routes above; `chat` and `completion` answer a validated request as
    /v1/chat/completions and /v1/completions do."""
    batch = BatchChat(serving)

    @app.post("/v1/chat/completions/batch")
    async def chat_batch(request: Request) -> Response:
        req = await parse_body(request, BatchChatCompletionRequest)
        planned = await prep.run(batch.jobs, req)

        async def work() -> JSONResponse:
            return JSONResponse(await batch.response(planned))

        return await until_disconnect(request, work())

    @app.post("/v1/completions/render")
    async def completion_render(request: Request) -> Any:
        req = await parse_body(request, CompletionRequest)
        return await prep.run(render_completion, serving, req)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        body = (await parse_body(request, _AnyBody)).model_dump()
        for model, handler in ((ChatCompletionRequest, chat), (CompletionRequest, completion)):
            try:
                req = model.model_validate(body)
            except ValidationError:
                continue
            return await handler(request, req)
        raise APIError(
            400,
            "Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', 'CompletionRequest']",
        )

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return Response(status_code=200 if serving.engine.is_alive else 503)

    @app.get("/load")
    async def server_load() -> dict[str, int]:
        return {"server_load": load.value}

    if tokenizer_info_enabled:
        info = tokenizer_info(serving.engine.model_path, chat_template)

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict[str, Any]:
            return info
