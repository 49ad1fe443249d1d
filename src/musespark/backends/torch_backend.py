"""The torch backend: the reference formulas (docs/spec.md §2-3) in plain PyTorch, for every dtype
and device. Every rounding to the activation dtype is explicit and matches the production
system's; other backends must match this one (tests/model/test_backends.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..layers.attention import AttentionContext, paged_attention
from ..layers.linear import REFERENCE, Products
from ..layers.norm import rms
from ..layers.rotary import norm_rope
from .base import Backend, Rotary

if TYPE_CHECKING:
    from .modules import AttentionModule, DecoderLayerModule, DecoderModel


class TorchBackend(Backend):
    name = "torch"
    supports_autograd = True
    # Who computes the products (layers/linear.py): the formats' reference products here.
    products: Products = REFERENCE

    def embed(self, model: DecoderModel, input_ids: torch.Tensor) -> torch.Tensor:
        return rms(model.embed_tokens(input_ids), model.config.rms_norm_eps)

    def attn_in(
        self, layer: DecoderLayerModule, s: torch.Tensor, rotary: Rotary, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, T, D = layer.self_attn, s.shape[0], layer.self_attn.head_dim
        h = layer.input_layernorm(s, out_dtype=dtype)
        mm = self.products
        q = norm_rope(mm.linear(attn.q_proj, h).view(T, attn.num_heads, D), attn.eps, attn.qk_scale, rotary, dtype)
        k = norm_rope(mm.linear(attn.k_proj, h).view(T, attn.num_kv_heads, D), attn.eps, 1.0, rotary, dtype)
        v = mm.linear(attn.v_proj, h).view(T, attn.num_kv_heads, D)
        g = mm.linear(attn.gate_proj, h).view(T, attn.num_heads, D)
        return q, k, v, g

    def attention(
        self,
        attn: AttentionModule,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        return paged_attention(q, k, v, positions, ctx, attn.layer, attn.scale, attn.window)

    def attn_out(self, layer: DecoderLayerModule, s: torch.Tensor, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        attn, T = layer.self_attn, s.shape[0]
        o = (rms(o, attn.eps) * torch.sigmoid(g.float())).to(o.dtype)  # O-norm, then sigmoid gate
        a = self.products.linear(attn.o_proj, o.reshape(T, attn.num_heads * attn.head_dim))
        return layer.post_attention_residual_gate(s, rms(a, layer.post_norm_eps))  # weightless post-norm

    def dense_ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._ffn(layer, s, dtype)

    def moe_ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._ffn(layer, s, dtype)

    def _ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b = layer.mlp(layer.pre_feedforward_layernorm(s, out_dtype=dtype), self.products)  # DenseMlp or SparseMoeBlock
        return layer.post_feedforward_residual_gate(s, layer.post_feedforward_layernorm(b, out_dtype=torch.float32))

    def final_norm(self, model: DecoderModel, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return model.norm(s, out_dtype=dtype)

    def logits(self, model: DecoderModel, y: torch.Tensor) -> torch.Tensor:
        cap = model.config.final_logit_softcapping
        # Vocab-parallel head: gather every rank's block (exact), drop the padding past V.
        x = model.parallel.gather_last_dim(self.products.linear(model.lm_head, y))[..., : model.config.vocab_size]
        x = x.float() * model.config.output_multiplier
        return cap * torch.tanh(x / cap)
