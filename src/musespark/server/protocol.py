"""Request and response bodies of the OpenAI-compatible API (pydantic).

Unknown request fields are accepted and ignored, as vLLM does. Sampling fields default to
None so that the checkpoint's generation_config.json supplies the default unless the
request names a value (`sampling_fields`). Range checks live in `SamplingParams`; the
few checks here are the ones that protect the server (sizes the engine cannot bound).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# OpenAI's top_logprobs limit (vLLM's default max_logprobs is 20 as well).
MAX_LOGPROBS = 20
# Seeds must fit a signed 64-bit integer (torch.Generator.manual_seed).
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class RequestModel(BaseModel):
    """The base of every request body: fields outside the model are ignored (as vLLM does)."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(RequestModel):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's names)."""

    model: StrictStr | None = None
    n: StrictInt = 1
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    seed: StrictInt | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Logit controls. OpenAI sends logit_bias keys as strings ({"50256": -100}): an int key
    # type parses them (a non-integer key is a 400 naming logit_bias); ranges and the
    # vocabulary are checked by SamplingParams and InputProcessor.validate.
    logit_bias: dict[int, StrictFloat] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    # Structured outputs (server/constraints.py checks them, naming the field).
    response_format: Any = None
    structured_outputs: Any = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # Prefix-cache namespace: requests share cached prompt blocks only with the same salt.
    cache_salt: StrictStr | None = Field(None, min_length=1)
    # vLLM's extensions: beam search is refused (400 naming the field), never ignored; token
    # ids in the response; logprob tokens named "token_id:N" (also --return-tokens-as-token-ids).
    use_beam_search: StrictBool = False
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool | None = None

    _GEN_FIELDS = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    )

    def sampling_fields(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams keyword arguments: the checkpoint's defaults, then the request's
        values (max_tokens is resolved by the caller, who knows the prompt length)."""
        fields = {k: v for k, v in defaults.items() if k != "max_tokens"}
        for name in self._GEN_FIELDS:
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        fields.update(
            n=self.n,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )
        return fields

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM: `continuous_usage_stats` puts `usage` on every chunk, only with `include_usage`."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


PromptIds = list[StrictInt]


class CompletionRequest(_SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids.
    prompt: StrictStr | list[StrictStr] | PromptIds | list[PromptIds]
    max_tokens: StrictInt | None = 16  # OpenAI's and vLLM's default for completions
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: StrictStr | None = None
    # vLLM's scoring extensions: the prompt's own logprobs, token ids in the response, and
    # keeping only the last N prompt tokens.
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=1)


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class _ChatTemplateFields(RequestModel):
    """What a chat request adds to its template's kwargs (vLLM's names; engine/chat.py).
    Entries of `tools` are checked there, so a bad one is a 400 naming `tools`."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[Any] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None


class ChatCompletionRequest(_SamplingRequest, _ChatTemplateFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    # vLLM's types: `logprobs` is a lax bool ("true" is true); top_logprobs and prompt_logprobs
    # take -1 (the whole vocabulary, then limited by --max-logprobs); server/chat_fields.py checks.
    logprobs: bool | None = False
    top_logprobs: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None
    echo: StrictBool = False  # with continue_final_message: the final message's text leads the answer
    # Muse reasoning channel: after this many reasoning tokens the `to=self` message is ended
    # and the answer begins (-1 or null: no limit).
    thinking_token_budget: StrictInt | None = Field(None, ge=-1)
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    include_reasoning: StrictBool = True  # with --reasoning-parser: send message.reasoning

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_ChatTemplateFields):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False  # vLLM: also each token's vocabulary string


class DetokenizeRequest(RequestModel):
    model: StrictStr | None = None
    tokens: list[StrictInt]


# -- responses (plain dicts built by helpers keep the hot path cheap) ---------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage block. `prompt_tokens_details` is null unless `cached_tokens` is given
    (vLLM sends it only with --enable-prompt-tokens-details): then its `cached_tokens` is the
    prompt tokens the prefix cache served (the engine's count)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
    }


def envelope(
    kind: Literal["text_completion", "chat.completion", "chat.completion.chunk"],
    request_id: str,
    model: str,
    created: int | None = None,
) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}
