"""The weight-format interfaces (see `quant/__init__.py`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from ..checkpoint.names import TensorSpec
from .gemm import Gemm


def register_tensors(module: nn.Module, specs: dict[str, TensorSpec]) -> None:
    """Register one zero parameter per spec on `module`, on the current default device (the
    loader builds on meta and assigns). Float specs take the default dtype and train;
    fixed non-float ones (packed codes) do not."""
    for name, spec in specs.items():
        module.register_parameter(
            name, nn.Parameter(torch.zeros(spec.shape, dtype=spec.dtype), requires_grad=spec.dtype is None)
        )


class LinearFormat(ABC):
    """The storage and the product of one linear layer of logical shape [out, in] (y = x W^T)."""

    # Whether `apply` takes `gemm` (the formats here do; a format written elsewhere may define
    # apply(module, x) alone, and is then always called so: the backends leave it to itself).
    takes_gemm: bool = False

    @abstractmethod
    def tensors(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        """The checkpoint tensors this layer needs, by name relative to the module ("weight", ...)."""

    def create_weights(self, module: nn.Module, out_features: int, in_features: int) -> None:
        register_tensors(module, self.tensors(out_features, in_features))

    @abstractmethod
    def apply(self, module: nn.Module, x: torch.Tensor, gemm: Gemm | None = None) -> torch.Tensor:
        """x [..., in] in the activation dtype -> [..., out] in x's dtype. `gemm`: the product of
        x with a float weight (default `quant/gemm.py` `linear`), where the format makes one."""


class ExpertsFormat(ABC):
    """The storage and the product of E SwiGLU experts at width Hm with intermediate width Im,
    kept as fused 3-D tensors (`gate_up_proj` [E, 2*Im, Hm]: gate rows, then up rows;
    `down_proj` [E, Hm, Im]), as every Muse checkpoint stores them."""

    takes_gemm: bool = False  # as for `LinearFormat`

    @abstractmethod
    def tensors(self, num_experts: int, intermediate: int, hidden: int) -> dict[str, TensorSpec]:
        """The checkpoint tensors, by name relative to the experts module ("gate_up_proj", ...)."""

    def create_weights(self, module: nn.Module, num_experts: int, intermediate: int, hidden: int) -> None:
        register_tensors(module, self.tensors(num_experts, intermediate, hidden))

    @abstractmethod
    def apply(
        self, module: nn.Module, expert: int, x: torch.Tensor, partial: bool = False, gemm: Gemm | None = None
    ) -> torch.Tensor:
        """Expert `expert`'s SwiGLU: x [n, Hm] (activation dtype) -> down(silu(gate x) * up x) [n, Hm]
        in x's dtype; `partial` (a tensor-parallel slice of Im): the down product in fp32,
        unrounded, to be summed over the ranks before rounding. `gemm` as for `LinearFormat`."""


class WeightFormats:
    """Which format each module gets, by its relative name ("layers.3.self_attn.q_proj",
    "layers.3.mlp.experts"). The default is dense everywhere; a quantized checkpoint's
    config (with its exclude list) becomes a subclass."""

    def linear(self, name: str) -> LinearFormat:
        from .dense import DENSE

        return DENSE.linear

    def experts(self, name: str) -> ExpertsFormat:
        from .dense import DENSE

        return DENSE.experts
