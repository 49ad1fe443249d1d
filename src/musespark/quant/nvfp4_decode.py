"""NVFP4 weights decoded in row blocks straight to the compute dtype, with the bits of
`nvfp4_math.dequantize(...).to(dtype)` (the reference's rounding) but without its fp32 copy of
the whole weight or its per-element table lookups: the torch backend's product for NVFP4
linears and experts (docs/nvfp4.md §6).

How one block is decoded, with plain tensor ops:
1. each E2M1 code is moved into the bits of an fp16 number: sign to bit 15, exponent to bits
   10-11, mantissa to bit 9. fp16 has the same layout with a wider exponent (bias 15 instead of
   1), so that fp16 number is exactly E2M1 value * 2^-14 for all 16 codes (code 1, 0.5, lands
   on an fp16 subnormal, which the fp16 -> fp32 conversion widens exactly);
2. those are widened to fp32 and multiplied by t * 2^14, where t = f32(block scale) * f32(global)
   as the reference computes it. t * 2^14 is exact and the real product is E2M1 * t, so the fp32
   result, rounded once to the output dtype, is the reference's to the bit. A block where
   t * 2^14 would overflow (|t| > 2^113: no real checkpoint) uses the reference formula instead.

Memory: the temporaries hold one block (`BLOCK_ELEMENTS` weights, a few MB); the output is the
weight in the compute dtype.
"""

from __future__ import annotations

import torch

from .nvfp4_math import BLOCK, dequantize

# Weights decoded per block: the int32 and fp32 temporaries of one block (~8 bytes a weight)
# stay within a core's L2 cache, and each op still spans enough elements to use every thread.
BLOCK_ELEMENTS = 1 << 17
_F16_UNIT = 2.0**14  # an E2M1 code written into fp16 bits is its value / 2^14
_SIGNS = 0x00080008  # the sign bit of both codes of a byte, once spread into an int32 (below)
_MAGNITUDES = 0x00070007  # their exponent and mantissa bits


class _Workspace:
    """Per-call temporaries for blocks of up to `rows` rows of `half` packed bytes."""

    def __init__(self, rows: int, half: int) -> None:
        self.spread = torch.empty(rows, half, dtype=torch.int32)
        self.signs = torch.empty(rows, half, dtype=torch.int32)
        self.values = torch.empty(rows, 2 * half, dtype=torch.float32)


def _decode_block(packed: torch.Tensor, t: torch.Tensor, out: torch.Tensor, work: _Workspace | None = None) -> None:
    """packed uint8 [n, K/2], t = block scale * global * 2^14 fp32 [n, K/16] -> out [n, K] (any
    float dtype, contiguous rows), each weight f32(E2M1 * 2^-14 * t) rounded once to out's dtype."""
    n, half = packed.shape
    work = work or _Workspace(n, half)
    q, signs, values = work.spread[:n], work.signs[:n], work.values[:n]
    # One int32 per byte; its low 16 bits become element 2j (low nibble), its high 16 bits 2j+1.
    q.copy_(packed)
    torch.bitwise_left_shift(q, 12, out=signs)
    q.bitwise_or_(signs)  # low nibble at bits 0-3, high nibble at bits 16-19 (other bits: ignored)
    torch.bitwise_and(q, _SIGNS, out=signs).bitwise_left_shift_(12)  # E2M1 bit 3 -> fp16 bit 15
    q.bitwise_and_(_MAGNITUDES).bitwise_left_shift_(9).bitwise_or_(signs)  # bits 0-2 -> 9-11
    values.copy_(q.view(torch.float16))  # [n, K]: exact
    torch.mul(values.view(n, -1, BLOCK), t.unsqueeze(-1), out=out.view(n, -1, BLOCK))


def dequantize_to(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    block_elements: int | None = None,
) -> torch.Tensor:
    """packed uint8 [N, K/2], block_scale e4m3 [N, K/16], global_scale fp32 broadcasting against
    [N, K/16] (0-d, or [N, 1]) -> the weight [N, K] in `dtype` (into `out` when given), bit for bit
    `nvfp4_math.dequantize(packed, block_scale, global_scale).to(dtype)`; decoded
    `block_elements` weights (default `BLOCK_ELEMENTS`) at a time, at least one row."""
    if packed.dim() != 2:
        raise ValueError(f"dequantize_to decodes one 2-D weight, got packed codes of shape {list(packed.shape)}")
    N, half = packed.shape
    K = 2 * half
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=packed.device)
    if packed.device.type != "cpu":  # the bit tricks below are tuned for CPUs; elsewhere the formula itself
        return out.copy_(dequantize(packed, block_scale, global_scale))
    g = torch.broadcast_to(global_scale.float(), (N, K // BLOCK))  # a view: per row or shared
    limit = BLOCK_ELEMENTS if block_elements is None else block_elements
    rows = max(1, min(N, limit // max(K, 1)))
    work = _Workspace(rows, half)
    for r in range(0, N, rows):
        s = slice(r, min(r + rows, N))
        t = block_scale[s].float() * g[s]  # the reference's t, exactly
        scaled = t * _F16_UNIT
        if bool(torch.isinf(scaled).any()):  # |t| > 2^113 (or inf): the formula itself, same bits
            out[s].copy_(dequantize(packed[s], block_scale[s], g[s]))
            continue
        _decode_block(packed[s], scaled, out[s], work)
    return out
