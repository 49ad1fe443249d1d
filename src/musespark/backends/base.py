"""The compute-backend interface: the decoder's steps, each over a flat batch of T tokens.

A backend computes; the modules hold weights. `DecoderLayer.forward` is the only forward
path of a layer, and it is the same for every backend:

    q, k, v, g = attn_in(layer, s, rotary, dtype)       # norm, Q/K/V/gate, QK-norm, rotary
    o          = attention(layer.self_attn, q, k, v, positions, ctx)   # over the paged cache
    s          = attn_out(layer, s, o, g)                # O-norm, sigmoid gate, O proj, gated residual
    s          = dense_ffn(layer, s, dtype) or moe_ffn(layer, s, dtype)  # the feed-forward half

`s` is the fp32 residual stream [T, H]; `dtype` is the model's activation dtype (what the
reference rounds to between steps). Each step takes the module that owns the weights (a
`DecoderLayer`, its `Attention`, the model; typed by the Protocols of `modules.py`, since
backends/ does not import model/), never loose tensors. The torch backend is the
reference every other backend is tested against (tests/model/test_backends.py). A backend may
also offer `decode_forward`: a whole step in one call, the same bits as these steps.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ..layers.attention import AttentionContext
    from .modules import AttentionModule, DecoderLayerModule, DecoderModel

Rotary = tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin) [T, D] fp32 of the layer's base; None on NoPE layers


class Backend(ABC):
    name: ClassVar[str]
    supports_autograd: ClassVar[bool] = False  # without it, a forward that needs gradients runs on torch

    @contextlib.contextmanager
    def step(self, ctx: AttentionContext) -> Iterator[None]:
        """Wraps one forward over the batch `ctx` describes (the model enters it around its
        layers): a backend that picks kernels per row (ctx.prompt_rows) reads the batch here."""
        yield

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
        """The model's whole forward in one go (it calls this inside `step` first): the final
        norm's output y, the same bits as `embed`, `DecoderLayer.forward` layer by layer and
        `final_norm` give, and with `aux_layers` (y, aux) as the model's forward returns them;
        or None (the default), and the model runs those steps. A backend offers it for the
        steps where one call saves its overhead."""
        return None

    @abstractmethod
    def embed(self, model: DecoderModel, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the fp32 stream [T, H]: the embedding, RMS-normalized without weight."""

    @abstractmethod
    def attn_in(
        self, layer: DecoderLayerModule, s: torch.Tensor, rotary: Rotary, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """s [T, H] fp32 -> q [T, nH, D], k [T, nKV, D], v [T, nKV, D], gate [T, nH, D], all in
        `dtype`; q and k QK-normed (q times qk_scale) and rotated."""

    @abstractmethod
    def attention(
        self,
        attn: AttentionModule,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """Write k/v into the paged cache (if any) and attend -> o [T, nH, D] in q's dtype."""

    @abstractmethod
    def attn_out(self, layer: DecoderLayerModule, s: torch.Tensor, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """-> s' [T, H] fp32 = gate(s, rms(o_proj(rms(o) * sigmoid(g))))."""

    @abstractmethod
    def dense_ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """-> s' [T, H] fp32 = gate(s, post_norm(SwiGLU(pre_norm(s))))."""

    @abstractmethod
    def moe_ffn(self, layer: DecoderLayerModule, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """-> s' [T, H] fp32 = gate(s, post_norm(MoE(pre_norm(s)))) (route, pool, experts, unpool)."""

    @abstractmethod
    def final_norm(self, model: DecoderModel, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """s [T, H] fp32 -> y [T, H] in `dtype`."""

    @abstractmethod
    def logits(self, model: DecoderModel, y: torch.Tensor) -> torch.Tensor:
        """y [N, H] -> soft-capped logits [N, V] fp32: cap * tanh(y W^T * m / cap)."""
