"""Building blocks of the DSpark draft (DSPARK.md §4.1, §4.3): interleaved RoPE, the fp32
RMSNorm family, the gated residual blend, SwiGLU, masked GQA attention, and a cache for tensors
derived from weights (stacked projections, norm gains) used on the inference path.

Every function takes arbitrary leading dims (`*B`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_INV_FREQ: dict[tuple[float, int, str], torch.Tensor] = {}


def rope_table(
    positions: torch.Tensor, theta: float, head_dim: int, table_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Complex rotations e^{i phi} [*B, Q, 1, hd/2] (complex64) at phi = pos * theta^(-2m/hd);
    cos and sin are fp32 values, rounded through `table_dtype` first if that is not fp32.
    Shared by q and k and by every layer of one pass."""
    key = (theta, head_dim, str(positions.device))
    inv = _INV_FREQ.get(key)
    if inv is None:
        inv = _INV_FREQ[key] = 1.0 / theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
        )
    ang = positions.float()[..., None, None] * inv
    if table_dtype == torch.float32:
        return torch.polar(torch.ones_like(ang), ang)
    return torch.complex(ang.cos().to(table_dtype).float(), ang.sin().to(table_dtype).float())


def interleaved_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    table_dtype: torch.dtype = torch.float32,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """GPT-J RoPE on pairs (x_2m, x_2m+1) at angle phi = pos * theta^(-2m/hd), full head rotated:
    (x_2m cos - x_2m+1 sin, x_2m+1 cos + x_2m sin), i.e. the pair as a complex number times e^{i phi}.
    x [*B, Q, heads, hd], positions [*B, Q] -> fp32 [*B, Q, heads, hd]; `table` = rope_table(...)."""
    hd = x.shape[-1]
    rot = table if table is not None else rope_table(positions, theta, hd, table_dtype)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (hd // 2, 2)).contiguous())
    return torch.view_as_real(pairs * rot).flatten(-2)


def derived_weight(
    owner: nn.Module, name: str, sources: list[torch.Tensor], make: Callable[[], torch.Tensor] | None = None
) -> torch.Tensor:
    """A tensor derived from weights (default: torch.cat(sources) by rows), cached on `owner`
    until a source is replaced or modified in place (keyed by storage and version counter).
    Inference only: the result carries no gradient."""
    # (inference tensors have no version counter: for them only a replaced tensor invalidates)
    key = tuple((p.data_ptr(), -1 if p.is_inference() else p._version, p.dtype) for p in sources)
    cache = owner.__dict__.setdefault("_derived", {})
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            value = make() if make is not None else torch.cat([p.detach() for p in sources])
        hit = cache[name] = (key, value)
    return hit[1]


def head_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm over the last dim in fp32: x / sqrt(mean(x^2) + eps) (fp32 result)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps)


class DraftNorm(nn.Module):
    """RMSNorm, fp32 inside, rounded once to `out_dtype`. Gain g = weight + center (no weight:
    no gain). `input_scaled`: rms(x * g) instead of rms(x) * g. (torch's fused rms_norm on fp32
    inputs: the draft only proposes, so its rounding never decides an output token.)"""

    def __init__(self, dim: int, eps: float, affine: bool, center: float = 0.0, input_scaled: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.eps, self.center, self.input_scaled = eps, center, input_scaled

    def gain(self) -> torch.Tensor | None:
        """fp32 weight + center (None without a weight); cached when no gradient is wanted."""
        if self.weight is None:
            return None
        if torch.is_grad_enabled():
            w = self.weight.float()
            return w + self.center if self.center else w
        return derived_weight(self, "gain", [self.weight], lambda: self.weight.float() + self.center)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        g, x = self.gain(), x.float()
        if self.input_scaled:
            return F.rms_norm(x * g, (x.shape[-1],), None, self.eps).to(out_dtype)
        return F.rms_norm(x, (x.shape[-1],), g, self.eps).to(out_dtype)


class GatedAdd(nn.Module):
    """Norm-preserving residual blend s <- alpha*s + beta*b (fp32, cast to the stream dtype),
    beta = sigmoid(w/0.3), alpha = sqrt(max(1e-3, sigmoid(-w/0.3)(1+beta)))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(dim))

    def forward(self, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        w = self.gate.float() / 0.3
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1 + beta), min=1e-3))
        return (alpha * s.float() + beta * b.float()).to(s.dtype)


class FeedForward(nn.Module):
    def __init__(self, H: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        w = derived_weight(self, "gate_up", [self.gate_proj.weight, self.up_proj.weight])  # one matmul
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def attention_scores(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked softmax attention. q [*B, Q, nh, hd], k/v [*B, K, nkv, hd], mask [*B, Q, K] bool
    (True = visible) -> [*B, Q, nh, hd]. Query head h reads kv head h // (nh / nkv)."""
    groups = q.shape[-2] // k.shape[-2]
    qt, kt, vt = q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3)  # heads before length
    if groups > 1:
        kt, vt = kt.repeat_interleave(groups, dim=-3), vt.repeat_interleave(groups, dim=-3)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask.unsqueeze(-3), scale=scale)
    return out.transpose(-2, -3)


def position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[*B, Q, K] bool: key position <= query position (and > query - window)."""
    m = k_pos[..., None, :] <= q_pos[..., :, None]
    if window is not None:
        m &= k_pos[..., None, :] > q_pos[..., :, None] - window
    return m
