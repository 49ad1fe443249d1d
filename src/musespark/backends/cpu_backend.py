"""The cpu backend: the native kernels of `kernels/` on x86-64 CPUs (AVX2+FMA; AVX-512-BF16
where the CPU has it, chosen at load: kernels/csrc/common/dispatch.h).

For bf16 and fp32 models whose linears and experts are dense or weight-only NVFP4 and whose
widths are multiples of 8, each decoder layer is four native calls around the attention
(`attn_in`, `attn_out`, `ffn_dense`/`ffn_moe`: kernels/csrc/blocks/attn_block.cpp, csrc/blocks/ffn_block.cpp),
with the same formulas and the same roundings as the torch backend (a bf16 model rounds to
bf16 where PyTorch would; an fp32 model rounds nothing); the embedding norm, final norm and
LM head are native too. Every row is computed alone, so a request's tokens never depend on
its batch (NVFP4 outside the fused blocks excepted: see below).

fp32 decode leaves MKL: under the exactness rule of the CPU-speed issue (our fp32 logits no
further from a float64 evaluation than the PyTorch/MKL path's, over the oracle configs;
`benchmarks/fp32_exactness.py`) the native fp32 blocks qualify (fp32 weights accumulate in
double), and they read weights faster than MKL's GEMV. fp32 prefills (more than
`FP32_FUSED_MAX_ROWS` rows) keep MKL, so an fp32 request's tokens may depend on whether
its step was decode-sized (bf16 ones never do).

Decode rows attend through the native paged decode kernel for bf16 and fp32 caches.

NVFP4 modules outside the fused blocks (other widths, fp16): every product with at most
`NVFP4_NATIVE_MAX_ROWS` rows goes to the native weight-only kernel (`nvfp4_linear`,
kernels/csrc/nvfp4/nvfp4_linear.cpp) through `_NativeNvfp4` below; larger batches decode the weight once
and use the reference GEMM. w4a4 NVFP4 and everything else is the torch backend's code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu
from ..layers.attention import AttentionContext, paged_attention
from ..layers.moe import SparseMoeBlock
from ..quant.dense import DenseExperts, DenseLinear
from ..quant.format import ExpertsFormat, LinearFormat
from ..quant.nvfp4 import Nvfp4Experts, Nvfp4Linear
from .base import Rotary
from .cpu_args import StepArgs, WeightArgs
from .cpu_decode import DecodePlan
from .torch_backend import TorchBackend

if TYPE_CHECKING:
    from .modules import AttentionModule, DecoderLayerModule, DecoderModel

_NATIVE_CACHE_DTYPES = (torch.bfloat16, torch.float32)
# fp32 steps with more rows than this (prefills) keep the torch reference: MKL's fp32 GEMM is
# faster there than the native products (which accumulate fp32 weights in double), and its
# logits are the ones transformers computes (oracle parity). Decode-sized fp32 steps are
# bound by reading the weights, where the native blocks are faster than MKL's GEMV.
FP32_FUSED_MAX_ROWS = 16


def _fused_dtype(dtype: torch.dtype, rows: int) -> bool:
    return dtype == torch.bfloat16 or (dtype == torch.float32 and rows <= FP32_FUSED_MAX_ROWS)


# Most activation rows an NVFP4 product sends to the native kernel (decode batches, short
# prefills); larger ones decode the weight once and use the reference GEMM.
NVFP4_NATIVE_MAX_ROWS = 16


def _fusable(fmt: object) -> bool:
    """Formats the fused blocks multiply: dense, and weight-only NVFP4."""
    return isinstance(fmt, (DenseLinear, DenseExperts)) or (
        isinstance(fmt, (Nvfp4Linear, Nvfp4Experts)) and fmt.mode == "weight-only"
    )


def _native_rows(x: torch.Tensor) -> bool:
    return (
        x.dtype in (torch.bfloat16, torch.float32)
        and 0 < x.numel() // x.shape[-1] <= NVFP4_NATIVE_MAX_ROWS
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


class _NativeNvfp4Linear(LinearFormat):
    """`Nvfp4Linear` (weight-only) with the native product for decode-sized batches; the
    reference `ref` for everything else."""

    def __init__(self, ref: Nvfp4Linear, ops: Any) -> None:
        self.ref, self.ops = ref, ops

    def tensors(self, out_features: int, in_features: int) -> dict:
        return self.ref.tensors(out_features, in_features)

    def apply(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not _native_rows(x):
            return self.ref.apply(module, x)
        y = self.ops.nvfp4_linear(
            x.reshape(-1, x.shape[-1]), module.weight, module.weight_scale.view(torch.uint8), module.weight_scale_2
        )
        return y.view(*x.shape[:-1], y.shape[-1])


class _NativeNvfp4Experts(ExpertsFormat):
    """`Nvfp4Experts` (weight-only) with native products: gate|up in one call (its two global
    scales, gate rows then up rows), silu(gate) * up in torch as the reference does, then down.
    Tensor-parallel partial products (never on this backend) and large batches: `ref`."""

    def __init__(self, ref: Nvfp4Experts, ops: Any) -> None:
        self.ref, self.ops = ref, ops

    def tensors(self, num_experts: int, intermediate: int, hidden: int) -> dict:
        return self.ref.tensors(num_experts, intermediate, hidden)

    def apply(self, module: nn.Module, expert: int, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        if partial or not _native_rows(x):
            return self.ref.apply(module, expert, x, partial)
        ops = self.ops
        gate_up = ops.nvfp4_linear(
            x,
            module.gate_up_proj[expert],
            module.gate_up_proj_weight_scale[expert].view(torch.uint8),
            module.gate_up_proj_weight_scale_2[expert],
        )
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
        return ops.nvfp4_linear(
            h,
            module.down_proj[expert],
            module.down_proj_weight_scale[expert].view(torch.uint8),
            module.down_proj_weight_scale_2[expert],
        )


class _NativeNvfp4:
    """The NVFP4 modules of a model, grouped by the step owner that multiplies them (a
    `DecoderLayer`, or the model for its LM head), each with a native twin of its format.

    `with nvfp4.native(owner):` swaps the twins into the owner's modules for the duration of
    one step and restores the reference formats afterwards (also on errors), so the reference
    step code runs unchanged and the model keeps its own formats between steps: a torch
    backend on the same model computes the reference. (Were another thread to run that same
    model under another backend during a step, it would get the native products for that
    step: the same values up to fp32 summation order.)"""

    def __init__(self, model: DecoderModel, ops: Any) -> None:
        self.swaps: dict[nn.Module, list[tuple[nn.Module, Any]]] = {}
        owners = [layer for layer in model.layers if hasattr(layer, "self_attn")] + [model]
        for owner in owners:
            modules = owner.modules() if owner is not model else [model.lm_head]
            for m in modules:
                fmt = getattr(m, "format", None) if m is not None else None
                if isinstance(fmt, Nvfp4Linear) and fmt.mode == "weight-only" and getattr(m, "reduce", None) is None:
                    twin: Any = _NativeNvfp4Linear(fmt, ops)
                elif isinstance(fmt, Nvfp4Experts) and fmt.mode == "weight-only":
                    twin = _NativeNvfp4Experts(fmt, ops)
                else:
                    continue
                self.swaps.setdefault(owner, []).append((m, twin))

    def __bool__(self) -> bool:
        return bool(self.swaps)

    @contextmanager
    def native(self, owner: nn.Module) -> Iterator[None]:
        swaps = self.swaps.get(owner, ())
        saved = [m.format for m, _ in swaps]
        try:
            for m, twin in swaps:
                m.format = twin
            yield
        finally:
            for (m, _), fmt in zip(swaps, saved):
                m.format = fmt


class CpuBackend(TorchBackend):
    name = "cpu"
    supports_autograd = False

    def __init__(self, model: DecoderModel) -> None:
        """Loads (or builds, once, cached) the kernels now, not in the first request.
        Raises ValueError naming the reason when they are unavailable."""
        ops = cpu.native_ops()
        if ops is None:
            raise ValueError(
                "backend='cpu' needs the native CPU kernels, which are unavailable here "
                f"({cpu.unavailable_reason()}); use backend='torch' or 'auto'"
            )
        if model.device.type != "cpu":
            raise ValueError(f"backend='cpu' runs models on the CPU; this model is on {model.device}")
        self.ops: Any = ops
        cfg = model.config
        widths = (cfg.hidden_size, cfg.head_dim, cfg.moe_hidden_size, cfg.moe_intermediate_size, cfg.intermediate_size)
        fusable = all(_fusable(m.format) for m in model.modules() if hasattr(m, "format") and m is not model.lm_head)
        # Which steps have kernels for this model (its dtype is checked per call: `.to()` may change it).
        # The fused blocks hold a whole layer: one process (no tensor-parallel partial sums).
        self.fused_blocks = fusable and all(n % 8 == 0 for n in widths) and model.parallel.tp_size == 1
        self.native_decode = cfg.head_dim % 8 == 0
        # Prefill chunks of bf16 caches: the AVX-512-BF16 kernel (kernels/csrc/attention/prefill_attention.cpp),
        # when the kernels run that path (checked per call: tests switch paths).
        self.native_prefill = cfg.head_dim % 16 == 0 and (cfg.head_dim <= 128 or cfg.head_dim == 256)
        # The head kernel needs a dense head, whatever the other modules' formats.
        self.native_head = isinstance(getattr(model.lm_head, "format", None), DenseLinear) and cfg.hidden_size % 8 == 0
        self.nvfp4 = _NativeNvfp4(model, ops)
        # bf16 experts packed into panels too when there is room for the copy (cpu.expert_panels).
        expert_bytes = sum(
            p.numel() * p.element_size()
            for m in model.modules()
            if isinstance(getattr(m, "format", None), DenseExperts)
            for p in (m.gate_up_proj, m.down_proj)
            if p.dtype == torch.bfloat16
        )
        self.weights = WeightArgs(ops, pack_experts=cpu.expert_panels(expert_bytes))
        self.args = StepArgs(self.weights)
        self._prompt_rows: torch.Tensor | None = None  # the current step's (`step`)
        # Pure decode steps run in one native call (cpu_decode.py): the same bits.
        # False: step by step (for comparisons).
        self.use_decode_plan = True
        self.decode_plan = DecodePlan(self)

    @contextmanager
    def step(self, ctx: AttentionContext) -> Iterator[None]:
        """Holds the step's prompt rows for the fused blocks: the native products multiply
        them by the prompt-sized kernel (kernels/csrc/gemm/jobs.h, split_prompt_runs); and
        follows the kernels' path for the weight arguments (`WeightArgs.refresh`)."""
        rows = ctx.prompt_rows
        self._prompt_rows = rows.contiguous() if rows is not None and bool(rows.any()) else None
        self.weights.refresh()
        try:
            yield
        finally:
            self._prompt_rows = None

    def _prompt(self, s: torch.Tensor) -> torch.Tensor | None:
        """The step's prompt-row flags when they describe these rows (a layer called on its own: None)."""
        rows = self._prompt_rows
        return rows if rows is not None and rows.shape[0] == s.shape[0] else None

    def decode_forward(
        self,
        model: DecoderModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        rope: dict,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """A pure decode step (one new row per sequence, no speculative rows) of a model in
        one process whose layers all take the fused blocks and the native decode attention
        (the paths `attn_in` ... `final_norm` below would take): the decode plan."""
        if not (
            self.use_decode_plan
            and self.fused_blocks
            and self.native_decode
            and _fused_dtype(dtype, input_ids.shape[0])
            and input_ids.shape[0] == ctx.num_seqs > 0
            and not ctx.row_wise
            and ctx.kv_caches is not None
            and ctx.groups is not None
            and ctx.layer_group is not None
            and all(k.dtype == v.dtype == dtype for k, v in ctx.kv_caches)
        ):
            return None
        return self.decode_plan.run(model, input_ids, positions, ctx, rope, dtype)

    def embed(self, model: DecoderModel, input_ids: torch.Tensor) -> torch.Tensor:
        x = model.embed_tokens(input_ids)
        if x.dtype != torch.bfloat16:
            return super().embed(model, input_ids)
        return self.ops.rms_norm(x, None, model.config.rms_norm_eps, False, 1.0, torch.float32)

    def attn_in(
        self, layer: DecoderLayerModule, s: torch.Tensor, rotary: Rotary, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if not (self.fused_blocks and _fused_dtype(dtype, s.shape[0])):
            with self.nvfp4.native(layer):
                return super().attn_in(layer, s, rotary, dtype)
        cos, sin = rotary or (None, None)
        return self.ops.attn_in(s, *self._attn_in_args(layer), cos, sin, dtype == torch.bfloat16, self._prompt(s))

    def _attn_in_args(self, layer: DecoderLayerModule) -> tuple:
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

        return self.args.get("attn_in", layer, build)

    def attention(
        self,
        attn: AttentionModule,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        native = (
            self.native_decode
            and ctx.kv_caches is not None
            and ctx.kv_caches[attn.layer][0].dtype in _NATIVE_CACHE_DTYPES
        )
        if native and q.shape[0] == ctx.num_seqs and q.dtype == k.dtype == ctx.kv_caches[attn.layer][0].dtype:
            # A pure decode step: the cache writes and the decode kernel in one call (the
            # numbers paged_attention's decode path gives, without its per-layer glue).
            assert ctx.groups is not None and ctx.layer_group is not None
            group = ctx.groups[ctx.layer_group[attn.layer]]
            k_cache, v_cache = ctx.kv_caches[attn.layer]
            return self.ops.paged_decode_step(
                q.contiguous(),
                k.contiguous(),
                v.contiguous(),
                k_cache,
                v_cache,
                group.slot_mapping,
                group.block_tables,
                ctx.seq_lens_tensor(q.device),
                attn.window or 0,
                attn.scale,
            )
        return paged_attention(
            q,
            k,
            v,
            positions,
            ctx,
            attn.layer,
            attn.scale,
            attn.window,
            decode=self.ops.paged_decode_attention if native else None,
            prefill=self.ops.prefill_attention
            if native and self.native_prefill and self.ops.isa_path() in cpu.PANEL_PATHS
            else None,
        )

    def attn_out(self, layer: DecoderLayerModule, s: torch.Tensor, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if not (self.fused_blocks and _fused_dtype(o.dtype, s.shape[0])):
            with self.nvfp4.native(layer):
                return super().attn_out(layer, s, o, g)
        return self.ops.attn_out(s, o.contiguous(), g, *self._attn_out_args(layer), self._prompt(s))

    def _attn_out_args(self, layer: DecoderLayerModule) -> tuple:
        def build() -> tuple:
            attn, gate = layer.self_attn, layer.post_attention_residual_gate
            return (self.weights.linear(attn.o_proj), attn.eps, *gate.coefficients_cached(), layer.post_norm_eps)

        return self.args.get("attn_out", layer, build)

    def dense_ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not (self.fused_blocks and _fused_dtype(dtype, s.shape[0])):
            with self.nvfp4.native(layer):
                return super().dense_ffn(layer, s, dtype)
        return self.ops.ffn_dense(s, *self._ffn_args("ffn_dense", layer), dtype == torch.bfloat16, self._prompt(s))

    def moe_ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The op takes one eps for the pre-norm and the pre-expert norm (both rms_norm_eps)
        and one for the per-expert and block post-norms (both post_norm_eps)."""
        if not (self.fused_blocks and _fused_dtype(dtype, s.shape[0])):
            with self.nvfp4.native(layer):
                return super().moe_ffn(layer, s, dtype)
        return self.ops.ffn_moe(s, *self._ffn_args("ffn_moe", layer), dtype == torch.bfloat16, self._prompt(s))

    def _ffn_args(self, op: str, layer: DecoderLayerModule) -> tuple:
        """`op`'s arguments between the stream and the bf16 flag: the pre-norm, the block's
        weights, the post-norm and the residual gate."""

        def build() -> tuple:
            mlp, pre, post, gate = (
                layer.mlp,
                layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm,
                layer.post_feedforward_residual_gate,
            )
            w, tail = self.weights, (post.gain(), post.eps, *gate.coefficients_cached())
            if op == "ffn_dense":
                return (
                    pre.gain(),
                    pre.eps,
                    w.linear(mlp.gate_proj),
                    w.linear(mlp.up_proj),
                    w.linear(mlp.down_proj),
                    *tail,
                )
            moe: SparseMoeBlock = mlp
            router, experts = moe.gate, moe.experts
            return (
                pre.gain(),
                pre.eps,
                router.weight.float(),
                router.e_score_correction_bias.float(),
                router.top_k,
                router.output_multiplier,
                router.routed_scaling_factor,
                w.linear(moe.pre_expert_proj),
                moe.pre_expert_norm.gain(),
                *w.experts(experts),
                experts.post_expert_norm.gain(),
                w.linear(moe.post_expert_proj),
                *tail,
            )

        return self.args.get(op, layer, build)

    def final_norm(self, model: DecoderModel, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not _fused_dtype(dtype, s.shape[0]):
            return super().final_norm(model, s, dtype)
        norm = model.norm
        return self.ops.rms_norm(s, norm.gain(), norm.eps, False, 1.0, dtype)

    def logits(self, model: DecoderModel, y: torch.Tensor) -> torch.Tensor:
        if not (
            self.native_head
            and _fused_dtype(y.dtype, y.shape[0])
            and y.dtype == model.lm_head.weight.dtype
            and y.shape[0] > 0
        ):
            with self.nvfp4.native(model):
                return super().logits(model, y)
        head = self.weights.linear(model.lm_head)
        return self.ops.softcapped_logits(
            y.reshape(-1, y.shape[-1]),
            head[0],
            model.config.output_multiplier,
            model.config.final_logit_softcapping,
            head[1] if len(head) == 2 else None,
        )
