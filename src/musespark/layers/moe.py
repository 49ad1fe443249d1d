"""The compressed mixture of experts (docs/spec.md §3): route in fp32, pool H -> Hm, run the
chosen experts at width Hm with a per-expert post-norm, weight, sum, unpool Hm -> H.

Tokens are grouped by expert (one sort), and each expert that received tokens runs one
GEMM pair over all of them; no per-token Python loop.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.names import Shard, TensorSpec
from ..config import ModelConfig
from ..parallel.state import SINGLE
from .linear import REFERENCE, Linear, Products, linear
from .norm import RMSNorm, input_scaled_rms_norm

if TYPE_CHECKING:
    from ..parallel.state import ParallelContext
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
        return route(
            x, self.weight, self.e_score_correction_bias, self.top_k, self.output_multiplier, self.routed_scaling_factor
        )


class Experts(nn.Module):
    """E SwiGLU experts at width Hm, each followed by an input-scaled post-norm. The expert
    tensors and their product come from `fmt` (dense: `gate_up_proj` [E, 2*Im, Hm], gate rows
    first, then up rows; `down_proj` [E, Hm, Im]).

    Parallel (docs/parallel.md §3): with expert parallelism this rank holds a contiguous block of
    experts at full width, and the weighted per-slot outputs [T, k, Hm] are all-reduced (one
    contributor per slot: exact); with tensor parallelism alone it holds every expert at
    width Im / tp, and the down-projection rows are all-reduced in fp32 *before* the
    post-expert norm (RMS is not linear in partial sums)."""

    def __init__(self, cfg: ModelConfig, fmt: ExpertsFormat, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        E, Hm, Im = cfg.num_local_experts, cfg.moe_hidden_size, cfg.moe_intermediate_size
        self.parallel = parallel
        self.first_expert, n_local = parallel.expert_split(E)
        i0, n_im = (0, Im) if parallel.expert_parallel else parallel.split(Im, "moe_intermediate_size")
        self.format = fmt
        fmt.create_weights(self, n_local, n_im, Hm)
        self.post_expert_norm = RMSNorm(Hm, cfg.post_norm_eps, gain_center=1.0, input_scaled=True)
        self.num_experts, self.intermediate, self.hidden = E, Im, Hm
        self.local_experts, self.local_intermediate = n_local, n_im
        self._shards: dict[str, Shard] = {}
        if parallel.expert_parallel and parallel.tp_size > 1:
            block = Shard.range(0, self.first_expert, n_local, E)
            self._shards = {"gate_up_proj": block, "down_proj": block}
        elif parallel.tp_size > 1:
            self._shards = {
                "gate_up_proj": Shard(1, ((i0, n_im), (Im + i0, n_im)), 2 * Im),
                "down_proj": Shard.range(2, i0, n_im, Im),
            }

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """The checkpoint tensors of the experts (not the post-norm), by name relative to this module."""
        specs = self.format.tensors(self.local_experts, self.local_intermediate, self.hidden)
        if self._shards and set(specs) != set(self._shards):
            raise NotImplementedError(f"{type(self.format).__name__} experts cannot be parallel yet")
        return {n: replace(spec, shard=self._shards.get(n)) for n, spec in specs.items()}

    def forward(
        self, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, mm: Products = REFERENCE
    ) -> torch.Tensor:
        """u [T, Hm] model dtype, weights/ids [T, k] -> weighted sum [T, Hm] fp32, the products by `mm`.

        Assignments are sorted by expert; each expert with tokens runs one GEMM pair over
        all of them. Each token's k contributions are then summed in increasing expert id,
        one add at a time (the reference's accumulation order).
        """
        z = self._grouped(u, weights, ids, mm)
        out = z[:, 0]
        for r in range(1, ids.shape[1]):
            out = out + z[:, r]
        return out

    def _grouped(self, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, mm: Products) -> torch.Tensor:
        """Weighted, post-normed expert outputs [T, k, Hm] fp32, slot r of token t holding
        its r-th smallest expert."""
        T, k = ids.shape
        par, first = self.parallel, self.first_expert
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # [T*k] assignments grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        x = u[order // k]  # [T*k, Hm] expert inputs, grouped by expert
        partial = par.tp_size > 1 and not par.expert_parallel  # TP-split experts: Im-slices to sum
        ys = []
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            if first <= expert < first + self.local_experts:
                ys.append(mm.expert(self, expert - first, x[start : start + n], partial))  # [n, Hm]
            else:  # another EP rank's expert: contributes nothing here (a zero row stays zero)
                ys.append(x.new_zeros(n, self.hidden))
            start += n
        y = torch.cat(ys)
        if partial:  # full rows before the norm: fp32 sum over the ranks, rounded once
            y = par.all_reduce_fp32(y).to(u.dtype)
        norm = self.post_expert_norm
        y = input_scaled_rms_norm(y, norm.eps, norm.weight, norm.gain_center, torch.float32)
        y = y * weights.reshape(-1)[order, None]
        rank = ids.argsort(dim=1).argsort(dim=1).reshape(-1)  # [T*k] rank of each expert in its token
        dest = (order // k) * k + rank[order]
        z = torch.empty_like(y).index_copy_(0, dest, y).view(T, k, -1)
        return par.all_reduce_fp32(z) if par.expert_parallel else z  # one owner per slot: exact


class SparseMoeBlock(nn.Module):
    """f [T, H] (model dtype) -> b [T, H] (model dtype)."""

    def __init__(
        self, cfg: ModelConfig, formats: WeightFormats, prefix: str, parallel: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        self.gate = Router(cfg)  # router, pooler, norms and unpooler are replicated
        self.pre_expert_proj = Linear(
            cfg.hidden_size, cfg.moe_hidden_size, formats.linear(prefix + "pre_expert_proj")
        )  # pooler
        self.pre_expert_norm = RMSNorm(cfg.moe_hidden_size, cfg.rms_norm_eps, gain_center=1.0)
        self.experts = Experts(cfg, formats.experts(prefix + "experts"), parallel)
        self.post_expert_proj = Linear(
            cfg.moe_hidden_size, cfg.hidden_size, formats.linear(prefix + "post_expert_proj")
        )  # unpooler

    def forward(self, f: torch.Tensor, mm: Products = REFERENCE) -> torch.Tensor:
        weights, ids = self.gate(f)
        u = self.pre_expert_norm(mm.linear(self.pre_expert_proj, f))  # [T, Hm], rounded to model dtype
        y = self.experts(u, weights, ids, mm)  # [T, Hm] fp32
        return mm.linear(self.post_expert_proj, y.to(f.dtype))


class DenseMlp(nn.Module):
    """SwiGLU: down(silu(gate f) * up f)."""

    def __init__(
        self, cfg: ModelConfig, formats: WeightFormats, prefix: str, parallel: ParallelContext = SINGLE
    ) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        i0, n = parallel.split(I, "intermediate_size")
        cols = Shard.range(0, i0, n, I) if parallel.tp_size > 1 else None
        rows = Shard.range(1, i0, n, I) if parallel.tp_size > 1 else None
        self.gate_proj = Linear(H, n, formats.linear(prefix + "gate_proj"), cols)
        self.up_proj = Linear(H, n, formats.linear(prefix + "up_proj"), cols)
        self.down_proj = Linear(n, H, formats.linear(prefix + "down_proj"), rows, reduce=parallel)

    def forward(self, f: torch.Tensor, mm: Products = REFERENCE) -> torch.Tensor:
        return mm.linear(self.down_proj, F.silu(mm.linear(self.gate_proj, f)) * mm.linear(self.up_proj, f))
