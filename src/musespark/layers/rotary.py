"""Rotary position embedding, rotate-half form, with a per-layer base (docs/spec.md §1, §3).

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


class RopeTable:
    """cos and sin of one rotary base for positions [0, n), kept as [2, n, head_dim] fp32 and
    grown (doubling) to the largest position asked, up to `MAX_POSITIONS`; a step's rows are
    then one `index_select` instead of the half-dozen small ops of `cos_sin`, which cost
    ~85 µs a decode step on a CPU whose caches the weights just streamed through.

    Each value is `cos_sin`'s formula at its position, computed once for the whole table, so
    a position's value never depends on the step it is in (`cos_sin` on a step's rows may
    take torch's scalar tail for some of them: a row of 16 values alone can). Positions past
    `MAX_POSITIONS` use `cos_sin`."""

    MAX_POSITIONS = 1 << 15

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq
        self.table = torch.empty(2, 0, 2 * inv_freq.shape[0], dtype=torch.float32, device=inv_freq.device)

    def lookup(self, positions: torch.Tensor, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each contiguous [T, head_dim] fp32, for integer positions [T] on the
        table's device; `max_position` is their largest (computed from them when None)."""
        if positions.numel() == 0:
            return cos_sin(positions, self.inv_freq)
        if max_position is None:
            max_position = int(positions.max())
        if max_position >= self.MAX_POSITIONS:
            return cos_sin(positions, self.inv_freq)
        n = self.table.shape[1]
        if max_position >= n:
            n = min(self.MAX_POSITIONS, max(1024, 2 * n, 1 << max_position.bit_length()))
            cos, sin = cos_sin(torch.arange(n, device=self.inv_freq.device), self.inv_freq)
            self.table = torch.stack((cos, sin))
        both = torch.index_select(self.table, 1, positions)
        return both[0], both[1]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (any float dtype) by cos/sin [T, head_dim]; float32 result."""
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The interleaved (GPT-J) form: rotate the pairs (x_2m, x_2m+1) by frequency m's angle,
    (x_2m cos - x_2m+1 sin, x_2m+1 cos + x_2m sin). x [*B, heads, head_dim] (any float dtype),
    cos/sin [*B, head_dim] as `cos_sin` makes them (frequency m at m and m + head_dim/2);
    float32 result."""
    x = x.float()
    half = x.shape[-1] // 2
    c, s = cos[..., None, :half], sin[..., None, :half]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)


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
