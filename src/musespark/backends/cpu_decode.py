"""The cpu backend's decode plan: a pure decode step of the whole model (embedding norm, every
decoder layer, final norm) in one native call (kernels/csrc/blocks/decode_plan.cpp) instead of four
op calls per layer from Python.

The plan holds, per layer, the argument tuples the step-by-step path passes to the fused ops
(`CpuBackend._attn_in_args`, `_attn_out_args`, `_ffn_args`, cached in `StepArgs`) and the
layer's KV cache, and the embedding's and final norm's arguments. The native loop calls the
functions behind those ops in the same order with the same arguments, so a step's output is
the same bits either way (tests/kernels/test_cpu_decode_plan.py). What it saves: ~2 ms of Python and
dispatch per batch-1 token on bench-small when it landed (`git log -S DecodePlan`).

A model's weights are frozen once its backend is chosen (`cpu_args.py`), so the plan is built
at the first decode step and rebuilt only when the step's own inputs to it differ: the weight
path (`WeightArgs.panels`), the step's dtype, the KV caches or the layer groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..layers.attention import AttentionContext
    from .cpu_backend import CpuBackend
    from .modules import DecoderModel


class DecodePlan:
    """`run` is the model's forward over a pure decode step (the caller,
    `CpuBackend.decode_forward`, says when a step is one)."""

    def __init__(self, backend: CpuBackend) -> None:
        self.backend = backend
        self.builds = 0  # how many times a plan was built (tests: reuse and rebuilds)
        self._native: Any = None
        self._key: tuple = ()
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rope_layers: list[int] = []  # one layer per rotary base: run's tables, in order
        self._embeds = False  # whether the native plan embeds (a bf16 embedding)

    def run(
        self,
        model: DecoderModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        rope: dict,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """input_ids [B], one new token per sequence -> the final norm's output [B, H] in `dtype`.
        The rotary tables go through `rope` as in the step-by-step path."""
        assert ctx.kv_caches is not None and ctx.groups is not None and ctx.layer_group is not None
        native = self._current(model, ctx, dtype)
        # A bf16 embedding is looked up and normed natively; another goes the backend's way.
        first = input_ids if self._embeds else self.backend.embed(model, input_ids)
        tables = [model.layers[i].self_attn.rotary(positions, rope, ctx.max_position) for i in self._rope_layers]
        return native.run(
            first,
            [t[0] for t in tables],
            [t[1] for t in tables],
            [g.slot_mapping for g in ctx.groups],
            [g.block_tables for g in ctx.groups],
            ctx.seq_lens_tensor(positions.device),
            dtype == torch.bfloat16,
            self.backend._prompt(input_ids),
        )

    def _current(self, model: DecoderModel, ctx: AttentionContext, dtype: torch.dtype) -> Any:
        caches = ctx.kv_caches
        assert caches is not None and ctx.layer_group is not None
        key = (id(model), dtype, self.backend.weights.panels, tuple(ctx.layer_group))
        if (
            self._native is not None
            and key == self._key
            and len(caches) == len(self._caches)
            and all(a is b or (a[0] is b[0] and a[1] is b[1]) for a, b in zip(caches, self._caches))
        ):
            return self._native
        self._native = None  # a failed build leaves no half-built plan behind
        native = self._build(model, ctx)
        self._native, self._key, self._caches = native, key, list(caches)
        self.builds += 1
        return native

    def _build(self, model: DecoderModel, ctx: AttentionContext) -> Any:
        backend, caches, layer_group = self.backend, ctx.kv_caches, ctx.layer_group
        assert caches is not None and layer_group is not None
        native = torch.classes.musespark_cpu.DecodePlan()
        bases: dict[float, int] = {}
        self._rope_layers = []
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            if attn.rope_theta is None:
                rope = -1
            else:
                if attn.rope_theta not in bases:
                    bases[attn.rope_theta] = len(self._rope_layers)
                    self._rope_layers.append(i)
                rope = bases[attn.rope_theta]
            k_cache, v_cache = caches[attn.layer]  # of the step's dtype (CpuBackend.decode_forward)
            ffn = "ffn_moe" if layer.is_sparse else "ffn_dense"
            native.set_attn_in(i, *backend._attn_in_args(layer), rope)
            native.set_attention(i, k_cache, v_cache, layer_group[attn.layer], attn.window or 0, attn.scale)
            native.set_attn_out(i, *backend._attn_out_args(layer))
            getattr(native, "set_" + ffn)(i, *backend._ffn_args(ffn, layer))
        embedding, norm = model.embed_tokens.weight, model.norm
        self._embeds = embedding.dtype == torch.bfloat16  # CpuBackend.embed's native case
        if self._embeds:
            native.set_embedding(embedding, model.config.rms_norm_eps)
        native.set_final_norm(norm.gain(), norm.eps)
        return native
