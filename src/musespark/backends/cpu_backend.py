"""The cpu backend: the native kernels of `kernels/` on x86-64 CPUs (AVX2+FMA; AVX-512-BF16
and AMX where the CPU has them, chosen at load: kernels/csrc/common/dispatch.h).

Which code serves each step is the CPU plan's decision (cpu_plan.py), made once per kernel
path; this module only carries it out. For bf16 and fp32 models whose linears and experts are
dense or weight-only NVFP4 and whose widths are multiples of 8, each decoder layer is four
native calls around the attention (`attn_in`, `attn_out`, `ffn_dense`/`ffn_moe`:
kernels/csrc/blocks/attn_block.cpp, csrc/blocks/ffn_block.cpp), with the same formulas and the
same roundings as the torch backend (a bf16 model rounds to bf16 where PyTorch would; an fp32
model rounds nothing); the embedding norm, final norm and LM head are native too, and a pure
decode step runs as one call (cpu_decode.py). Every row is computed alone, so a request's
tokens never depend on its batch (fp32 prefills, which keep MKL, and NVFP4 products outside
the fused blocks excepted: cpu_plan.py).

fp32 decode leaves MKL: under the exactness rule (our fp32 logits no further from a float64
evaluation than the PyTorch/MKL path's, over the oracle configs; `benchmarks/fp32_exactness.py`)
the native fp32 blocks qualify (fp32 weights accumulate in double), and they read weights
faster than MKL's GEMV.

Steps the plan leaves to the reference run the torch backend's code with the plan's
`CpuProducts` (native NVFP4 rows, widened bf16 products), so the model's modules are never
changed: a torch backend on the same model computes the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ..kernels import cpu
from ..layers.attention import AttentionContext, paged_attention
from ..layers.kv_quant import FP8_KV_DTYPE as FP8
from ..quant.dense import DenseExperts
from .base import Rotary
from .cpu_args import StepArgs, WeightArgs
from .cpu_decode import DecodePlan
from .cpu_plan import CpuPlan, CpuProducts, select_plan
from .torch_backend import TorchBackend

if TYPE_CHECKING:
    from .modules import AttentionModule, DecoderLayerModule, DecoderModel


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
        self._model = model
        # bf16 experts packed into panels too when there is room for the copy (cpu.expert_panels).
        expert_bytes = sum(
            p.numel() * p.element_size()
            for m in model.modules()
            if isinstance(getattr(m, "format", None), DenseExperts)
            for p in (m.gate_up_proj, m.down_proj)
            if p.dtype == torch.bfloat16
        )
        self.weights = WeightArgs(panels=False, pack_experts=cpu.expert_panels(expert_bytes))
        self.args = StepArgs(self.weights)
        self.decode_plan = DecodePlan(self.args)
        self._plans: dict[str, CpuPlan] = {}  # one per kernel path met (tests switch paths)
        self._prompt_rows: torch.Tensor | None = None  # the current step's (`step`)
        # A tensor/expert-parallel rank (one host): its fused blocks sum their partial products
        # over the TP group (kernels/tp_comm.py), switched on only inside this model's steps, so
        # another model in this process computes as one process. Outside a step its layers take
        # the reference code, whose Linear/Experts modules reduce for themselves.
        self._comm = model.parallel.comm if model.parallel.tp_size > 1 else None
        self._expert_parallel = model.parallel.expert_parallel
        self._reducing = self._comm is None
        self._follow_path()

    @property
    def plan(self) -> CpuPlan:
        return self._plan

    @plan.setter
    def plan(self, plan: CpuPlan) -> None:
        self._plan = plan
        self.products = CpuProducts(plan, self.ops)
        self.weights.panels = plan.panels

    def _follow_path(self) -> None:
        """The plan of the kernels' current path (made at its first use)."""
        path = self.ops.isa_path()
        if getattr(self, "_plan", None) is not None and self._plan.path == path:
            return
        if path not in self._plans:
            self._plans[path] = select_plan(self._model, path, panels=path in cpu.PANEL_PATHS)
        self.plan = self._plans[path]

    @contextmanager
    def step(self, ctx: AttentionContext) -> Iterator[None]:
        """Holds the step's prompt rows for the fused blocks: the native products multiply
        them by the prompt-sized kernel (kernels/csrc/gemm/jobs.h, split_prompt_runs); and
        follows the kernels' path (a path switched between steps gets its own plan)."""
        rows = ctx.prompt_rows
        self._prompt_rows = rows.contiguous() if rows is not None and bool(rows.any()) else None
        self._follow_path()
        if self._comm is not None:
            self._comm.blocks(True, self._expert_parallel)
            self._reducing = True
        try:
            yield
        finally:
            self._prompt_rows = None
            if self._comm is not None:
                self._reducing = False
                self._comm.blocks(False, False)

    def _fused(self, dtype: torch.dtype, rows: int) -> bool:
        """Whether a layer step takes the fused blocks now (a TP rank's: only inside its step)."""
        return self._reducing and self.plan.fused(dtype, rows)

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
        aux_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step (speculative verification rows included) as one native call, where the
        plan takes it (`CpuPlan.whole`)."""
        plan = self.plan
        if not plan.whole(input_ids.shape[0], ctx, dtype):
            return None
        first = input_ids if plan.native_embed else self.embed(model, input_ids)
        return self.decode_plan.run(
            model, plan, first, positions, ctx, rope, dtype, self._prompt(input_ids), aux_layers
        )

    def embed(self, model: DecoderModel, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.plan.native_embed:
            return super().embed(model, input_ids)
        x = model.embed_tokens(input_ids)
        return self.ops.rms_norm(x, None, model.config.rms_norm_eps, False, 1.0, torch.float32)

    def attn_in(
        self, layer: DecoderLayerModule, s: torch.Tensor, rotary: Rotary, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._fused(dtype, s.shape[0]):
            return super().attn_in(layer, s, rotary, dtype)
        cos, sin = rotary or (None, None)
        return self.ops.attn_in(s, *self.args.attn_in(layer), cos, sin, dtype == torch.bfloat16, self._prompt(s))

    def attention(
        self,
        attn: AttentionModule,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        plan, caches = self.plan, ctx.kv_caches
        native = caches is not None and plan.decode_attention(caches[attn.layer][0])
        if (
            native
            and q.shape[0] == ctx.num_seqs
            and q.dtype == k.dtype
            and caches[attn.layer][0].dtype in (q.dtype, FP8)
        ):
            # A pure decode step: the cache writes and the decode kernel in one call (the
            # numbers paged_attention's decode path gives, without its per-layer glue).
            assert ctx.groups is not None and ctx.layer_group is not None
            group = ctx.groups[ctx.layer_group[attn.layer]]
            k_cache, v_cache = caches[attn.layer]
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
            prefill=self.ops.prefill_attention if native and plan.prefill_attention(caches[attn.layer][0]) else None,
        )

    def attn_out(self, layer: DecoderLayerModule, s: torch.Tensor, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if not self._fused(o.dtype, s.shape[0]):
            return super().attn_out(layer, s, o, g)
        return self.ops.attn_out(s, o.contiguous(), g, *self.args.attn_out(layer), self._prompt(s))

    def dense_ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not self._fused(dtype, s.shape[0]):
            return super().dense_ffn(layer, s, dtype)
        return self.ops.ffn_dense(s, *self.args.ffn(layer), dtype == torch.bfloat16, self._prompt(s))

    def moe_ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not self._fused(dtype, s.shape[0]):
            return super().moe_ffn(layer, s, dtype)
        return self.ops.ffn_moe(s, *self.args.ffn(layer), dtype == torch.bfloat16, self._prompt(s))

    def final_norm(self, model: DecoderModel, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not self.plan.native_rows(dtype, s.shape[0]):
            return super().final_norm(model, s, dtype)
        norm = model.norm
        return self.ops.rms_norm(s, norm.gain(), norm.eps, False, 1.0, dtype)

    def logits(self, model: DecoderModel, y: torch.Tensor) -> torch.Tensor:
        if not self.plan.head(y, model.lm_head.weight.dtype):
            return super().logits(model, y)
        head = self.weights.linear(model.lm_head)
        x = self.ops.softcapped_logits(
            y.reshape(-1, y.shape[-1]),
            head[0],
            model.config.output_multiplier,
            model.config.final_logit_softcapping,
            head[1] if len(head) == 2 else None,
        )
        # Vocab-parallel head: the soft cap is elementwise, so capping each block before the
        # (exact) gather equals capping after it; then the padding past V is cut off.
        return model.parallel.gather_last_dim(x)[..., : model.config.vocab_size]
