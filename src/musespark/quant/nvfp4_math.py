"""NVFP4 arithmetic as small pure functions (docs/nvfp4.md §2, §4, §5), shared by the
weight format (`nvfp4.py`, decoding) and the checkpoint writer (`quantize.py`, encoding).

Vocabulary: a weight of logical shape [..., N, K] (K % 16 == 0) is stored as
- `packed` uint8 [..., N, K/2]: two E2M1 codes per byte, element 2j in the low nibble;
- `block_scale` float8_e4m3fn [..., N, K/16]: one scale per 16 consecutive elements of a row;
- a float32 global scale (`weight_scale_2`, a decode multiplier = amax / (6 * 448)),
  given here as a tensor that broadcasts against [..., N, K/16] (0-d, or [..., N, 1]).

E2M1 code: bit 3 sign, bits 2-1 exponent, bit 0 mantissa (values in `E2M1_VALUES`). E4M3FN:
bias 7, subnormals m * 2^-9, no infinity, 0x7F/0xFF NaN, max 448; decoded by torch's
float8_e4m3fn -> float32 conversion, which is exact. Every product is an fp32 multiply with
round-to-nearest-even, in the order docs/nvfp4.md §2 gives (the two scales first).
"""

from __future__ import annotations

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
GLOBAL_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688: amax / 2688 is the global decode multiplier

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)
# Midpoints between consecutive E2M1 magnitudes; a tie goes to the even code (mantissa bit 0):
# 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, |v| > 5 -> 6 (saturating).
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_TIES_UP = (0.75, 1.75, 3.5)  # the midpoints whose upper neighbour is the even code


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K]: element 2j from the low nibble of byte j,
    element 2j+1 from the high nibble."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even, each < 16) -> uint8 [..., K/2] (`unpack_codes`' inverse)."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> their float32 values (same shape)."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """float32 values -> uint8 E2M1 codes, round-to-nearest-even, saturating at +-6; the sign
    bit is set for any v < 0 (so a negative value that rounds to 0 is code 8, -0)."""
    a = v.abs()
    bounds = _BOUNDS.to(v.device)
    idx = torch.searchsorted(bounds, a.contiguous(), right=False)  # number of bounds strictly below a
    for tie in _TIES_UP:
        idx = idx + (a == tie).long()
    return (idx + 8 * (v < 0).long()).to(torch.uint8)


def to_e4m3(s: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, round-to-nearest-even, saturating at +-448 (satfinite)."""
    return s.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., N, K/2], block_scale e4m3 [..., N, K/16], global_scale float32
    broadcasting against [..., N, K/16] -> float32 [..., N, K], bit-exact with vLLM's and
    ModelOpt's references: t = f32(scale) * f32(global); w = E2M1[code] * t."""
    t = block_scale.float() * global_scale.float()  # [..., N, K/16]
    w = e2m1_values(unpack_codes(packed)).unflatten(-1, (-1, BLOCK))  # [..., N, K/16, 16]
    return (w * t.unsqueeze(-1)).flatten(-2)


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The global decode multiplier f32(amax) / 2688 (docs/nvfp4.md §5.1; `input_scale` alike,
    §5.6). An all-zero tensor (amax 0) gets 1/2688 instead of 0, so its block scales stay
    finite (its codes are all zero either way)."""
    amax = amax.float()
    return torch.where(amax > 0, amax, torch.ones_like(amax)) / GLOBAL_DIVISOR


def quantize(w: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float weights [..., N, K] (K % 16 == 0) and a float32 global scale broadcasting against
    [..., N, K/16] (> 0) -> (packed uint8 [..., N, K/2], block_scale e4m3 [..., N, K/16]),
    ModelOpt's recipe (docs/nvfp4.md §5.2-5.5): s = block_amax / (6 * global), 1 where s == 0,
    clamped to [2^-9, 448], cast to e4m3 (RNE); codes = e2m1_rne(W / (f32(s) * global))."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the input dimension to be a multiple of {BLOCK}, got {w.shape[-1]}")
    g = global_scale.float()
    blocks = w.float().unflatten(-1, (-1, BLOCK))  # [..., N, K/16, 16]
    s = blocks.abs().amax(dim=-1) / (E2M1_MAX * g)
    s = torch.where(s == 0, torch.ones_like(s), s).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)
    scale = s.to(torch.float8_e4m3fn)
    v = blocks / (scale.float() * g).unsqueeze(-1)
    return pack_codes(round_to_e2m1(v).flatten(-2)), scale


def quantize_activation(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's runtime activation quantization (docs/nvfp4.md §4) of x [..., K] (K % 16 == 0) with
    the static 0-d `input_scale` (gs = 1 / input_scale), in fp32 with IEEE division (the GPU
    uses rcp.approx: rare boundary cases may differ).

    Returns (values, sf): values float32 [..., K] = E2M1[q] * f32(sf) exactly (the
    dequantized activation is values * input_scale) and sf e4m3 [..., K/16]."""
    gs = 1.0 / input_scale.float()
    blocks = x.float().unflatten(-1, (-1, BLOCK))  # [..., K/16, 16]
    amax16 = blocks.abs().amax(dim=-1)
    sf = to_e4m3(gs * (amax16 * (1.0 / E2M1_MAX)))
    sf32 = sf.float()
    out_scale = torch.where(sf32 == 0, torch.zeros_like(sf32), 1.0 / (sf32 * (1.0 / gs)))
    codes = round_to_e2m1(blocks * out_scale.unsqueeze(-1))
    return (e2m1_values(codes) * sf32.unsqueeze(-1)).flatten(-2), sf


def unscaled_weight(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """E2M1[code] * f32(block scale), float32 [..., N, K]: exact (at most 6 significant bits),
    the per-element factor the W4A4 GEMM multiplies before applying the global scales."""
    return dequantize(packed, block_scale, torch.ones((), dtype=torch.float32))
