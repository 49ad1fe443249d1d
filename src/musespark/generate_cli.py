"""`musespark generate`: complete one or more prompts with the offline engine, printing each
completion as it streams. With `--chat` each prompt is one user message rendered by the chat
template; on a model that speaks Muse, reasoning, answer and tool calls print under their own
labels. `--seed` here is the per-request sampling seed (the engine seed elsewhere)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .engine.args import EngineArgs

# `generate`'s fallback when the checkpoint's generation_config.json sets no max_new_tokens.
GENERATE_MAX_TOKENS = 64


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate completions for one or more prompts",
        usage="musespark generate [flags; --help lists them] PROMPT [PROMPT ...]",
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    EngineArgs.add_cli_args(p, skip={"seed"})
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens to generate per prompt (default: the checkpoint's generation config, else {GENERATE_MAX_TOKENS})",
    )
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", dest="request_seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument(
        "--chat-template",
        default=None,
        help="with --chat: a Jinja chat template file (or the template itself) replacing the checkpoint's",
    )
    p.add_argument(
        "--tools",
        default=None,
        metavar="JSON|FILE",
        help="with --chat: OpenAI tool definitions, a JSON list or a file holding one",
    )
    p.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help='with --chat: extra template kwargs, a JSON object (e.g. \'{"reasoning_strength": "low"}\')',
    )


def load_tools(value: str | None) -> list | None:
    import json
    from pathlib import Path

    if value is None:
        return None
    if value.lstrip().startswith("["):
        text = value
    elif Path(value).is_file():
        text = Path(value).read_text(encoding="utf-8")
    else:
        raise ValueError(f"--tools: give a JSON list of tools or a file holding one, got {value!r}")
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--tools is not valid JSON: {exc}") from None
    return tools


class ChatPrinter:
    """Prints a Muse turn as it streams: reasoning, answer and tool calls under their own
    labels (the model's channel markers are parsed, never printed)."""

    def __init__(self, tools: list | None) -> None:
        from .parsers import MuseOutputParser, tool_schemas_from_openai

        self.parser = MuseOutputParser(
            reasoning=True, tools=bool(tools), tool_names=tool_schemas_from_openai(tools) if tools else None
        )
        self.section: str | None = None

    def _label(self, section: str) -> None:
        if section != self.section:
            print(("\n" if self.section else "") + f"[{section}] ", end="", flush=True)
            self.section = section

    def show(self, delta: Any) -> None:  # a parsers.ParsedDelta
        if delta.reasoning:
            self._label("reasoning")
            print(delta.reasoning, end="", flush=True)
        if delta.content:
            self._label("answer")
            print(delta.content, end="", flush=True)
        for call in delta.tool_calls:
            if call.name is not None:  # a new call: always its own labelled line
                self._label(f"tool call {call.name} #{call.index}")
            print(call.arguments, end="", flush=True)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from .engine.chat import load_chat_template, normalize_tools, parse_template_kwargs
    from .engine.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)), show_progress=True)
    processor = llm.engine.input_processor
    max_tokens = args.max_tokens
    if max_tokens is not None and processor.override_max_tokens is not None:  # the server's cap (vLLM's)
        max_tokens = min(max_tokens, processor.override_max_tokens)
    params = processor.default_sampling_params(
        fallback_max_tokens=GENERATE_MAX_TOKENS,
        max_tokens=max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.request_seed,
    )
    template = load_chat_template(args.chat_template)
    template_kwargs = parse_template_kwargs(args.chat_template_kwargs, "--chat-template-kwargs")
    tools = normalize_tools(load_tools(args.tools))
    muse = args.chat and processor.tokenizer is not None and processor.tokenizer.token_to_id("<|message|>") is not None
    if muse:
        params = dataclasses.replace(params, skip_special_tokens=False)  # the parser reads the markers
    for i, prompt in enumerate(args.prompts):
        if args.chat:
            if processor.tokenizer is None:
                raise ValueError("--chat needs a model with a tokenizer and a chat template")
            request = processor.render_chat(
                [{"role": "user", "content": prompt}],
                chat_template=template,
                chat_template_kwargs=template_kwargs,
                tools=tools,
            )
        else:
            request = prompt
        if len(args.prompts) > 1:
            print(f"--- [{i}] {prompt!r}", flush=True)
        final = None
        printer = ChatPrinter(tools) if muse else None
        for out in llm.generate_stream(request, params):
            if final is None and not args.chat:
                print(prompt, end="", flush=True)  # echo the prompt once the request is accepted
            if printer is None:
                print(out.outputs[0].delta_text, end="", flush=True)
            else:
                printer.show(printer.parser.feed(out.outputs[0].delta_text))
            final = out
        if printer is not None and final is not None:
            printer.show(printer.parser.finish(final.outputs[0].finish_reason))
        print(flush=True)
        if final is not None:
            c = final.outputs[0]
            print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]", file=sys.stderr, flush=True)
    stats = llm.engine.get_stats()
    if stats.num_speculative_tokens and stats.spec_num_drafts:
        mean = 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
        print(
            f"[speculative decoding: mean acceptance length {mean:.2f} over {stats.spec_num_drafts} drafts]",
            file=sys.stderr,
            flush=True,
        )
    return 0
