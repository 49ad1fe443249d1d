"""`EngineArgs`: every engine knob, its default and its CLI flag, in one place.

    args = EngineArgs(model="DIR", max_model_len=4096)      # or EngineArgs.from_cli_args(ns)
    config = args.create_engine_config()                     # a frozen EngineConfig tree
    engine = LLMEngine(config)

Invariants:
* A field's default here is the only default: `LLM(...)`, `musespark generate`, `serve` and
  `bench` all take theirs from this table (a command may change a default, e.g. bench turns
  prefix caching off; `add_cli_args(defaults=...)` says so where the command is built).
* `None` means "derive it": `model` -> the bundled model, `max_model_len` ->
  `default_max_model_len`, `max_num_batched_tokens` -> `default_max_num_batched_tokens`
  (the one statement of those rules). `create_engine_config` resolves them, so an
  `EngineConfig` holds no `None` but the optional ones (`kv_cache_memory`, `seed`,
  `speculative`); the config sections (musespark.config) have no defaults of their own.
* The bundled model is package data (`musespark/models/musespark-tiny`, in the wheel too);
  `$MUSESPARK_MODEL` overrides it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..checkpoint.loader import load_config, resolve_dtype
from ..cli_parsing import human_readable_int, human_readable_int_or_auto
from ..config import (
    BACKENDS,
    FP8_KV_SPELLINGS,
    CacheConfig,
    EngineConfig,
    ModelSettings,
    ParallelConfig,
    SchedulerConfig,
    check_kv_cache_dtype,
)
from ..errors import InvalidArgumentError
from ..layers.kv_quant import kv_cache_torch_dtype
from .spec_decode.config import SpeculativeConfig

DEFAULT_MODEL_ENV = "MUSESPARK_MODEL"
BUNDLED_MODEL_NAME = "musespark-tiny"
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


def bundled_model_path() -> Path:
    """Where the installed package keeps the bundled checkpoint (package data)."""
    return Path(str(resources.files("musespark").joinpath("models", BUNDLED_MODEL_NAME)))


def default_model_path() -> Path:
    """$MUSESPARK_MODEL if set, else the bundled model."""
    env = os.environ.get(DEFAULT_MODEL_ENV)
    path = Path(env) if env else bundled_model_path()
    if not (path / "config.json").is_file():
        raise InvalidArgumentError(
            f"no model given and the default model {str(path)!r} is missing; pass "
            f"model=DIR (or set {DEFAULT_MODEL_ENV})",
            param="model",
        )
    return path


# The derived defaults' bounds (see default_max_num_batched_tokens).
BATCHED_TOKENS_FLOOR = 2048
BATCHED_TOKENS_CAP = 8192


def default_max_model_len(checkpoint_limit: int) -> int:
    """`max_model_len` when not given: the checkpoint's own `max_position_embeddings` (vLLM's
    rule; the KV cache must then hold one sequence of it, checked when it is sized)."""
    return checkpoint_limit


def check_max_model_len(max_model_len: int, checkpoint_limit: int) -> None:
    """A `max_model_len` over the checkpoint's `max_position_embeddings` is refused (as vLLM
    refuses it at start-up): positions past it were never trained."""
    if max_model_len > checkpoint_limit:
        raise InvalidArgumentError(
            f"max_model_len={max_model_len} is greater than the model's max_position_embeddings="
            f"{checkpoint_limit} (config.json); give --max-model-len {checkpoint_limit} or less",
            param="max_model_len",
        )


def default_max_num_batched_tokens(max_model_len: int) -> int:
    """`max_num_batched_tokens` when not given: `max_model_len` (a whole prompt in one step)
    clamped to [BATCHED_TOKENS_FLOOR, BATCHED_TOKENS_CAP]."""
    return max(BATCHED_TOKENS_FLOOR, min(max_model_len, BATCHED_TOKENS_CAP))


def _flag(help: str, **argparse_kwargs: Any) -> dict[str, Any]:
    return {"help": help, **argparse_kwargs}


@dataclass
class EngineArgs:
    """Loose engine arguments; `metadata["cli"]` holds each one's argparse settings."""

    model: str | Path | None = field(
        default=None, metadata={"cli": _flag("checkpoint directory (default: the bundled musespark-tiny)")}
    )
    dtype: Any = field(
        default="auto",
        metadata={"cli": _flag("weight and activation dtype ('auto': the checkpoint's)", choices=DTYPE_CHOICES)},
    )
    backend: str = field(
        default="auto",
        metadata={
            "cli": _flag(
                "compute backend: torch (reference), cpu (native kernels), triton (experimental: Triton GPU "
                "kernels, never run on a GPU so far), auto (the best available)",
                choices=BACKENDS,
            )
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            "cli": _flag(
                "longest sequence, prompt plus output: an integer, vLLM's 32k / 1K forms, or 'auto' "
                "(default: the checkpoint's max_position_embeddings)",
                type=human_readable_int_or_auto,
            )
        },
    )
    max_num_seqs: int = field(default=64, metadata={"cli": _flag("most sequences in one step", type=int)})
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata={
            "cli": _flag(
                f"most tokens in one step (default: max_model_len, clamped to [{BATCHED_TOKENS_FLOOR}, "
                f"{BATCHED_TOKENS_CAP}])",
                type=human_readable_int,
            )
        },
    )
    block_size: int = field(default=16, metadata={"cli": _flag("tokens per KV cache block", type=int)})
    kv_cache_memory: int | None = field(
        default=None,
        metadata={
            "cli": _flag(
                "KV cache size in bytes, e.g. 4G (default: a fraction of available memory)", type=human_readable_int
            )
        },
    )
    kv_cache_fraction: float = field(
        default=0.2,
        metadata={
            "cli": _flag(
                "fraction of available memory for the KV cache when --kv-cache-memory is not given", type=float
            )
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "cli": _flag(
                "KV cache storage: auto (the model's dtype), fp8 or fp8_e4m3 (float8 e4m3, fixed scale 1.0: half "
                "the bytes of bfloat16, twice the blocks for the same --kv-cache-memory), or the model's dtype by name"
            )
        },
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={"cli": _flag("reuse the KV blocks of shared prompt prefixes", action=argparse.BooleanOptionalAction)},
    )
    seed: int | None = field(
        default=0,
        metadata={"cli": _flag("seed of the engine's generator, used by requests without their own seed", type=int)},
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={"cli": _flag("tensor-parallel ranks: worker processes on this machine, joined over gloo", type=int)},
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata={"cli": _flag("shard the experts by expert (EP = TP group) instead of by width", action="store_true")},
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata={"cli": _flag("pipeline stages: each a rank holding a contiguous block of layers", type=int)},
    )
    nvfp4_mode: str = field(
        default="weight-only",
        metadata={
            "cli": _flag(
                "NVFP4 checkpoints: weight-only (bf16 activations, vLLM on Hopper) or w4a4 (activations quantized "
                "per 16, vLLM on Blackwell)",
                choices=("weight-only", "w4a4"),
            )
        },
    )
    speculative_config: Any = field(
        default=None,
        metadata={
            "cli": _flag(
                'speculative decoding, vLLM\'s JSON keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
                '"prompt_lookup_max": 4}\' or method "dspark" with "model": DRAFT_DIR (default: off)'
            )
        },
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "cli": _flag(
                "sampling defaults: 'auto' (the checkpoint's generation_config.json), 'vllm' (none: vLLM's "
                "defaults), or a directory holding a generation_config.json"
            )
        },
    )

    skip_tokenizer_init: bool = field(
        default=False,
        metadata={
            "cli": _flag(
                "load no tokenizer: prompts must be token ids, outputs carry token ids and empty text",
                action=argparse.BooleanOptionalAction,
            )
        },
    )

    # -- the command line -------------------------------------------------------------------
    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        *,
        model_positional: bool = False,
        skip: Collection[str] = (),
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        """Add one flag per field (`--max-model-len` for `max_model_len`). `model_positional`
        makes MODEL an optional positional (vLLM's `serve MODEL`); `skip` leaves fields out;
        `defaults` changes a default for this command."""
        defaults = dict(defaults or {})
        unknown = (set(defaults) | set(skip)) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"EngineArgs has no field(s) {sorted(unknown)}")
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            kwargs = dict(f.metadata["cli"])
            kwargs["default"] = defaults.get(f.name, f.default)
            if f.name == "model" and model_positional:
                parser.add_argument("model", nargs="?", metavar="MODEL", **kwargs)
            else:
                parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """The fields `add_cli_args` added; the others keep their defaults."""
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})

    # -- the frozen config ------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """Resolve the derived defaults (reads the checkpoint's config.json) and check every
        value; raises ValueError (InvalidArgumentError where one argument is to blame)."""
        path = Path(self.model) if self.model is not None else default_model_path()
        checkpoint = load_config(path)
        max_len = self.max_model_len
        if max_len is None:
            max_len = default_max_model_len(checkpoint.max_position_embeddings)
        elif isinstance(max_len, int) and not isinstance(max_len, bool):
            check_max_model_len(max_len, checkpoint.max_position_embeddings)
        batched = self.max_num_batched_tokens
        if batched is None and isinstance(max_len, int):
            batched = default_max_num_batched_tokens(max_len)
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None and self.pipeline_parallel_size != 1:
            raise InvalidArgumentError(
                f"speculative decoding does not support pipeline_parallel_size > 1 (got {self.pipeline_parallel_size})",
                param="speculative_config",
            )
        if speculative is not None and speculative.method == "dspark" and self.tensor_parallel_size != 1:
            raise InvalidArgumentError(
                "speculative method 'dspark' does not support tensor_parallel_size > 1 yet "
                "(the draft reads rank 0's shard of the target); use 'ngram' or one process",
                param="speculative_config",
            )
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype not in ("auto", *FP8_KV_SPELLINGS):  # an explicit dtype must be the model's
            try:
                model_dtype = resolve_dtype(self.dtype, checkpoint)
            except ValueError:
                model_dtype = None  # a bad dtype: ModelSettings names it
            if model_dtype is not None:
                kv_cache_torch_dtype(self.kv_cache_dtype, model_dtype)
        return EngineConfig(
            model=ModelSettings(
                path=path,
                dtype=self.dtype,
                backend=self.backend,
                seed=self.seed,
                generation_config=self.generation_config,
                nvfp4_mode=self.nvfp4_mode,
                skip_tokenizer_init=self.skip_tokenizer_init,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=self.kv_cache_memory,
                kv_cache_fraction=self.kv_cache_fraction,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_model_len=max_len, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
            ),
            speculative=speculative,
        )


# Where each EngineArgs field lands in an EngineConfig (section, attribute).
_CONFIG_FIELD = {
    "model": ("model", "path"),
    "dtype": ("model", "dtype"),
    "backend": ("model", "backend"),
    "seed": ("model", "seed"),
    "generation_config": ("model", "generation_config"),
    "nvfp4_mode": ("model", "nvfp4_mode"),
    "skip_tokenizer_init": ("model", "skip_tokenizer_init"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "pipeline_parallel_size": ("parallel", "pipeline_parallel_size"),
    "enable_expert_parallel": ("parallel", "enable_expert_parallel"),
    "max_model_len": ("scheduler", "max_model_len"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "block_size": ("cache", "block_size"),
    "kv_cache_memory": ("cache", "kv_cache_memory"),
    "kv_cache_fraction": ("cache", "kv_cache_fraction"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"),
}


def check_no_conflict(config: EngineConfig, loose: Mapping[str, Any]) -> None:
    """Refuse loose arguments that contradict `config` (None means "not given"); the error
    names both the config section and the argument."""
    for name, value in loose.items():
        if name not in _CONFIG_FIELD:
            raise InvalidArgumentError(f"unknown engine argument {name!r}", param=name)
        if value is None:
            continue
        section, attr = _CONFIG_FIELD[name]
        have = getattr(getattr(config, section), attr)
        same = Path(value) == have if name == "model" else value == have
        if not same:
            raise InvalidArgumentError(
                f"config.{section}.{attr}={have!r} conflicts with {name}={value!r}; give one of them", param=name
            )
