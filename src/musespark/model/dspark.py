"""The DSpark draft: a semi-autoregressive block drafter over the target's hidden states
(docs/speculative.md §3-§5). Config: `dspark_config.DSparkConfig`.

One step: (a) the target's fp32 stream after `target_layer_ids` (concatenated, [n, n_t*T]) goes
through `fc` + `hidden_norm`, and every draft layer projects it into its own context K/V at the
target's positions (`context_kv`); (b) one forward over the block `[anchor, mask, ..., mask]` at
positions P0.. (P0 = the anchor's position = number of context positions), attending to all
context K/V and causally inside the block (`block_hidden`); (c) the Markov head adds a low-rank
bias that depends on the previously chosen token (`markov_logits`, `choose`); draft id d maps to
target id d + d2t[d].

Module and parameter names equal the checkpoint names of §3 (without `model.`), so
`state_dict()` is the checkpoint. Dtypes: weights and matmuls in D (the target's dtype), the
residual stream in R (`residual_dtype`), norms in fp32 rounded once, logits fp32; the
confidence head is fp32. Every function takes arbitrary leading dims (`*B`), so the same code
serves inference (flat rows) and training (batched sequences). Where the context K/V live at
inference (paged, in the engine's KV budget): `dspark_kv.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import linear
from ..layers.norm import ResidualGate
from .dspark_config import DSparkConfig, gain_center
from .dspark_layers import (
    Rotary,
    dense_linear,
    derived_weight,
    draft_norm,
    feed_forward,
    head_rms,
    interleaved_rope,
    residual_gate,
)

# attend(layer, q [*B, Q, nh, hd], k, v [*B, Q, nkv, hd]) -> o [*B, Q, nh, hd]: the block's
# attention over whatever context the caller holds (cache, training pack, reference).
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (c [n, H] in D, positions [n], store(layer, k [n, nkv, hd], v)): context rows handled in the block pass
Context = tuple[torch.Tensor, torch.Tensor, Callable[[int, torch.Tensor, torch.Tensor], None]]
MARKOV_TABLE_MAX = 1 << 24  # entries of the precomputed Markov bias table (64 MiB fp32)


class DraftAttention(nn.Module):
    """Projections of one draft layer; `layer`, `scale` and `window` are what a backend's
    paged attention reads (`Backend.attention`)."""

    def __init__(self, cfg: DSparkConfig, center: float, layer: int, window: int | None) -> None:
        super().__init__()
        self.layer, self.window = layer, window
        self.scale = cfg.q_scale / cfg.head_dim**0.5
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = dense_linear(H, nh * hd)
        self.k_proj = dense_linear(H, nkv * hd)
        self.v_proj = dense_linear(H, nkv * hd)
        self.o_gate_proj = dense_linear(H, nh * hd) if cfg.use_attn_o_gate else None
        self.o_proj = dense_linear(nh * hd, H)
        self.pre_qkv_proj_norm = draft_norm(H, cfg.rms_norm_eps, cfg.norm_affine, center)


class DraftLayer(nn.Module):
    """Draft layer i, global index ell = L_T + i (gain centres, NoPE and window cycles)."""

    def __init__(self, cfg: DSparkConfig, index: int, ell: int) -> None:
        super().__init__()
        H, zc = cfg.hidden_size, cfg.norm_zero_centered_gamma
        if cfg.layer_uses_rope(ell) != cfg.use_rope:
            raise ValueError(f"draft layer {index}: positional mode differs from use_rope (every_n_layers_nope)")
        if cfg.is_moe(ell):
            raise ValueError(
                f"draft layer {index} would be MoE (global index {ell}); the draft is dense only: "
                "set moe.is_enabled=false"
            )
        self.cfg, self.index, self.ell = cfg, index, ell
        self.window = cfg.layer_window(ell)
        self.self_attn = DraftAttention(cfg, 1.0 if zc else 0.0, index, self.window)
        post = cfg.post_norm_gain_center_type

        def center(rid: int) -> float:
            return gain_center(post, rid) if zc else 0.0

        self.post_attn_norm = draft_norm(H, cfg.post_eps, cfg.post_norm_affine, center(2 * ell + 1))
        self.pre_ffn_norm = draft_norm(H, cfg.rms_norm_eps, cfg.norm_affine, 1.0 if zc else 0.0)
        self.feed_forward = feed_forward(cfg)
        self.post_ffn_norm = draft_norm(
            H,
            cfg.post_eps,
            cfg.use_ffn_learnable_scales or cfg.post_norm_affine,
            center(2 * ell + 2),
            input_scaled=cfg.use_ffn_learnable_scales,
        )
        self.add_attn = residual_gate(H) if cfg.use_residual_gate else None
        self.add_ffn = residual_gate(H) if cfg.use_residual_gate else None
        self.rotary = Rotary(cfg.rope_theta, cfg.head_dim)

    def kv(
        self,
        u: torch.Tensor,
        positions: torch.Tensor,
        dtype: torch.dtype,
        table: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (QK-normed, rotated) and values of normed inputs u [*B, Q, H] -> [*B, Q, nkv, hd] in dtype."""
        cfg, a = self.cfg, self.self_attn
        if torch.is_grad_enabled():
            k, v = a.k_proj(u), a.v_proj(u)
        else:  # one matmul
            k, v = linear(u, derived_weight(self, "kv", [a.k_proj.weight, a.v_proj.weight])).chunk(2, dim=-1)
        k = head_rms(k.unflatten(-1, (cfg.kv_heads, cfg.head_dim)), cfg.rms_norm_eps).to(dtype)
        if cfg.use_rope:
            table = self.rope(positions, dtype) if table is None else table
            k = interleaved_rope(k, positions, cfg.rope_theta, table=table).to(dtype)
        return k, v.unflatten(-1, (cfg.kv_heads, cfg.head_dim))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [*B, Q, hd] fp32 of positions [*B, Q], shared by q and k."""
        return self.rotary.cos_sin(positions, torch.float32 if self.cfg.rope_use_fp32_in_outer_product else dtype)

    def _add(self, gate: ResidualGate | None, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return s + b.to(s.dtype) if gate is None else gate(s, b).to(s.dtype)

    def _qkv(
        self, u: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Inference form of the projections: one matmul over the stacked [q | k | v | o_gate]
        rows (vLLM's qkv_proj order), one QK-norm and one rotation for q and k together."""
        cfg, a = self.cfg, self.self_attn
        nh, nkv, hd = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
        parts = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
        if a.o_gate_proj is not None:
            parts.append(a.o_gate_proj.weight)
        x = linear(u, derived_weight(self, "qkv", parts))
        qk = head_rms(x[..., : (nh + nkv) * hd].unflatten(-1, (nh + nkv, hd)), cfg.rms_norm_eps).to(dtype)
        if cfg.use_rope:
            qk = interleaved_rope(qk, positions, cfg.rope_theta, table=self.rope(positions, dtype)).to(dtype)
        v = x[..., (nh + nkv) * hd : (nh + 2 * nkv) * hd].unflatten(-1, (nkv, hd))
        g = x[..., (nh + 2 * nkv) * hd :].unflatten(-1, (nh, hd)) if a.o_gate_proj is not None else None
        return qk[..., :nh, :], qk[..., nh:, :], v, g

    def forward(
        self,
        s: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        dtype: torch.dtype,
        context: Context | None = None,
    ) -> torch.Tensor:
        """s [*B, Q, H] in R, positions [*B, Q] -> new stream in R; `dtype` = D. With `context`
        (c [n, H] in D, their positions [n], store): first hand this layer's context K/V of those
        rows to store(layer, k, v) — without gradients in the same matmuls as the block's rows."""
        cfg, a = self.cfg, self.self_attn
        x = s.to(dtype)  # the stream rounded to D before the pre-norm (§4.4)
        if not torch.is_grad_enabled() and not cfg.temperature_tuned(self.ell):
            if context is None:
                q, k, v, g = self._qkv(a.pre_qkv_proj_norm(x, dtype), positions, dtype)
                return self._finish(s, q, k, v, g, attend, dtype)
            c, c_pos, store = context
            n, lead = c.shape[0], s.shape[:-1]
            u = a.pre_qkv_proj_norm(torch.cat((c, x.reshape(-1, x.shape[-1]))), dtype)
            q, k, v, g = self._qkv(u, torch.cat((c_pos, positions.reshape(-1))), dtype)
            store(self.index, k[:n], v[:n])
            q, k, v = (t[n:].reshape(*lead, *t.shape[1:]) for t in (q, k, v))
            g = None if g is None else g[n:].reshape(*lead, *g.shape[1:])
            return self._finish(s, q, k, v, g, attend, dtype)
        if context is not None:
            c, c_pos, store = context
            store(self.index, *self.kv(a.pre_qkv_proj_norm(c, dtype), c_pos, dtype))
        u = a.pre_qkv_proj_norm(x, dtype)
        q = head_rms(a.q_proj(u).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim)), cfg.rms_norm_eps).to(dtype)
        if cfg.temperature_tuned(self.ell):
            scale = 1 + cfg.attn_temperature_tuning_q_scale_constant * torch.log(
                (positions.float() + 1) / cfg.attn_temperature_tuning_floor_scale
            )
            q = (q.float() * scale.clamp(min=1.0)[..., None, None]).to(dtype)
        table = self.rope(positions, dtype) if cfg.use_rope else None
        if table is not None:
            q = interleaved_rope(q, positions, cfg.rope_theta, table=table).to(dtype)
        k, v = self.kv(u, positions, dtype, table)
        g = (
            a.o_gate_proj(u).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
            if a.o_gate_proj is not None
            else None
        )
        return self._finish(s, q, k, v, g, attend, dtype)

    def _finish(
        self,
        s: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None,
        attend: Attend,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Attention from the projected q/k/v (and gate), then the residual adds and the FFN."""
        cfg, a = self.cfg, self.self_attn
        o = attend(self.index, q, k, v)  # [*B, Q, nh, hd]
        if cfg.use_attn_o_norm:
            o = head_rms(o, cfg.rms_norm_eps)
        if g is not None:
            o = o.float() * torch.sigmoid(g.float())
        s = self._add(self.add_attn, s, self.post_attn_norm(a.o_proj(o.to(dtype).flatten(-2)), dtype))
        f = self.feed_forward(self.pre_ffn_norm(s.to(dtype), dtype))
        return self._add(self.add_ffn, s, self.post_ffn_norm(f, dtype))


class MarkovHead(nn.Module):
    def __init__(self, v_in: int, v_d: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(v_in, rank)  # indexed by TARGET ids
        self.markov_w2 = dense_linear(rank, v_d)  # weight [V_d, r]


class ConfidenceHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DSparkDraft(nn.Module):
    """The draft model. `target_num_layers` (L_T) fixes the layers' global indices."""

    def __init__(self, cfg: DSparkConfig, target_num_layers: int) -> None:
        super().__init__()
        H, zc = cfg.hidden_size, cfg.norm_zero_centered_gamma
        self.config, self.target_num_layers = cfg, target_num_layers
        self.fc = dense_linear(cfg.target_hidden_size * len(cfg.target_layer_ids), H)
        self.hidden_norm = draft_norm(H, cfg.rms_norm_eps, cfg.norm_affine, 1.0 if zc else 0.0)
        self.layers = nn.ModuleList(DraftLayer(cfg, i, target_num_layers + i) for i in range(cfg.num_hidden_layers))
        self.norm = draft_norm(H, cfg.rms_norm_eps, cfg.norm_affine, 1.0 if zc else 0.0)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.d_vocab, cfg.markov_rank)
        self.confidence_head = (
            ConfidenceHead(H + (cfg.markov_rank if cfg.confidence_head_with_markov else 0))
            if cfg.enable_confidence_head
            else None
        )
        self.lm_head = dense_linear(H, cfg.d_vocab)
        self.register_buffer("d2t", torch.zeros(cfg.d_vocab, dtype=torch.long))

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def residual_dtype(self) -> torch.dtype:
        return torch.float32 if self.config.residual_dtype == "fp32" else torch.bfloat16

    # -- (a) context ---------------------------------------------------------------------
    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """aux [*B, n, n_t*T] (fp32 target stream) at positions [*B, n] -> per draft layer
        (k, v) [*B, n, nkv, hd] in D. Depends only on each position's own row."""
        return self.context_kv_of(self.context_features(aux), positions)

    def context_features(self, aux: torch.Tensor) -> torch.Tensor:
        """c = HiddenNorm(fc(aux in D)) [*B, n, H] in D (§4.2 steps 1-2)."""
        D = self.dtype
        return self.hidden_norm(self.fc(aux.to(D)), D)

    def context_kv_of(self, c: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer (k, v) [*B, n, nkv, hd] of context features c (§4.2 step 3)."""
        D = self.dtype
        table = self.layers[0].rope(positions, D) if self.config.use_rope and len(self.layers) else None
        return [layer.kv(layer.self_attn.pre_qkv_proj_norm(c, D), positions, D, table) for layer in self.layers]

    # -- (b) block pass ------------------------------------------------------------------
    def block_hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        embed: torch.Tensor,
        attend: Attend,
        context: Context | None = None,
    ) -> torch.Tensor:
        """tokens, positions [*B, Q] (anchor then masks), embed = the target's raw table [V, H]
        -> y [*B, Q, H] in D; y_k predicts the token at position positions_k + 1. `context`:
        new context rows whose per-layer K/V each layer stores before its attention."""
        D = self.dtype
        s = F.embedding(tokens, embed).to(self.residual_dtype)
        for layer in self.layers:
            s = layer(s, positions, attend, D, context)
        return self.norm(s.to(D), D)

    def attention_scale(self) -> float:
        return self.config.q_scale / self.config.head_dim**0.5

    # -- (c) heads -----------------------------------------------------------------------
    def markov_logits(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Teacher-forced Markov stage: base [*B, V_d] (lm_head output), prev [*B] target ids of
        the previous token -> l' [*B, V_d] fp32 = softcap(mu * (base + w2 . w1[prev]))."""
        mh = self.markov_head
        return self._cap(base.float() + mh.markov_w2(mh.markov_w1(prev)).float())

    def confidence(self, y: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """rho [*B] fp32 = sigmoid(w_c . [y; w1[prev]] + b_c), or None without the head."""
        if self.confidence_head is None:
            return None
        x = y.float()
        if self.config.confidence_head_with_markov:
            x = torch.cat((x, self.markov_head.markov_w1(prev).float()), dim=-1)
        return torch.sigmoid(self.confidence_head.proj(x))[..., 0]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def choose(
        self,
        y: torch.Tensor,
        anchors: torch.Tensor,
        sample: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        with_confidence: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Sequential stage over y [B, N, H] starting from anchors [B] (target ids).
        `sample(l' [B, V_d], k) -> draft ids [B]` (None: greedy argmax). Returns target ids
        [B, N], l' [B, N, V_d] fp32 (None when greedy: not needed) and the confidence [B, N]
        (None unless asked for and the head exists).

        Greedy skips mu and the soft cap: both are monotone (mu > 0), so argmax is unchanged
        (up to fp32 ties at saturation, §4.5)."""
        mh = self.markov_head
        base = self.lm_head(y).float()  # [B, N, V_d] b_k, in the lm_head dtype, then fp32
        w1, w2 = mh.markov_w1.weight, mh.markov_w2.weight
        to_target = derived_weight(
            self, "to_target", [self.d2t], lambda: torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t
        )
        # small vocabularies: the whole bias table w1 w2^T [V_in, V_d] once, a row lookup per step
        table = (
            derived_weight(self, "markov", [w1, w2], lambda: F.linear(w1, w2).float())
            if w1.shape[0] * w2.shape[0] <= MARKOV_TABLE_MAX and not torch.is_grad_enabled()
            else None
        )
        prev, toks, logits, conf = anchors, [], [], []
        for k in range(y.shape[1]):
            bias = table[prev] if table is not None else F.linear(w1[prev], w2).float()  # [B, V_d] = w2 . e_k
            if sample is None:
                d = (base[:, k] + bias).argmax(-1)
            else:
                lk = self._cap(base[:, k] + bias)
                d = sample(lk, k)
                logits.append(lk)
            if with_confidence and self.confidence_head is not None:
                conf.append(self.confidence(y[:, k], prev))
            prev = to_target[d]
            toks.append(prev)
        return (
            torch.stack(toks, 1),
            torch.stack(logits, 1) if logits else None,
            torch.stack(conf, 1) if conf else None,
        )

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        """l' = softcap(mu * l), fp32."""
        cfg = self.config
        logits = logits.float() * cfg.output_multiplier
        tau = cfg.output_soft_cap_temp
        return tau * torch.tanh(logits / tau) if tau else logits
