"""The triton backend: the decoder's boundaries as Triton kernels (`kernels/triton/`), the
GEMMs (Q/K/V/gate, O, dense MLP, pooler, unpooler, LM head) as the torch backend's linears.

Per layer, for a model on a CUDA device:

    attn_in    pre-norm (fused into the previous step, see below) -> 4 linears ->
               QK-norm + q scale + RoPE (`qk_norm_rope`; NoPE layers skip the rotation)
    attention  paged K/V write + attention (`attention`: chunked prefill and decode, windows)
    attn_out   O-norm x sigmoid gate (`o_norm_gate`) -> o_proj ->
               post-norm -> gated residual -> pre-FFN norm (`norm_residual`)
    ffn        route (`routing`) | pooler -> pre-expert norm (`norm_residual.rms_norm`) ->
               grouped experts + per-expert post-norm + ordered weighted sum (`experts`) ->
               unpooler -> input-scaled post-norm -> gated residual -> the next layer's input
               norm (or the final norm after the last layer)

Fusing a step's residual with the *next* step's norm crosses the `Backend` interface (each
step receives only the stream), so a step that has already computed the next norm keeps it
beside the stream object it returned; the next step uses it when it receives that very
object for that very norm and dtype, and computes the norm itself otherwise. The numbers
are the same either way.

The kernels take tensors and plain numbers only: this backend unpacks the modules (norm
gains, gate coefficients, router and expert tensors) and the `AttentionContext`
(`attention_args`) into them. What each kernel must equal is `triton_reference.py`.

Formats other than dense experts, and tensor/pipeline parallel models, run the torch
backend's code for the step (the experts) or are refused (parallel). On CPU the backend is
constructible only under TRITON_INTERPRET=1 (the tests); there the kernels run in Triton's
interpreter, slowly, with the same numbers a GPU computes up to fp32 summation order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..kernels import triton as triton_kernels
from ..layers.attention import AttentionContext
from ..layers.kv_quant import is_fp8
from ..layers.moe import ROUTER_EPS
from ..layers.norm import RMSNorm
from .base import Rotary
from .torch_backend import TorchBackend

if TYPE_CHECKING:
    from .modules import AttentionModule, DecoderLayerModule, DecoderModel


# The attention kernel's `cache` argument: k_cache, v_cache, slot_mapping, block_tables.
PagedKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def step_lens(ctx: AttentionContext) -> tuple[list[int], list[int]]:
    """The step's (query_start_loc [B+1], key_lens [B]) as the attention kernel takes them:
    key_lens are the seq_lens with a paged cache, each sequence's query count without."""
    qsl = list(ctx.query_start_loc)
    if ctx.kv_caches is None:
        return qsl, [qsl[b + 1] - qsl[b] for b in range(len(qsl) - 1)]
    return qsl, list(ctx.seq_lens)


def layer_cache(ctx: AttentionContext, layer: int) -> PagedKV | None:
    """Decoder layer `layer`'s (k_cache, v_cache, slot_mapping, block_tables) in `ctx`; None
    without a paged cache."""
    if ctx.kv_caches is None:
        return None
    if ctx.groups is None or ctx.layer_group is None:
        raise ValueError("ctx: a paged cache (kv_caches) needs its groups and layer_group")
    group = ctx.groups[ctx.layer_group[layer]]
    k_cache, v_cache = ctx.kv_caches[layer]
    return k_cache, v_cache, group.slot_mapping, group.block_tables


def attention_args(ctx: AttentionContext, layer: int) -> tuple[list[int], list[int], PagedKV | None]:
    """`ctx` for decoder layer `layer` as the attention kernel's (query_start_loc, key_lens, cache)."""
    return (*step_lens(ctx), layer_cache(ctx, layer))


