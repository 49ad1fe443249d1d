"""The compressed mixture of experts (SPEC §3): route in fp32, pool H -> Hm, run the
chosen experts at width Hm with a per-expert post-norm, weight, sum, unpool Hm -> H.

Tokens are grouped by expert (one sort), and each expert that received tokens runs one
GEMM pair over all of them; no per-token Python loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.names import TensorSpec
from ..config import ModelConfig
from .linear import Linear, linear
from .norm import RMSNorm, input_scaled_rms_norm

if TYPE_CHECKING:
    from ..quant.format import ExpertsFormat, WeightFormats

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
    """E SwiGLU experts at width Hm, each followed by an input-scaled post-norm. The expert
    tensors and their product come from `fmt` (dense: `gate_up_proj` [E, 2*Im, Hm], gate rows
    first, then up rows; `down_proj` [E, Hm, Im])."""

    def __init__(self, cfg: ModelConfig, fmt: "ExpertsFormat") -> None:
        super().__init__()
        E, Hm, Im = cfg.num_local_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
        self.format = fmt
        fmt.create_weights(self, E, Im, Hm)
        self.post_expert_norm = RMSNorm(Hm, cfg.post_norm_eps, gain_center=1.0, input_scaled=True)
        self.num_experts, self.intermediate, self.hidden = E, Im, Hm

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """The checkpoint tensors of the experts (not the post-norm), by name relative to this module."""
        return self.format.tensors(self.num_experts, self.intermediate, self.hidden)

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
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        x = u[order // k]  # [T*k, Hm] expert inputs, grouped by expert
        ys = []
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            ys.append(self.format.apply(self, expert, x[start:start + n]))  # [n, Hm]
            start += n
        norm = self.post_expert_norm
        y = input_scaled_rms_norm(torch.cat(ys), norm.eps, norm.weight, norm.gain_center, torch.float32)
        y = y * weights.reshape(-1)[order, None]
        rank = ids.argsort(dim=1).argsort(dim=1).reshape(-1)  # [T*k] rank of each expert in its token
        dest = (order // k) * k + rank[order]
        return torch.empty_like(y).index_copy_(0, dest, y).view(T, k, -1)


class SparseMoeBlock(nn.Module):
    """f [T, H] (model dtype) -> b [T, H] (model dtype)."""

    def __init__(self, cfg: ModelConfig, formats: "WeightFormats", prefix: str) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.pre_expert_proj = Linear(cfg.hidden_size, cfg.moe_hidden_size,
                                      formats.linear(prefix + "pre_expert_proj"))  # pooler
        self.pre_expert_norm = RMSNorm(cfg.moe_hidden_size, cfg.rms_norm_eps, gain_center=1.0)
        self.experts = Experts(cfg, formats.experts(prefix + "experts"))
        self.post_expert_proj = Linear(cfg.moe_hidden_size, cfg.hidden_size,
                                       formats.linear(prefix + "post_expert_proj"))  # unpooler

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(f)
        u = self.pre_expert_norm(self.pre_expert_proj(f))  # [T, Hm], rounded to model dtype
        y = self.experts(u, weights, ids)  # [T, Hm] fp32
        return self.post_expert_proj(y.to(f.dtype))


class DenseMlp(nn.Module):
    """SwiGLU: down(silu(gate f) * up f)."""

    def __init__(self, cfg: ModelConfig, formats: "WeightFormats", prefix: str) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(H, I, formats.linear(prefix + "gate_proj"))
        self.up_proj = Linear(H, I, formats.linear(prefix + "up_proj"))
        self.down_proj = Linear(I, H, formats.linear(prefix + "down_proj"))

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(f)) * self.up_proj(f))
