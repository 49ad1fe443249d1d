"""`load_model`: a checkpoint directory -> a ready `MuseSparkForCausalLM` with its backend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..backends import Backend, select_backend
from ..checkpoint.loader import load_config, read_state_dict, resolve_dtype
from ..checkpoint.names import TensorSpec, keeps_fp32
from ..parallel.state import SINGLE, ParallelContext
from ..quant import WeightFormats
from ..quant.config import Nvfp4WeightFormats, checkpoint_formats
from ..quant.nvfp4 import check_checkpoint_layout, check_finite_scales, scale_tensor_names
from .muse_spark import MuseSparkForCausalLM


def checkpoint_tensors(model: nn.Module) -> dict[str, TensorSpec]:
    """What a checkpoint for `model` must hold, by relative name: each weight format's
    tensors under its module, and every other parameter or persistent buffer (norms, gates,
    router, embedding) as a float tensor of its shape (fp32 where `keeps_fp32`)."""
    specs: dict[str, TensorSpec] = {}
    for prefix, module in model.named_modules():
        dot = prefix + "." if prefix else ""
        owned = set()
        if hasattr(module, "tensor_specs"):  # a Linear or the Experts: their format knows their tensors
            for name, spec in module.tensor_specs().items():
                specs[dot + name] = spec
                owned.add(name)
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in tensors:
            if name in owned or name in module._non_persistent_buffers_set or t is None:
                continue
            specs[dot + name] = TensorSpec(tuple(t.shape), torch.float32 if keeps_fp32(dot + name) else None)
    return specs


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = "bfloat16",
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
    backend: str | Backend = "auto",
    formats: WeightFormats | None = None,
    parallel: ParallelContext = SINGLE,
    nvfp4_mode: str = "weight-only",
) -> MuseSparkForCausalLM:
    """Load a released-format checkpoint directory; the model comes back in eval mode.

    `dtype`: "bfloat16" (default), "float16", "float32", a torch dtype, or "auto" (the
    checkpoint's declared dtype). `backend`: "auto" (default), "torch" or "cpu" (see
    `musespark.backends`). The model is built on the meta device, its weight formats say
    which tensors to read, and each tensor is read straight into its final place, so no
    second copy of the weights is made. `parallel` (see `musespark.parallel`): this rank's
    shard of a tensor/pipeline/expert-parallel model; it reads only its slices of each
    tensor and only its stage's layers.

    `formats` None: the checkpoint's own (dense, or NVFP4 per its quantization config with
    its exclude list, `quant.config`); `nvfp4_mode` says how NVFP4 layers multiply:
    "weight-only" (decoded weights, unquantized activations: vLLM on Hopper) or "w4a4"
    (activations quantized with the input scales: vLLM on Blackwell).
    """
    cfg = load_config(path)
    torch_dtype = resolve_dtype(dtype, cfg)
    if formats is None:
        formats = checkpoint_formats(path, nvfp4_mode)
    with torch.device("meta"):
        model = MuseSparkForCausalLM(cfg, formats, parallel=parallel)
    specs = checkpoint_tensors(model)
    elsewhere: set[str] = set()
    if parallel.pp_size > 1:  # other stages' tensors are in the checkpoint too
        with torch.device("meta"):
            whole = MuseSparkForCausalLM(cfg, formats)
        elsewhere = set(checkpoint_tensors(whole)) - set(specs)
    nvfp4 = isinstance(formats, Nvfp4WeightFormats)
    if nvfp4:
        check_checkpoint_layout(path, specs)
    state = read_state_dict(path, cfg, torch_dtype, device, progress, specs=specs, skip=elsewhere)
    if nvfp4:
        check_finite_scales(state, scale_tensor_names(specs))
    model.load_state_dict(state, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    model.materialize_constants()
    model.backend = select_backend(backend, model)
    return model.eval()