class TritonBackend(TorchBackend):
    name = "triton"
    supports_autograd = False

    def __init__(self, model: DecoderModel) -> None:
        """Raises ValueError naming the reason when the kernels cannot run this model here."""
        if not triton_kernels.available():
            raise ValueError(
                "backend='triton' needs the `triton` package, which does not import here; use backend='torch' or 'auto'"
            )
        device = model.device
        if device.type == "cpu":
            if not triton_kernels.interpreting():
                raise ValueError(
                    "backend='triton' runs models on a CUDA device; on the CPU only under "
                    "TRITON_INTERPRET=1 (tests). Use backend='cpu', 'torch' or 'auto'"
                )
        elif device.type != "cuda":
            raise ValueError(f"backend='triton' runs models on a CUDA device; this model is on {device}")
        if model.parallel.world_size > 1:
            raise ValueError("backend='triton' runs one process; tensor/pipeline parallel models use backend='torch'")
        from ..kernels.triton import attention, experts, norm_residual, o_norm_gate, qk_norm_rope, routing
        from ..kernels.triton._common import interpreted
        from ..quant.dense import DenseExperts

        if device.type == "cpu" and not interpreted():
            raise ValueError(
                "backend='triton' on the CPU needs TRITON_INTERPRET=1 set before the Triton "
                "kernels were first imported in this process"
            )

        self._k_attention, self._k_experts, self._k_norm = attention, experts, norm_residual
        self._k_ogate, self._k_qk, self._k_route = o_norm_gate, qk_norm_rope, routing
        self._dense_experts = DenseExperts
        # The norm that follows each layer's FFN: the next layer's input norm, or the final norm.
        self._next_norm: dict[nn.Module, RMSNorm] = {}
        start, end = model.layer_range
        for i in range(start, end):
            nxt = model.layers[i + 1].input_layernorm if i + 1 < end else model.norm
            if nxt is not None:
                self._next_norm[model.layers[i]] = nxt
        # The last step's attention tables (its context object, the tables made from it, and
        # its query_start_loc and key_lens).
        self._meta: tuple[AttentionContext, Any, list[int], list[int]] | None = None
        # (stream, norm, dtype, normed): the norm of the stream a step returned, computed with it.
        self._pending: tuple[torch.Tensor, RMSNorm, torch.dtype, torch.Tensor] | None = None

    # -- the fused boundary -------------------------------------------------------------------
    def _norm(self, s: torch.Tensor, norm: RMSNorm, dtype: torch.dtype) -> torch.Tensor:
        """norm(s) -> dtype: the value computed with `s` when there is one, else a norm kernel."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is s and pending[1] is norm and pending[2] == dtype:
            return pending[3]
        return self._k_norm.rms_norm(s, norm.eps, norm.gain(), dtype)

    def _residual(
        self,
        s: torch.Tensor,
        branch: torch.Tensor,
        gate: nn.Module,
        post_eps: float,
        post: RMSNorm | None,
        nxt: RMSNorm | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """gate(s, post_norm(branch)) -> s' fp32, computing nxt(s') beside it when nxt is known."""
        alpha, beta = gate.coefficients_cached()
        s2, h = self._k_norm.norm_residual(
            s,
            branch,
            alpha,
            beta,
            post_eps,
            post.gain() if post is not None else None,
            nxt.gain() if nxt is not None else None,
            nxt.eps if nxt is not None else 0.0,
            dtype,
            next_norm=nxt is not None,
        )
        self._pending = (s2, nxt, dtype, h) if nxt is not None else None
        return s2

    # -- the steps ----------------------------------------------------------------------------
    def embed(self, model: DecoderModel, input_ids: torch.Tensor) -> torch.Tensor:
        self._pending = None
        return self._k_norm.rms_norm(model.embed_tokens(input_ids), model.config.rms_norm_eps, None, torch.float32)

    def attn_in(
        self, layer: DecoderLayerModule, s: torch.Tensor, rotary: Rotary, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, T, D = layer.self_attn, s.shape[0], layer.self_attn.head_dim
        h = self._norm(s, layer.input_layernorm, dtype)
        q = self._k_qk.qk_norm_rope(attn.q_proj(h).view(T, attn.num_heads, D), attn.eps, attn.qk_scale, rotary, dtype)
        k = self._k_qk.qk_norm_rope(attn.k_proj(h).view(T, attn.num_kv_heads, D), attn.eps, 1.0, rotary, dtype)
        v = attn.v_proj(h).view(T, attn.num_kv_heads, D)
        g = attn.gate_proj(h).view(T, attn.num_heads, D)
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
        if ctx.kv_caches is not None and is_fp8(ctx.kv_caches[attn.layer][0].dtype):
            return super().attention(attn, q, k, v, positions, ctx)  # the Triton kernel takes no fp8 cache
        group = attn.num_heads // attn.num_kv_heads
        cached = self._meta
        if cached is None or cached[0] is not ctx or cached[1].group != group:  # once per step, not per layer
            qsl, key_lens = step_lens(ctx)
            self._meta = cached = (ctx, self._k_attention.attention_meta(qsl, key_lens, group, q.device), qsl, key_lens)
        cache = layer_cache(ctx, attn.layer)
        return self._k_attention.paged_attention(
            q, k, v, positions, cached[2], cached[3], cache, attn.scale, attn.window, meta=cached[1]
        )

    def attn_out(self, layer: DecoderLayerModule, s: torch.Tensor, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        attn, T = layer.self_attn, s.shape[0]
        o = self._k_ogate.o_norm_gate(o, g, attn.eps)
        a = attn.o_proj(o.reshape(T, attn.num_heads * attn.head_dim))
        return self._residual(
            s,
            a,
            layer.post_attention_residual_gate,
            layer.post_norm_eps,
            None,
            layer.pre_feedforward_layernorm,
            o.dtype,
        )

    def dense_ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b = layer.mlp(self._norm(s, layer.pre_feedforward_layernorm, dtype))
        return self._ffn_out(layer, s, b, dtype)

    def moe_ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        mlp = layer.mlp
        f = self._norm(s, layer.pre_feedforward_layernorm, dtype)
        experts = mlp.experts
        if not isinstance(experts.format, self._dense_experts):
            return self._ffn_out(layer, s, mlp(f), dtype)  # other expert formats: the reference block
        router, pre = mlp.gate, mlp.pre_expert_norm
        weights, ids = self._k_route.route_topk(
            f,
            router.weight,
            router.e_score_correction_bias,
            router.top_k,
            router.output_multiplier,
            router.routed_scaling_factor,
            ROUTER_EPS,
        )
        u = self._k_norm.rms_norm(mlp.pre_expert_proj(f), pre.eps, pre.gain(), dtype)  # pooled [T, Hm]
        post = experts.post_expert_norm
        y = self._k_experts.moe_experts(
            u, weights, ids, experts.gate_up_proj, experts.down_proj, post.gain(), post.eps
        )  # [T, Hm] fp32
        return self._ffn_out(layer, s, mlp.post_expert_proj(y.to(f.dtype)), dtype)

    def _ffn_out(self, layer: DecoderLayerModule, s: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        post = layer.post_feedforward_layernorm
        assert post.input_scaled
        return self._residual(
            s, b, layer.post_feedforward_residual_gate, post.eps, post, self._next_norm.get(layer), dtype
        )

    def final_norm(self, model: DecoderModel, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._norm(s, model.norm, dtype)
