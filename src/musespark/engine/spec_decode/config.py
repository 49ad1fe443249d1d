"""`SpeculativeConfig`: vLLM's `--speculative-config` JSON, checked once at start-up.

    SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    SpeculativeConfig.parse({"method": "dspark", "model": "DIR", "num_speculative_tokens": 3})

Keys are vLLM 0.33's `SpeculativeConfig` field names. Invariants:
* Every key vLLM accepts is either implemented (`method`, `model`, `num_speculative_tokens`,
  `prompt_lookup_min`, `prompt_lookup_max`, `draft_sample_method` for dspark), accepted
  because ignoring it cannot change any output (`_IGNORED`: draft-side performance switches;
  or any key given at vLLM's default value), or refused with a ValueError that names it. A key
  vLLM does not have is refused too ("unknown key"), as is a method other than "ngram" and "dspark".
* vLLM's ngram defaults: neither lookup bound given -> both 5; one given -> the other takes
  its value; min <= max. `model: "ngram"` alone selects the ngram method.
* `num_speculative_tokens` is required and positive (no draft checkpoint supplies a default here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidArgumentError

METHODS = ("ngram", "dspark")
_IMPLEMENTED = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_sample_method",
)
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# Draft-side performance switches: they change how drafts are made, never what is verified.
_IGNORED = (
    "enforce_eager",
    "disable_padded_drafter_batch",
    "disable_eagle_block_drop",
    "disable_lookahead_block_hashes",
    "use_local_argmax_reduction",
)
# The other fields of vLLM 0.33's SpeculativeConfig, with vLLM's default: given at that
# default they are accepted (nothing changes), given otherwise they are refused.
_VLLM_DEFAULTS: dict[str, Any] = {
    "draft_tensor_parallel_size": None,
    "tensor_parallel_size": None,
    "quantization": None,
    "moe_backend": None,
    "attention_backend": None,
    "kv_cache_dtype": None,
    "max_model_len": None,
    "revision": None,
    "code_revision": None,
    "index_share_for_mtp_iteration": None,
    "draft_lm_head_quantization": None,
    "use_heterogeneous_vocab": False,
    "parallel_drafting": False,
    "target_model_config": None,
    "target_parallel_config": None,
    "num_speculative_tokens_per_batch_size": None,
    "draft_model_config": None,
    "draft_parallel_config": None,
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
    "draft_load_config": None,
    "rejection_sample_method": "standard",
    "synthetic_acceptance_rates": None,
    "synthetic_acceptance_length": None,
    "enable_adaptive_verification": False,
    "dspark_draft_topk": None,
    "xpress_topc": None,
    "fly_window_size": None,
    "fly_entropy_threshold": 0.3,
    "fly_entropy_top_k": 3,
}
_PARAM = "speculative_config"


def _err(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"speculative_config: {message}", param=_PARAM)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _err(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "dspark"
    num_speculative_tokens: int  # k: drafts verified per step per request
    model: str | None = None  # dspark: the draft checkpoint directory (None: the target's)
    prompt_lookup_min: int = 0  # ngram only (0 for other methods)
    prompt_lookup_max: int = 0
    draft_sample_method: str = "greedy"  # dspark: "greedy" (one-hot drafts) | "probabilistic" (drafts ~ q)

    @classmethod
    def parse(cls, value: SpeculativeConfig | str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From a JSON object string or a dict (vLLM's keys); None and "" mean no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise _err(f"not valid JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(value, dict):
            raise _err(f"must be a JSON object (a dict), got {type(value).__name__}")
        data = dict(value)
        for key in data:
            if not isinstance(key, str) or (
                key not in _IMPLEMENTED and key not in _IGNORED and key not in _VLLM_DEFAULTS
            ):
                raise _err(f"unknown key {key!r} (vLLM's keys; implemented here: {', '.join(_IMPLEMENTED)})")
        for key, default in _VLLM_DEFAULTS.items():
            if key in data and data[key] != default:
                raise _err(
                    f"key {key!r}={data[key]!r} is not supported (only vLLM's default {default!r}); "
                    f"implemented keys: {', '.join(_IMPLEMENTED)}"
                )
        method, model = data.get("method"), data.get("model")
        if method is None and model in ("ngram", "[ngram]"):
            method = "ngram"
        if method == "[ngram]":
            method = "ngram"
        if method is None:
            raise _err(f"'method' is required (one of {', '.join(METHODS)})")
        if method not in METHODS:
            raise _err(f"unknown method {method!r} (supported: {', '.join(METHODS)})")
        if model is not None and not isinstance(model, str):
            raise _err(f"model must be a string, got {model!r}")
        if data.get("num_speculative_tokens") is None:
            raise _err("num_speculative_tokens is required")
        k = _positive_int("num_speculative_tokens", data["num_speculative_tokens"])
        lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
        if method == "ngram":
            if data.get("draft_sample_method", "greedy") != "greedy":
                raise _err("draft_sample_method applies to model-based drafters, not method 'ngram'")
            if model not in (None, "ngram", "[ngram]"):
                raise _err(f"method 'ngram' takes no draft model, got model={model!r}")
            lo = _positive_int("prompt_lookup_min", lo) if lo is not None else None
            hi = _positive_int("prompt_lookup_max", hi) if hi is not None else None
            if lo is None and hi is None:
                lo = hi = 5
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            if lo > hi:
                raise _err(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
            return cls("ngram", k, None, lo, hi)
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if data.get(key) is not None:
                raise _err(f"{key} applies to method 'ngram' only, not {method!r}")
        sample = data.get("draft_sample_method", "greedy")
        if sample not in DRAFT_SAMPLE_METHODS:
            raise _err(f"draft_sample_method must be one of {', '.join(DRAFT_SAMPLE_METHODS)}, got {sample!r}")
        return cls(method, k, model, draft_sample_method=sample)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.model is not None:
            out["model"] = self.model
        if self.method == "ngram":
            out.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        elif self.draft_sample_method != "greedy":
            out["draft_sample_method"] = self.draft_sample_method
        return out
