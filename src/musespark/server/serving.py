"""The generation routes (/v1/completions, /v1/chat/completions), /tokenize and /detokenize
(render.py shows what a request would run).

Each turns a validated request into (prompt, SamplingParams) jobs with the engine's input
processor, runs them through the AsyncEngine, and renders either one JSON body or a
server-sent-event stream that ends with `data: [DONE]`.

Invariants:
* The `*_jobs`, `tokenize` and `detokenize` methods tokenize or render chats: the routes
  call them in a worker thread (`asyncio.to_thread`), never on the event loop.
* Every `ValueError` raised while building a request becomes a 400 whose `param` is the
  error's own (`InvalidArgumentError.param`); no message text is parsed.
* The streams themselves are server/streams.py; vLLM's chat extensions (logprob counts,
  echo, beam search refusal) are server/chat_fields.py.
* With an output parser (chat, `--reasoning-parser` / `--enable-auto-tool-choice`), the
  engine's output processor parses; this file only maps `delta_parsed` / `parsed` to
  `reasoning`, `content` and `tool_calls`, so streamed and non-streamed agree.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.chat import check_tool_choice, normalize_tools
from ..engine.input_processor import ProcessedPrompt
from ..engine.outputs import RequestOutput
from ..parsers import MuseOutputParser
from ..sampling_params import SamplingParams
from . import streams
from .async_engine import AsyncEngine
from .chat_fields import (
    chat_logprob_counts,
    chat_top,
    echo_text,
    final_prompt_limit,
    prompt_logprobs_body,
    refuse_beam_search,
)
from .chat_output import chat_finish_reason, chat_message, chat_usage, output_parser_factory
from .constraints import request_constraint
from .http import APIError, bad_request
from .logprobs import LogprobFormatter, scoring_fields
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
    envelope,
    random_id,
    usage,
)


@dataclass(frozen=True)
class ChatSettings:
    """Server-wide chat template settings: `--chat-template` (None: the checkpoint's),
    `--default-chat-template-kwargs` (the lowest-precedence kwargs) and
    `--reasoning-effort-map` (effort name -> template value; unlisted names map to themselves)."""

    chat_template: str | None = None
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    reasoning_effort_map: Mapping[str, str] = field(default_factory=dict)
    reasoning_parser: str | None = None  # --reasoning-parser
    tool_call_parser: str | None = None  # --tool-call-parser, when --enable-auto-tool-choice is on
    enable_prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids


@dataclass(frozen=True)
class Job:
    """One engine request: a prompt and its parameters."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    output_parser: Callable[[], MuseOutputParser] | None = None  # chat with --reasoning-parser / tools


def _blame_response_format(err: APIError, rf_only: bool) -> APIError:
    """A constraint that came from `response_format` (`rf_only`: the request gave no
    structured_outputs) is blamed on it, not on the structured_outputs key it became."""
    param = err.param or ""
    if not rf_only or not param.startswith("structured_outputs"):
        return err
    where = "response_format.json_schema.schema" if param.endswith(".json") else "response_format"
    return APIError(err.status, err.message.replace(param, where, 1), "response_format")


class Serving:
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        max_sequences_per_request: int,
        chat: ChatSettings | None = None,
        *,
        model_aliases: tuple[str, ...] = (),
        max_logprobs: int = -1,
        force_include_usage: bool = False,
    ) -> None:
        self.engine = engine
        self.force_include_usage = force_include_usage  # --enable-force-include-usage
        self.model_name = model_name
        self.model_aliases = tuple(model_aliases)  # more names requests may use (--served-model-name)
        self.max_logprobs = max_logprobs  # --max-logprobs (-1: only the protocol's cap)
        self.max_sequences = max_sequences_per_request
        self.inputs = engine.input_processor
        self.chat = chat or ChatSettings()
        self.logprobs = LogprobFormatter(self.inputs.tokenizer, self.chat.return_tokens_as_token_ids)

    # -- request -> jobs (worker thread) ------------------------------------------------------
    def check_model(self, req: CompletionRequest | ChatCompletionRequest | TokenizeRequest | DetokenizeRequest) -> None:
        """The request names this server's model (or none); its stream_options come with stream."""
        name = req.model
        if name is not None and name != self.model_name and name not in self.model_aliases:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        keys = ("logprobs", "prompt_logprobs") if isinstance(req, CompletionRequest) else ()
        for key in keys:
            n = getattr(req, key, None)
            if isinstance(n, int) and not isinstance(n, bool) and 0 <= self.max_logprobs < n:
                raise APIError(400, f"{key} must be at most {self.max_logprobs} (--max-logprobs), got {n}", key)
        if getattr(req, "stream_options", None) is not None and not getattr(req, "stream", False):
            raise APIError(400, "stream_options can only be given when stream is true", "stream_options")
        if self.force_include_usage and getattr(req, "stream", False):
            # vLLM's --enable-force-include-usage: usage as if the client asked for it, on every chunk too
            req.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)

    def _jobs(
        self,
        base_id: str,
        prompts: list[ProcessedPrompt],
        fields: dict[str, Any],
        max_tokens: int | None,
        kind: str,
        param: str = "max_tokens",
        rf_only: bool = False,
    ) -> list[Job]:
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt")
        if len(prompts) * max(1, fields.get("n", 1)) > self.max_sequences:
            raise APIError(400, f"a request may ask for at most {self.max_sequences} sequences (prompts times n)", "n")
        jobs = []
        for i, prompt in enumerate(prompts):
            try:
                self.inputs.validate_prompt(prompt.token_ids)
                resolved = self.inputs.resolve_max_tokens(max_tokens, len(prompt.token_ids), kind, param)
                params = SamplingParams(**fields, max_tokens=resolved)
                self.inputs.validate(prompt.token_ids, params)
            except ValueError as exc:
                raise _blame_response_format(bad_request(exc), rf_only) from None
            jobs.append(Job(base_id if len(prompts) == 1 else f"{base_id}-{i}", prompt, params))
        return jobs

    def completion_jobs(self, req: CompletionRequest) -> tuple[str, list[Job]]:
        self.check_model(req)
        refuse_beam_search(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        raw = req.prompt
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        try:
            prompts = [self.inputs.process_prompt(p if isinstance(p, str) else {"prompt_token_ids": p}) for p in raw]
        except ValueError as exc:
            raise bad_request(exc) from None
        prompts = [self._truncate(p, req.truncate_prompt_tokens, req.cache_salt) for p in prompts]
        fields = req.sampling_fields(self.inputs.generation_defaults)
        fields["logprobs"] = req.logprobs
        # echo with logprobs scores the prompt too (lm-evaluation-harness's loglikelihood).
        asked = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
        fields["prompt_logprobs"] = max(asked) if asked else None
        try:
            fields["structured_outputs"] = request_constraint(req.response_format, req.structured_outputs)
        except ValueError as exc:
            raise bad_request(exc) from None
        base = random_id("cmpl")
        rf_only = req.response_format is not None and req.structured_outputs is None
        jobs = self._jobs(base, prompts, fields, req.max_tokens, "prompt", rf_only=rf_only)
        if req.echo:  # the echoed text of a token-id prompt is decoded here, off the event loop
            jobs = [replace(j, prompt=replace(j.prompt, text=self._prompt_text(j.prompt))) for j in jobs]
        return base, jobs

    def _truncate(self, prompt: ProcessedPrompt, keep: int | None, cache_salt: str | None) -> ProcessedPrompt:
        """vLLM's truncate_prompt_tokens (keep the last `keep` tokens; the text then no longer
        matches and is dropped) and the request's cache_salt."""
        if keep is not None and len(prompt.token_ids) > keep:
            prompt = ProcessedPrompt(None, prompt.token_ids[-keep:])
        return replace(prompt, cache_salt=cache_salt)

    def chat_jobs(self, req: ChatCompletionRequest) -> tuple[str, list[Job]]:
        self.check_model(req)
        refuse_beam_search(req)
        if self.inputs.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it has no chat template")
        logprobs, prompt_logprobs = chat_logprob_counts(req, self.inputs.vocab_size, self.max_logprobs)
        prompt = replace(self._render_chat(req, req.messages, tool_choice=req.tool_choice), cache_salt=req.cache_salt)
        fields = req.sampling_fields(self.inputs.generation_defaults)
        fields.update(logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if req.thinking_token_budget is not None and req.thinking_token_budget >= 0:
            fields["thinking_token_budget"] = req.thinking_token_budget
        parser = output_parser_factory(self.chat.reasoning_parser, self.chat.tool_call_parser, req)
        if parser is not None:
            fields["skip_special_tokens"] = False  # the parsers read the channel markers
        try:
            fields["structured_outputs"] = request_constraint(
                req.response_format,
                req.structured_outputs,
                tools=normalize_tools(req.tools),
                tool_choice=req.tool_choice,
                final_message_only=self.chat.reasoning_parser is not None and req.include_reasoning,
            )
        except ValueError as exc:
            raise bad_request(exc) from None
        base = random_id("chatcmpl")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        rf_only = req.response_format is not None and req.structured_outputs is None
        jobs = self._jobs(base, [prompt], fields, req.requested_max_tokens, "messages", param, rf_only)
        return base, [replace(job, output_parser=parser) for job in jobs]

    def _render_chat(
        self,
        req: ChatCompletionRequest | TokenizeRequest,
        messages: Any,
        add_special_tokens: bool = False,
        tool_choice: Any = None,
    ) -> ProcessedPrompt:
        """The request's conversation rendered and encoded; tools and tool_choice are checked
        first. Any refusal is a 400 naming the field to blame."""
        try:
            tools = normalize_tools(req.tools)
            check_tool_choice(tool_choice, tools)
            return self.inputs.render_chat(
                messages,
                req.add_generation_prompt,
                add_special_tokens,
                tools=tools,
                documents=req.documents,
                chat_template=self.chat.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                continue_final_message=req.continue_final_message,
                reasoning_effort=req.reasoning_effort,
                default_chat_template_kwargs=self.chat.default_chat_template_kwargs,
                reasoning_effort_map=self.chat.reasoning_effort_map,
            )
        except ValueError as exc:
            param = getattr(exc, "param", None) or "messages"
            raise APIError(400, f"invalid {param}: {exc}", param) from None

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req)
        if self.inputs.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            ids = self._render_chat(req, req.messages, bool(req.add_special_tokens)).token_ids
        else:
            ids = self.inputs.tokenize(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        strs = [self.inputs.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.inputs.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req)
        tok = self.inputs.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        vocab = self.inputs.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must lie in [0, {vocab}), got {bad[0]}", "tokens")
        return {"prompt": tok.decode(req.tokens)}

    def _prompt_text(self, prompt: ProcessedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        tok = self.inputs.tokenizer
        return "" if tok is None else tok.decode(prompt.token_ids, skip_special_tokens=False)

    # -- running ---------------------------------------------------------------------------
    async def run(self, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all jobs as they come, tagged with the job's index. Closing this
        generator early aborts every unfinished job."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, job: Job) -> None:
            try:
                async for out in self.engine.generate(job.request_id, job.prompt, job.params, job.output_parser):
                    queue.put_nowait((i, out))
            except Exception as exc:
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def final_outputs(self, jobs: list[Job]) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        gen = self.run(jobs)
        try:
            async for i, out in gen:
                if out.finished:
                    finals[i] = out
        finally:
            await gen.aclose()
        return [finals[i] for i in range(len(jobs))]

    # -- rendering ---------------------------------------------------------------------------
    def completion_response(
        self, base: str, req: CompletionRequest, jobs: list[Job], finals: list[RequestOutput]
    ) -> dict[str, Any]:
        choices, n_prompt, n_out, n_cached = [], 0, 0, 0
        fmt = self.logprobs.for_request(req.return_tokens_as_token_ids)
        for i, out in enumerate(finals):
            n_prompt += len(out.prompt_token_ids)
            n_cached += out.num_cached_tokens
            for c in out.outputs:
                n_out += len(c.token_ids)
                text = (out.prompt or "") + c.text if req.echo else c.text
                choice = {
                    "index": i * req.n + c.index,
                    "text": text,
                    "logprobs": fmt.completion_choice(req, out, c.logprobs, c.token_ids, True),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                choices.append(scoring_fields(req, out, choice, c.token_ids))
        return {
            **envelope("text_completion", base, self.model_name),
            "choices": choices,
            "usage": usage(n_prompt, n_out, self.cached_tokens(n_cached)),
        }

    def cached_tokens(self, n: int) -> int | None:
        """usage.prompt_tokens_details.cached_tokens: only with --enable-prompt-tokens-details."""
        return n if self.chat.enable_prompt_tokens_details else None

    def chat_response(self, base: str, req: ChatCompletionRequest, final: RequestOutput) -> dict[str, Any]:
        fmt, top, echo = self.logprobs.for_request(req.return_tokens_as_token_ids), chat_top(req), echo_text(req)
        choices = []
        for c in final.outputs:
            message = chat_message(c, req.include_reasoning, req.tool_choice)
            if echo:
                message["content"] = echo + (message["content"] or "")
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": fmt.chat(c.logprobs, c.token_ids, top),
                    "finish_reason": chat_finish_reason(c, bool(c.parsed and c.parsed.tool_calls), req.tool_choice),
                    "stop_reason": c.stop_reason,
                    "token_ids": list(c.token_ids) if req.return_token_ids else None,
                }
            )
        n_out = sum(len(c.token_ids) for c in final.outputs)
        return {
            **envelope("chat.completion", base, self.model_name),
            "choices": choices,
            "usage": chat_usage(final, n_out, self.cached_tokens(final.num_cached_tokens)),
            "prompt_logprobs": prompt_logprobs_body(final.prompt_logprobs, final_prompt_limit(req)),
            "prompt_token_ids": final.prompt_token_ids if req.return_token_ids else None,
        }

    # -- streaming (server/streams.py) -------------------------------------------------------
    def completion_stream(self, base: str, req: CompletionRequest, jobs: list[Job]) -> AsyncIterator[str]:
        return streams.completion_stream(self, base, req, jobs)

    def chat_stream(self, base: str, req: ChatCompletionRequest, jobs: list[Job]) -> AsyncIterator[str]:
        return streams.chat_stream(self, base, req, jobs)
