"""The `Linear` module: a bias-free linear layer that holds a weight format (`quant/`), and
`Products`: who computes the products of a step's linears and experts.

`linear(x, w) = x @ w^T`, the torch reference product the formats multiply with, lives below
the formats (`quant/gemm.py`); it is re-exported here for the layers that call it directly.

The layers that multiply (`DenseMlp`, `SparseMoeBlock`, `Experts`) take a `Products`; the
default, `REFERENCE`, asks each module's format with the reference product. A backend passes
its own: the cpu backend's answers some products natively (backends/cpu_plan.py), the same
contract with other summation orders, so the layers' code is the same for every backend.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.names import Shard, TensorSpec
from ..quant.gemm import Gemm, linear

if TYPE_CHECKING:
    from ..parallel.state import ParallelContext
    from ..quant.format import LinearFormat

__all__ = ["REFERENCE", "Linear", "Products", "linear"]


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


class Products:
    """The products of a step: `linear(module, x)` for a `Linear`, `expert(...)` for one expert
    of an `Experts` module. These ask the module's format, with `gemm` as the float product
    (None: the format's own, the reference `linear`). Subclasses answer some products another
    way and fall back to these; a tensor-parallel row slice (`reduce`) always keeps its module's
    own fp32 sum."""

    gemm: Gemm | None = None

    def linear(self, module: Linear, x: torch.Tensor) -> torch.Tensor:
        if module.reduce is not None or self.gemm is None or not module.format.takes_gemm:
            return module(x)
        return module.format.apply(module, x, self.gemm)

    def expert(self, module: nn.Module, expert: int, x: torch.Tensor, partial: bool) -> torch.Tensor:
        """Expert `expert` (local index) of `module` (an `Experts`) on x [n, Hm] (ExpertsFormat.apply)."""
        if self.gemm is None or not module.format.takes_gemm:
            return module.format.apply(module, expert, x, partial)
        return module.format.apply(module, expert, x, partial, self.gemm)


REFERENCE = Products()
