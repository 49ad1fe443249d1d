"""`load_model`: a checkpoint directory -> a ready `MuseSparkForCausalLM`."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..checkpoint.loader import load_config, read_state_dict, resolve_dtype
from .muse_spark import MuseSparkForCausalLM


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = "bfloat16",
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> MuseSparkForCausalLM:
    """Load a released-format checkpoint directory; the model comes back in eval mode.

    `dtype`: "bfloat16" (default), "float16", "float32", a torch dtype, or "auto" (the
    checkpoint's declared dtype). The model is built on the meta device and each tensor
    is read straight into its final place, so no second copy of the weights is made.
    """
    cfg = load_config(path)
    torch_dtype = resolve_dtype(dtype, cfg)
    state = read_state_dict(path, cfg, torch_dtype, device, progress)
    with torch.device("meta"):
        model = MuseSparkForCausalLM(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    model.materialize_constants()
    return model.eval()
