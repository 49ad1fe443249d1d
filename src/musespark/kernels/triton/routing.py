"""Kernel 4: MoE routing in fp32, BLOCK_T tokens per program.

    r = (x W^T) * output_multiplier        x [T, H] (widened to fp32), W [E, H] fp32
    p = sigmoid(r);  chosen = top-k of p + bias (ties: the lower expert id)
    w = p[chosen] / (sum p[chosen] + router_eps) * routed_scaling_factor

Returns (w [T, k] fp32, ids [T, k] int64) with each token's ids in increasing order (the
order the experts kernel sums in). The bias only picks experts; it never enters w.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, pow2


@triton.jit
def _routing_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_w_ptr,
    out_id_ptr,
    T,
    H,
    E,
    mult,
    scale,
    router_eps,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    e_ok = experts < E
    hs = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h_ok = (h0 + hs) < H
        x = tl.load(x_ptr + rows64[:, None] * H + h0 + hs[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0).to(
            tl.float32
        )
        wt = tl.load(
            w_ptr + experts[None, :].to(tl.int64) * H + h0 + hs[:, None], mask=h_ok[:, None] & e_ok[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_H, BLOCK_E]
        acc = tl.dot(x, wt, acc, input_precision="ieee")
    p = tl.sigmoid(acc * mult)
    bias = tl.load(bias_ptr + experts, mask=e_ok, other=0.0)
    pick = tl.where(e_ok[None, :], p + bias[None, :], float("-inf"))
    chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    for _ in tl.static_range(K):
        best = tl.max(pick, axis=1)
        idx = tl.min(tl.where(pick == best[:, None], experts[None, :], BLOCK_E), axis=1)  # lowest id among ties
        hit = experts[None, :] == idx[:, None]
        chosen = tl.where(hit, 1, chosen)
        pick = tl.where(hit, float("-inf"), pick)
    p_chosen = tl.where(chosen == 1, p, 0.0)
    total = tl.sum(p_chosen, axis=1)
    w = p_chosen / (total[:, None] + router_eps) * scale
    rank = tl.cumsum(chosen, axis=1) - 1  # slot of each chosen expert: increasing id order
    dst = rows64[:, None] * K + rank
    keep = (chosen == 1) & row_ok[:, None]
    tl.store(out_w_ptr + dst, w, mask=keep)
    tl.store(out_id_ptr + dst, experts[None, :].to(tl.int64) + tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int64), mask=keep)


def route_topk(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    output_multiplier: float,
    routed_scaling_factor: float,
    router_eps: float,
    block_t: int = 16,
    block_h: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (any float dtype), router_weight [E, H] fp32, bias [E] fp32 ->
    (weights [T, k] fp32, ids [T, k] int64, ids increasing along k). `router_eps` is added to
    the sum of the chosen scores (the model's: `layers.moe.ROUTER_EPS`)."""
    check_device(x)
    T, H = x.shape
    E = router_weight.shape[0]
    assert router_weight.shape == (E, H) and 0 < top_k <= E
    x = x.contiguous()
    w = router_weight.float().contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    if T > 0:
        _routing_kernel[(triton.cdiv(T, block_t),)](
            x,
            w,
            bias.float().contiguous(),
            weights,
            ids,
            T,
            H,
            E,
            float(output_multiplier),
            float(routed_scaling_factor),
            float(router_eps),
            K=top_k,
            BLOCK_T=block_t,
            BLOCK_H=pow2(min(block_h, H)),
            BLOCK_E=pow2(E),
            num_warps=4,
        )
    return weights, ids
