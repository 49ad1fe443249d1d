"""`linear(x, w) = x @ w^T`: the torch reference product every weight format multiplies with
(and the `Linear` module of `layers/linear.py` through them).

`linear` accumulates in fp32 and rounds once to x's dtype, as `F.linear` does. One route
choice, by shape and CPU only: a bf16 product with many rows on an x86 CPU without bf16
hardware (no AVX512-BF16/AMX) widens the weight to fp32 and runs MKL's fp32 GEMM, about 7x
faster there than PyTorch's bf16 GEMM for a 2048-token prefill. The native kernels are
the cpu backend's business (`backends/cpu_backend.py`), never chosen here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cpu_features import is_x86_without_native_bf16

_WIDEN_MIN_ROWS = 64  # below this the bf16 GEMM's conversion cost is smaller than widening the weight


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] and w [N, K] of the same dtype -> [..., N] in x's dtype."""
    if (
        x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.numel() > _WIDEN_MIN_ROWS * x.shape[-1]
        and not (torch.is_grad_enabled() and w.requires_grad)
        and is_x86_without_native_bf16()
    ):
        return F.linear(x.float(), w.float()).to(torch.bfloat16)
    return F.linear(x, w)
