"""Dense weights (bf16, fp16 or fp32): one float tensor per matrix, multiplied as stored."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.names import TensorSpec
from .format import ExpertsFormat, LinearFormat
from .gemm import Gemm, linear


class DenseLinear(LinearFormat):
    takes_gemm = True

    def tensors(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec((out_features, in_features))}

    def apply(self, module: nn.Module, x: torch.Tensor, gemm: Gemm | None = None) -> torch.Tensor:
        return (gemm or linear)(x, module.weight)


class DenseExperts(ExpertsFormat):
    takes_gemm = True

    def tensors(self, num_experts: int, intermediate: int, hidden: int) -> dict[str, TensorSpec]:
        return {
            "gate_up_proj": TensorSpec((num_experts, 2 * intermediate, hidden)),
            "down_proj": TensorSpec((num_experts, hidden, intermediate)),
        }

    def apply(
        self, module: nn.Module, expert: int, x: torch.Tensor, partial: bool = False, gemm: Gemm | None = None
    ) -> torch.Tensor:
        mm = gemm or linear
        gate, up = mm(x, module.gate_up_proj[expert]).chunk(2, dim=-1)  # [n, Im] each
        h = F.silu(gate) * up
        if partial:
            return F.linear(h.float(), module.down_proj[expert].float())
        return mm(h, module.down_proj[expert])


@dataclass(frozen=True)
class _Dense:
    linear: DenseLinear
    experts: DenseExperts


DENSE = _Dense(DenseLinear(), DenseExperts())
