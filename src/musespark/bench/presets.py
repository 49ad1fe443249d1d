"""Named model presets for benchmarks; random-weight checkpoints made on the fly.

    bench-small  the fixed benchmark model (SPEC of the bench issue): vocab 32768, hidden 1024,
                 dense intermediate 2816, 12 layers (layer 0 dense, 11 sparse), 16 heads,
                 4 KV heads, head_dim 64, MoE hidden/intermediate 512, 32 experts, top-4,
                 sliding window 512, the default sliding/full/NoPE pattern
    bench-tiny   a very small random model for smoke tests
    tiny         the bundled musespark-tiny (its trained weights, not random)
    muse-spark-open-816b
                 the released Muse Spark Open 816B-A42B's shape (docs/parallel.md §10), config only:
                 for `musespark plan`; `make_checkpoint` refuses it (no weights, 1.6 TB in bf16)

`count_params(cfg)` counts from the config alone (nothing is allocated); `make_checkpoint`
writes a seeded random checkpoint once into a cache directory and reuses it.

    python -m musespark.bench.presets            # print each preset's parameter counts
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.names import EMBED, expected_shapes
from ..config import ModelConfig

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}
CACHE_ENV = "MUSESPARK_BENCH_CACHE"
# Random checkpoints never end by EOS in benchmarks (ignore_eos / min_new_tokens), but the
# ids must lie inside the vocabulary so that both engines accept the config.
_SPECIAL = dict(bos_token_id=1, eos_token_id=2)

PRESETS: dict[str, dict[str, Any] | None] = {
    "bench-small": dict(
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        moe_hidden_size=512,
        moe_intermediate_size=512,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=512,
        mlp_layer_types=("dense",) + ("sparse",) * 11,
        **_SPECIAL,
    ),
    "bench-tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_hidden_size=32,
        moe_intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=32,
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        **_SPECIAL,
    ),
    "tiny": None,  # the bundled checkpoint
    "muse-spark-open-816b": dict(
        vocab_size=202048,
        hidden_size=8192,
        intermediate_size=16384,
        num_hidden_layers=62,
        num_attention_heads=128,
        num_key_value_heads=16,
        head_dim=64,
        moe_hidden_size=4096,
        moe_intermediate_size=4096,
        num_local_experts=256,
        num_experts_per_tok=8,
        sliding_window=2048,
        mlp_layer_types=("sparse",) * 62,
        tie_word_embeddings=False,
        layer_types=tuple("full_attention" if (61 - i) % 4 == 0 else "sliding_attention" for i in range(62)),
    ),
}
# Presets that describe a shape only (planning): no checkpoint is ever made for them.
CONFIG_ONLY = frozenset({"muse-spark-open-816b"})


def dtype_name(dtype: str | torch.dtype) -> str:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> 'bfloat16'."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES) + sorted(DTYPE_ALIASES)}, got {dtype!r}")
    return name


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    fields = PRESETS[name]
    if fields is None:
        from ..checkpoint.loader import load_config
        from ..engine.args import default_model_path

        return load_config(default_model_path())
    return ModelConfig(**fields)


@dataclass(frozen=True)
class ParamCount:
    total: int  # every text tensor, embedding and LM head included
    active: int  # read per token in decode: non-expert weights + top-k experts + LM head, no embedding
    expert: int  # all routed-expert weights
    embedding: int

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "active": self.active, "expert": self.expert, "embedding": self.embedding}

    def __str__(self) -> str:
        return f"{self.total / 1e6:.1f} M parameters, {self.active / 1e6:.1f} M active per token"


def count_params(cfg: ModelConfig) -> ParamCount:
    """Count from the config alone (the checkpoint's tensor shapes; nothing allocated).

    Active per token = everything but the embedding table (one row read: negligible) and the
    experts, plus num_experts_per_tok / num_local_experts of each sparse layer's experts.
    The LM head counts fully.
    """
    shapes = expected_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    expert = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n and not n.endswith("norm.weight"))
    embedding = math.prod(shapes[EMBED])
    routed = expert * cfg.num_experts_per_tok // cfg.num_local_experts
    active = total - embedding - expert + routed
    return ParamCount(total=total, active=active, expert=expert, embedding=embedding)


def active_weight_bytes(cfg: ModelConfig, dtype: str | torch.dtype) -> int:
    """Bytes of weights one decode token reads at `dtype` (the roofline's numerator).
    The fp32-kept router/gate vectors are a rounding error and counted at `dtype`."""
    return count_params(cfg).active * DTYPES[dtype_name(dtype)].itemsize


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "musespark" / "bench"


def make_checkpoint(
    preset: str, dtype: str | torch.dtype = "bfloat16", cache_dir: str | Path | None = None, seed: int = 0
) -> Path:
    """The checkpoint directory for `preset` at `dtype`: the bundled one for 'tiny', else a
    seeded random checkpoint written once to <cache_dir>/<preset>-<dtype>-seed<seed> and reused."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if preset in CONFIG_ONLY:
        raise ValueError(
            f"preset {preset!r} is a config only (for `musespark plan`): it has no weights and is "
            f"too large for a random checkpoint; choose one of "
            f"{sorted(set(PRESETS) - CONFIG_ONLY)} or pass --model DIR"
        )
    if PRESETS[preset] is None:
        from ..engine.args import default_model_path

        return default_model_path()
    name = dtype_name(dtype)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    suffix = "" if seed == 0 else f"-seed{seed}"
    path = root / f"{preset}-{name}{suffix}"
    cfg = preset_config(preset)
    if (path / "config.json").is_file() and (path / ".complete").is_file():
        from ..checkpoint.loader import load_config

        if load_config(path).text_config_dict() == cfg.text_config_dict():
            return path
    from ..checkpoint.writer import save_checkpoint
    from ..model.muse_spark import MuseSparkForCausalLM, init_random_weights

    root.mkdir(parents=True, exist_ok=True)
    model = MuseSparkForCausalLM(cfg)
    init_random_weights(model, seed=seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=root))
    try:
        save_checkpoint(model.state_dict(), cfg, tmp, dtype=DTYPES[name])
        (tmp / ".complete").write_text("ok\n")
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)  # atomic: a half-written checkpoint is never picked up
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def resolve_model(
    model: str | Path | None,
    preset: str | None,
    dtype: str = "auto",
    cache_dir: str | Path | None = None,
    seed: int = 0,
) -> Path | None:
    """--model DIR wins; else --preset NAME (random weights at --dtype, bfloat16 for 'auto');
    else None (the bundled model)."""
    if model is not None and preset is not None:
        raise ValueError("give --model or --preset, not both")
    if model is not None:
        return Path(model)
    if preset is None:
        return None
    return make_checkpoint(preset, "bfloat16" if dtype == "auto" else dtype, cache_dir, seed)


def main() -> None:
    for name in PRESETS:
        cfg = preset_config(name)
        print(f"{name:20s} {count_params(cfg)}")


if __name__ == "__main__":
    main()


def nvfp4_checkpoint(src: str | Path, scope: str = "linear", cache_dir: str | Path | None = None) -> Path:
    """`src` quantized to NVFP4 (`musespark quantize --format nvfp4 --scope SCOPE`), made once
    and cached next to it (or in `cache_dir`). A random preset (no tokenizer) is calibrated on
    seeded random token ids."""
    from ..apps.quantize import quantize_checkpoint

    src = Path(src)
    root = Path(cache_dir) if cache_dir is not None else src.parent
    dst = root / f"{src.name}-nvfp4-{scope}"
    if (dst / "config.json").is_file():
        return dst
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=root))
    try:
        shutil.rmtree(tmp)
        quantize_checkpoint(src, tmp, scope=scope, calibration_prompts=2, log=lambda *a, **k: None)
        os.replace(tmp, dst)  # atomic, as make_checkpoint
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst
