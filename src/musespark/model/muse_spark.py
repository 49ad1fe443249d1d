"""The Muse Spark 1x text decoder (SPEC §2-3).

Module names follow the checkpoint's tensor names, so loading is mechanical:
`model.state_dict()` keys are exactly `checkpoint.names.expected_shapes(cfg)`.

The residual stream `s` is float32 from the embedding norm to the final norm, whatever
the model dtype; weights and matmuls run in the model dtype; logits are float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels import cpu
from ..layers.attention import AttentionContext, paged_attention
from ..layers.linear import Linear, linear
from ..layers.moe import DenseMlp, SparseMoeBlock
from ..layers.norm import ResidualGate, RMSNorm, rms
from ..layers.rotary import cos_sin, inv_frequencies, norm_rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = Linear(H, self.num_heads * D)
        self.k_proj = Linear(H, self.num_kv_heads * D)
        self.v_proj = Linear(H, self.num_kv_heads * D)
        self.gate_proj = Linear(H, self.num_heads * D)  # the output gate
        self.o_proj = Linear(self.num_heads * D, H)
        self.eps = cfg.rms_norm_eps
        # Queries are multiplied by qk_scale_factor after the weightless QK-norm (in fp32);
        # equal to folding it into the softmax scale, and closer to the reference's rounding.
        self.scale = 1 / math.sqrt(D)
        self.qk_scale = cfg.qk_scale_factor
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        theta = float(cfg.layer_rope_theta[layer])
        self.rope_theta = theta if theta > 0 else None
        # Filled by `materialize_constants` (not here: building on the meta device stays cheap).
        self.register_buffer("inv_freq", None, persistent=False)

    def rotary(self, positions: torch.Tensor,
               rope: dict[float, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) [T, D] fp32 of this layer's base, shared through `rope` by layers of
        the same base; None on NoPE layers."""
        if self.rope_theta is None:
            return None
        if self.inv_freq is None:
            self.inv_freq = inv_frequencies(self.rope_theta, self.head_dim).to(positions.device)
        if self.rope_theta not in rope:
            rope[self.rope_theta] = cos_sin(positions, self.inv_freq)
        return rope[self.rope_theta]

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                rope: dict[float, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """h [T, H] (model dtype) -> a [T, H] (model dtype)."""
        T, dtype, D = h.shape[0], h.dtype, self.head_dim
        rotary = self.rotary(positions, rope)
        # Weightless QK-norm (queries times qk_scale), then rotary, in fp32; rounded to the model dtype.
        q = norm_rope(self.q_proj(h).view(T, self.num_heads, D), self.eps, self.qk_scale, rotary, dtype)
        k = norm_rope(self.k_proj(h).view(T, self.num_kv_heads, D), self.eps, 1.0, rotary, dtype)
        v = self.v_proj(h).view(T, self.num_kv_heads, D)
        o = paged_attention(q, k, v, positions, ctx, self.layer, self.scale, self.window)
        g = self.gate_proj(h).view(T, self.num_heads, D)
        o = (rms(o, self.eps) * torch.sigmoid(g.float())).to(dtype)  # O-norm, then sigmoid gate
        return self.o_proj(o.reshape(T, self.num_heads * D))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, gain_center=1.0)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_residual_gate = ResidualGate(H, cfg.residual_gate_temperature)
        self.pre_feedforward_layernorm = RMSNorm(H, cfg.rms_norm_eps, gain_center=1.0)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_sparse(layer) else DenseMlp(cfg)
        self.post_feedforward_layernorm = RMSNorm(H, cfg.post_norm_eps, gain_center=1.0, input_scaled=True)
        self.post_feedforward_residual_gate = ResidualGate(H, cfg.residual_gate_temperature)
        self.post_norm_eps = cfg.post_norm_eps

    def forward(self, s: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                rope: dict[float, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
        """s [T, H] fp32 stream -> new stream [T, H] fp32."""
        h = self.input_layernorm(s, out_dtype=dtype)
        a = self.self_attn(h, positions, ctx, rope)
        s = self.post_attention_residual_gate(s, rms(a, self.post_norm_eps))  # weightless post-norm
        f = self.pre_feedforward_layernorm(s, out_dtype=dtype)
        b = self.mlp(f)
        return self.post_feedforward_residual_gate(s, self.post_feedforward_layernorm(b, out_dtype=torch.float32))

    def forward_fused(self, ops: Any, s: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                      rope: dict[float, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """`forward` for bf16 weights on the CPU through the native fused blocks (kernels/
        cpu_attn_block.cpp, cpu_ffn_block.cpp: the same formulas and bf16 roundings), four
        calls plus the attention: s [T, H] fp32 -> new stream [T, H] fp32."""
        attn, norm = self.self_attn, self.input_layernorm
        cos, sin = attn.rotary(positions, rope) or (None, None)
        q, k, v, g = ops.attn_in(s, norm.gain(), norm.eps, attn.q_proj.weight, attn.k_proj.weight,
                                 attn.v_proj.weight, attn.gate_proj.weight, attn.num_heads, attn.num_kv_heads,
                                 attn.qk_scale, cos, sin)
        o = paged_attention(q, k, v, positions, ctx, attn.layer, attn.scale, attn.window)
        gate = self.post_attention_residual_gate.coefficients_cached()
        s = ops.attn_out(s, o.contiguous(), g, attn.o_proj.weight, attn.eps, *gate, self.post_norm_eps)
        return self.mlp.forward_fused(ops, s, self.pre_feedforward_layernorm, self.post_feedforward_layernorm,
                                      self.post_feedforward_residual_gate)


class Embedding(nn.Module):
    """A plain lookup table [V, H]. (Not `nn.Embedding`: its random init on the meta
    device pulls in heavy imports while loading; ours is filled by the loader.)"""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class MuseSparkForCausalLM(nn.Module):
    """The text decoder. `forward` takes a flat batch and returns final hidden states."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gain_center=0.0)  # plain weight
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:  # a loaded checkpoint that has its own head replaces this
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def materialize_constants(self) -> None:
        """Compute weight-only constants (residual gate alpha/beta, fp32 norm gains) once, after loading."""
        for module in self.modules():
            if isinstance(module, (ResidualGate, RMSNorm)):
                module.materialize()
            elif isinstance(module, DecoderLayer) and module.self_attn.rope_theta is not None:
                attn = module.self_attn
                attn.inv_freq = inv_frequencies(attn.rope_theta, attn.head_dim).to(self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states y [T, H] in the model dtype."""
        dtype = self.dtype
        s = rms(self.embed_tokens(input_ids), self.config.rms_norm_eps)  # fp32 stream
        rope: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}  # cos/sin shared by layers of one base
        ops = self._fused_ops(s)
        for layer in self.layers:
            if ops is None:
                s = layer(s, positions, ctx, rope, dtype)
            else:
                s = layer.forward_fused(ops, s, positions, ctx, rope)
        return self.norm(s, out_dtype=dtype)

    def _fused_ops(self, s: torch.Tensor) -> Any:
        """The native ops when the fused decoder blocks apply (bf16 weights on an x86 CPU
        with the kernels built, no autograd, widths that are multiples of 8), else None."""
        cfg = self.config
        if (self.dtype != torch.bfloat16 or s.device.type != "cpu" or self.training
                or (torch.is_grad_enabled() and self.embed_tokens.weight.requires_grad)
                or any(n % 8 for n in (cfg.hidden_size, cfg.head_dim, cfg.moe_hidden_size,
                                       cfg.moe_intermediate_size, cfg.intermediate_size))):
            return None
        return cpu.native_ops()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """y [N, H] -> soft-capped logits [N, V] in fp32: T * tanh(y W^T * m / T)."""
        cap = self.config.final_logit_softcapping
        x = linear(hidden, self.lm_head.weight).float() * self.config.output_multiplier
        return cap * torch.tanh(x / cap)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Reference entry point: the [len, vocab] float32 logits of one sequence."""
        ids = self._check_ids(token_ids)
        positions = torch.arange(len(token_ids), device=self.device)
        hidden = self(ids, positions, AttentionContext.for_prompts([len(token_ids)]))
        return self.compute_logits(hidden)

    @torch.inference_mode()
    def greedy_continuation(self, token_ids: list[int], max_new_tokens: int) -> list[int]:
        """Reference greedy decoding by full recompute each step (slow; for tests)."""
        ids = list(token_ids)
        for _ in range(max_new_tokens):
            ids.append(int(self.prompt_logits(ids)[-1].argmax()))
        return ids[len(token_ids):]

    def _check_ids(self, token_ids: list[int]) -> torch.Tensor:
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be a flat list of ints, got shape {tuple(ids.shape)}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bool(bad.any()):
            raise ValueError(
                f"token_ids must lie in [0, {self.config.vocab_size}), got {int(ids[bad][0])}")
        return ids


@torch.no_grad()
def init_random_weights(model: MuseSparkForCausalLM, seed: int = 0) -> None:
    """Randomize every parameter and persistent buffer (norm weights, gates, router bias
    included), so that parity tests cannot pass by a zero hiding a bug.

    Matrices get std 1/sqrt(fan_in) (activations stay O(1)); the LM head and router are
    scaled up so that greedy choices and expert choices are decisive, not near-ties.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor is None or name.endswith(("inv_freq", "alpha", "beta")):
            continue
        noise = torch.randn(tensor.shape, generator=gen)
        if name.endswith("residual_gate.gate"):
            values = noise * 1.0
        elif name.endswith("e_score_correction_bias"):
            values = noise * 0.1
        elif name == "norm.weight":
            values = 1.0 + noise * 0.2
        elif tensor.ndim == 1:  # zero-centred norm weights
            values = noise * 0.2
        elif name == "lm_head.weight":
            values = noise * 3.0 / hidden**0.5
        elif name.endswith("mlp.gate.weight"):
            values = noise * 2.0 / hidden**0.5
        else:
            values = noise / tensor.shape[-1] ** 0.5
        tensor.copy_(values.to(tensor.dtype))
    model.materialize_constants()
