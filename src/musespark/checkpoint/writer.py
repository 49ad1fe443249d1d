"""Write a checkpoint in the released format: `config.json` + safetensors (one file or
shards with `model.safetensors.index.json`), text tensors under the nested
`model.language_model.` prefix (or flat `model.`), `lm_head.weight` at the top.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from .loader import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from .names import FLAT_PREFIX, LM_HEAD, NESTED_PREFIX, expected_shapes, keeps_fp32


def save_checkpoint(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    path: str | Path,
    dtype: torch.dtype | None = None,
    nested: bool = True,
    max_shard_bytes: int | None = None,
) -> Path:
    """Save a text-decoder state dict (relative names, as `model.state_dict()` gives).

    `dtype` casts the weights (fp32-only tensors stay fp32); `max_shard_bytes` splits the
    weights into shards of at most that size (a single tensor is never split).
    Nested checkpoints always hold `lm_head.weight`, even when tied, because
    transformers' nested model does not tie in memory; flat tied ones leave it out.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(cfg)
    prefix = NESTED_PREFIX if nested else FLAT_PREFIX
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name == LM_HEAD and cfg.tie_word_embeddings and not nested:
            continue  # flat tied checkpoints leave the head out, as transformers' text model does
        if name not in state:
            raise ValueError(f"state dict is missing tensor {name!r} (expected shape {list(shape)})")
        t = state[name].detach().to("cpu")
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if keeps_fp32(name):
            t = t.float()
        elif dtype is not None:
            t = t.to(dtype)
        disk = name if name == LM_HEAD else prefix + name
        tensors[disk] = t.contiguous().clone()  # clone: tied tensors must not share storage on disk

    _write_shards(tensors, path, max_shard_bytes)
    config = cfg.to_dict(nested=nested)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
        if nested:
            config["text_config"]["dtype"] = config["dtype"]
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return path


def _write_shards(tensors: dict[str, torch.Tensor], path: Path, max_shard_bytes: int | None) -> None:
    """One `model.safetensors`, or shards of at most `max_shard_bytes` (a tensor is never
    split) listed in `model.safetensors.index.json`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for disk, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][disk] = t
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE_FILE), metadata=metadata)
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata=metadata)
        weight_map.update((k, fname) for k in shard)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
