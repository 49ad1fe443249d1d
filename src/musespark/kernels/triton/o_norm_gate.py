"""Kernel 3: the attention output's per-head weightless O-norm times the sigmoid output gate,
one (token, head) per program:  out = rms(o, eps) * sigmoid(g) -> o's dtype  (fp32 inside)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, is_bf16, pow2, round_to


@triton.jit
def _o_norm_gate_kernel(o_ptr, g_ptr, out_ptr, D, eps, OUT_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # flat (token, head)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    o = tl.load(o_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    y = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)
    y = y * tl.sigmoid(g)
    tl.store(out_ptr + row * D + cols, round_to(y, OUT_BF16), mask=m)


def o_norm_gate(o: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """o, g [T, nH, D] -> rms(o) * sigmoid(g) [T, nH, D] in o's dtype."""
    check_device(o, g)
    assert o.shape == g.shape and o.dim() == 3
    T, nH, D = o.shape
    o, g = o.contiguous(), g.contiguous()
    out = torch.empty_like(o)
    if T * nH > 0:
        _o_norm_gate_kernel[(T * nH,)](
            o, g, out, D, float(eps), OUT_BF16=is_bf16(o.dtype), BLOCK_D=pow2(D), num_warps=1
        )
    return out
