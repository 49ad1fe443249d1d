"""Frozen configuration: the checkpoint's `ModelConfig` and the engine's `EngineConfig` tree.

`ModelConfig` parses and validates a Muse Spark 1x `config.json`. Two shapes are accepted
(docs/spec.md §1):
  * nested, the released omni model: {"model_type": "muse_spark", "text_config": {...}, ...}
  * flat, text-only: {"model_type": "muse_spark_text", ...}
Only the text decoder's fields matter; vision and audio sub-configs are ignored.

`EngineConfig` is what an engine is built from: `ModelSettings` (which checkpoint, dtype,
backend, seed), `CacheConfig`, `SchedulerConfig` and `ParallelConfig`. Every value in it is
resolved (no "auto" left but `dtype`/`backend`, which the loader resolves). These sections
have no defaults: every field is required, and `EngineArgs` (engine/args.py) is the one
place engine defaults and CLI flags live (`EngineArgs(...).create_engine_config()` builds a
whole tree). Each section checks its own fields and raises `InvalidArgumentError` naming
the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from .errors import InvalidArgumentError

LayerType = Literal["full_attention", "sliding_attention"]
MlpType = Literal["dense", "sparse"]

NESTED_MODEL_TYPE = "muse_spark"
FLAT_MODEL_TYPE = "muse_spark_text"
_LAYER_TYPES = ("full_attention", "sliding_attention")
_MLP_TYPES = ("dense", "sparse")


def _nope_every_fourth(num_layers: int, i: int) -> bool:
    """Every 4th layer counted back from the last (the last layer included)."""
    return (num_layers - 1 - i) % 4 == 0


@dataclass(frozen=True)
class ModelConfig:
    """The text decoder's hyper-parameters, with the released schema's defaults."""

    vocab_size: int = 202048
    hidden_size: int = 8192
    intermediate_size: int = 16384
    num_hidden_layers: int = 62
    num_attention_heads: int = 128
    num_key_value_heads: int = 16
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    post_norm_eps: float = 1e-8
    rope_theta: float = 500000.0
    # Per layer; 0 means NoPE. Filled from rope_theta when absent.
    layer_rope_theta: tuple[float, ...] = ()
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int = 2048
    mlp_layer_types: tuple[MlpType, ...] = ()
    qk_scale_factor: float = 5.4730064863875
    output_multiplier: float = 0.1767766952966369
    final_logit_softcapping: float = 20.0
    residual_gate_temperature: float = 0.3
    moe_hidden_size: int = 4096
    moe_intermediate_size: int = 4096
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 1.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 200000
    eos_token_id: tuple[int, ...] = (200001,)
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    # The checkpoint's declared storage dtype ("bfloat16", ...), if any.
    checkpoint_dtype: str | None = None
    # Extra top-level data we round-trip when writing (e.g. vision/audio configs).
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Over 60 lines on purpose: one check per field, in field order, so the schema's
        # rules read in one place.
        n = self.num_hidden_layers
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "sliding_window",
            "moe_hidden_size",
            "moe_intermediate_size",
            "num_local_experts",
            "num_experts_per_tok",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"config field {name!r} must be a positive integer, got {value!r}")
        for name in (
            "rms_norm_eps",
            "post_norm_eps",
            "rope_theta",
            "qk_scale_factor",
            "output_multiplier",
            "final_logit_softcapping",
            "residual_gate_temperature",
            "routed_scaling_factor",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"config field {name!r} must be a positive number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                "config field 'num_attention_heads' must be divisible by 'num_key_value_heads', "
                f"got {self.num_attention_heads} and {self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                "config field 'num_experts_per_tok' must be <= 'num_local_experts', "
                f"got {self.num_experts_per_tok} > {self.num_local_experts}"
            )
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(
                f"config field 'tie_word_embeddings' must be true or false, got {self.tie_word_embeddings!r}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"config field 'hidden_act' must be 'silu', got {self.hidden_act!r}")
        # Fill per-layer defaults (frozen dataclass: use object.__setattr__).
        if not self.layer_types:
            object.__setattr__(
                self,
                "layer_types",
                tuple("full_attention" if _nope_every_fourth(n, i) else "sliding_attention" for i in range(n)),
            )
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", ("sparse",) * n)
        if not self.layer_rope_theta:
            object.__setattr__(
                self,
                "layer_rope_theta",
                tuple(0.0 if _nope_every_fourth(n, i) else float(self.rope_theta) for i in range(n)),
            )
        for name, allowed in (("layer_types", _LAYER_TYPES), ("mlp_layer_types", _MLP_TYPES)):
            values = getattr(self, name)
            if len(values) != n:
                raise ValueError(f"config field {name!r} must have num_hidden_layers={n} entries, got {len(values)}")
            for i, v in enumerate(values):
                if v not in allowed:
                    raise ValueError(f"config field {name!r}[{i}] must be one of {allowed}, got {v!r}")
        if len(self.layer_rope_theta) != n:
            raise ValueError(
                f"config field 'layer_rope_theta' must have num_hidden_layers={n} entries, "
                f"got {len(self.layer_rope_theta)}"
            )
        for i, theta in enumerate(self.layer_rope_theta):
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta < 0 or not math.isfinite(theta):
                raise ValueError(
                    f"config field 'layer_rope_theta'[{i}] must be 0 (NoPE) or a positive number, got {theta!r}"
                )
        if self.head_dim % 2 != 0:
            raise ValueError(f"config field 'head_dim' must be even for RoPE, got {self.head_dim}")
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        elif isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in ("layer_types", "mlp_layer_types", "layer_rope_theta"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.eos_token_id:
            raise ValueError("config field 'eos_token_id' must name at least one token")
        for tok in (*self.eos_token_id, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok:
                raise ValueError(f"config token id must be a non-negative integer, got {tok!r}")

    # ------------------------------------------------------------------ derived

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def is_sparse(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Parse either config shape; unknown fields are ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type")
        extra: dict[str, Any] = {}
        if model_type == NESTED_MODEL_TYPE or "text_config" in data:
            text = data.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("config field 'text_config' must be an object in a nested muse_spark config")
            extra = {k: v for k, v in data.items() if k != "text_config"}
            checkpoint_dtype = (
                text.get("dtype") or text.get("torch_dtype") or data.get("dtype") or data.get("torch_dtype")
            )
        elif model_type in (FLAT_MODEL_TYPE, None):
            text = data
            checkpoint_dtype = data.get("dtype") or data.get("torch_dtype")
        else:
            raise ValueError(
                f"config field 'model_type' must be {NESTED_MODEL_TYPE!r} or {FLAT_MODEL_TYPE!r}, got {model_type!r}"
            )

        kwargs: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "checkpoint_dtype", "rope_theta"}
        for name in names:
            if name in text and (text[name] is not None or name == "bos_token_id"):
                kwargs[name] = text[name]
        rope = text.get("rope_parameters")
        if rope is None and "rope_theta" in text:  # older schema
            rope = {"rope_type": "default", "rope_theta": text["rope_theta"]}
        if rope is not None:
            if not isinstance(rope, dict):
                raise ValueError(f"config field 'rope_parameters' must be an object, got {rope!r}")
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"config field 'rope_parameters.rope_type' must be 'default', got {rope_type!r}")
            if "rope_theta" in rope:
                kwargs["rope_theta"] = rope["rope_theta"]
        for name in ("layer_rope_theta", "layer_types", "mlp_layer_types"):
            if name in kwargs:
                if not isinstance(kwargs[name], (list, tuple)):
                    raise ValueError(f"config field {name!r} must be a list, got {kwargs[name]!r}")
                kwargs[name] = tuple(kwargs[name])
        if "eos_token_id" in kwargs:
            eos = kwargs["eos_token_id"]
            kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        if isinstance(checkpoint_dtype, str):
            kwargs["checkpoint_dtype"] = checkpoint_dtype
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def text_config_dict(self) -> dict[str, Any]:
        """The text fields in the released schema (as written into `text_config`)."""
        out: dict[str, Any] = {"model_type": FLAT_MODEL_TYPE}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "checkpoint_dtype", "rope_theta"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        eos = list(self.eos_token_id)
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        return out

    def to_dict(self, nested: bool = True) -> dict[str, Any]:
        """The whole `config.json`: nested (released omni form) or flat text-only."""
        text = self.text_config_dict()
        if not nested:
            return text
        out = dict(self.extra)
        out["model_type"] = NESTED_MODEL_TYPE
        out["architectures"] = ["MuseSparkForConditionalGeneration"]
        out["text_config"] = text
        # Minimal towers so the released loader accepts the file; our engine ignores them.
        out.setdefault(
            "vision_config",
            {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
        )
        out.setdefault("audio_config", {"hidden_sizes": [8, 8, 8, 8], "out_hidden_size": self.hidden_size})
        out.setdefault("out_hidden_size", 128)
        out.setdefault("projector_hidden_size", 64)
        out["tie_word_embeddings"] = self.tie_word_embeddings
        return out


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}", param=name)


# `kv_cache_dtype` values (vLLM's spellings; what each stores: layers/kv_quant.py).
FP8_KV_SPELLINGS = ("fp8", "fp8_e4m3")
KV_CACHE_DTYPES = ("auto", *FP8_KV_SPELLINGS, "bfloat16", "float16", "float32")


def check_kv_cache_dtype(value: object) -> None:
    """Raise InvalidArgumentError (param `kv_cache_dtype`) unless `value` is one of KV_CACHE_DTYPES;
    vLLM's other quantized spellings (fp8_e5m2, int8_per_token_head, ...) are named not implemented."""
    if value in KV_CACHE_DTYPES:
        return
    known = isinstance(value, str) and value.startswith(("fp8", "int", "nvfp4", "turboquant", "octave", "ultraquant"))
    raise InvalidArgumentError(
        f"kv_cache_dtype {value!r} {'is not implemented' if known else 'is not a KV cache dtype'}; expected one "
        f"of {list(KV_CACHE_DTYPES)} ('auto': the model's dtype; 'fp8' = 'fp8_e4m3': half the bytes of bfloat16)",
        param="kv_cache_dtype",
    )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `kv_cache_memory` bytes (None: `kv_cache_fraction` of available
    RAM), in blocks of `block_size` tokens, holding keys and values as `kv_cache_dtype` says
    ("auto": the model's dtype; "fp8"/"fp8_e4m3": float8 e4m3, layers/kv_quant.py)."""

    block_size: int
    kv_cache_memory: int | None
    kv_cache_fraction: float
    enable_prefix_caching: bool
    kv_cache_dtype: str

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.kv_cache_memory is not None and (
            isinstance(self.kv_cache_memory, bool)
            or not isinstance(self.kv_cache_memory, int)
            or self.kv_cache_memory <= 0
        ):
            raise InvalidArgumentError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}",
                param="kv_cache_memory",
            )
        if (
            isinstance(self.kv_cache_fraction, bool)
            or not isinstance(self.kv_cache_fraction, (int, float))
            or not 0 < self.kv_cache_fraction <= 1
        ):
            raise InvalidArgumentError(
                f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction!r}", param="kv_cache_fraction"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidArgumentError(
                f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}",
                param="enable_prefix_caching",
            )
        check_kv_cache_dtype(self.kv_cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: at most `max_num_seqs` sequences and
    `max_num_batched_tokens` tokens per step; no sequence longer than `max_model_len`.
    (The defaults users get, derived ones included, are EngineArgs'.)"""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            _positive_int(name, getattr(self, name))


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes: `tensor_parallel_size` x `pipeline_parallel_size`
    ranks (musespark.parallel); with `enable_expert_parallel` the TP group shards the experts
    by expert instead of by width."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    enable_expert_parallel: bool

    def __post_init__(self) -> None:
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        if not isinstance(self.enable_expert_parallel, bool):
            raise InvalidArgumentError(
                f"enable_expert_parallel must be true or false, got {self.enable_expert_parallel!r}",
                param="enable_expert_parallel",
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


BackendName = Literal["auto", "torch", "cpu", "triton"]  # see musespark.backends
BACKENDS: tuple[str, ...] = get_args(BackendName)


@dataclass(frozen=True)
class ModelSettings:
    """Which checkpoint and how to run it. `dtype` is "auto" (the checkpoint's), a dtype
    name or a torch.dtype; `backend` is one of BACKENDS (chosen once, at load); `seed` seeds
    the engine's generator for requests without their own seed (None: a non-reproducible
    seed)."""

    path: Path
    dtype: Any  # str | torch.dtype; resolved by the checkpoint loader
    backend: BackendName
    seed: int | None
    generation_config: str  # "auto" | "vllm" | a directory (vLLM's --generation-config)
    nvfp4_mode: str  # NVFP4 checkpoints: "weight-only" | "w4a4"
    skip_tokenizer_init: bool  # vLLM's: no tokenizer (token ids in, token ids out)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        gc = self.generation_config
        if not isinstance(gc, (str, Path)) or (str(gc) not in ("auto", "vllm") and not Path(gc).is_dir()):
            raise InvalidArgumentError(
                f"generation_config must be 'auto', 'vllm' or a directory, got {gc!r}", param="generation_config"
            )
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(
                f"backend must be one of {list(BACKENDS)}, got {self.backend!r}", param="backend"
            )
        if self.nvfp4_mode not in ("weight-only", "w4a4"):
            raise InvalidArgumentError(
                f"nvfp4_mode must be 'weight-only' or 'w4a4', got {self.nvfp4_mode!r}", param="nvfp4_mode"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidArgumentError(f"seed must be None or an int, got {self.seed!r}", param="seed")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from (see `engine/args.py` for defaults and flags)."""

    model: ModelSettings
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: Any  # engine.spec_decode.config.SpeculativeConfig, or None: no speculative decoding
