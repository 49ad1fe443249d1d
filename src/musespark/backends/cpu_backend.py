"""The cpu backend: the native kernels of `kernels/` on x86-64 CPUs with AVX2 and FMA.

For bf16 models with dense weights and widths that are multiples of 8, each decoder layer
is four native calls around the attention (`attn_in`, `attn_out`, `ffn_dense`/`ffn_moe`:
kernels/cpu_attn_block.cpp, cpu_ffn_block.cpp), with the same formulas and the same bf16
roundings as the torch backend; the embedding norm, final norm and LM head are native too.
Every row is computed alone, so a request's tokens never depend on its batch.

Decode rows attend through the native paged decode kernel for bf16 and fp32 caches.
Everything else (fp32 and fp16 layers, other widths, other weight formats until they have
kernels) is the torch backend's reference code: fp32 keeps MKL, as transformers does
(README, "CPU kernels", says why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..kernels import cpu
from ..layers.attention import AttentionContext, paged_attention
from ..layers.moe import SparseMoeBlock
from ..quant.dense import DenseExperts, DenseLinear
from .base import Rotary
from .torch_backend import TorchBackend

if TYPE_CHECKING:
    from ..model.muse_spark import Attention, DecoderLayer, MuseSparkForCausalLM

_NATIVE_CACHE_DTYPES = (torch.bfloat16, torch.float32)


class CpuBackend(TorchBackend):
    name = "cpu"
    supports_autograd = False

    def __init__(self, model: "MuseSparkForCausalLM") -> None:
        """Loads (or builds, once, cached) the kernels now, not in the first request.
        Raises ValueError naming the reason when they are unavailable."""
        ops = cpu.native_ops()
        if ops is None:
            raise ValueError("backend='cpu' needs the native CPU kernels, which are unavailable here "
                             f"({cpu.unavailable_reason()}); use backend='torch' or 'auto'")
        if model.device.type != "cpu":
            raise ValueError(f"backend='cpu' runs models on the CPU; this model is on {model.device}")
        self.ops: Any = ops
        cfg = model.config
        widths = (cfg.hidden_size, cfg.head_dim, cfg.moe_hidden_size, cfg.moe_intermediate_size,
                  cfg.intermediate_size)
        dense = all(isinstance(m.format, (DenseLinear, DenseExperts))
                    for m in model.modules() if hasattr(m, "format"))
        # Which steps have kernels for this model (its dtype is checked per call: `.to()` may change it).
        self.fused_blocks = dense and all(n % 8 == 0 for n in widths)
        self.native_decode = cfg.head_dim % 8 == 0
        self.native_head = dense and cfg.hidden_size % 8 == 0

    def embed(self, model: "MuseSparkForCausalLM", input_ids: torch.Tensor) -> torch.Tensor:
        x = model.embed_tokens(input_ids)
        if x.dtype != torch.bfloat16:
            return super().embed(model, input_ids)
        return self.ops.rms_norm(x, None, model.config.rms_norm_eps, False, 1.0, torch.float32)

    def attn_in(self, layer: "DecoderLayer", s: torch.Tensor, rotary: Rotary, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if not (self.fused_blocks and dtype == torch.bfloat16):
            return super().attn_in(layer, s, rotary, dtype)
        attn, norm = layer.self_attn, layer.input_layernorm
        cos, sin = rotary or (None, None)
        return self.ops.attn_in(s, norm.gain(), norm.eps, attn.q_proj.weight, attn.k_proj.weight,
                                attn.v_proj.weight, attn.gate_proj.weight, attn.num_heads, attn.num_kv_heads,
                                attn.qk_scale, cos, sin)

    def attention(self, attn: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        native = (self.native_decode and ctx.kv_caches is not None
                  and ctx.kv_caches[attn.layer][0].dtype in _NATIVE_CACHE_DTYPES)
        return paged_attention(q, k, v, positions, ctx, attn.layer, attn.scale, attn.window,
                               decode=self.ops.paged_decode_attention if native else None)

    def attn_out(self, layer: "DecoderLayer", s: torch.Tensor, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if not (self.fused_blocks and o.dtype == torch.bfloat16):
            return super().attn_out(layer, s, o, g)
        attn = layer.self_attn
        alpha, beta = layer.post_attention_residual_gate.coefficients_cached()
        return self.ops.attn_out(s, o.contiguous(), g, attn.o_proj.weight, attn.eps, alpha, beta,
                                 layer.post_norm_eps)

    def dense_ffn(self, layer: "DecoderLayer", s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not (self.fused_blocks and dtype == torch.bfloat16):
            return super().dense_ffn(layer, s, dtype)
        mlp, pre, post = layer.mlp, layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
        alpha, beta = layer.post_feedforward_residual_gate.coefficients_cached()
        return self.ops.ffn_dense(s, pre.gain(), pre.eps, mlp.gate_proj.weight, mlp.up_proj.weight,
                                  mlp.down_proj.weight, post.gain(), post.eps, alpha, beta)

    def moe_ffn(self, layer: "DecoderLayer", s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The op takes one eps for the pre-norm and the pre-expert norm (both rms_norm_eps)
        and one for the per-expert and block post-norms (both post_norm_eps)."""
        if not (self.fused_blocks and dtype == torch.bfloat16):
            return super().moe_ffn(layer, s, dtype)
        mlp: SparseMoeBlock = layer.mlp
        pre, post, router, experts = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm, \
            mlp.gate, mlp.experts
        alpha, beta = layer.post_feedforward_residual_gate.coefficients_cached()
        return self.ops.ffn_moe(s, pre.gain(), pre.eps, router.weight.float(), router.e_score_correction_bias.float(),
                                router.top_k, router.output_multiplier, router.routed_scaling_factor,
                                mlp.pre_expert_proj.weight, mlp.pre_expert_norm.gain(), experts.gate_up_proj,
                                experts.down_proj, experts.post_expert_norm.gain(), mlp.post_expert_proj.weight,
                                post.gain(), post.eps, alpha, beta)

    def final_norm(self, model: "MuseSparkForCausalLM", s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if dtype != torch.bfloat16:
            return super().final_norm(model, s, dtype)
        norm = model.norm
        return self.ops.rms_norm(s, norm.gain(), norm.eps, False, 1.0, dtype)

    def logits(self, model: "MuseSparkForCausalLM", y: torch.Tensor) -> torch.Tensor:
        if not (self.native_head and y.dtype == torch.bfloat16 and y.shape[0] > 0):
            return super().logits(model, y)
        cap = model.config.final_logit_softcapping
        x = self.ops.linear_small_m(y.reshape(-1, y.shape[-1]), model.lm_head.weight).float()
        x = x * model.config.output_multiplier
        return cap * torch.tanh(x / cap)
