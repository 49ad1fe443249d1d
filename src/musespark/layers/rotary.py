"""Rotary position embedding, rotate-half form, with a per-layer base (SPEC §1, §3).

Checkpoints store Q/K rows per head in rotate-half order, so rotating them as stored
equals the production system's interleaved rotation. cos/sin are built in float32.
"""

from __future__ import annotations

import torch

from .norm import rms


def inv_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies for base `theta`."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim] (float32) for integer positions [T]."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (any float dtype) by cos/sin [T, head_dim]; float32 result."""
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def norm_rope(
    x: torch.Tensor,  # [T, heads, D], any float dtype
    eps: float,
    scale: float,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The attention's QK-norm and rotary embedding: rope(rms(x) * scale) in fp32,
    rounded once to out_dtype."""
    y = rms(x, eps, scale)
    if cos_sin is not None:
        y = apply_rotary(y, *cos_sin)
    return y.to(out_dtype)
