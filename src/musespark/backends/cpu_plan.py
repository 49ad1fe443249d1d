"""The CPU plan: which code serves each step of one model on the native kernels, decided once
per (model, kernel path) and read per step by the step's dtype and row count.

A model's weights are frozen once its backend is chosen (cpu_args.py), so everything the plan
looks at (the modules' formats, the widths, the dtypes of the weights, the kernel path) is
fixed for the plan's life; `CpuBackend` makes one plan per kernel path it meets (tests switch
paths) and reads nothing else to choose. The row-count thresholds come from one table,
kernels/csrc/common/thresholds.h: the kernels compile it in, `kernels.cpu.thresholds()` reads
it here. docs/cpu.md §2 tells the same table for users.

What the plan decides, step by step (else: the torch reference's code, with `CpuProducts`):
* a decoder layer (`attn_in`, `attn_out`, `ffn_*`): the fused blocks when `fused_blocks` and
  the step's rows are native (bf16; fp32 up to kFp32FusedMaxRows rows);
* a pure decode step: one native call (`whole`) when every layer's choice above is the fused
  blocks and `native_decode`, one row per sequence, caches of the step's dtype or fp8;
* decode attention rows: the paged decode kernel (`native_decode`, bf16/fp32/fp8 caches); prompt
  chunks: the prompt-attention kernel (`native_prefill`, panel paths; bf16 queries);
* embedding norm, final norm, head: native for a bf16 embedding, native rows, a dense head;
* a weight-only NVFP4 product outside the blocks: the native kernel up to kNvfp4NativeMaxRows
  rows, else the reference GEMM on the decoded weight;
* a bf16 product outside the blocks: widened to fp32 (MKL) above kBf16GemmMaxRows rows on
  CPUs without bf16 hardware, else `F.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu_features import has_native_bf16, is_x86
from ..kernels import cpu
from ..layers.linear import Linear, Products
from ..quant.dense import DenseExperts, DenseLinear
from ..quant.nvfp4 import Nvfp4Experts, Nvfp4Linear

if TYPE_CHECKING:
    from ..layers.attention import AttentionContext
    from .modules import DecoderModel

ROWS = cpu.thresholds()
_NATIVE_CACHE_DTYPES = (torch.bfloat16, torch.float32)
# The attention kernels also take fp8 e4m3 caches (the fp8 KV cache, layers/kv_quant.py): the
# decode kernel reads them as stored (its scale is 1.0) and writes a step's keys into them as
# kv_quant.to_cache does (so the whole-step plan takes them too); prompt chunks get their keys
# widened to bf16 (paged_attention).
_ATTENTION_CACHE_DTYPES = (*_NATIVE_CACHE_DTYPES, torch.float8_e4m3fn)


def _fusable(fmt: object) -> bool:
    """Formats the fused blocks multiply: dense, and weight-only NVFP4."""
    return isinstance(fmt, (DenseLinear, DenseExperts)) or (
        isinstance(fmt, (Nvfp4Linear, Nvfp4Experts)) and fmt.mode == "weight-only"
    )


@dataclass(frozen=True)
class CpuPlan:
    """One model's plan on one kernel path (the table above). Tests and benchmarks that want
    another route make one with `dataclasses.replace` and assign it to `CpuBackend.plan`."""

    path: str  # the kernel path (kernels.cpu.kernel_path)
    fused_blocks: bool  # every layer in the fused ops: fusable formats, widths % 8, one process or a TP rank
    native_decode: bool  # the paged decode-attention kernel (head_dim % 8)
    native_prefill: bool  # the prompt-attention kernel (head_dim % 16, <= 128 or 256; panel paths)
    native_head: bool  # a dense head, hidden % 8
    native_embed: bool  # a bf16 embedding: looked up and normed natively
    panels: bool  # dense bf16 weights packed into panels (cpu_args.WeightArgs)
    widen_bf16: bool  # bf16 products outside the blocks widened to fp32: x86 without bf16 hardware
    whole_step: bool = True  # pure decode steps in one native call (cpu_decode.py); False: layer by layer
    fp32_fused_max_rows: int = ROWS["kFp32FusedMaxRows"]
    nvfp4_native_max_rows: int = ROWS["kNvfp4NativeMaxRows"]
    bf16_gemm_max_rows: int = ROWS["kBf16GemmMaxRows"]

    def native_rows(self, dtype: torch.dtype, rows: int) -> bool:
        """Whether a step of `rows` rows in `dtype` is of a class the native steps take: bf16
        always; fp32 up to kFp32FusedMaxRows rows. fp32 prefills keep MKL's GEMM (faster there,
        and the logits transformers computes); decode-sized fp32 steps are bound by reading
        the weights, where the native blocks are faster."""
        return dtype == torch.bfloat16 or (dtype == torch.float32 and rows <= self.fp32_fused_max_rows)

    def fused(self, dtype: torch.dtype, rows: int) -> bool:
        """Whether a layer step takes the fused blocks."""
        return self.fused_blocks and self.native_rows(dtype, rows)

    def decode_attention(self, cache: torch.Tensor) -> bool:
        return self.native_decode and cache.dtype in _ATTENTION_CACHE_DTYPES

    def prefill_attention(self, cache: torch.Tensor) -> bool:
        return self.native_prefill and self.decode_attention(cache)

    def head(self, y: torch.Tensor, head_dtype: torch.dtype) -> bool:
        return self.native_head and y.dtype == head_dtype and y.shape[0] > 0 and self.native_rows(y.dtype, y.shape[0])

    def whole(self, rows: int, ctx: AttentionContext, dtype: torch.dtype) -> bool:
        """Whether a step is a decode step the whole-step plan runs: every row a decode row (one
        new row per sequence, or a sequence's speculative rows, which attend row by row), and
        every layer's choice the fused blocks plus the decode kernel, as the layer-by-layer
        path would choose them for those rows."""
        return (
            self.whole_step
            and self.native_decode
            and self.fused(dtype, rows)
            and ctx.num_seqs > 0
            and _decode_rows(ctx, rows)
            and ctx.kv_caches is not None
            and ctx.groups is not None
            and ctx.layer_group is not None
            and all(k.dtype == v.dtype and k.dtype in (dtype, torch.float8_e4m3fn) for k, v in ctx.kv_caches)
        )


def _decode_rows(ctx: AttentionContext, rows: int) -> bool:
    """Whether each of the step's `rows` rows is a decode row: every sequence has one new row
    or is in `ctx.row_wise`."""
    if not ctx.row_wise:
        return rows == ctx.num_seqs
    qsl, row_wise = ctx.query_start_loc, set(ctx.row_wise)
    return qsl[-1] == rows and all(qsl[b + 1] - qsl[b] == 1 or b in row_wise for b in range(ctx.num_seqs))


def select_plan(model: DecoderModel, path: str, panels: bool) -> CpuPlan:
    """The plan of `model` on kernel path `path` (`panels`: whether that path packs bf16 weights)."""
    cfg, tp = model.config, model.parallel.tp_size
    widths = (cfg.hidden_size, cfg.head_dim, cfg.moe_hidden_size, cfg.moe_intermediate_size, cfg.intermediate_size)
    widths += (cfg.moe_intermediate_size // tp, cfg.intermediate_size // tp)  # a TP rank's slices
    fusable = all(_fusable(m.format) for m in model.modules() if hasattr(m, "format") and m is not model.lm_head)
    head = getattr(model.lm_head, "format", None)
    return CpuPlan(
        path=path,
        # A TP rank's fused blocks sum its partial products at their split point (kernels/tp_comm.py).
        fused_blocks=fusable and all(n % 8 == 0 for n in widths) and (tp == 1 or model.parallel.comm is not None),
        native_decode=cfg.head_dim % 8 == 0,
        native_prefill=path in cpu.PANEL_PATHS
        and cfg.head_dim % 16 == 0
        and (cfg.head_dim <= 128 or cfg.head_dim == 256),
        native_head=isinstance(head, DenseLinear) and cfg.hidden_size % 8 == 0,
        native_embed=model.embed_tokens.weight.dtype == torch.bfloat16 and tp == 1,  # TP: a vocabulary block
        panels=panels,
        widen_bf16=is_x86() and not has_native_bf16(),
    )


class CpuProducts(Products):
    """The products of the steps the fused blocks do not take (layers/linear.py `Products`):
    weight-only NVFP4 products of at most `nvfp4_native_max_rows` rows by the native kernel
    (`nvfp4_linear`, kernels/csrc/nvfp4/nvfp4_linear.cpp; experts: gate|up in one call with its
    two global scales, silu(gate) * up in torch as the reference does, then down), and, where
    the plan says so, bf16 products of more than `bf16_gemm_max_rows` rows widened to fp32:
    PyTorch's bf16 GEMM converts element by element on CPUs without bf16 hardware, about 7x
    slower than MKL's fp32 GEMM for a 2048-token prompt. Everything else: the reference's."""

    def __init__(self, plan: CpuPlan, ops: Any) -> None:
        self.plan, self.ops = plan, ops
        self.gemm = self._widened if plan.widen_bf16 else None

    def _widened(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == w.dtype == torch.bfloat16 and x.numel() > self.plan.bf16_gemm_max_rows * x.shape[-1]:
            return F.linear(x.float(), w.float()).to(torch.bfloat16)
        return F.linear(x, w)

    def _native_rows(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in _NATIVE_CACHE_DTYPES
            and 0 < x.numel() // x.shape[-1] <= self.plan.nvfp4_native_max_rows
            and not (torch.is_grad_enabled() and x.requires_grad)
        )

    def linear(self, module: Linear, x: torch.Tensor) -> torch.Tensor:
        fmt = module.format
        if not (
            isinstance(fmt, Nvfp4Linear)
            and fmt.mode == "weight-only"
            and module.reduce is None
            and self._native_rows(x)
        ):
            return super().linear(module, x)
        y = self.ops.nvfp4_linear(
            x.reshape(-1, x.shape[-1]), module.weight, module.weight_scale.view(torch.uint8), module.weight_scale_2
        )
        return y.view(*x.shape[:-1], y.shape[-1])

    def expert(self, module: nn.Module, expert: int, x: torch.Tensor, partial: bool) -> torch.Tensor:
        fmt = module.format
        if partial or not (isinstance(fmt, Nvfp4Experts) and fmt.mode == "weight-only" and self._native_rows(x)):
            return super().expert(module, expert, x, partial)
        gate_up = self.ops.nvfp4_linear(
            x,
            module.gate_up_proj[expert],
            module.gate_up_proj_weight_scale[expert].view(torch.uint8),
            module.gate_up_proj_weight_scale_2[expert],
        )
        gate, up = gate_up.chunk(2, dim=-1)
        return self.ops.nvfp4_linear(
            F.silu(gate) * up,
            module.down_proj[expert],
            module.down_proj_weight_scale[expert].view(torch.uint8),
            module.down_proj_weight_scale_2[expert],
        )
