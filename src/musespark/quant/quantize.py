"""NVFP4 quantization of float weights (ModelOpt's recipe, docs/nvfp4.md §5): the tensors of one
linear or one experts module, the fused groups that share a global scale, and the two forms
of the quantization config. The application that loads a model, calibrates it and writes the
quantized checkpoint is `musespark.apps.quantize` (`musespark quantize`).

Global scales: amax / 2688 per tensor; the shards of a fused vLLM module share one (amax over
the union): attention q|k|v|o-gate of a layer, and a dense MLP's gate|up. Experts get one
per expert and projection: down, and gate|up from their joint amax (both columns of the
[E, 2] tensor equal, as ModelOpt 0.47 writes them; `quantize_experts(share_gate_up=False)`
keeps them apart). Input scales: calib_amax / 2688 of the calibrated activation amax.
"""

from __future__ import annotations

import torch

from .nvfp4_math import BLOCK, global_scale, quantize

SCOPES = ("experts", "linear")
PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # the format ModelOpt 0.47.0 writes (docs/nvfp4.md §1)


def check_scope(scope: str) -> str:
    """`scope` if it is one of SCOPES; else ValueError naming `scope`."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {list(SCOPES)}, got {scope!r}")
    return scope


def fused_group(name: str) -> str:
    """The vLLM fused module a linear is a shard of (its own name if none): q/k/v/o-gate ->
    `<layer>.self_attn.qkv_proj`, a dense MLP's gate/up -> `<layer>.mlp.gate_up_proj`."""
    parent, _, leaf = name.rpartition(".")
    if parent.endswith("self_attn") and leaf in ("q_proj", "k_proj", "v_proj", "gate_proj"):
        return parent + ".qkv_proj"
    if parent.endswith("mlp") and leaf in ("gate_proj", "up_proj"):
        return parent + ".gate_up_proj"
    return name


def quantize_linear(
    w: torch.Tensor, weight_amax: torch.Tensor, input_amax: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """One linear's NVFP4 tensors (relative to it) from its float weight [N, K]; `weight_amax`:
    the amax the global scale comes from (the fused group's); `input_amax`: the calibrated
    activation amax (None: no `input_scale`)."""
    ws2 = global_scale(weight_amax.reshape(()))
    packed, scale = quantize(w, ws2)
    out = {"weight": packed, "weight_scale": scale, "weight_scale_2": ws2}
    if input_amax is not None:
        out["input_scale"] = global_scale(input_amax.reshape(()))
    return out


def quantize_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_input_amax: torch.Tensor | None,
    down_input_amax: torch.Tensor | None,
    share_gate_up: bool = True,
) -> dict[str, torch.Tensor]:
    """The fused NVFP4 expert tensors (docs/nvfp4.md §3, relative to the experts module) from
    gate_up [E, 2I, Hm] and down [E, Hm, I]; the input amaxes are shared by all experts.
    `share_gate_up` (default): each expert's gate and up get one global scale from their
    joint amax, both columns of `gate_up_proj_weight_scale_2` equal, as ModelOpt 0.47 writes
    them (checked bit for bit) and as engines that read only column 0 need; False: one per
    projection (Muse's [E, 2] allows it)."""
    E, two_i, _ = gate_up.shape
    gu = gate_up.float().unflatten(1, (2, two_i // 2))  # [E, 2, I, Hm]
    amax_gu = gu.abs().amax(dim=(2, 3))  # [E, 2]: gate, up
    if share_gate_up:
        amax_gu = amax_gu.amax(dim=1, keepdim=True).expand(E, 2)
    ws2_gu = global_scale(amax_gu).contiguous()
    packed_gu, scale_gu = quantize(gate_up, ws2_gu.repeat_interleave(two_i // 2, dim=1)[:, :, None])
    ws2_d = global_scale(down.float().abs().amax(dim=(1, 2)))  # [E]
    packed_d, scale_d = quantize(down, ws2_d[:, None, None])
    out = {
        "gate_up_proj": packed_gu,
        "gate_up_proj_weight_scale": scale_gu,
        "gate_up_proj_weight_scale_2": ws2_gu,
        "down_proj": packed_d,
        "down_proj_weight_scale": scale_d,
        "down_proj_weight_scale_2": ws2_d,
    }
    if gate_up_input_amax is not None and down_input_amax is not None:
        out["gate_up_proj_input_scale"] = global_scale(gate_up_input_amax).expand(E, 2).contiguous()
        out["down_proj_input_scale"] = global_scale(down_input_amax).expand(E).contiguous()
    return out


def config_form_a(exclude: list[str]) -> dict:
    return {
        "producer": dict(PRODUCER),
        "quantization": {
            "quant_algo": "NVFP4",
            "group_size": BLOCK,
            "kv_cache_quant_algo": None,
            "exclude_modules": exclude,
        },
    }


def config_form_b(exclude: list[str]) -> dict:
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK}
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "producer": dict(PRODUCER),
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(fp4), "input_activations": dict(fp4)}},
        "ignore": exclude,
    }
