"""The DSpark draft's building blocks on the shared layers (docs/speculative.md §4.1, §4.3):
interleaved RoPE (`layers.rotary`), the fp32 RMSNorm family and the gated residual blend
(`layers.norm`), SwiGLU and linears (`layers.moe.DenseMlp`, `layers.linear.Linear`), the
masked GQA attention of the training pack, and a cache for tensors derived from weights
(stacked projections) used on the inference path. No module-global state: rotary
frequencies are cached per layer instance and device.

Every function takes arbitrary leading dims (`*B`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import Linear
from ..layers.moe import DenseMlp
from ..layers.norm import ResidualGate, RMSNorm, rms
from ..layers.rotary import apply_rotary_interleaved, cos_sin, inv_frequencies
from ..quant.format import WeightFormats

RESIDUAL_GATE_TEMPERATURE = 0.3  # the draft's gated residual blend (§4.1): beta = sigmoid(w / 0.3)
DENSE = WeightFormats()  # the draft's linears are dense


def dense_linear(in_features: int, out_features: int) -> Linear:
    """A bias-free dense linear [out, in] (checkpoint name `weight`)."""
    return Linear(in_features, out_features, DENSE.linear(""))


def draft_norm(dim: int, eps: float, affine: bool, center: float = 0.0, input_scaled: bool = False) -> RMSNorm:
    """The draft's RMSNorm: gain = weight + center (no weight: no gain), weight initialised
    to 1; fp32 inside, rounded once to the output dtype (`RMSNorm.forward(x, out_dtype)`)."""
    norm = RMSNorm(dim, eps, gain_center=center, input_scaled=input_scaled, affine=affine)
    if norm.weight is not None:
        with torch.no_grad():
            norm.weight.fill_(1.0)
    return norm


def residual_gate(dim: int) -> ResidualGate:
    """Norm-preserving blend s <- alpha*s + beta*b, beta = sigmoid(w/0.3), eps 1e-3 (fp32)."""
    return ResidualGate(dim, RESIDUAL_GATE_TEMPERATURE, eps=1e-3)


def feed_forward(cfg: object) -> DenseMlp:
    """SwiGLU down(silu(gate x) * up x) at the draft's hidden_size / intermediate_size."""
    return DenseMlp(cfg, DENSE, "feed_forward.")  # type: ignore[arg-type]  (reads the two sizes only)


class Rotary:
    """cos/sin of one base for a layer (interleaved RoPE, §4.3): frequencies cached per device."""

    def __init__(self, theta: float, head_dim: int) -> None:
        self.theta, self.head_dim = theta, head_dim
        self._inv: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, table_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*B, Q, hd] fp32 at positions [*B, Q], rounded through `table_dtype` first
        if that is not fp32."""
        inv = self._inv.get(positions.device)
        if inv is None:
            inv = self._inv[positions.device] = inv_frequencies(self.theta, self.head_dim).to(positions.device)
        cos, sin = cos_sin(positions.reshape(-1), inv)
        cos, sin = cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)
        if table_dtype != torch.float32:
            cos, sin = cos.to(table_dtype).float(), sin.to(table_dtype).float()
        return cos, sin


def interleaved_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    table_dtype: torch.dtype = torch.float32,
    table: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """GPT-J RoPE on pairs (x_2m, x_2m+1) at angle phi = pos * theta^(-2m/hd), full head rotated.
    x [*B, Q, heads, hd], positions [*B, Q] -> fp32 [*B, Q, heads, hd]; `table` = (cos, sin)."""
    cos, sin = table if table is not None else Rotary(theta, x.shape[-1]).cos_sin(positions, table_dtype)
    return apply_rotary_interleaved(x, cos, sin)


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
    """Weightless RMS norm over the last dim in fp32 (`layers.norm.rms`; fp32 result)."""
    return rms(x, eps)


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
