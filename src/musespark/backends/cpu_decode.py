"""The cpu backend's whole-step plan: a decode step of the whole model (embedding norm,
every decoder layer, final norm) in one native call (kernels/csrc/blocks/decode_plan.cpp)
instead of four op calls per layer from Python. A decode step here is one whose every row
is a decode row: one new token per sequence, or a sequence's speculative verification rows
(`AttentionContext.row_wise`), which attend row by row as decode rows in both paths. The
streams a drafter reads (`aux_layers`) come out of the same call.

It is the layer-by-layer path with the loop moved into C++: per layer it holds the argument
tuples that path passes to the fused ops (`StepArgs`, the same objects) and the layer's KV
cache, and the native loop calls the functions behind those ops in the same order with the
same arguments, so a step's output is the same bits either way
(tests/kernels/test_cpu_decode_plan.py). When a step may take it is the CPU plan's call
(`CpuPlan.whole`). What it saves: ~2 ms of Python and dispatch per batch-1 token on
bench-small when it landed (`git log -S DecodePlan`).

A model's weights are frozen once its backend is chosen (`cpu_args.py`), so the native plan
is built at the first decode step and rebuilt only when the step's own inputs to it differ:
the weight path (`CpuPlan.panels`), the step's dtype, the KV caches or the layer groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..layers.attention import AttentionContext
    from .cpu_args import StepArgs
    from .cpu_plan import CpuPlan
    from .modules import DecoderModel


def row_sequences(ctx: AttentionContext, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per row of a decode step: its sequence (None when each sequence has one row) and how
    many keys it sees [T] int64. Row i of a verifying sequence's n rows sees
    seq_len - (n - 1 - i) keys, as `layers/attention.py` computes row-wise rows."""
    if not ctx.row_wise:
        return None, ctx.seq_lens_tensor(device)
    qsl, seqs, lens = ctx.query_start_loc, [], []
    for b, seq_len in enumerate(ctx.seq_lens):
        n = qsl[b + 1] - qsl[b]
        seqs += [b] * n
        lens += range(seq_len - n + 1, seq_len + 1)
    return torch.tensor(seqs, device=device), torch.tensor(lens, dtype=torch.int64, device=device)


class DecodePlan:
    """`run` is the model's forward over a decode step (the caller, `CpuBackend.decode_forward`,
    asks the CPU plan whether a step is one)."""

    def __init__(self, args: StepArgs) -> None:
        self.args = args
        self.builds = 0  # how many times a plan was built (tests: reuse and rebuilds)
        self._native: Any = None
        self._key: tuple = ()
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rope_layers: list[int] = []  # one layer per rotary base: run's tables, in order

    def run(
        self,
        model: DecoderModel,
        plan: CpuPlan,
        first: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        rope: dict,
        dtype: torch.dtype,
        prompt: torch.Tensor | None,
        aux_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """first: the token ids [T] where `plan.native_embed`, else the embedding norm's output
        [T, H] fp32 -> the final norm's output [T, H] in `dtype`, and with `aux_layers` (y, aux)
        as the model's forward returns them. The rotary tables go through `rope` as in the
        layer-by-layer path; `prompt`: the step's prompt-row flags (CpuBackend.step)."""
        assert ctx.kv_caches is not None and ctx.groups is not None and ctx.layer_group is not None
        native = self._current(model, plan, ctx, dtype)
        tables = [model.layers[i].self_attn.rotary(positions, rope, ctx.max_position) for i in self._rope_layers]
        seqs, lens = row_sequences(ctx, positions.device)
        out = native.run(
            first,
            [t[0] for t in tables],
            [t[1] for t in tables],
            [g.slot_mapping for g in ctx.groups],
            [g.block_tables if seqs is None else g.block_tables.index_select(0, seqs) for g in ctx.groups],
            lens,
            dtype == torch.bfloat16,
            prompt,
            list(aux_layers),
        )
        return (out[0], torch.cat(out[1:], dim=-1)) if aux_layers else out[0]

    def _current(self, model: DecoderModel, plan: CpuPlan, ctx: AttentionContext, dtype: torch.dtype) -> Any:
        caches = ctx.kv_caches
        assert caches is not None and ctx.layer_group is not None
        key = (id(model), dtype, plan.panels, plan.native_embed, tuple(ctx.layer_group))
        if (
            self._native is not None
            and key == self._key
            and len(caches) == len(self._caches)
            and all(a is b or (a[0] is b[0] and a[1] is b[1]) for a, b in zip(caches, self._caches))
        ):
            return self._native
        self._native = None  # a failed build leaves no half-built plan behind
        native = self._build(model, plan, ctx)
        self._native, self._key, self._caches = native, key, list(caches)
        self.builds += 1
        return native

    def _build(self, model: DecoderModel, plan: CpuPlan, ctx: AttentionContext) -> Any:
        args, caches, layer_group = self.args, ctx.kv_caches, ctx.layer_group
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
            k_cache, v_cache = caches[attn.layer]  # of the step's dtype, or fp8 (CpuPlan.whole)
            native.set_attn_in(i, *args.attn_in(layer), rope)
            native.set_attention(i, k_cache, v_cache, layer_group[attn.layer], attn.window or 0, attn.scale)
            native.set_attn_out(i, *args.attn_out(layer))
            (native.set_ffn_moe if layer.is_sparse else native.set_ffn_dense)(i, *args.ffn(layer))
        embedding, norm = model.embed_tokens.weight, model.norm
        if plan.native_embed:  # CpuBackend.embed's native case
            native.set_embedding(embedding, model.config.rms_norm_eps)
        native.set_final_norm(norm.gain(), norm.eps)
        return native
