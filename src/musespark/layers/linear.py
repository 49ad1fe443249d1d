"""`linear(x, w) = x @ w^T`: the torch reference product, and the `Linear` module that
holds a weight format (`quant/`).

`linear` accumulates in fp32 and rounds once to x's dtype, as `F.linear` does. One route
choice, by shape and CPU only: a bf16 product with many rows on an x86 CPU without bf16
hardware (no AVX512-BF16/AMX) widens the weight to fp32 and runs MKL's fp32 GEMM, about 7x
faster there than PyTorch's bf16 GEMM for a 2048-token prefill. The native kernels are
the cpu backend's business (`backends/cpu_backend.py`), never chosen here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.names import Shard, TensorSpec
from ..cpu_features import is_x86_without_native_bf16

if TYPE_CHECKING:
    from ..parallel.state import ParallelContext
    from ..quant.format import LinearFormat

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


class Linear(nn.Module):
    """A bias-free linear layer [out, in] whose tensors and product come from `fmt`
    (dense: one `weight` [out, in], the checkpoint's name).

    Tensor parallel (`parallel/`): `shard` says which rows (column-parallel, dim 0) or
    columns (row-parallel, dim 1) of the checkpoint's weight this rank holds; a row-parallel
    layer gets `reduce` (the rank's ParallelContext) and sums its partial products over the
    TP group in fp32, rounding once to the input dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: LinearFormat,
        shard: Shard | None = None,
        reduce: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.format = fmt
        self.shard = shard
        self.reduce = reduce if reduce is not None and reduce.tp_size > 1 else None
        fmt.create_weights(self, out_features, in_features)

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """The checkpoint tensors this layer reads, by name relative to it."""
        specs = self.format.tensors(self.out_features, self.in_features)
        if self.shard is None:
            return specs
        if set(specs) != {"weight"}:
            raise NotImplementedError(f"{type(self.format).__name__} linears cannot be tensor-parallel yet")
        return {"weight": replace(specs["weight"], shard=self.shard)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return self.format.apply(self, x)
        partial = F.linear(x.float(), self.weight.float())  # exact products, fp32 sums
        return self.reduce.all_reduce_fp32(partial).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={type(self.format).__name__}"
