"""Which output parsers a Muse checkpoint gets without being asked.

A checkpoint whose chat template is the Muse template (it writes the Muse channel markers
and ATEM tool calls, docs/muse_chat.md) speaks Muse: `serve` turns the Muse reasoning parser,
the Muse tool-call parser and auto tool choice on by default, and `LLM.chat` returns the
parsed view beside the raw text. Every other template keeps vLLM's behaviour (no parser
unless a flag names one). `--reasoning-parser none` / `--tool-call-parser none` turn each
default off (`none` is never a parser's name).

    parsers = resolve_parsers(template, reasoning_flag, tool_flag, auto_tool_flag)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Text every Muse chat template holds: its turn markers and its tool-call block.
_MUSE_MARKERS = ("<|start|>", "<|message|>", "<|eot|>", "<atem:function_calls>")
MUSE_PARSER = "muse"
OFF = "none"  # `--reasoning-parser none`, `--tool-call-parser none`: no parser


def is_muse_template(template: str | None) -> bool:
    """True when `template` renders the Muse chat format (all its markers appear in it)."""
    return template is not None and all(marker in template for marker in _MUSE_MARKERS)


@dataclass(frozen=True)
class ParserChoice:
    """The parsers `serve` runs with; `muse_defaults` says the Muse default was taken."""

    reasoning_parser: str | None
    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    muse_defaults: bool

    def describe(self) -> str:
        """One line for the start-up summary."""
        tools = self.tool_call_parser if self.enable_auto_tool_choice else "off"
        if self.tool_call_parser is not None and not self.enable_auto_tool_choice:
            tools = f"{self.tool_call_parser} (auto tool choice off)"
        text = f"reasoning={self.reasoning_parser or 'off'}, tools={tools}"
        if self.muse_defaults:
            text += " (Muse defaults; --reasoning-parser none / --tool-call-parser none turn them off)"
        return text


def resolve_parsers(
    template: str | None, reasoning_parser: str | None, tool_call_parser: str | None, auto_tool_choice: bool | None
) -> ParserChoice:
    """The flags as given (None: not given) -> what runs. A flag given always wins; `none`
    turns a parser off. Without the flags, a Muse template gets the Muse parsers and auto
    tool choice; anything else gets none (vLLM's defaults)."""
    muse = is_muse_template(template)
    reasoning = (MUSE_PARSER if muse else None) if reasoning_parser is None else reasoning_parser
    tools = (MUSE_PARSER if muse else None) if tool_call_parser is None else tool_call_parser
    reasoning = None if reasoning == OFF else reasoning
    tools = None if tools == OFF else tools
    auto = (muse and tools is not None) if auto_tool_choice is None else auto_tool_choice
    taken = muse and (reasoning_parser is None or tool_call_parser is None)
    return ParserChoice(reasoning, tools, bool(auto), taken)


def checkpoint_chat_template(model_dir: Path) -> str | None:
    """The checkpoint's chat template as the tokenizer will read it (chat_template.jinja wins
    over tokenizer_config.json's `chat_template`; of a list, the one named "default"), read
    without loading the tokenizer; None when there is none or it cannot be read (loading the
    tokenizer reports why)."""
    jinja = model_dir / "chat_template.jinja"
    try:
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    template = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
