"""Kernel 2: the attention's per-head QK-norm, query scale and rotate-half RoPE, with the
paged K/V write, one (token, head) per program.

    y = rope(rms(x, eps) * scale) -> out_dtype       x [T, heads, D]; cos/sin [T, D] fp32 or None (NoPE)
    with a cache: k_cache[slot] = y, v_cache[slot] = v  (flat slot = block * block_size + offset;
                  a negative slot is padding and writes nothing)

`write_kv` is the same kernel with the norm and rotation off: it only writes K/V (the triton
backend writes in `attention`, where the slots are known; `attn_in` has only the stream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, is_bf16, pow2, round_to


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    v_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    heads,
    D,
    eps,
    scale,
    NORM: tl.constexpr,
    ROPE: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    CACHE_BF16: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    base = (t * heads + hd) * D
    x = tl.load(x_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        y = x * r * scale
        if ROPE:
            half = D // 2
            partner = tl.where(cols < half, cols + half, cols - half)
            xp = tl.load(x_ptr + base + partner, mask=m, other=0.0).to(tl.float32)
            yp = xp * r * scale
            rot = tl.where(cols < half, -yp, yp)
            c = tl.load(cos_ptr + t * D + cols, mask=m, other=0.0)
            s = tl.load(sin_ptr + t * D + cols, mask=m, other=0.0)
            y = y * c + rot * s
        y = round_to(y, OUT_BF16)
    else:
        y = x
    if WRITE_OUT:
        tl.store(out_ptr + base + cols, y, mask=m)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            dst = (slot * heads + hd) * D
            tl.store(kc_ptr + dst + cols, round_to(y, CACHE_BF16), mask=m)
            v = tl.load(v_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(vc_ptr + dst + cols, round_to(v, CACHE_BF16), mask=m)


def qk_norm_rope(
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
    """x [T, heads, D] -> rope(rms(x) * scale) [T, heads, D] in out_dtype. With the cache
    arguments (v [T, heads, D], slot_mapping [T] int64, caches [num_blocks, block_size, heads, D])
    the result and v are also written at each token's slot."""
    check_device(x)
    assert x.dim() == 3
    T, heads, D = x.shape
    x = x.contiguous()
    out = torch.empty(T, heads, D, dtype=out_dtype, device=x.device)
    cos, sin = rotary if rotary is not None else (x, x)
    if rotary is not None:
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        assert cos.shape == (T, D) and D % 2 == 0
    cache = k_cache is not None
    if cache:
        assert v is not None and slot_mapping is not None and v_cache is not None
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-2:] == (heads, D)
        v, slot_mapping = v.contiguous(), slot_mapping.to(torch.int64).contiguous()
    if T > 0:
        _qk_norm_rope_kernel[(T, heads)](
            x,
            cos,
            sin,
            out,
            v if cache else x,
            slot_mapping if cache else x,
            k_cache if cache else x,
            v_cache if cache else x,
            heads,
            D,
            float(eps),
            float(scale),
            NORM=True,
            ROPE=rotary is not None,
            WRITE_OUT=True,
            WRITE_CACHE=cache,
            OUT_BF16=is_bf16(out_dtype),
            CACHE_BF16=cache and is_bf16(k_cache.dtype),
            BLOCK_D=pow2(D),
            num_warps=1,
        )
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """k, v [T, nKV, D] (already normed and rotated) -> k_cache/v_cache [num_blocks, block_size,
    nKV, D] at slot_mapping [T] (negative: skipped), converted to the cache dtype."""
    check_device(k, v)
    T, heads, D = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-2:] == (heads, D)
    k, v, slots = k.contiguous(), v.contiguous(), slot_mapping.to(torch.int64).contiguous()
    if T > 0:
        _qk_norm_rope_kernel[(T, heads)](
            k,
            k,
            k,
            k,
            v,
            slots,
            k_cache,
            v_cache,
            heads,
            D,
            0.0,
            1.0,
            NORM=False,
            ROPE=False,
            WRITE_OUT=False,
            WRITE_CACHE=True,
            OUT_BF16=False,
            CACHE_BF16=is_bf16(k_cache.dtype),
            BLOCK_D=pow2(D),
            num_warps=1,
        )
