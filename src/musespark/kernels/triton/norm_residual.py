"""Kernel 1: post-norm -> norm-preserving gated residual -> next pre-norm, one row per program.

    b'  = rms(b * post_gain, post_eps)            (post_gain absent: weightless post-norm)
    s'  = alpha * s + beta * b'                   fp32 stream [T, H]
    h   = rms(s', eps) * next_gain  -> out_dtype  (optional: the next layer's input or FFN norm)

and, with no residual, the plain norm `rms(x, eps) * gain -> out_dtype` (embedding norm,
pre-expert norm, final norm). Every sum is fp32; h is rounded once, at its store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, is_bf16, pow2, round_to


@triton.jit
def _norm_residual_kernel(
    s_ptr,
    b_ptr,
    post_gain_ptr,
    alpha_ptr,
    beta_ptr,
    gain_ptr,
    s_out_ptr,
    h_ptr,
    H,
    post_eps,
    eps,
    RESIDUAL: tl.constexpr,
    HAS_POST_GAIN: tl.constexpr,
    NEXT_NORM: tl.constexpr,
    HAS_GAIN: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    s = tl.load(s_ptr + row * H + cols, mask=m, other=0.0).to(tl.float32)
    if RESIDUAL:
        b = tl.load(b_ptr + row * H + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_POST_GAIN:
            b = b * tl.load(post_gain_ptr + cols, mask=m, other=0.0)
        b = b * tl.rsqrt(tl.sum(b * b, axis=0) / H + post_eps)
        alpha = tl.load(alpha_ptr + cols, mask=m, other=0.0)
        beta = tl.load(beta_ptr + cols, mask=m, other=0.0)
        s = alpha * s + beta * b
        tl.store(s_out_ptr + row * H + cols, s, mask=m)
    if NEXT_NORM:
        h = s * tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
        if HAS_GAIN:
            h = h * tl.load(gain_ptr + cols, mask=m, other=0.0)
        tl.store(h_ptr + row * H + cols, round_to(h, OUT_BF16), mask=m)


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


def norm_residual(
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
    """stream [T, H] fp32, branch [T, H] (any float dtype), alpha/beta/post_gain/next_gain [H]
    fp32 -> (s' [T, H] fp32, h [T, H] out_dtype or None when `next_norm` is False).
    `next_gain` None with `next_norm` is a weightless next norm."""
    check_device(stream, branch)
    assert stream.dtype == torch.float32 and stream.shape == branch.shape and stream.dim() == 2
    T, H = stream.shape
    stream, branch = stream.contiguous(), branch.contiguous()
    s_out = torch.empty_like(stream)
    out_dtype = out_dtype or branch.dtype
    h = torch.empty(T, H, dtype=out_dtype, device=stream.device) if next_norm else s_out
    block = pow2(H)
    if T > 0:
        _norm_residual_kernel[(T,)](
            stream,
            branch,
            post_gain if post_gain is not None else alpha,
            alpha,
            beta,
            next_gain if next_gain is not None else alpha,
            s_out,
            h,
            H,
            float(post_eps),
            float(eps),
            RESIDUAL=True,
            HAS_POST_GAIN=post_gain is not None,
            NEXT_NORM=next_norm,
            HAS_GAIN=next_gain is not None,
            OUT_BF16=is_bf16(out_dtype),
            BLOCK_H=block,
            num_warps=_warps(block),
        )
    return s_out, (h if next_norm else None)


def rms_norm(
    x: torch.Tensor, eps: float, gain: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [T, H] (any float dtype) -> rms(x, eps) * gain [T, H] in out_dtype (default x's);
    gain [H] fp32 is the norm's full gain (gain_center + weight), None for a weightless norm."""
    check_device(x)
    assert x.dim() == 2
    x = x.contiguous()
    T, H = x.shape
    out_dtype = out_dtype or x.dtype
    out = torch.empty(T, H, dtype=out_dtype, device=x.device)
    block = pow2(H)
    if T > 0:
        _norm_residual_kernel[(T,)](
            x,
            x,
            x,
            x,
            x,
            gain if gain is not None else x,
            out,
            out,
            H,
            0.0,
            float(eps),
            RESIDUAL=False,
            HAS_POST_GAIN=False,
            NEXT_NORM=True,
            HAS_GAIN=gain is not None,
            OUT_BF16=is_bf16(out_dtype),
            BLOCK_H=block,
            num_warps=_warps(block),
        )
    return out
