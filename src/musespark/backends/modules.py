"""What a backend reads from the model's modules, as Protocols.

The model (`model/muse_spark.py`: `MuseSparkForCausalLM`, `DecoderLayer`, `Attention`)
satisfies them; backends/ never imports model/ (the model imports the backends). Each
Protocol lists the attributes the backends use, nothing more: a backend that needs another
adds it here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from torch import nn

    from ..config import ModelConfig
    from ..layers.linear import Linear
    from ..layers.moe import DenseMlp, SparseMoeBlock
    from ..layers.norm import ResidualGate, RMSNorm
    from ..parallel.state import ParallelContext


class AttentionModule(Protocol):
    """One layer's attention weights and constants."""

    layer: int  # the decoder layer's index: ctx.kv_caches[layer], ctx.layer_group[layer]
    num_heads: int  # this rank's query (and output-gate) heads
    num_kv_heads: int  # this rank's key/value heads
    head_dim: int
    q_proj: Linear  # [num_heads * head_dim, H]
    k_proj: Linear  # [num_kv_heads * head_dim, H]
    v_proj: Linear  # [num_kv_heads * head_dim, H]
    gate_proj: Linear  # [num_heads * head_dim, H]: the output gate
    o_proj: Linear  # [H, num_heads * head_dim]
    eps: float  # the QK-norm's and O-norm's
    scale: float  # the softmax scale, 1 / sqrt(head_dim)
    qk_scale: float  # queries are multiplied by it after the QK-norm
    window: int | None  # sliding window in tokens; None: full attention
    rope_theta: float | None  # rotary base; None: NoPE

    def rotary(
        self, positions: torch.Tensor, rope: dict, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) [T, D] fp32 of this layer's base, shared through `rope`; None on NoPE layers."""
        ...


class DecoderLayerModule(Protocol):
    """One decoder layer: attention, feed-forward half, their norms and residual gates."""

    self_attn: AttentionModule
    input_layernorm: RMSNorm
    post_attention_residual_gate: ResidualGate
    post_norm_eps: float  # the weightless post-attention norm's
    pre_feedforward_layernorm: RMSNorm
    is_sparse: bool  # mlp is a SparseMoeBlock (else a DenseMlp)
    mlp: DenseMlp | SparseMoeBlock
    post_feedforward_layernorm: RMSNorm  # input-scaled
    post_feedforward_residual_gate: ResidualGate


class DecoderModel(Protocol):
    """The decoder (this rank's stage of it): embedding, layers, final norm and LM head."""

    config: ModelConfig
    parallel: ParallelContext
    layer_range: tuple[int, int]  # this stage's layers [start, end)
    embed_tokens: nn.Module | None  # .weight [V, H]; None off the first pipeline stage
    layers: nn.ModuleList  # DecoderLayerModule at [start, end), placeholders elsewhere
    norm: RMSNorm | None  # None off the last pipeline stage
    lm_head: Linear | None  # None off the last pipeline stage

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def modules(self) -> Iterator[nn.Module]: ...
