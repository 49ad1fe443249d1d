"""Load a released Muse Spark checkpoint directory into our decoder.

A directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. The model is built on the meta device, then every
tensor is read from its memory-mapped file straight into its final dtype, one at a
time, so peak memory stays near the final model size. Pickle checkpoints are refused,
never unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from ..config import ModelConfig
from .names import EMBED, LM_HEAD, TensorSpec, dense_specs, to_relative
from .safetensors_file import SafetensorsFile

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float": torch.float32,
}


_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # converted to the dtype asked for
_WIDENED = (torch.float32,)  # a fixed dtype any of _FLOATS converts to (fp32 gates, router, global scales)


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig | None = None) -> torch.dtype:
    """`bfloat16` (default), `float16`, `float32`, or "auto" (the checkpoint's dtype if it is one of those)."""
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float16, torch.float32):
            return dtype
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    if dtype == "auto":
        declared = cfg.checkpoint_dtype if cfg is not None else None
        return DTYPES.get(str(declared).removeprefix("torch."), torch.bfloat16)
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype must be one of 'auto', 'bfloat16', 'float16', 'float32', got {dtype!r}")


def find_weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory; refuses pickles with a clear error."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a valid safetensors index ({exc!r})") from None
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ValueError(f"{index}: lists shard(s) that do not exist: {missing}")
        return [path / f for f in files]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    others = sorted(path.glob("*.safetensors"))
    if others:
        return others
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{path}: found only pickle checkpoint file(s) {pickles}; musespark never unpickles weights "
            "(a pickle can run arbitrary code). Convert the checkpoint to safetensors."
        )
    raise ValueError(f"{path}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE})")


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a directory")
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{path}: no {CONFIG_FILE}; a checkpoint directory needs one")
    return ModelConfig.from_file(path / CONFIG_FILE)


def read_state_dict(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
    specs: dict[str, TensorSpec] | None = None,
    skip: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Every tensor `specs` names (default: the dense decoder of `cfg`, `dense_specs`),
    read from the checkpoint at `path`, by relative name, in its final dtype: a spec's
    fixed dtype, else `dtype`. (The model's weight formats say what to read: see
    `model.load.load_model`.) Residual gates, the router weight and the expert bias stay
    float32 in any dtype. Tied embeddings share one tensor. `progress(done, total)` is
    called after each tensor read, in bytes of the weight files (it ends at done == total).
    """
    path = Path(path)
    files = find_weight_files(path)
    specs = dense_specs(cfg) if specs is None else specs
    shapes = {name: spec.full_shape for name, spec in specs.items()}
    loaded: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    total_bytes = sum(f.stat().st_size for f in files)
    done_bytes = 0
    for file in files:
        with SafetensorsFile(file) as st:
            for disk_name, entry in st.entries.items():
                name = to_relative(disk_name)
                if name is None or name in skip:  # vision/audio tower; another pipeline stage's tensor
                    continue
                if name not in shapes:
                    raise ValueError(
                        f"{file}: unexpected tensor {disk_name!r} (not part of the text decoder this config describes)"
                    )
                if name in loaded:
                    raise ValueError(f"{file}: tensor {disk_name!r} appears twice (also in {where[name]})")
                if entry.shape != shapes[name]:
                    raise ValueError(
                        f"{file}: tensor {disk_name!r} has shape {list(entry.shape)}, expected {list(shapes[name])}"
                    )
                fixed = specs[name].dtype
                if fixed is not None and fixed not in _WIDENED and entry.dtype != fixed:  # packed codes, fp8 scales
                    raise ValueError(f"{file}: tensor {disk_name!r} has dtype {entry.dtype}, expected {fixed}")
                if (fixed is None or fixed in _WIDENED) and entry.dtype not in _FLOATS:
                    raise ValueError(f"{file}: tensor {disk_name!r} has dtype {entry.dtype}, expected a float type")
                shard = specs[name].shard
                tensor = (
                    st.read(disk_name, fixed or dtype)
                    if shard is None
                    else st.read_shard(disk_name, shard.dim, shard.pieces, fixed or dtype)
                )
                loaded[name] = tensor.to(device)
                where[name] = file
                if progress is not None:
                    done_bytes += entry.end - entry.start
                    progress(min(done_bytes, total_bytes), total_bytes)
    if progress is not None:
        progress(total_bytes, total_bytes)

    if LM_HEAD in shapes and LM_HEAD not in loaded and cfg.tie_word_embeddings and EMBED in loaded:
        loaded[LM_HEAD] = loaded[EMBED]  # tied: the head reuses the embedding matrix
    missing = [n for n in shapes if n not in loaded]
    if missing:
        shown = ", ".join(f"{n!r} (expected shape {list(shapes[n])})" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{path}: checkpoint is missing tensor(s) {shown}{more} (searched {[f.name for f in files]})")
    return loaded
