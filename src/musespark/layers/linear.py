"""`linear(x, w) = x @ w^T` in x's dtype, by the fastest exact route for the shape.

On CPUs (see `kernels/cpu.py` for why):
* bf16: the native kernel, for every number of rows. It reads each weight once per
  4-row tile, widens bf16 to fp32 in registers and computes every output row the same
  way whatever the batch, so a request's tokens never depend on what it is batched with
  (the server gives the offline text). PyTorch's bf16 GEMM on CPUs without AVX512-BF16/AMX
  is several times slower;
* bf16 without the kernels, on such a CPU, with many rows: the weight is widened to fp32
  once per call and MKL's fp32 GEMM runs (about 7x faster than the bf16 GEMM for a
  2048-token prefill);
* otherwise `F.linear` (fp32 models: MKL, as in transformers).
All routes accumulate in fp32 and round the result once to x's dtype, as `F.linear` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu

# fp32 keeps MKL, the library transformers uses: the kernel is as accurate (closer to an
# fp64 reference than MKL on the oracle configs, RESULTS.md) but rounds differently, and
# on random MoE configs that moves fp32 logits by up to 1e-4 relative, over the 1e-5 the
# engine allows an optimization.
NATIVE_DTYPES = (torch.bfloat16,)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] and w [N, K] of the same dtype -> [..., N] in x's dtype."""
    if x.device.type != "cpu" or x.dtype != w.dtype or (torch.is_grad_enabled() and w.requires_grad):
        return F.linear(x, w)
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if x.dtype in NATIVE_DTYPES and M > 0 and K % 8 == 0:
        ops = cpu.native_ops()
        if ops is not None:
            return ops.linear_small_m(x.reshape(M, K), w).view(*x.shape[:-1], w.shape[0])
    if x.dtype == torch.bfloat16 and M > 64 and cpu.is_x86_without_native_bf16():
        return F.linear(x.float(), w.float()).to(torch.bfloat16)
    return F.linear(x, w)


class Linear(nn.Linear):
    """`nn.Linear` without bias that computes through `linear` (same parameter names)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)

