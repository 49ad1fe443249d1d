"""The input processor: what a request's prompt and parameters become before the engine.

One place for prompt validation, tokenization, chat rendering, the checkpoint's
generation defaults (`generation_config.json`), the `max_tokens` default and the server-wide
`max_tokens` cap (vLLM's: only from `--generation-config DIR` or
`--override-generation-config`); `LLM`, the CLI and the server all call it.

Invariants:
* Read-only after construction, so it is safe to call from several threads at once (the
  server tokenizes and renders chats in worker threads while the engine thread steps).
* Every refusal is an `InvalidArgumentError` naming the argument (`prompt`,
  `prompt_token_ids`, `messages`, `tools`, `max_tokens`, `stop`, ...) or None, raised before
  any work.
* A `ProcessedPrompt` that passed `validate` is safe for the engine: non-empty, shorter
  than `max_model_len`, every id inside the vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..sampling_params import SamplingParams
from ..structured import StructuredOutputManager
from . import chat
from .thinking_budget import plan_for
from .tokenizer import Tokenizer

# generation_config.json key -> SamplingParams field (vLLM's mapping).
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(path: Path) -> dict[str, Any]:
    """Sampling defaults from the checkpoint's generation_config.json (vLLM's behaviour)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError:
        return {}
    return {
        ours: data[theirs] for theirs, ours in _GENERATION_KEYS.items() if theirs in data and data[theirs] is not None
    }


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt as the engine takes it: token ids, and the text when there was one."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None  # prefix-cache namespace (vLLM's prompt "cache_salt")


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        generation_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.generation_defaults: dict[str, Any] = dict(generation_defaults or {})
        # vLLM's server-wide cap on max_tokens: the generation config's max_new_tokens, only when
        # it comes from --generation-config DIR or --override-generation-config (else None).
        self.override_max_tokens: int | None = None
        # Compiles structured-output grammars (thread-safe, cached; xgrammar loads on first use).
        self.structured = StructuredOutputManager(tokenizer, vocab_size) if tokenizer is not None else None
        self.thinking_plan = plan_for(tokenizer)  # thinking_token_budget's markers (None: no channels)
        # The longest token's text: a prompt of N characters has at least N / this many tokens,
        # so a prompt far over max_model_len is refused without tokenizing it.
        self._max_token_chars = (
            max((len(t) for t in tokenizer.vocab_encoding()[0]), default=1) if tokenizer is not None else 1
        )

    # -- prompts ----------------------------------------------------------------------
    def process_prompt(self, prompt: Any) -> ProcessedPrompt:
        """A prompt is a string, {"prompt_token_ids": [...]} (with an optional "prompt"
        text), {"prompt": str}, or an already processed prompt. Not yet validated."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError(
                    "this model has no tokenizer.json: give prompts as {'prompt_token_ids': [...]}", param="prompt"
                )
            self._check_length(prompt, "prompt")
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise InvalidArgumentError(f"prompt has unknown key(s) {sorted(unknown)}", param="prompt")
            salt = prompt.get("cache_salt")
            if salt is not None and not (isinstance(salt, str) and salt):
                raise InvalidArgumentError("cache_salt must be a non-empty string", param="cache_salt")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise InvalidArgumentError("prompt_token_ids must be a list of ints", param="prompt_token_ids")
                return ProcessedPrompt(prompt.get("prompt"), list(ids), salt)
            if "prompt" in prompt:
                return replace(self.process_prompt(prompt["prompt"]), cache_salt=salt)
        raise InvalidArgumentError(
            f"prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}", param="prompt"
        )

    def render_chat(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        *,
        tools: Any = None,
        documents: Any = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
        reasoning_effort: str | None = None,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_effort_map: Mapping[str, str] | None = None,
    ) -> ProcessedPrompt:
        """Apply the chat template (`chat_template`, else the checkpoint's) to one
        conversation, then encode it (no BOS rule by default: the template spells its own).
        Template kwargs, lowest precedence first: `default_chat_template_kwargs` (server-wide),
        `chat_template_kwargs`, then the other arguments (engine/chat.py `template_kwargs`).
        Refusals name `messages`, `tools`, `documents`, `reasoning_effort`, ..."""
        if self.tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer, so it has no chat template")
        try:
            kwargs = chat.template_kwargs(
                default_chat_template_kwargs,
                chat_template_kwargs,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                reasoning_effort=reasoning_effort,
                reasoning_effort_map=reasoning_effort_map,
            )
            for reserved in ("messages", "chat_template"):  # never template kwargs (vLLM drops them too)
                kwargs.pop(reserved, None)
            text = self.tokenizer.apply_chat_template(
                messages,
                bool(kwargs.pop("add_generation_prompt", False)),
                tools=kwargs.pop("tools", None),
                documents=kwargs.pop("documents", None),
                continue_final_message=bool(kwargs.pop("continue_final_message", False)),
                chat_template=chat_template,
                **kwargs,
            )
        except InvalidArgumentError:
            raise
        except Exception as exc:  # ValueError from validation, jinja errors from the template
            raise InvalidArgumentError(str(exc), param="messages") from exc
        self._check_length(text, "messages")
        return ProcessedPrompt(text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _check_length(self, text: str, param: str) -> None:
        at_least = len(text) // max(1, self._max_token_chars)
        if at_least >= self.max_model_len:
            raise InvalidArgumentError(
                f"{param} is at least {at_least} tokens ({len(text)} characters); max_model_len={self.max_model_len} "
                "(the prompt must be shorter than max_model_len)",
                param=param,
            )

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # -- checks -------------------------------------------------------------------------
    def validate_prompt(self, token_ids: list[int]) -> None:
        limit = self.max_model_len
        if not token_ids:
            raise InvalidArgumentError("prompt must not be empty", param="prompt")
        if len(token_ids) >= limit:
            raise InvalidArgumentError(
                f"prompt is {len(token_ids)} tokens; max_model_len={limit} leaves no room to generate "
                "(the prompt must be shorter than max_model_len)",
                param="prompt",
            )
        # vLLM's check and message: the lowest id if one is negative, else the highest.
        lowest, highest = min(token_ids), max(token_ids)
        if lowest < 0 or highest >= self.vocab_size:
            bad = lowest if lowest < 0 else highest
            raise InvalidArgumentError(f"Token id {bad} is out of vocabulary", param="prompt_token_ids")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.validate_prompt(token_ids)
        if params.stop and self.tokenizer is None:
            raise InvalidArgumentError(
                "stop strings need a tokenizer; this model has none (use stop_token_ids)", param="stop"
            )
        # Logit controls: every token id inside the vocabulary; bad_words tokenized here
        # (SamplingParams.update_from_tokenizer, as vLLM's processor does).
        if params.bad_words:
            if self.tokenizer is None:
                raise InvalidArgumentError("bad_words need a tokenizer; this model has none", param="bad_words")
            params.update_from_tokenizer(self.tokenizer)
        vocab = self.vocab_size
        # vLLM's messages for out-of-vocabulary ids in each field.
        for name, ids in (("stop_token_ids", params.stop_token_ids or ()), ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidArgumentError(
                    f"token_id(s) {bad} in {name} contain out-of-vocab token ids. Vocabulary size: {vocab}", param=name
                )
        if any(not 0 <= t < vocab for t in params.allowed_token_ids or ()):
            raise InvalidArgumentError("allowed_token_ids contains out-of-vocab token id!", param="allowed_token_ids")
        bad = sorted({t for seq in params._bad_words_token_ids or () for t in seq if not 0 <= t < vocab})
        if bad:
            raise InvalidArgumentError(
                f"bad_words has out-of-vocabulary token id(s) {bad[:8]}; the vocabulary is [0, {vocab})",
                param="bad_words",
            )
        if params.thinking_token_budget is not None and params._thinking_plan is None:
            object.__setattr__(params, "_thinking_plan", self.thinking_plan)
        # Structured outputs: compiled here, on the caller's thread (the server's worker
        # threads), never on the engine loop; cached per constraint.
        if params.structured_outputs is not None and params._compiled_grammar is None:
            if self.structured is None:
                raise InvalidArgumentError(
                    "structured outputs need a tokenizer; this model has none", param="structured_outputs"
                )
            object.__setattr__(params, "_compiled_grammar", self.structured.compile(params.structured_outputs))

    # -- sampling parameters ----------------------------------------------------------------
    def default_sampling_params(self, fallback_max_tokens: int | None = None, **overrides: Any) -> SamplingParams:
        """vLLM's defaults, overridden by the checkpoint's generation_config.json, then by
        `overrides` (None values ignored). `fallback_max_tokens` applies when neither the
        checkpoint nor `overrides` sets max_tokens (None: SamplingParams' own default)."""
        fields = dict(self.generation_defaults)
        if fallback_max_tokens is not None:
            fields.setdefault("max_tokens", fallback_max_tokens)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**fields)

    def resolve_max_tokens(
        self, max_tokens: int | None, num_prompt_tokens: int, kind: str = "prompt", param: str = "max_tokens"
    ) -> Any:
        """The server's rule (vLLM's `get_max_tokens`): the request's value, else the generation
        config's max_new_tokens, capped by the room left after the prompt and by
        `override_max_tokens`. A request for more than max_model_len is refused (vLLM's
        message). Anything but an int >= 1 is returned as is for SamplingParams to check."""
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None:
            asked = self.generation_defaults.get("max_tokens")
        elif isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1:
            if max_tokens > self.max_model_len:
                raise InvalidArgumentError(
                    f"{param}={max_tokens} cannot be greater than max_model_len={self.max_model_len}. "
                    "Please request fewer output tokens.",
                    param=param,
                )
            asked = max_tokens
        else:
            return max_tokens
        return min(v for v in (room, asked, self.override_max_tokens) if v is not None)
