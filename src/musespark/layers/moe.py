"""The compressed mixture of experts (SPEC §3): route in fp32, pool H -> Hm, run the
chosen experts at width Hm with a per-expert post-norm, weight, sum, unpool Hm -> H.

Tokens are grouped by expert (one sort), and each expert that received tokens runs one
GEMM pair over all of them; no per-token Python loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .linear import Linear, linear
from .norm import ResidualGate, RMSNorm, input_scaled_rms_norm

ROUTER_EPS = 1e-15


def route(
    x: torch.Tensor,  # [T, H] (any float dtype; the router runs in fp32)
    router_weight: torch.Tensor,  # [E, H] fp32
    bias: torch.Tensor,  # [E] fp32, only picks experts
    top_k: int,
    output_multiplier: float,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (weights [T, k] fp32, expert ids [T, k] int64)."""
    logits = linear(x.float(), router_weight.float()) * output_multiplier
    scores = torch.sigmoid(logits)
    ids = torch.topk(scores + bias.float(), k=top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTER_EPS) * routed_scaling_factor
    return weights, ids


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_local_experts, cfg.hidden_size, dtype=torch.float32))
        # A buffer, not a parameter: it is nudged toward balanced load, never trained by gradient.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_local_experts, dtype=torch.float32))
        self.top_k = cfg.num_experts_per_tok
        self.output_multiplier = cfg.output_multiplier
        self.routed_scaling_factor = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.weight, self.e_score_correction_bias, self.top_k,
                     self.output_multiplier, self.routed_scaling_factor)


class Experts(nn.Module):
    """E SwiGLU experts at width Hm, each followed by an input-scaled post-norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, Hm, Im = cfg.num_local_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * Im, Hm))  # gate rows first, then up rows
        self.down_proj = nn.Parameter(torch.zeros(E, Hm, Im))
        self.post_expert_norm = RMSNorm(Hm, cfg.post_norm_eps, gain_center=1.0, input_scaled=True)
        self.intermediate = Im

    def forward(self, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """u [T, Hm] model dtype, weights/ids [T, k] -> weighted sum [T, Hm] fp32.

        Assignments are sorted by expert; each expert with tokens runs one GEMM pair over
        all of them. Each token's k contributions are then summed in increasing expert id,
        one add at a time (the reference's accumulation order).
        """
        z = self._grouped(u, weights, ids)
        out = z[:, 0]
        for r in range(1, ids.shape[1]):
            out = out + z[:, r]
        return out

    def _grouped(self, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Weighted, post-normed expert outputs [T, k, Hm] fp32, slot r of token t holding
        its r-th smallest expert."""
        T, k = ids.shape
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # [T*k] assignments grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        x = u[order // k]  # [T*k, Hm] expert inputs, grouped by expert
        ys = []
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            gate_up = linear(x[start:start + n], self.gate_up_proj[expert])  # [n, 2*Im]
            gate, up = gate_up.split(self.intermediate, dim=-1)
            ys.append(linear(F.silu(gate) * up, self.down_proj[expert]))  # [n, Hm]
            start += n
        norm = self.post_expert_norm
        y = input_scaled_rms_norm(torch.cat(ys), norm.eps, norm.weight, norm.gain_center, torch.float32)
        y = y * weights.reshape(-1)[order, None]
        rank = ids.argsort(dim=1).argsort(dim=1).reshape(-1)  # [T*k] rank of each expert in its token
        dest = (order // k) * k + rank[order]
        return torch.empty_like(y).index_copy_(0, dest, y).view(T, k, -1)


class SparseMoeBlock(nn.Module):
    """f [T, H] (model dtype) -> b [T, H] (model dtype)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.pre_expert_proj = Linear(cfg.hidden_size, cfg.moe_hidden_size)  # pooler
        self.pre_expert_norm = RMSNorm(cfg.moe_hidden_size, cfg.rms_norm_eps, gain_center=1.0)
        self.experts = Experts(cfg)
        self.post_expert_proj = Linear(cfg.moe_hidden_size, cfg.hidden_size)  # unpooler

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(f)
        u = self.pre_expert_norm(self.pre_expert_proj(f))  # [T, Hm], rounded to model dtype
        y = self.experts(u, weights, ids)  # [T, Hm] fp32
        return self.post_expert_proj(y.to(f.dtype))

    def forward_fused(self, ops: Any, s: torch.Tensor, pre_norm: RMSNorm, post_norm: RMSNorm,
                      gate: ResidualGate) -> torch.Tensor:
        """The decoder layer's whole feed-forward half in one native call (bf16 weights on
        the CPU, kernels/cpu_ffn_block.cpp `ffn_moe`): s [T, H] fp32 -> gate(s, post_norm(forward(pre_norm(s)))).

        The op takes one eps for the pre-norm and pre-expert norm (both rms_norm_eps) and one
        for the per-expert and block post-norms (both post_norm_eps)."""
        router, experts = self.gate, self.experts
        return ops.ffn_moe(s, pre_norm.gain(), pre_norm.eps, router.weight.float(),
                           router.e_score_correction_bias.float(),
                           router.top_k, router.output_multiplier, router.routed_scaling_factor,
                           self.pre_expert_proj.weight, self.pre_expert_norm.gain(), experts.gate_up_proj,
                           experts.down_proj, experts.post_expert_norm.gain(), self.post_expert_proj.weight,
                           post_norm.gain(), post_norm.eps, *gate.coefficients_cached())


class DenseMlp(nn.Module):
    """SwiGLU: down(silu(gate f) * up f)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(f)) * self.up_proj(f))

    def forward_fused(self, ops: Any, s: torch.Tensor, pre_norm: RMSNorm, post_norm: RMSNorm,
                      gate: ResidualGate) -> torch.Tensor:
        """As `SparseMoeBlock.forward_fused`, through `ffn_dense`."""
        return ops.ffn_dense(s, pre_norm.gain(), pre_norm.eps, self.gate_proj.weight, self.up_proj.weight,
                             self.down_proj.weight, post_norm.gain(), post_norm.eps, *gate.coefficients_cached())
