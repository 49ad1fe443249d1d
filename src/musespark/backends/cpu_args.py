"""The cpu backend's argument caches: what the fused ops take from the model, built at a
module's first use and kept.

A decode step calls four fused ops per layer, each with 10-25 arguments read from the
layer's modules. Reading them afresh costs 10-30 µs of Python per call (nn.Module attribute
lookups, the derived fp32 gains, the weight arguments' checks): ~0.5 ms of a ~9 ms bf16
batch-1 token on bench-small. So:

* `WeightArgs` holds each linear's and each expert set's weight argument
  (kernels/csrc/blocks/block.h `weight_arg`), with its packed panels where the kernels read them.
* `StepArgs` holds each (op, layer) argument tuple.

Invariant: a model's weights are frozen once its backend is chosen. Nothing here watches
them: a caller that changes a weight (in place, by replacing a parameter or a module, or by
`.to()`) calls `model.materialize_constants()` and chooses the backend again
(`model.backend = select_backend(...)`), which starts with empty caches. Entries are per
kernel path (`WeightArgs.panels`): the same module has one argument per path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..kernels import cpu
from ..quant.nvfp4 import Nvfp4Experts, Nvfp4Linear

if TYPE_CHECKING:
    from .modules import DecoderLayerModule


class WeightArgs:
    """The fused ops' weight arguments (kernels/csrc/blocks/block.h `weight_arg`) of each module.

    On the AVX-512-BF16 path a dense bf16 linear's argument is [weight, panels]: the weight
    packed once more (`cpu.pack_panels`, as many bytes again) for the panel kernel, which
    then multiplies every row of it, prompt or decode, 1.1-2x faster than the dot-product
    kernel (measured when the panels landed: `git log -S pack_panels`). bf16 experts [E, N, K] are packed likewise
    when `pack_experts` (the backend's choice, `cpu.expert_panels`: they are most of a MoE
    model, so that holds it nearly twice). The panels are made at a weight's first use (the
    first step), not at load, which keeps one copy of the weights (tests/model/test_load_memory.py).
    `panels` is the current plan's (cpu_plan.py; the backend sets it when the path changes)."""

    def __init__(self, panels: bool, pack_experts: bool = False) -> None:
        self.panels = panels
        self.pack_experts = pack_experts
        # (id(module), panels) -> (module, args); the module is held so that its id stays its own.
        self._cache: dict[tuple[int, bool], tuple[nn.Module, Any]] = {}

    def _get(self, module: nn.Module, names: tuple[str, ...], build: Callable[..., Any]) -> Any:
        key = (id(module), self.panels)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = (module, build(*(getattr(module, n) for n in names)))
        return hit[1]

    def _dense(self, w: torch.Tensor) -> list[torch.Tensor]:
        if self.panels and w.dtype == torch.bfloat16 and w.shape[-1] % 2 == 0 and (w.dim() == 2 or self.pack_experts):
            return [w, cpu.pack_panels(w)]
        return [w]

    def linear(self, linear: nn.Module) -> list[torch.Tensor]:
        if isinstance(linear.format, Nvfp4Linear):
            return self._get(
                linear,
                ("weight", "weight_scale", "weight_scale_2"),
                lambda w, s, g: [w, s.view(torch.uint8), g.reshape(1)],
            )
        return self._get(linear, ("weight",), self._dense)

    def experts(self, experts: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """gate|up and down (NVFP4: gate|up has two global scales per expert, down one)."""
        if isinstance(experts.format, Nvfp4Experts):
            names = (
                "gate_up_proj",
                "gate_up_proj_weight_scale",
                "gate_up_proj_weight_scale_2",
                "down_proj",
                "down_proj_weight_scale",
                "down_proj_weight_scale_2",
            )
            return self._get(
                experts,
                names,
                lambda gu, gus, gug, d, ds, dg: ([gu, gus.view(torch.uint8), gug], [d, ds.view(torch.uint8), dg]),
            )
        return self._get(experts, ("gate_up_proj", "down_proj"), lambda gu, d: (self._dense(gu), self._dense(d)))


class StepArgs:
    """Each fused op's argument tuple per (op, owner), built at first use and kept per weight
    path (`WeightArgs.panels`): the arguments after the stream that `attn_in`, `attn_out`,
    `ffn_dense` and `ffn_moe` take (kernels/csrc/blocks/block.h), the same tuples the layer-by-layer
    path passes and the whole-step plan holds (cpu_decode.py)."""

    def __init__(self, weights: WeightArgs) -> None:
        self.weights = weights
        # (op, id(owner), panels) -> (owner, args); the owner is held so that its id stays its own.
        self._cache: dict[tuple[str, int, bool], tuple[nn.Module, tuple]] = {}

    def _get(self, op: str, owner: nn.Module, build: Callable[[], tuple]) -> tuple:
        key = (op, id(owner), self.weights.panels)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = (owner, build())
        return hit[1]

    def attn_in(self, layer: DecoderLayerModule) -> tuple:
        """The input norm, q/k/v/gate weights, head counts and the q scale."""

        def build() -> tuple:
            attn, norm, w = layer.self_attn, layer.input_layernorm, self.weights
            return (
                norm.gain(),
                norm.eps,
                w.linear(attn.q_proj),
                w.linear(attn.k_proj),
                w.linear(attn.v_proj),
                w.linear(attn.gate_proj),
                attn.num_heads,
                attn.num_kv_heads,
                attn.qk_scale,
            )

        return self._get("attn_in", layer, build)

    def attn_out(self, layer: DecoderLayerModule) -> tuple:
        """The o weight, the O-norm eps, the residual gate's coefficients and the post-norm eps."""

        def build() -> tuple:
            attn, gate = layer.self_attn, layer.post_attention_residual_gate
            return (self.weights.linear(attn.o_proj), attn.eps, *gate.coefficients_cached(), layer.post_norm_eps)

        return self._get("attn_out", layer, build)

    def ffn(self, layer: DecoderLayerModule) -> tuple:
        """`ffn_dense`'s or `ffn_moe`'s arguments between the stream and the bf16 flag: the
        pre-norm, the block's weights, the post-norm and the residual gate. `ffn_moe` takes one
        eps for the pre-norm and the pre-expert norm (both rms_norm_eps) and one for the
        per-expert and block post-norms (both post_norm_eps)."""

        def build() -> tuple:
            mlp, pre, post, gate = (
                layer.mlp,
                layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm,
                layer.post_feedforward_residual_gate,
            )
            w, tail = self.weights, (post.gain(), post.eps, *gate.coefficients_cached())
            if not layer.is_sparse:
                return (
                    pre.gain(),
                    pre.eps,
                    w.linear(mlp.gate_proj),
                    w.linear(mlp.up_proj),
                    w.linear(mlp.down_proj),
                    *tail,
                )
            router, experts = mlp.gate, mlp.experts
            return (
                pre.gain(),
                pre.eps,
                router.weight.float(),
                router.e_score_correction_bias.float(),
                router.top_k,
                router.output_multiplier,
                router.routed_scaling_factor,
                w.linear(mlp.pre_expert_proj),
                mlp.pre_expert_norm.gain(),
                *w.experts(experts),
                experts.post_expert_norm.gain(),
                w.linear(mlp.post_expert_proj),
                *tail,
            )

        return self._get("ffn", layer, build)
