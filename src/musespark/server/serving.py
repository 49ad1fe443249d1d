"""The two generation routes: /v1/completions and /v1/chat/completions.

Each turns a validated request into (prompt, SamplingParams) pairs, runs them through the
AsyncEngine, and renders either one JSON body or a server-sent-event stream that ends with
`data: [DONE]`. Every ValueError raised while building the request becomes a 400.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..engine.outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine
from .protocol import ChatCompletionRequest, CompletionRequest, envelope, error_body, random_id, usage


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def bad_request(exc: ValueError) -> APIError:
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = first if first.isidentifier() and first in _PARAM_NAMES else None
    return APIError(400, message, param)


_PARAM_NAMES = {"n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
                "prompt", "prompt_token_ids", "messages"}


@dataclass(frozen=True)
class Job:
    """One engine request: a prompt and its parameters."""

    request_id: str
    prompt: dict[str, Any]  # {"prompt_token_ids": [...]} plus "prompt" text when known
    params: SamplingParams


class Serving:
    def __init__(self, engine: AsyncEngine, model_name: str, max_sequences_per_request: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_sequences = max_sequences_per_request
        self.llm = engine.engine
        self.max_model_len = self.llm.scheduler_config.max_model_len

    # -- request -> jobs --------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def _params(self, fields: dict[str, Any], ids: list[int], max_tokens: int | None, kind: str) -> SamplingParams:
        room = self.max_model_len - len(ids)
        if max_tokens is None:
            default = self.llm.generation_defaults.get("max_tokens")
            max_tokens = room if default is None else min(room, default)
        elif isinstance(max_tokens, int) and max_tokens >= 1 and len(ids) + max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the {kind}, "
                                f"{max_tokens} in the completion). Please reduce the length of the {kind} "
                                "or completion.", "max_tokens")
        try:
            return SamplingParams(**fields, max_tokens=max_tokens)
        except ValueError as exc:
            raise bad_request(exc) from None

    def _jobs(self, base_id: str, prompts: list[dict[str, Any]], fields: dict[str, Any],
              max_tokens: int | None, kind: str) -> list[Job]:
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt")
        if len(prompts) * max(1, fields.get("n", 1)) > self.max_sequences:
            raise APIError(400, f"a request may ask for at most {self.max_sequences} sequences "
                                "(prompts times n)", "n")
        jobs = []
        for i, prompt in enumerate(prompts):
            try:
                self.llm.validate(prompt["prompt_token_ids"], SamplingParams())
            except ValueError as exc:
                raise bad_request(exc) from None
            params = self._params(fields, prompt["prompt_token_ids"], max_tokens, kind)
            if params.stop and self.llm.tokenizer is None:
                raise APIError(400, "stop strings need a tokenizer; this model has none", "stop")
            jobs.append(Job(base_id if len(prompts) == 1 else f"{base_id}-{i}", prompt, params))
        return jobs

    def completion_jobs(self, req: CompletionRequest) -> tuple[str, list[Job]]:
        self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo together with logprobs (prompt logprobs) is not supported", "echo")
        raw = req.prompt
        if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        prompts = []
        for p in raw:
            try:
                text, ids = self.llm.tokenize_prompt(p if isinstance(p, str) else {"prompt_token_ids": p})
            except ValueError as exc:
                raise bad_request(exc) from None
            prompts.append({"prompt": text, "prompt_token_ids": ids} if text is not None
                           else {"prompt_token_ids": ids})
        fields = req.sampling_fields(self.llm.generation_defaults)
        fields["logprobs"] = req.logprobs
        base = random_id("cmpl")
        return base, self._jobs(base, prompts, fields, req.max_tokens, "prompt")

    def chat_jobs(self, req: ChatCompletionRequest) -> tuple[str, list[Job]]:
        self.check_model(req.model)
        tok = self.llm.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so it has no chat template")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "when using top_logprobs, logprobs must be set to true", "top_logprobs")
        try:
            text = tok.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt)
        except Exception as exc:  # ValueError from validation, jinja errors from the template
            raise APIError(400, f"invalid messages: {exc}", "messages") from None
        prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        fields = req.sampling_fields(self.llm.generation_defaults)
        fields["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
        base = random_id("chatcmpl")
        return base, self._jobs(base, [prompt], fields, req.requested_max_tokens, "messages")

    # -- running ---------------------------------------------------------------------------
    async def run(self, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all jobs as they come, tagged with the job's index. Closing this
        generator early aborts every unfinished job."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, job: Job) -> None:
            try:
                async for out in self.engine.generate(job.request_id, job.prompt, job.params):
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
    def completion_response(self, base: str, req: CompletionRequest, jobs: list[Job],
                            finals: list[RequestOutput]) -> dict[str, Any]:
        choices, n_prompt, n_out = [], 0, 0
        for i, out in enumerate(finals):
            n_prompt += len(out.prompt_token_ids)
            for c in out.outputs:
                n_out += len(c.token_ids)
                text = self._prompt_text(out) + c.text if req.echo else c.text
                choices.append({"index": i * req.n + c.index, "text": text,
                                "logprobs": self.completion_logprobs(c, c.token_ids, 0),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {**envelope("text_completion", base, self.model_name), "choices": choices,
                "usage": usage(n_prompt, n_out)}

    def chat_response(self, base: str, req: ChatCompletionRequest, final: RequestOutput) -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.chat_logprobs(c, c.token_ids), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in final.outputs]
        n_out = sum(len(c.token_ids) for c in final.outputs)
        return {**envelope("chat.completion", base, self.model_name), "choices": choices,
                "usage": usage(len(final.prompt_token_ids), n_out)}

    def completion_logprobs(self, c: CompletionOutput, ids: list[int], offset: int) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        entries = c.logprobs[len(c.logprobs) - len(ids):] if ids else []
        tokens, chosen, tops, offsets = [], [], [], []
        for token_id, entry in zip(ids, entries):
            name = self._token_name(token_id, entry)
            offsets.append(offset)
            offset += len(name)
            tokens.append(name)
            chosen.append(entry[token_id].logprob)
            tops.append({self._token_name(t, entry): lp.logprob for t, lp in self._ranked(entry)})
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, c: CompletionOutput, ids: list[int]) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        entries = c.logprobs[len(c.logprobs) - len(ids):] if ids else []
        content = []
        for token_id, entry in zip(ids, entries):
            name = self._token_name(token_id, entry)
            content.append({"token": name, "logprob": entry[token_id].logprob, "bytes": list(name.encode()),
                            "top_logprobs": [{"token": self._token_name(t, entry), "logprob": lp.logprob,
                                              "bytes": list(self._token_name(t, entry).encode())}
                                             for t, lp in self._ranked(entry)]})
        return {"content": content}

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.llm.tokenizer
        return "" if tok is None else tok.decode(out.prompt_token_ids, skip_special_tokens=False)

    @staticmethod
    def _ranked(entry: dict) -> list:
        return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)

    @staticmethod
    def _token_name(token_id: int, entry: dict) -> str:
        lp = entry.get(token_id)
        return lp.decoded_token if lp is not None and lp.decoded_token is not None else f"token_id:{token_id}"

    # -- streaming ---------------------------------------------------------------------------
    async def completion_stream(self, base: str, req: CompletionRequest, jobs: list[Job]) -> AsyncIterator[str]:
        created = int(time.time())
        head = envelope("text_completion", base, self.model_name, created)
        started: set[int] = set()
        finished: set[int] = set()
        offsets: dict[int, int] = {}
        last: dict[int, RequestOutput] = {}
        gen = self.run(jobs)
        try:
            async for i, out in gen:
                last[i] = out
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in finished or not (c.delta_token_ids or c.finish_reason):
                        continue
                    text = c.delta_text
                    if req.echo and index not in started:
                        text = self._prompt_text(out) + text
                    started.add(index)
                    lp = self.completion_logprobs(c, c.delta_token_ids, offsets.get(index, 0))
                    if lp is not None:
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
                    choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    if c.finish_reason:
                        finished.add(index)
                    yield _sse({**head, "choices": [choice]})
            if req.include_usage:
                n_prompt = sum(len(o.prompt_token_ids) for o in last.values())
                n_out = sum(len(c.token_ids) for o in last.values() for c in o.outputs)
                yield _sse({**head, "choices": [], "usage": usage(n_prompt, n_out)})
        except Exception as exc:
            yield _sse(error_body(f"generation failed: {exc}", 500))
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"

    async def chat_stream(self, base: str, req: ChatCompletionRequest, jobs: list[Job]) -> AsyncIterator[str]:
        created = int(time.time())
        head = envelope("chat.completion.chunk", base, self.model_name, created)
        started: set[int] = set()
        finished: set[int] = set()
        last: RequestOutput | None = None
        gen = self.run(jobs)
        try:
            async for _, out in gen:
                last = out
                for c in out.outputs:
                    if c.index in finished or not (c.delta_token_ids or c.finish_reason):
                        continue
                    if c.index not in started:  # the role goes out once the first token exists
                        started.add(c.index)
                        yield _sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant",
                                                                                      "content": ""},
                                                         "logprobs": None, "finish_reason": None}]})
                    choice = {"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                              "logprobs": self.chat_logprobs(c, c.delta_token_ids),
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if c.finish_reason:
                        finished.add(c.index)
                    yield _sse({**head, "choices": [choice]})
            if req.include_usage and last is not None:
                n_out = sum(len(c.token_ids) for c in last.outputs)
                yield _sse({**head, "choices": [], "usage": usage(len(last.prompt_token_ids), n_out)})
        except Exception as exc:
            yield _sse(error_body(f"generation failed: {exc}", 500))
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
