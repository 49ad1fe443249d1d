"""`linear(x, w) = x @ w^T`: the torch reference product every weight format multiplies with
(and the `Linear` module of `layers/linear.py` through them).

`linear` accumulates in fp32 and rounds once to x's dtype, as `F.linear` does, on every CPU and
device alike: the reference never looks at the hardware. A backend may hand a format another
product of the same contract (`Gemm`): the cpu backend's plan widens large bf16 products to
fp32 on CPUs without bf16 hardware (backends/cpu_plan.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (x [..., K], w [N, K]) -> [..., N] in x's dtype.
Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] and w [N, K] of the same dtype -> [..., N] in x's dtype."""
    return F.linear(x, w)
