"""The tool loop through the OpenAI client: ask a served Muse model a question, run each tool
call it makes locally with the three demo tools, send the results back, print its answer.

    musespark serve --reasoning-parser muse --enable-auto-tool-choice --tool-call-parser muse &
    python examples/openai_tool_loop.py "What is 4817 * 23?" "What's the weather in Porto?"
    python examples/openai_tool_loop.py --dir docs "Show me serving.md"

It prints question -> call -> result -> answer, as `musespark generate --chat --run-tools DIR`
does offline. The tools are `musespark.apps.demo_tools` (a safe calculator, deterministic fake
weather, `read_file` confined to --dir).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from openai import OpenAI

from musespark.apps.demo_tools import DEMO_TOOLS, run_tool

MAX_TOOL_ROUNDS = 4


def ask(client: OpenAI, model: str, question: str, root: str, max_tokens: int) -> str | None:
    """One conversation: the model's calls are run and answered until it replies in text."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    print(f"[question] {question}")
    for _ in range(MAX_TOOL_ROUNDS + 1):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=list(DEMO_TOOLS.values()), temperature=0, max_tokens=max_tokens
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            print(f"[answer] {message.content}")
            return message.content
        messages.append(message.model_dump(exclude_none=True))  # the assistant turn with its calls
        for call in message.tool_calls:
            print(f"[tool call {call.function.name}] {call.function.arguments}")
            result = run_tool(call.function.name, call.function.arguments, root)
            print(f"[tool result {call.function.name}] {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(f"[stopped: {MAX_TOOL_ROUNDS} tool rounds without an answer]")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("questions", nargs="+", metavar="QUESTION")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--model", default=None, help="the served model name (default: the server's first)")
    p.add_argument("--dir", default=".", help="the directory read_file may read (default: the current one)")
    p.add_argument("--max-tokens", type=int, default=160)
    args = p.parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    for question in args.questions:
        ask(client, model, question, args.dir, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
