"""What each Triton kernel (`kernels/triton/`) must compute: the torch backend's formulas
(`layers/`, `quant/`) in the kernel's own signature. The kernel tests and
`benchmarks/gpu_check.py` compare each kernel with its reference here; the kernels themselves
import nothing of the model's (they take tensors).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..layers.attention import AttentionContext, paged_attention
from ..layers.moe import route
from ..layers.norm import input_scaled_rms_norm, rms, rms_norm
from ..layers.rotary import norm_rope
from ..quant.dense import DenseExperts


def reference_norm_residual(
    stream: torch.Tensor,
    branch: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    post_eps: float,
    post_gain: torch.Tensor | None = None,
    next_gain: torch.Tensor | None = None,
    eps: float = 0.0,
    out_dtype: torch.dtype | None = None,
    next_norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`norm_residual.norm_residual`: the torch formulas it fuses (layers/norm.py)."""
    if post_gain is None:
        b = rms(branch, post_eps)  # weightless post-attention norm
    else:
        b = input_scaled_rms_norm(branch, post_eps, post_gain, gain_center=0.0, out_dtype=torch.float32)
    s = alpha * stream + beta * b.float()  # ResidualGate.forward
    if not next_norm:
        return s, None
    return s, rms_norm(s, eps, next_gain, gain_center=0.0, out_dtype=out_dtype or branch.dtype)


def reference_rms_norm(
    x: torch.Tensor, eps: float, gain: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`norm_residual.rms_norm`: `layers.norm.rms_norm` with the full gain as its weight."""
    return rms_norm(x, eps, gain, gain_center=0.0, out_dtype=out_dtype or x.dtype)


def reference_qk_norm_rope(
    x: torch.Tensor,
    eps: float,
    scale: float,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    out_dtype: torch.dtype,
    v: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """`qk_norm_rope.qk_norm_rope`: `layers.rotary.norm_rope`, then the cache write of
    `layers.attention.paged_attention`."""
    y = norm_rope(x, eps, scale, rotary, out_dtype)
    if k_cache is not None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, y[keep].to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))
    return y


def reference_o_norm_gate(o: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """`o_norm_gate.o_norm_gate`: TorchBackend.attn_out's first line, O-norm then the sigmoid gate."""
    return (rms(o, eps) * torch.sigmoid(g.float())).to(o.dtype)


def reference_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    output_multiplier: float,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.route_topk` (with router_eps `layers.moe.ROUTER_EPS`): `layers.moe.route`,
    with each token's (weight, id) pairs sorted by id."""
    weights, ids = route(x, router_weight, bias, top_k, output_multiplier, routed_scaling_factor)
    ids, order = ids.sort(dim=1)
    return weights.gather(1, order), ids


def reference_moe_experts(
    u: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    post_gain: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """`experts.moe_experts`: `layers.moe.Experts.forward` for dense experts: each expert's
    SwiGLU (`DenseExperts.apply`), the input-scaled post-norm, the weight, then each token's
    sum from its smallest expert id."""
    experts = SimpleNamespace(gate_up_proj=gate_up, down_proj=down)
    T, k = ids.shape
    ids, perm = ids.sort(dim=1)
    weights = weights.gather(1, perm)
    z = torch.zeros(T, k, u.shape[1], dtype=torch.float32, device=u.device)
    for e in ids.unique().tolist():
        t, r = (ids == e).nonzero(as_tuple=True)
        y = DenseExperts().apply(experts, e, u[t])
        y = input_scaled_rms_norm(y, eps, post_gain, gain_center=0.0, out_dtype=torch.float32)
        z[t, r] = y * weights[t, r, None]
    out = z[:, 0]
    for r in range(1, k):
        out = out + z[:, r]
    return out


def reference_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    ctx: AttentionContext,
    layer: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """`attention.paged_attention` given `triton_backend.attention_args(ctx, layer)`:
    `layers.attention.paged_attention` (writes the cache, then attends)."""
    return paged_attention(q, k, v, positions, ctx, layer, scale, window)
