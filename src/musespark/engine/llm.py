"""`LLM`: vLLM's offline API over the engine.

    llm = LLM()                                  # the bundled model
    outs = llm.generate(["def f(x):"], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text

Every argument is checked before any work starts; a bad one is a ValueError naming it
(an `InvalidArgumentError` whose `.param` is its name). The engine's knobs and their
defaults are `EngineArgs`' (engine/args.py); prompts and chats go through the engine's
input processor, as in the CLI and the server.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..parsers.defaults import is_muse_template
from ..sampling_params import SamplingParams
from .args import EngineArgs
from .input_processor import ProcessedPrompt
from .llm_engine import LLMEngine
from .outputs import RequestOutput

Prompt = str | dict[str, Any] | ProcessedPrompt


class LLM:
    def __init__(self, model: str | Path | None = None, *, show_progress: bool = False, **engine_args: Any) -> None:
        """`model` and `engine_args` are `EngineArgs` fields (engine/args.py: each one's meaning
        and its default, the only one); an unknown keyword is an `InvalidArgumentError` (a
        ValueError) naming it. `show_progress` draws a bar while the weights load."""
        fields = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_args) - fields)
        if unknown:
            raise InvalidArgumentError(
                f"LLM() got unknown argument(s) {unknown}; engine arguments are EngineArgs' fields: {sorted(fields)}",
                param=unknown[0],
            )
        args = EngineArgs(model=model, **engine_args)
        config = args.create_engine_config()  # every argument checked before the progress bar appears
        from ..startup import weights_bar

        progress = weights_bar(force=True) if show_progress else None
        try:
            self.engine = LLMEngine(config, progress=progress)
        finally:
            if progress is not None:
                progress.close()  # cleared: an error starts on a line of its own
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine under vLLM's name for it (`llm.llm_engine.add_request(...)`, `.step()`)."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    # -- generation -------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order."""
        ids = self._submit(prompts, sampling_params)
        results: dict[str, RequestOutput] = {}
        bar = _progress_bar("Processed prompts", total=len(ids)) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar(len(results), len(ids))
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [results[rid] for rid in ids]

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Streaming form: yields a RequestOutput each step the request advances; each
        completion's `delta_text` / `delta_token_ids` hold what that step added.
        Closing the iterator early aborts the request."""
        (rid,) = self._submit([prompt], sampling_params)
        done = False
        try:
            while not done and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort_request(rid)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        documents: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: render one conversation (a list of messages) or several with
        `chat_template` (the template text; default: the checkpoint's) as HF's
        apply_chat_template does, then generate. `chat_template_kwargs` are extra template
        kwargs, overridden by `tools`, `documents`, `add_generation_prompt` and
        `continue_final_message`. Everything is rendered and checked before anything runs.

        With the Muse chat template each finished `CompletionOutput` also carries the parsed
        view the server gives (`.parsed`, and `.reasoning`, `.content`, `.tool_calls`);
        `.text` stays the raw completion text."""
        processor = self.engine.input_processor
        if processor.tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer, so it has no chat template")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidArgumentError(
                "messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)",
                param="messages",
            )
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            processor.render_chat(
                list(conv),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                continue_final_message=continue_final_message,
            )
            for conv in conversations
        ]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        template = chat_template if chat_template is not None else processor.tokenizer.chat_template
        if is_muse_template(template):
            _parse_muse(outputs, processor.tokenizer, tools)
        return outputs

    # -- helpers ------------------------------------------------------------------
    def _submit(self, prompts: Prompt | Sequence[Prompt], sampling_params: Any) -> list[str]:
        if isinstance(prompts, (str, dict, ProcessedPrompt)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidArgumentError(
                "prompts must be a string, a {'prompt_token_ids': [...]} dict, or a non-empty list of them",
                param="prompt",
            )
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, dict):
            sampling_params = SamplingParams.from_dict(sampling_params)
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidArgumentError(
                    f"sampling_params has {len(params)} entries for {len(prompts)} prompts", param="sampling_params"
                )
            if not all(isinstance(p, SamplingParams) for p in params):
                raise InvalidArgumentError(
                    "sampling_params must be SamplingParams (or a list of them)", param="sampling_params"
                )
        # Validate everything before queueing anything.
        processor = self.engine.input_processor
        tokenized = []
        for prompt, p in zip(prompts, params):
            processed = processor.process_prompt(prompt)
            processor.validate(processed.token_ids, p)
            tokenized.append(processed)
        request_ids = [str(next(self._ids)) for _ in prompts]
        for rid, prompt, p in zip(request_ids, tokenized, params):
            self.engine.add_request(rid, prompt, p)
        return request_ids

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the checkpoint's generation_config.json."""
        return self.engine.input_processor.default_sampling_params()


def _parse_muse(outputs: list[RequestOutput], tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
    """Set `.parsed` on every completion: its tokens, markers kept, read by the Muse parser
    (reasoning channel, answer, ATEM tool calls) as the server's parsers read them."""
    from ..parsers import MuseOutputParser, assemble, tool_schemas_from_openai
    from .chat import normalize_tools

    names = tool_schemas_from_openai(normalize_tools(tools)) if tools else None
    for out in outputs:
        for c in out.outputs:
            parser = MuseOutputParser(reasoning=True, tools=bool(tools), tool_names=names)
            text = tokenizer.decode(c.token_ids, skip_special_tokens=False)
            c.parsed = assemble([parser.feed(text), parser.finish(c.finish_reason)])


def _progress_bar(desc: str, total: int | None = None):
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, leave=False)

    def update(done: int, total_: int) -> None:
        if bar.total != total_:
            bar.total = total_
        bar.update(done - bar.n)  # tqdm rate-limits its own redraws
        if done >= total_:
            bar.close()

    return update
