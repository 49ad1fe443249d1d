"""`musespark generate`: complete one or more prompts with the offline engine, printing each
completion as it streams. With `--chat` each prompt is one user message rendered by the chat
template; on a model that speaks Muse, reasoning, answer and tool calls print under their own
labels. `--seed` here is the per-request sampling seed (the engine seed elsewhere).

`--chat --run-tools DIR` closes the tool loop: each call the model makes to one of the three
demo tools (`calculator`, `get_weather`, `read_file` inside DIR; apps/demo_tools.py) runs
locally, its result is printed and sent back as a tool message, and the model continues, at
most `MAX_TOOL_ROUNDS` times, so one command shows question -> call -> result -> answer."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .engine.args import EngineArgs

# `generate`'s fallback when the checkpoint's generation_config.json sets no max_new_tokens.
GENERATE_MAX_TOKENS = 64
# With --run-tools: tool rounds run for one prompt at most; a call after the last one is not run.
MAX_TOOL_ROUNDS = 4


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
    p.add_argument(
        "--run-tools",
        default=None,
        metavar="DIR",
        help="with --chat: run the model's calls to the demo tools (calculator, get_weather, read_file of files "
        "inside DIR) and send each result back until it answers; offers the three demo tools unless --tools is given",
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
        self.deltas: list[Any] = []  # every parsed delta shown, for `message()`

    def _label(self, section: str) -> None:
        if section != self.section:
            print(("\n" if self.section else "") + f"[{section}] ", end="", flush=True)
            self.section = section

    def message(self) -> Any:  # a parsers.ParsedMessage: the turn so far, as a client assembles it
        from .parsers import assemble

        return assemble(self.deltas)

    def show(self, delta: Any) -> None:  # a parsers.ParsedDelta
        self.deltas.append(delta)
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


def tool_directory(value: str | None, chat: bool) -> str | None:
    """`--run-tools DIR`, checked before any weight loads: an existing directory, with --chat."""
    import os

    if value is None:
        return None
    if not chat:
        raise ValueError("--run-tools needs --chat (the tools run in a chat)")
    if not os.path.isdir(value):
        raise ValueError(f"--run-tools: {value!r} is not a directory (read_file reads only inside it)")
    return value


def _stream(llm: Any, request: Any, params: Any, printer: ChatPrinter | None, echo: str | None) -> Any:
    """Generate one completion, printing it as it streams; the last RequestOutput (or None)."""
    final = None
    for out in llm.generate_stream(request, params):
        if final is None and echo is not None:
            print(echo, end="", flush=True)  # echo the prompt once the request is accepted
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
    return final


def _tool_round_messages(message: Any, root: str, round_index: int) -> list[dict[str, Any]]:
    """The assistant turn that made `message.tool_calls` and one tool message per call, with
    each demo tool run locally; every result is printed under `[tool result NAME #i]`."""
    from .apps.demo_tools import run_tool

    calls = [
        {
            "id": call.id or f"call_{round_index}_{i}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for i, call in enumerate(message.tool_calls)
    ]
    out: list[dict[str, Any]] = [
        {"role": "assistant", "content": message.content, "reasoning": message.reasoning, "tool_calls": calls}
    ]
    for i, call in enumerate(calls):
        result = run_tool(call["function"]["name"], call["function"]["arguments"], root)
        print(f"[tool result {call['function']['name']} #{i}] {result}", flush=True)
        out.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return out


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from .engine.chat import load_chat_template, normalize_tools, parse_template_kwargs
    from .engine.llm import LLM

    tool_root = tool_directory(getattr(args, "run_tools", None), args.chat)
    tools = normalize_tools(load_tools(args.tools))
    if tool_root is not None and tools is None:
        from .apps.demo_tools import DEMO_TOOLS

        tools = normalize_tools(list(DEMO_TOOLS.values()))
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
    muse = args.chat and processor.tokenizer is not None and processor.tokenizer.token_to_id("<|message|>") is not None
    if muse:
        params = dataclasses.replace(params, skip_special_tokens=False)  # the parser reads the markers
    elif tool_root is not None:
        raise ValueError("--run-tools needs a model that speaks Muse (its tool calls are parsed from the Muse format)")
    for i, prompt in enumerate(args.prompts):
        if len(args.prompts) > 1:
            print(f"--- [{i}] {prompt!r}", flush=True)
        if not args.chat:
            _stream(llm, prompt, params, None, prompt)
            continue
        if processor.tokenizer is None:
            raise ValueError("--chat needs a model with a tokenizer and a chat template")
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        for round_index in range(MAX_TOOL_ROUNDS + 1 if tool_root is not None else 1):
            request = processor.render_chat(
                messages, chat_template=template, chat_template_kwargs=template_kwargs, tools=tools
            )
            printer = ChatPrinter(tools) if muse else None
            final = _stream(llm, request, params, printer, None)
            if tool_root is None or printer is None or final is None or not printer.message().tool_calls:
                break
            if round_index == MAX_TOOL_ROUNDS:
                print(f"[stopped: {MAX_TOOL_ROUNDS} tool rounds without an answer]", file=sys.stderr, flush=True)
                break
            messages += _tool_round_messages(printer.message(), tool_root, round_index)
    stats = llm.engine.get_stats()
    if stats.num_speculative_tokens and stats.spec_num_drafts:
        mean = 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
        print(
            f"[speculative decoding: mean acceptance length {mean:.2f} over {stats.spec_num_drafts} drafts]",
            file=sys.stderr,
            flush=True,
        )
    return 0
