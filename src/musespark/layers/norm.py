"""The fp32 RMSNorm family and the norm-preserving residual gate (docs/spec.md §2-3).

Every norm computes in float32 and rounds once, when it stores its output:
    rms(x, eps) = x * rsqrt(mean(x**2, -1) + eps)
Deliberately not `F.rms_norm` (the production description notes that path can
flip greedy choices); the formula is written out so its rounding is explicit.
"""

from __future__ import annotations

import torch
from torch import nn


def rms(x: torch.Tensor, eps: float, scale: float = 1.0) -> torch.Tensor:
    """Weightless RMS normalization over the last dim, times `scale`, in float32 (returns float32)."""
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y * scale if scale != 1.0 else y


def rms_norm(
    x: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None = None,
    gain_center: float = 0.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`rms(x) * (gain_center + weight)`, computed in fp32, rounded once to `out_dtype`."""
    y = rms(x, eps)
    if weight is not None:
        w = weight.float()
        y = y * (w + gain_center if gain_center else w)
    return y.to(out_dtype or x.dtype)


def input_scaled_rms_norm(
    x: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    gain_center: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Weight first, then normalize: `rms(x * (gain_center + weight))`, fp32 throughout."""
    y = rms(x.float() * (weight.float() + gain_center), eps)
    return y.to(out_dtype or x.dtype)


class RMSNorm(nn.Module):
    """A norm with a learned weight `[dim]`; `gain_center` 1.0 is the zero-centred form (1 + w).
    `affine=False`: no weight and no gain (`weight` and `gain()` are None)."""

    def __init__(
        self, dim: int, eps: float, gain_center: float = 1.0, input_scaled: bool = False, affine: bool = True
    ) -> None:
        super().__init__()
        if input_scaled and not affine:
            raise ValueError("RMSNorm: input_scaled needs a weight (affine=True)")
        if affine:
            self.weight = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter("weight", None)
        self.dim = dim
        self.eps = eps
        self.gain_center = gain_center
        self.input_scaled = input_scaled
        self._gain: torch.Tensor | None = None  # fp32 gain_center + weight, set by materialize()

    @torch.no_grad()
    def materialize(self) -> None:
        """Cache the fp32 gain for native kernels (after loading; the weight must not change afterwards)."""
        self._gain = None if self.weight is None else (self.weight.float() + self.gain_center).contiguous()

    def _apply(self, fn, *args, **kwargs):
        self._gain = None  # `.to()` and friends may change the weight: recompute on next use
        return super()._apply(fn, *args, **kwargs)

    def gain(self) -> torch.Tensor | None:
        """fp32 [dim]: gain_center + weight (None without a weight)."""
        if self._gain is None and self.weight is not None:
            self.materialize()
        return self._gain

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.input_scaled:
            return input_scaled_rms_norm(x, self.eps, self.weight, self.gain_center, out_dtype)
        return rms_norm(x, self.eps, self.weight, self.gain_center, out_dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, gain_center={self.gain_center}, input_scaled={self.input_scaled}" + (
            "" if self.weight is not None else ", affine=False"
        )


class ResidualGate(nn.Module):
    """Norm-preserving gated residual: `stream = alpha * stream + beta * branch`, in fp32.

    With w = gate / temperature:  beta = sigmoid(w),
    alpha = sqrt(max(eps, sigmoid(-w) * (1 + beta)))  (= sqrt(1 - beta^2), computed stably).
    alpha and beta depend only on the weight: `materialize()` caches them once after
    loading; in training mode they are recomputed so gradients reach `gate`.
    """

    alpha: torch.Tensor | None
    beta: torch.Tensor | None

    def __init__(self, dim: int, temperature: float, eps: float = 1e-3) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(dim, dtype=torch.float32))
        self.temperature = temperature
        self.eps = eps
        self.register_buffer("alpha", None, persistent=False)
        self.register_buffer("beta", None, persistent=False)

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.gate.float() / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=self.eps))
        return alpha, beta

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.alpha = self.beta = None  # the gate may have changed dtype or device: recompute on next use
        return out

    @torch.no_grad()
    def materialize(self) -> None:
        alpha, beta = self.coefficients()
        self.alpha, self.beta = alpha.contiguous(), beta.contiguous()

    def forward(self, stream: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        # stream: [T, H] fp32; branch: [T, H] fp32 (already post-normed)
        alpha, beta = self.coefficients() if self.training else self.coefficients_cached()
        return alpha * stream + beta * branch.float()

    def coefficients_cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha, beta) fp32 [H], from `materialize()` (made on first use)."""
        if self.alpha is None:
            self.materialize()
        return self.alpha, self.beta
