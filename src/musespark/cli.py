"""The `musespark` command line.

    musespark generate [--model DIR] [--max-tokens N] [--temperature T] [--top-p P]
                       [--seed S] [--chat] PROMPT...

prints each completion as it streams. Without --model it uses the bundled model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .engine.llm import LLM
from .sampling_params import SamplingParams


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for one or more prompts")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled musespark-tiny)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate per prompt (default: "
                   "the checkpoint's generation config, else 64)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-model-len", type=int, default=None)


def _run_generate(args: argparse.Namespace) -> int:
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, show_progress=True)
    engine = llm.engine
    fields = dict(engine.generation_defaults)
    fields.setdefault("max_tokens", 64)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    params = SamplingParams(**fields)
    for i, prompt in enumerate(args.prompts):
        if args.chat:
            tokenizer = llm.get_tokenizer()
            if tokenizer is None:
                raise ValueError("--chat needs a model with a tokenizer and a chat template")
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            request = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        else:
            request = prompt
        if len(args.prompts) > 1:
            print(f"--- [{i}] {prompt!r}", flush=True)
        final = None
        for out in llm.generate_stream(request, params):
            if final is None and not args.chat:
                print(prompt, end="", flush=True)  # echo the prompt once the request is accepted
            print(out.outputs[0].delta_text, end="", flush=True)
            final = out
        print(flush=True)
        if final is not None:
            c = final.outputs[0]
            print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]", file=sys.stderr, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="musespark", description="Serve and run Muse Spark 1x models.")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
    except ValueError as exc:
        print(f"musespark {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
